"""Memory sub-runners: structured memory jobs that run after a reply, off the critical path.

A job asks a model for JSON against a bounded pydantic schema, validates it,
and writes the items to the LangGraph store, namespaced per assistant and user
like LangGraph's own memory examples, with the thread, turn and step they came
from. Jobs go through the provider chain like any inference (fallover, cost),
on the leg chosen by ``sub_runners``; local jobs use llama-server's reserved
reflection slot so they never evict a conversation's cached prefix. A failing,
slow or invalid job is recorded and dropped; it never fails the turn.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, get_buffer_string
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_openai import ChatOpenAI
from langgraph.store.base import BaseStore, SearchItem
from pydantic import BaseModel, Field, ValidationError

from fusion_graph import prompts
from fusion_graph.chain import ChainLink, ProviderChain
from fusion_graph.records import answered_record, make_record
from fusion_graph.routing import Leg, RouteDecision
from fusion_graph.slots import slot_body
from fusion_graph.state import RouteRecord

logger = logging.getLogger(__name__)

MEMORY_MESSAGE_NAME = prompts.MEMORY_MESSAGE_NAME
NAMESPACE_ROOT = "fusion_memories"


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


@dataclass
class JobResult:
    """What one job did: its route record (``kind="memory"``) and the items it stored."""

    job: str
    stored: list[dict[str, Any]]
    records: list[RouteRecord]
    dropped: str | None = None


def namespace(assistant_id: str, user_id: str) -> tuple[str, ...]:
    """The store namespace of an assistant's memories about one user."""
    return (NAMESPACE_ROOT, assistant_id, user_id)


def jobs_namespace(ns: tuple[str, ...]) -> tuple[str, ...]:
    """Where detached jobs leave their records: beside the memories, outside their search prefix."""
    return (f"{ns[0]}_jobs", *ns[1:])


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


def transcript(messages: Sequence[BaseMessage], max_chars: int) -> str:
    """The turn as plain text, newest part kept when it is too long."""
    shown = [m for m in messages if not (isinstance(m, HumanMessage) and m.name == MEMORY_MESSAGE_NAME)]
    text = get_buffer_string(shown)
    return text if len(text) <= max_chars else "...\n" + text[-max_chars:]


SlotFor = Callable[[ChainLink], Awaitable[int | None]]


async def run_job(
    job: MemoryJob,
    *,
    chain: ProviderChain,
    leg: Leg,
    reflection_slot: SlotFor,
    excerpt: str,
    turn: int,
    step: int,
    max_tokens: int,
    config: RunnableConfig | None = None,
) -> tuple[BaseModel | None, list[RouteRecord], str | None]:
    """Ask for the job's JSON (one repair on the same provider), validate it; never raises.

    Returns:
        The validated result (or ``None``), one record per inference, and why it was dropped.
    """
    prompt: list[BaseMessage] = [SystemMessage(job.instructions), HumanMessage(excerpt)]
    records: list[RouteRecord] = []
    prefer: str | None = None
    error = ""
    slots: dict[str, int | None] = {}
    for attempt in range(2):
        reason = f"memory job {job.name} on the {leg} leg (sub_runners={leg})"
        decision = RouteDecision(leg=leg, score=None, threshold=None, reason=reason)

        async def invoke(link: ChainLink, prompt: list[BaseMessage] = prompt) -> AIMessage:
            model: Runnable[Any, Any] = link.model
            kwargs: dict[str, Any] = {}
            if isinstance(link.model, ChatOpenAI):
                kwargs = {"response_format": job.response_format(), "max_tokens": max_tokens}
            slot = await reflection_slot(link) if link.leg == "local" else None
            body = slot_body(link.leg, slot)
            slots[link.id] = slot if body is not None else None
            if body is not None:
                kwargs["extra_body"] = body
            if kwargs:
                model = model.bind(**kwargs)
            answer = await model.ainvoke(prompt, config=config)
            return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)

        try:
            outcome = await chain.call(invoke, preferred_leg=leg, prefer_provider=prefer)
        except Exception as failure:  # noqa: BLE001 - a memory job must never fail the turn
            logger.warning("memory job %s failed: %r", job.name, failure)
            return None, records, f"provider error: {type(failure).__name__}: {failure}"
        link, answer = outcome.provider, outcome.answer
        record = answered_record(
            outcome,
            turn=turn,
            step=step,
            kind="memory",
            decision=decision,
            signals=None,
            slot=slots.get(link.id),
            extra={"job": job.name, "repair": attempt > 0},
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
        extra={"job": job.name, "dropped": why},
    )


def _json_text(answer: AIMessage) -> str:
    """The JSON text of an answer (content, minus a Markdown fence some models add)."""
    text = answer.text.strip()
    if text.startswith("```"):
        text = text.strip("`")
        text = text[text.find("\n") + 1 :] if "\n" in text else text
    return text


async def store_items(
    store: BaseStore,
    ns: tuple[str, ...],
    job: MemoryJob,
    result: BaseModel,
    *,
    thread_id: str,
    turn: int,
    step: int,
) -> list[dict[str, Any]]:
    """Write a validated result's items to the store, each tagged with where it came from."""
    stored = []
    now = datetime.now(UTC).isoformat()
    for item in job.items(result):
        value = {**item, "job": job.name, "thread_id": thread_id, "turn": turn, "step": step, "at": now}
        await store.aput(ns, uuid.uuid4().hex, value)
        stored.append(value)
    return stored


#: Jobs running detached (``memory_mode="background"``); ``drain`` awaits them.
_PENDING: set[asyncio.Task[Any]] = set()


def detach(job: Awaitable[Any]) -> asyncio.Task[Any]:
    """Run ``job`` in the background, keeping a reference until it is done."""
    task = asyncio.ensure_future(job)
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)
    return task


async def drain(timeout: float | None = None) -> None:
    """Wait for detached memory jobs (e.g. before a process exits, or in tests)."""
    if _PENDING:
        await asyncio.wait(list(_PENDING), timeout=timeout)
