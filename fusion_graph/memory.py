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

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool
from langchain_openai import ChatOpenAI
from langgraph.store.base import BaseStore, SearchItem
from pydantic import BaseModel, Field, ValidationError

from fusion_graph import prompts
from fusion_graph.chain import ChainLink, ProviderChain
from fusion_graph.executor import bound_model
from fusion_graph.records import answered_record, make_record
from fusion_graph.redact import scrub
from fusion_graph.routing import Leg, RouteDecision
from fusion_graph.signals import build_prompt
from fusion_graph.slots import slot_body
from fusion_graph.state import RouteRecord

if TYPE_CHECKING:
    from fusion_graph.context import FusionContext
    from fusion_graph.serial import FusionGraph

logger = logging.getLogger(__name__)

MEMORY_MESSAGE_NAME = prompts.MEMORY_MESSAGE_NAME
NAMESPACE_ROOT = "fusion_memories"
JOBS_NAMESPACE_ROOT = f"{NAMESPACE_ROOT}_jobs"
#: Seconds a job's lease outlasts its own budget (store writes after the model call).
LEASE_GRACE_S = 5.0
#: Runs of one job (the first and its re-runs after a crash) before it is given up.
MAX_ATTEMPTS = 3
#: The priming request's prompt: shares no prefix with any chat-templated conversation.
PRIMER_PROMPT = "fusion-graph memory slot: park the previous job in the host prompt cache"


class MemoryItem(BaseModel):
    """One thing worth remembering."""

    kind: Literal["fact", "decision", "task"] = Field(description="fact, decision or open task")
    text: str = Field(min_length=1, max_length=240, description="One self-contained sentence.")


class TurnMemories(BaseModel):
    """What a turn leaves behind (bounded, so a constrained local model always terminates)."""

    items: list[MemoryItem] = Field(default_factory=list, max_length=8)


@dataclass(frozen=True)
class MemoryJob:
    """A structured memory job: a schema with a list field ``items`` of objects to store."""

    name: str
    schema: type[BaseModel]
    instructions: str = prompts.MEMORY_INSTRUCTIONS

    def items(self, result: BaseModel) -> list[dict[str, Any]]:
        """The objects to store from a validated result."""
        raw = result.model_dump(mode="json")
        items = raw.get("items")
        return [dict(item) for item in items] if isinstance(items, list) else [raw]

    def response_format(self) -> dict[str, Any]:
        """OpenAI ``response_format``: llama-server turns it into a grammar."""
        return {
            "type": "json_schema",
            "json_schema": {"name": self.name, "schema": self.schema.model_json_schema()},
        }


DEFAULT_JOBS: tuple[MemoryJob, ...] = (MemoryJob("turn_memories", TurnMemories),)


def namespace(assistant_id: str, user_id: str) -> tuple[str, ...]:
    """The store namespace of an assistant's memories about one user."""
    return (NAMESPACE_ROOT, assistant_id, user_id)


def jobs_namespace(ns: tuple[str, ...]) -> tuple[str, ...]:
    """The job log beside the memories (outside their search prefix)."""
    return (JOBS_NAMESPACE_ROOT, *ns[1:])


def memories_namespace(jobs_ns: tuple[str, ...]) -> tuple[str, ...]:
    """The memories a job log belongs to (the inverse of ``jobs_namespace``)."""
    return (NAMESPACE_ROOT, *jobs_ns[1:])


def namespace_of(config: RunnableConfig, graph_name: str) -> tuple[str, ...]:
    """The namespace for a run: LangGraph's ``assistant_id`` and authenticated user, if any."""
    configurable = config.get("configurable", {})
    metadata = config.get("metadata", {})
    assistant = configurable.get("assistant_id") or metadata.get("assistant_id") or graph_name
    user = configurable.get("user_id") or configurable.get("langgraph_auth_user_id") or "anonymous"
    return namespace(str(assistant), str(user))


async def recall(store: BaseStore, ns: tuple[str, ...], query: str, limit: int) -> list[SearchItem]:
    """The ``limit`` most relevant memories (semantic score when the store has an index), newest first."""
    if limit <= 0:
        return []
    found = await store.asearch(ns, query=query or None, limit=max(limit * 5, 50))
    found.sort(key=lambda item: (item.score or 0.0, item.created_at), reverse=True)
    return found[:limit]


