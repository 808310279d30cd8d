"""Memory sub-runners: structured memory jobs off the critical path, warm and durable.

A job asks a model for JSON against a bounded pydantic schema, validates it,
and writes the items to the LangGraph store, namespaced per assistant and user
like LangGraph's own memory examples, with the thread, turn and step they came
from. Jobs go through the provider chain like any inference (fallover, cost),
on the leg chosen by ``sub_runners``. A failing, slow or invalid job is
recorded and dropped; it never fails the turn.

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

from fusion_graph.memory.background import (
    detach,
    inference_running,
    loop_outlives_run,
    running_here,
    steps_settled,
    wait_detached,
)
from fusion_graph.memory.job_call import (
    PRIMER_PROMPT,
    JobRunner,
    dropped_record,
    prime_reflection_slot,
    run_job,
)
from fusion_graph.memory.job_log import (
    LEASE_GRACE_S,
    MAX_ATTEMPTS,
    JobEntry,
    Owner,
    done_entry,
    folded_keys,
    needs_rerun,
    pending_entry,
    pending_everywhere,
    this_process,
    thread_entries,
    ticket_of,
    with_status,
    write_entry,
)
from fusion_graph.memory.jobs import (
    DEFAULT_JOBS,
    MEMORY_MESSAGE_NAME,
    JobTicket,
    MemoryItem,
    MemoryJob,
    TurnMemories,
    job_prompt,
)
from fusion_graph.memory.runs import MemoryGraph, MemoryRuns, drain, sweep
from fusion_graph.memory.store import (
    JOBS_NAMESPACE_ROOT,
    NAMESPACE_ROOT,
    jobs_namespace,
    memories_namespace,
    memory_message,
    namespace,
    namespace_of,
    recall,
    store_items,
)

__all__ = [
    "DEFAULT_JOBS",
    "JOBS_NAMESPACE_ROOT",
    "LEASE_GRACE_S",
    "MAX_ATTEMPTS",
    "MEMORY_MESSAGE_NAME",
    "NAMESPACE_ROOT",
    "PRIMER_PROMPT",
    "JobEntry",
    "JobRunner",
    "JobTicket",
    "MemoryGraph",
    "MemoryItem",
    "MemoryJob",
    "MemoryRuns",
    "Owner",
    "TurnMemories",
    "detach",
    "done_entry",
    "drain",
    "dropped_record",
    "folded_keys",
    "inference_running",
    "job_prompt",
    "jobs_namespace",
    "loop_outlives_run",
    "memories_namespace",
    "memory_message",
    "namespace",
    "namespace_of",
    "needs_rerun",
    "pending_entry",
    "pending_everywhere",
    "prime_reflection_slot",
    "recall",
    "run_job",
    "running_here",
    "steps_settled",
    "store_items",
    "sweep",
    "this_process",
    "thread_entries",
    "ticket_of",
    "wait_detached",
    "with_status",
    "write_entry",
]
