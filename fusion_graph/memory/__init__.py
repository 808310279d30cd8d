"""Memory sub-runners: structured memory jobs off the critical path, warm and durable.

A job asks a model for JSON against a bounded pydantic schema, validates it,
and writes the items to the LangGraph store, namespaced per assistant and user
like LangGraph's own memory examples, with the thread, turn and step they came
from. Jobs go through the provider chain like any inference (fallover, cost),
on the leg chosen by ``sub_runners``. A failing, slow or invalid job is
recorded and dropped; it never fails the turn. Items that echo the job's own
prompt, or repeat a stored memory, are left out and recorded (``screen``).

**Warm prompts.** A job sends the conversation exactly as the steps send it
(same system prompt, same messages, same bound tools, so the chat template
renders the same prefix), then one instruction message, with
``tool_choice: "none"`` and the schema as ``response_format`` (llama-server
turns it into a grammar). Local jobs run on llama-server's reserved
reflection slot. Before each, a one-token request on that slot
(``prime_reflection_slot``) makes llama-server park the slot's previous
content in its host prompt cache (``--cache-ram``) and copy the idle
conversation slots there (``--cache-idle-slots``, on by default); the job
then restores the conversation's prefix from that cache instead of
prefilling it.

**Durable, fire-and-forget jobs.** In ``background`` mode a job is written to
the store's job log as ``pending`` (thread, turn, step, the messages it
covers) before the run goes on, runs detached, and is marked ``done`` with
its records. A pending job whose process died, or whose lease ran out, runs
again at the thread's next turn, or on ``sweep``/``drain(graph=...)``;
finished jobs' records are folded into the thread's ``route_log`` once.
"""

from fusion_graph.memory.jobs import DEFAULT_JOBS, MemoryItem, MemoryJob, TurnMemories
from fusion_graph.memory.runs import drain, sweep
from fusion_graph.memory.store import namespace

# The modules behind these names: ``jobs`` (the job type and its schema), ``job_call`` (one job's
# call on the reflection slot), ``runs`` (inline, detached and re-run jobs), ``job_log`` (pending
# and done entries in the store), ``store`` (namespaces, recall, writes), ``screen`` (what a job
# may not store: echoes of its prompt, duplicates), ``background`` (this process's detached tasks).
__all__ = [
    "DEFAULT_JOBS",
    "MemoryItem",
    "MemoryJob",
    "TurnMemories",
    "drain",
    "namespace",
    "sweep",
]