def memory_message(items: Sequence[SearchItem]) -> HumanMessage | None:
    """The message that brings recalled memories into a turn (``None`` when there are none).

    It is stored in the thread like any message, so every later step shares
    the same prefix and llama-server's cache is not broken by it.
    """
    lines = [f"- [{item.value.get('kind', 'note')}] {item.value.get('text', '')}" for item in items]
    if not lines:
        return None
    text = prompts.RECALLED_MEMORIES.format(items="\n".join(lines))
    return HumanMessage(content=text, name=MEMORY_MESSAGE_NAME)


def job_prompt(system_prompt: str, messages: Sequence[BaseMessage], job: MemoryJob) -> list[BaseMessage]:
    """The conversation exactly as a step sends it (``build_prompt``), then the job's instructions."""
    return [*build_prompt(system_prompt, messages), HumanMessage(job.instructions)]


# -- one job: a warm, structured inference on the reflection slot -------------

SlotFor = Callable[[ChainLink], Awaitable[int | None]]

#: One lock per (event loop, llama-server, slot): priming and the job it primes for stay together.
_SLOT_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _slot_lock(link: ChainLink, slot: int) -> asyncio.Lock:
    locks = _SLOT_LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault((link.as_provider().base_url or link.id, slot), asyncio.Lock())


async def prime_reflection_slot(link: ChainLink, slot: int) -> bool:
    """Make llama-server hold the conversation's prefix for a job on ``slot``; ``True`` if it answered.

    llama-server restores a prompt from its host prompt cache (``--cache-ram``)
    only when the slot it picks would keep less than half of its own content,
    and it copies idle slots into that cache when a task starts
    (``--cache-idle-slots``). This one-token request shares nothing with the
    slot's content (the previous job), so it parks that content in the cache
    and snapshots the idle conversation slots; the job that follows then
    finds its conversation there. Any failure is ignored: the job runs cold.
    """
    model = link.model
    if not isinstance(model, ChatOpenAI) or model.root_async_client is None:
        return False
    try:
        await model.root_async_client.completions.create(
            model=model.model_name,
            prompt=PRIMER_PROMPT,
            max_tokens=1,
            temperature=0,
            extra_body={"id_slot": slot, "cache_prompt": True},
        )
    except Exception as error:  # noqa: BLE001 - priming only saves prefill; the job runs anyway
        logger.debug("priming slot %s of %s failed: %s", slot, link.id, scrub(repr(error)))
        return False
    return True


@dataclass(frozen=True)
class JobRunner:
    """How a thread's memory jobs are called.

    Attributes:
        chain: The provider chain (fallover, health, prices) the jobs go through.
        leg: The ``sub_runners`` leg the jobs start on.
        system_prompt: The steps' system prompt (the prefix must match theirs).
        tools: The tools the steps bind (their schemas are part of the prefix).
        reflection_slot: The llama-server slot for jobs on a local link (``None``: not llama-server).
        max_tokens: Completion budget of one answer.
        config: Callbacks and tags of the run (``None`` for detached jobs).
        prime: Prime the reflection slot before a local job (``bench/memory_warm.py`` measures
            what turning it off costs).
    """

    chain: ProviderChain
    leg: Leg
    system_prompt: str
    tools: Sequence[BaseTool]
    reflection_slot: SlotFor
    max_tokens: int
    config: RunnableConfig | None = None
    prime: bool = True


def _job_kwargs(
    link: ChainLink, job: MemoryJob, runner: JobRunner, body: dict[str, Any] | None
) -> dict[str, Any]:
    """Request fields of a job: the schema, no tool calls, the slot.

    ``response_format`` travels in ``extra_body``: as a model argument,
    langchain-openai would parse the answer with the SDK, which refuses
    non-strict tools, and the tools must stay bound for the prefix to match.
    """
    if not isinstance(link.model, ChatOpenAI):
        return {"extra_body": body} if body is not None else {}
    kwargs: dict[str, Any] = {
        "max_tokens": runner.max_tokens,
        "extra_body": {**(body or {}), "response_format": job.response_format()},
    }
    if runner.tools:
        kwargs["tool_choice"] = "none"
    return kwargs


