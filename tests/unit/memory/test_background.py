"""Fire-and-forget memory jobs that survive the process: pending before they start, done after.

A job killed with its process is in ``tests/integration/test_memory_durable.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any, Literal

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.store.memory import InMemoryStore

from fusion_graph import build_graph, memory
from fusion_graph.context import FusionContext
from fusion_graph.memory.background import inference_running, steps_settled
from fusion_graph.memory.job_log import (
    MAX_ATTEMPTS,
    JobEntry,
    Owner,
    folded_keys,
    pending_entry,
    this_process,
    thread_entries,
    write_entry,
)
from fusion_graph.memory.jobs import JobTicket, TicketFields
from fusion_graph.prompts import SYSTEM_PROMPT
from fusion_graph.routing.records import RouteRecord
from fusion_graph.sizing.turn import build_prompt
from tests.plugins.fakes import ScriptedModel, ai_calls, call, scripted, user_input

NS = memory.namespace("fusion", "anonymous")
GOOD = json.dumps({"items": [{"kind": "fact", "text": "The user prefers tabs."}]})


def fact(text: str) -> str:
    """A job's answer of one fact: each job of a test needs its own, as a repeated fact is stored once."""
    return json.dumps({"items": [{"kind": "fact", "text": text}]})


CONFIG: RunnableConfig = {"configurable": {"thread_id": "t1"}}
BACKGROUND = FusionContext(memory_mode="background")
INSTRUCTIONS = memory.DEFAULT_JOBS[0].instructions


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


TOOLS: list[BaseTool] = [echo]


def is_job(messages: Sequence[BaseMessage]) -> bool:
    return messages[-1].text == INSTRUCTIONS


class SlowMemory(ScriptedModel):
    """Answers steps at once; a memory job takes ``delay`` seconds, or waits for ``gate``."""

    delay: float = 0.0
    gate: asyncio.Event | None = None

    async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any) -> Any:
        if is_job(messages):
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.delay)
        return await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kw)


async def items(store: Any) -> list[dict[str, Any]]:
    return [item.value for item in await store.asearch(NS, limit=100)]


async def log_of(store: Any, thread: str = "t1") -> list[JobEntry]:
    return await thread_entries(store, NS, thread, statuses=("pending", "done", "folded"))


async def turn_with_slow_job(
    mode: Literal["inline", "background"], store: InMemoryStore
) -> tuple[dict[str, Any], float]:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "x"}, "c1"))])
    local = SlowMemory(messages=iter(["all done", GOOD]), model_name="localfake", delay=3.0)
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=InMemorySaver(), store=store
    )
    started = time.perf_counter()
    out = await graph.ainvoke(user_input("remember"), CONFIG, context=FusionContext(memory_mode=mode))
    return out, time.perf_counter() - started


async def test_the_reply_returns_without_waiting_for_a_slow_job_which_then_reaches_the_store() -> None:
    store = InMemoryStore()
    out, latency = await turn_with_slow_job("background", store)
    print(f"\nreply latency with a 3 s memory job, background: {latency:.3f} s")
    assert latency < 1.5  # the job takes 3 s
    assert out["messages"][-1].content == "all done"
    assert [r["kind"] for r in out["route_log"]] == ["plan", "step"]
    # Written as pending before the run returned, covering the whole conversation.
    [entry] = await log_of(store)
    assert (entry["status"], entry["turn"], entry["step"]) == ("pending", 0, 1)
    assert (entry["covers"], entry["last_message_id"]) == (len(out["messages"]), out["messages"][-1].id)
    assert entry["owner"] == this_process() and entry["lease_until"] > time.time()
    assert await items(store) == []
    await memory.drain(timeout=30)
    assert [i["text"] for i in await items(store)] == ["The user prefers tabs."]
    [entry] = await log_of(store)
    assert (entry["status"], entry["stored"], entry["attempts"]) == ("done", 1, 1)
    [record] = entry["records"]
    assert (record["kind"], record["provider"], record["memory"]["outcome"]) == (
        "memory",
        "local:localfake",
        "stored",
    )
    assert record["memory"]["job_key"] == "t1:0:1"