async def run_job(
    job: MemoryJob, messages: Sequence[BaseMessage], runner: JobRunner, *, turn: int, step: int
) -> tuple[BaseModel | None, list[RouteRecord], str | None]:
    """Ask for the job's JSON about ``messages`` (one repair on the same provider); never raises.

    Returns:
        The validated result (or ``None``), one record per inference, and why it was dropped.
    """
    prompt = job_prompt(runner.system_prompt, messages, job)
    records: list[RouteRecord] = []
    prefer: str | None = None
    error = ""
    slots: dict[str, int | None] = {}
    primed: dict[str, bool] = {}
    for attempt in range(2):
        reason = f"memory job {job.name} on the {runner.leg} leg (sub_runners={runner.leg})"
        decision = RouteDecision(leg=runner.leg, score=None, threshold=None, reason=reason)
        prime = runner.prime and attempt == 0  # a repair continues the slot's own content

        async def invoke(
            link: ChainLink, prompt: list[BaseMessage] = prompt, prime: bool = prime
        ) -> AIMessage:
            slot = await runner.reflection_slot(link) if link.leg == "local" else None
            body = slot_body(link.leg, slot)
            slots[link.id] = slot if body is not None else None
            model: Runnable[Any, Any] = bound_model(link, runner.tools)
            kwargs = _job_kwargs(link, job, runner, body)
            if kwargs:
                model = model.bind(**kwargs)
            if slot is None or body is None:
                answer = await model.ainvoke(prompt, config=runner.config)
            else:
                async with _slot_lock(link, slot):
                    primed[link.id] = prime and await prime_reflection_slot(link, slot)
                    answer = await model.ainvoke(prompt, config=runner.config)
            return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)

        try:
            outcome = await runner.chain.call(invoke, preferred_leg=runner.leg, prefer_provider=prefer)
        except Exception as failure:  # noqa: BLE001 - a memory job must never fail the turn
            why = scrub(f"provider error: {type(failure).__name__}: {failure}")
            logger.warning("memory job %s failed: %s", job.name, why)
            return None, records, why
        link, answer = outcome.provider, outcome.answer
        record = answered_record(
            outcome,
            turn=turn,
            step=step,
            kind="memory",
            decision=decision,
            signals=None,
            slot=slots.get(link.id),
            extra={"job": job.name, "repair": attempt > 0, "primed": primed.get(link.id, False)},
        )
        records.append(record)
        try:
            return job.schema.model_validate_json(_json_text(answer)), records, None
        except (ValidationError, ValueError) as invalid:
            error = str(invalid).splitlines()[0] if str(invalid) else type(invalid).__name__
            prompt = [*prompt, answer, HumanMessage(prompts.MEMORY_REPAIR.format(error=error))]
            prefer = link.id  # the repair is judged by the model that made the mistake
    records[-1]["extra"]["dropped"] = f"invalid JSON after one repair: {error}"
    return None, records, f"invalid JSON after one repair: {error}"


def dropped_record(job: MemoryJob, leg: Leg, turn: int, step: int, why: str) -> RouteRecord:
    """The record of a job that produced no answer at all (timeout, every provider down)."""
    decision = RouteDecision(leg=leg, score=None, threshold=None, reason=f"memory job {job.name} dropped")
    return make_record(
        turn=turn,
        step=step,
        kind="memory",
        leg=leg,
        decision=decision,
        signals=None,
        provider=None,
        answer=None,
        extra={"job": job.name, "dropped": scrub(why)},
    )


def _json_text(answer: AIMessage) -> str:
    """The JSON text of an answer (content, minus a Markdown fence some models add)."""
    text = answer.text.strip()
    if text.startswith("```"):
        text = text.strip("`")
        text = text[text.find("\n") + 1 :] if "\n" in text else text
    return text


# -- the job log: pending before a job starts, done after ---------------------


@dataclass(frozen=True)
class JobTicket:
    """One memory run of a thread: what it covers and where it writes (its job log entry).

    Attributes:
        namespace: The memories' namespace (the job log is ``jobs_namespace`` of it).
        thread_id: The thread whose conversation the jobs read.
        turn: Turn of the thread when the run was started.
        step: Last step of that turn the run covers.
        covers: How many of the thread's messages (from the first) the jobs read.
        last_message_id: Id of the last message covered, to check the thread still has it.
        leg: The ``sub_runners`` leg.
        attempt: 1 for the first run, then one more per re-run after a crash.
    """

    namespace: tuple[str, ...]
    thread_id: str
    turn: int
    step: int
    covers: int
    last_message_id: str | None
    leg: Leg
    attempt: int = 1

    @property
    def key(self) -> str:
        """The job log key (also the prefix of the items' keys, so a re-run overwrites them)."""
        return f"{self.thread_id}:{self.turn}:{self.step}"


class Owner(TypedDict):
    """The process that runs a job: a dead one's pending jobs are picked up without waiting."""

    host: str
    pid: int


class JobEntry(TypedDict):
    """A job log entry (``jobs_namespace``): one memory run of a thread, from pending to folded."""

    thread_id: str
    turn: int
    step: int
    covers: int
    last_message_id: str | None
    leg: Leg
    jobs: list[str]
    status: Literal["pending", "done", "folded"]
    """pending: written before the run; done: finished, records not yet in route_log; folded: they are."""
    attempts: int
    lease_until: float
    """Epoch seconds: a pending run past its lease is picked up again."""
    owner: Owner
    created_at: str
    finished_at: str | None
    stored: int
    records: list[RouteRecord]


_HOST = socket.gethostname()


def this_process() -> Owner:
    """This process as a job owner."""
    return Owner(host=_HOST, pid=os.getpid())


def _owner_gone(owner: Owner) -> bool:
    """Whether the owner is known to be gone: this process without the job, or a dead process here.

    An owner on another host is never judged: its lease decides.
    """
    if owner.get("host") != _HOST:
        return False
    pid = owner.get("pid")
    if pid == os.getpid():
        return True  # this process without the run (the caller checked), or an earlier one with our pid
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. PermissionError: it exists, under another user
        return False
    return False


def needs_rerun(entry: JobEntry, *, now: float, running_here: bool) -> bool:
    """Whether a job log entry is a pending run nobody is doing: lease over, or its process gone."""
    if entry.get("status") != "pending" or running_here:
        return False
    return float(entry.get("lease_until", 0.0)) <= now or _owner_gone(entry["owner"])


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


def pending_entry(
    ticket: JobTicket, jobs: Sequence[MemoryJob], *, lease_s: float, created_at: str | None = None
) -> JobEntry:
    """The entry written before a run starts (or restarts)."""
    return JobEntry(
        thread_id=ticket.thread_id,
        turn=ticket.turn,
        step=ticket.step,
        covers=ticket.covers,
        last_message_id=ticket.last_message_id,
        leg=ticket.leg,
        jobs=[job.name for job in jobs],
        status="pending",
        attempts=ticket.attempt,
        lease_until=time.time() + lease_s,
        owner=this_process(),
        created_at=created_at or _now_iso(),
        finished_at=None,
        stored=0,
        records=[],
    )


def done_entry(entry: JobEntry, records: Sequence[RouteRecord]) -> JobEntry:
    """``entry`` finished, with the records of every job of the run."""
    finished = JobEntry(**entry)
    finished["status"] = "done"
    finished["finished_at"] = _now_iso()
    finished["stored"] = sum(int(record["extra"].get("stored") or 0) for record in records)
    finished["records"] = list(records)
    return finished


def with_status(entry: JobEntry, status: Literal["pending", "done", "folded"]) -> JobEntry:
    """A copy of ``entry`` with another status."""
    changed = JobEntry(**entry)
    changed["status"] = status
    return changed


def ticket_of(entry: JobEntry, ns: tuple[str, ...], *, attempt: int | None = None) -> JobTicket:
    """The ticket of a logged run (``ns``: the memories' namespace), as a re-run takes it up."""
    return JobTicket(
        namespace=ns,
        thread_id=entry["thread_id"],
        turn=entry["turn"],
        step=entry["step"],
        covers=entry["covers"],
        last_message_id=entry.get("last_message_id"),
        leg=entry["leg"],
        attempt=entry.get("attempts", 1) if attempt is None else attempt,
    )


async def write_entry(store: BaseStore, ticket: JobTicket, entry: JobEntry) -> None:
    """Write ``entry`` to the job log (its key is the ticket's)."""
    await store.aput(jobs_namespace(ticket.namespace), ticket.key, dict(entry), index=False)


async def _search_all(
    store: BaseStore, prefix: tuple[str, ...], filter: dict[str, Any], page: int = 200
) -> list[SearchItem]:
    found: list[SearchItem] = []
    while True:
        batch = await store.asearch(prefix, filter=filter, limit=page, offset=len(found))
        found.extend(batch)
        if len(batch) < page:
            return found


async def thread_entries(
    store: BaseStore, ns: tuple[str, ...], thread_id: str, statuses: Sequence[str] = ("pending", "done")
) -> list[JobEntry]:
    """The thread's runs in ``statuses`` (by default: not yet folded into ``route_log``), oldest first."""
    found: list[SearchItem] = []
    for status in statuses:
        found += await _search_all(store, jobs_namespace(ns), {"thread_id": thread_id, "status": status})
    entries = [cast(JobEntry, item.value) for item in found]
    return sorted(entries, key=lambda e: (e["turn"], e["step"]))


async def pending_everywhere(store: BaseStore) -> list[tuple[tuple[str, ...], JobEntry]]:
    """Every pending run in the store, with its memories' namespace."""
    found = await _search_all(store, (JOBS_NAMESPACE_ROOT,), {"status": "pending"})
    return [(memories_namespace(item.namespace), cast(JobEntry, item.value)) for item in found]