async def test_inline_mode_keeps_the_jobs_inside_the_run() -> None:
    store = InMemoryStore()
    out, latency = await turn_with_slow_job("inline", store)
    print(f"\nreply latency with a 3 s memory job, inline: {latency:.3f} s")
    # The job ran before ainvoke returned: its memory is stored, its record is in route_log.
    assert [i["text"] for i in await items(store)] == ["The user prefers tabs."]
    assert [r["kind"] for r in out["route_log"]] == ["plan", "step", "memory"]
    assert await log_of(store) == []  # inline runs are checkpointed with the run, not logged


async def test_a_finished_job_reaches_route_log_at_the_next_turn_exactly_once() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": str(i)}, f"c{i}")) for i in range(3)])
    local = scripted(
        "localfake", ["one", GOOD, "two", fact("Tabs are 4 wide."), "three", fact("Lint with ruff.")]
    )
    store = InMemoryStore()
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=InMemorySaver(), store=store
    )
    outs = []
    for text in ("first", "second", "third"):
        outs.append(await graph.ainvoke(user_input(text), CONFIG, context=BACKGROUND))
        await memory.drain(timeout=30)
    kinds = [(r["turn"], r["kind"]) for r in outs[-1]["route_log"]]
    # Turn 0's job is folded by turn 1's plan step, turn 1's by turn 2's; the last waits for a next turn.
    assert kinds == [
        (0, "plan"),
        (0, "step"),
        (0, "memory"),
        (1, "plan"),
        (1, "step"),
        (1, "memory"),
        (2, "plan"),
        (2, "step"),
    ]
    assert [r["memory"]["job_key"] for r in outs[-1]["route_log"] if r["kind"] == "memory"] == [
        "t1:0:1",
        "t1:1:1",
    ]
    assert outs[-1]["totals"]["local"]["inferences"] == 3 + 2  # three steps, two folded jobs
    assert [(e["turn"], e["status"]) for e in await log_of(store)] == [
        (0, "folded"),
        (1, "folded"),
        (2, "done"),
    ]
    assert len(await items(store)) == 3


async def test_jobs_every_k_steps_never_hold_up_the_next_step() -> None:
    gate = asyncio.Event()
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "a"}, "c1"))])
    local = SlowMemory(
        messages=iter(
            [ai_calls(call("echo", {"text": t}, f"l{t}")) for t in "bc"]
            + ["done", GOOD, fact("Lint with ruff.")]
        ),
        model_name="localfake",
        gate=gate,
    )
    store = InMemoryStore()
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=InMemorySaver(), store=store
    )
    context = FusionContext(memory_every_k_steps=2, memory_mode="background")
    # Every memory job waits for the gate, yet the turn runs to its reply.
    out = await asyncio.wait_for(graph.ainvoke(user_input("long task"), CONFIG, context=context), timeout=30)
    assert out["messages"][-1].content == "done"
    assert [(r["kind"], r["step"]) for r in out["route_log"]] == [
        ("plan", 0),
        ("step", 1),
        ("step", 2),
        ("step", 3),
    ]
    assert [(e["step"], e["status"]) for e in await log_of(store)] == [(1, "pending"), (3, "pending")]
    gate.set()
    await memory.drain(timeout=30)
    assert sorted(i["step"] for i in await items(store)) == [1, 3]
    # The mid-turn job read what the step beside it sent (the same prefix); the last one, everything.
    step_prompts = [p for p in local.prompts if not is_job(p)]
    job_prompts = sorted((p for p in local.prompts if is_job(p)), key=len)
    assert [p[:-1] for p in job_prompts] == [step_prompts[1], build_prompt(SYSTEM_PROMPT, out["messages"])]


async def test_a_job_starts_after_the_inference_of_its_thread_in_flight() -> None:
    order: list[str] = []

    async def step() -> None:
        async with inference_running("t"):
            await asyncio.sleep(0.05)
            order.append("step answered")

    async def job() -> None:
        await asyncio.sleep(0)  # the step is in flight by now
        await steps_settled("t", timeout=10)
        order.append("job started")

    await asyncio.gather(step(), job())
    assert order == ["step answered", "job started"]
    await asyncio.wait_for(steps_settled("t", timeout=10), timeout=1)  # nothing in flight