def folded_keys(route_log: Iterable[RouteRecord]) -> set[str]:
    """Job log keys whose records are already in ``route_log``."""
    return {
        str(record["extra"]["job_key"])
        for record in route_log
        if record["kind"] == "memory" and record["extra"].get("job_key")
    }


async def store_items(
    store: BaseStore, job: MemoryJob, result: BaseModel, *, ticket: JobTicket
) -> list[dict[str, Any]]:
    """Write a validated result's items, each tagged with where it came from.

    Keys derive from the ticket, so a re-run after a crash overwrites what the
    interrupted run stored instead of adding a second copy.
    """
    ns = ticket.namespace
    stored = []
    now = _now_iso()
    keys = []
    for index, item in enumerate(job.items(result)):
        value = {
            **item,
            "job": job.name,
            "thread_id": ticket.thread_id,
            "turn": ticket.turn,
            "step": ticket.step,
            "at": now,
        }
        key = f"{ticket.key}:{job.name}:{index}"
        await store.aput(ns, key, value)
        keys.append(key)
        stored.append(value)
    if ticket.attempt > 1:  # an earlier run may have stored more items than this one
        where = {"thread_id": ticket.thread_id, "turn": ticket.turn, "step": ticket.step, "job": job.name}
        for old in await _search_all(store, ns, where):
            if old.key not in keys:
                await store.adelete(ns, old.key)
    return stored


# -- detached runs, and inferences in flight per thread ------------------------

#: Jobs running detached (``memory_mode="background"``); ``drain`` awaits them.
_PENDING: set[asyncio.Task[Any]] = set()
#: The detached run of each job log key, while it runs in this process.
_RUNNING: dict[str, asyncio.Task[Any]] = {}


def detach(job: Awaitable[Any], key: str | None = None) -> asyncio.Task[Any]:
    """Run ``job`` in the background, keeping a reference (by job log ``key``, if any) until it is done."""
    task = asyncio.ensure_future(job)
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)
    if key is not None:
        _RUNNING[key] = task

        def forget(done: asyncio.Task[Any]) -> None:
            if _RUNNING.get(key) is done:
                del _RUNNING[key]

        task.add_done_callback(forget)
    return task


def running_here(key: str) -> bool:
    """Whether the run logged under ``key`` is running in this process."""
    task = _RUNNING.get(key)
    return task is not None and not task.done()


#: Inferences in flight per event loop and thread, so a job can start after the step beside it.
_IN_FLIGHT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, set[asyncio.Future[None]]]] = (
    weakref.WeakKeyDictionary()
)


def _in_flight() -> dict[str, set[asyncio.Future[None]]]:
    return _IN_FLIGHT.setdefault(asyncio.get_running_loop(), {})


@contextlib.asynccontextmanager
async def inference_running(thread_id: str) -> AsyncIterator[None]:
    """Mark an inference of ``thread_id`` as in flight (``steps_settled`` waits for it)."""
    table = _in_flight()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    table.setdefault(thread_id, set()).add(done)
    try:
        yield
    finally:
        done.set_result(None)
        futures = table.get(thread_id, set())
        futures.discard(done)
        if not futures:
            table.pop(thread_id, None)


async def steps_settled(thread_id: str, timeout: float) -> None:
    """Wait (at most ``timeout`` s) for the thread's inferences in flight now.

    A job beside a step (``memory_every_k_steps``) starts once that step is
    answered: llama-server then holds the step's prompt in an idle slot, which
    the job's priming copies into the host prompt cache.
    """
    futures = set(_in_flight().get(thread_id, set()))
    if futures:
        await asyncio.wait(futures, timeout=timeout)


async def drain(
    timeout: float | None = None, *, graph: FusionGraph | None = None, context: FusionContext | None = None
) -> None:
    """Wait for detached memory jobs (e.g. before a process exits, or in tests).

    With ``graph``, first run its pending jobs that no live process is running
    (``sweep``), e.g. those a crashed process left behind.
    """
    if graph is not None:
        await sweep(graph, context=context)
    if _PENDING:
        await asyncio.wait(list(_PENDING), timeout=timeout)


async def sweep(graph: FusionGraph, *, context: FusionContext | None = None) -> int:
    """Run every pending job of ``graph``'s store that no live process is running; returns how many.

    Each is re-run on the thread's messages from ``graph``'s checkpointer and
    awaited; its records reach the thread's ``route_log`` at its next turn.
    """
    from fusion_graph.nodes.memory import memory_nodes_of  # the nodes import this module

    return await memory_nodes_of(graph).sweep(graph, context=context)