async def thread_with_a_stale_job(attempts: int) -> tuple[Any, InMemoryStore, JobTicket]:
    """A thread of one turn whose job log holds a pending run of another host whose lease ran out."""
    cloud = scripted("cloudfake", ["hello"])
    local = scripted("localfake", [GOOD])
    store = InMemoryStore()
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=InMemorySaver(), store=store
    )
    out = await graph.ainvoke(user_input("I like tabs"), CONFIG, context=FusionContext(sub_runners="off"))
    messages = out["messages"]
    run = TicketFields(
        thread_id="t1", turn=0, step=0, covers=len(messages), last_message_id=messages[-1].id, leg="local"
    )
    ticket = JobTicket(NS, run, attempt=attempts)
    entry = pending_entry(ticket, memory.DEFAULT_JOBS, lease_s=-1.0)
    entry["owner"] = Owner(host="elsewhere", pid=1)
    await write_entry(store, ticket, entry)
    return graph, store, ticket


async def test_sweep_runs_a_pending_job_whose_lease_ran_out() -> None:
    graph, store, _ = await thread_with_a_stale_job(attempts=1)
    assert await memory.sweep(graph, context=BACKGROUND) == 1
    [entry] = await log_of(store)
    assert (entry["status"], entry["attempts"], entry["stored"]) == ("done", 2, 1)
    assert [(i["thread_id"], i["turn"], i["text"]) for i in await items(store)] == [
        ("t1", 0, "The user prefers tabs.")
    ]
    assert await memory.sweep(graph, context=BACKGROUND) == 0  # nothing left to do


async def test_drain_with_the_graph_sweeps_and_a_job_that_keeps_dying_is_given_up() -> None:
    graph, store, _ = await thread_with_a_stale_job(attempts=MAX_ATTEMPTS)
    await memory.drain(timeout=30, graph=graph)
    [entry] = await log_of(store)
    assert entry["status"] == "done" and await items(store) == []
    [record] = entry["records"]
    job = record["memory"]
    assert job["outcome"] == "dropped" and "given up" in str(job["dropped"])


def test_records_of_finished_jobs_are_recognised_by_their_key() -> None:
    record: RouteRecord = {"kind": "memory", "memory": {"job_key": "t:0:1"}}  # type: ignore[typeddict-item]
    step: RouteRecord = {"kind": "step", "memory": {"job_key": "t:9:9"}}  # type: ignore[typeddict-item]
    assert folded_keys([record, step]) == {"t:0:1"}


def test_a_ticket_is_taken_back_whole_from_its_job_log_entry() -> None:
    from fusion_graph.memory.job_log import ticket_of

    # The entry holds the ticket's run as it is; a re-run takes every TicketFields key back.
    run = TicketFields(thread_id="t1", turn=2, step=7, covers=12, last_message_id="m-12", leg="cloud")
    ticket = JobTicket(NS, run, attempt=3)
    entry = pending_entry(ticket, memory.DEFAULT_JOBS, lease_s=5.0)
    assert entry["attempts"] == 3 and {k: entry[k] for k in run} == run  # type: ignore[literal-required]
    assert ticket_of(entry, NS) == ticket
    assert ticket_of(entry, NS, attempt=4) == JobTicket(NS, run, attempt=4)
    assert ticket.key == "t1:2:7"


def test_a_run_logged_with_an_id_is_claimed_by_it_and_its_re_runs_keep_it() -> None:
    from fusion_graph.memory.job_log import ticket_of

    # Two apps' runs of one thread, turn and step: one job log key, two claims.
    ours = JobTicket(
        NS,
        TicketFields(
            thread_id="t1", turn=2, step=7, covers=12, last_message_id=None, leg="local", log_id="a1"
        ),
    )
    theirs = JobTicket(NS, {**ours.run, "log_id": "b2"})
    assert ours.key == theirs.key == "t1:2:7"
    assert ours.claim_key != theirs.claim_key
    # A re-run takes the id back from the entry, so every worker of one app claims the same row.
    entry = pending_entry(ours, memory.DEFAULT_JOBS, lease_s=5.0)
    assert ticket_of(entry, NS, attempt=2).claim_key == ours.claim_key
    # A run logged before runs had an id keeps the claim it was made under: its job log key.
    old = JobTicket(
        NS, TicketFields(thread_id="t1", turn=2, step=7, covers=12, last_message_id=None, leg="local")
    )
    assert ticket_of(pending_entry(old, memory.DEFAULT_JOBS, lease_s=5.0), NS).claim_key == "t1:2:7"
