"""The memories in the LangGraph store: namespaces, recall into a turn, and writes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.store.base import BaseStore, SearchItem

from fusion_graph import prompts
from fusion_graph.inputs import user_of
from fusion_graph.memory.jobs import MEMORY_MESSAGE_NAME, JobTicket, MemoryJob

logger = logging.getLogger(__name__)

NAMESPACE_ROOT = "fusion_memories"
#: The job log's root: neither it nor ``NAMESPACE_ROOT`` is a string prefix of the other, as some
#: stores match namespace prefixes as strings (a search of the memories never finds the job log).
JOBS_NAMESPACE_ROOT = "fusion_jobs"
#: Shadow checks finished after their turn, until a turn of the thread records them.
SHADOWS_NAMESPACE_ROOT = "fusion_shadows"


def namespace(assistant_id: str, user_id: str) -> tuple[str, ...]:
    """The store namespace of an assistant's memories about one user."""
    return (NAMESPACE_ROOT, assistant_id, user_id)


def jobs_namespace(ns: tuple[str, ...]) -> tuple[str, ...]:
    """The job log beside the memories (outside their search prefix)."""
    return (JOBS_NAMESPACE_ROOT, *ns[1:])


def shadows_namespace(ns: tuple[str, ...]) -> tuple[str, ...]:
    """Where a thread's finished shadow checks wait for its next turn (the same assistant and user)."""
    return (SHADOWS_NAMESPACE_ROOT, *ns[1:])


def memories_namespace(jobs_ns: tuple[str, ...]) -> tuple[str, ...]:
    """The memories a job log belongs to (the inverse of ``jobs_namespace``)."""
    return (NAMESPACE_ROOT, *jobs_ns[1:])


def namespace_of(config: RunnableConfig, graph_name: str) -> tuple[str, ...]:
    """The namespace for a run: LangGraph's ``assistant_id`` and the run's user (``inputs.user_of``)."""
    configurable = config.get("configurable", {})
    metadata = config.get("metadata", {})
    assistant = configurable.get("assistant_id") or metadata.get("assistant_id") or graph_name
    return namespace(str(assistant), user_of(config))


async def recall(store: BaseStore, ns: tuple[str, ...], query: str, limit: int) -> list[SearchItem]:
    """The ``limit`` most relevant memories (semantic score when the store has an index), newest first.

    Only items whose namespace is exactly ``ns``: a store that matches prefixes as
    strings would otherwise hand user ``anon`` the memories of user ``anonymous``.
    """
    if limit <= 0:
        return []
    found = await store.asearch(ns, query=query or None, limit=max(limit * 5, 50))
    found = [item for item in found if tuple(item.namespace) == tuple(ns)]
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


async def store_items(
    store: BaseStore, job: MemoryJob, items: Sequence[dict[str, Any]], *, ticket: JobTicket
) -> list[dict[str, Any]]:
    """Write a job's items (``MemoryJob.items`` of its answer, screened), each tagged with where it came from.

    Keys derive from the ticket, so a re-run after a crash overwrites what the
    interrupted run stored instead of adding a second copy.
    """
    ns = ticket.namespace
    stored = []
    now = now_iso()
    keys = []
    for index, item in enumerate(items):
        value = {
            **item,
            "job": job.name,
            "thread_id": ticket.run["thread_id"],
            "turn": ticket.run["turn"],
            "step": ticket.run["step"],
            "at": now,
        }
        key = f"{ticket.key}:{job.name}:{index}"
        await store.aput(ns, key, value)
        keys.append(key)
        stored.append(value)
    if ticket.attempt > 1:  # an earlier run may have stored more items than this one
        where = {
            "thread_id": ticket.run["thread_id"],
            "turn": ticket.run["turn"],
            "step": ticket.run["step"],
            "job": job.name,
        }
        for old in await search_all(store, ns, where):
            if old.key not in keys:
                await store.adelete(ns, old.key)
    return stored


async def search_all(
    store: BaseStore,
    prefix: tuple[str, ...],
    filter: dict[str, Any],
    page: int = 200,
    *,
    depth: int | None = None,
) -> list[SearchItem]:
    """Every item under ``prefix`` matching ``filter``, page by page, in namespaces of ``depth`` labels.

    Only namespaces that really start with ``prefix``, label by label, and (``depth``,
    default ``len(prefix)``: exactly ``prefix``) have that many labels, whatever the
    store matches.
    """
    want = len(prefix) if depth is None else depth
    seen = 0
    found: list[SearchItem] = []
    while True:
        batch = await store.asearch(prefix, filter=filter, limit=page, offset=seen)
        seen += len(batch)
        found += [
            item
            for item in batch
            if len(item.namespace) == want and tuple(item.namespace[: len(prefix)]) == tuple(prefix)
        ]
        if len(batch) < page:
            return found


def now_iso() -> str:
    """Now, in UTC, as ISO 8601 (the job log's timestamps)."""
    return datetime.now(UTC).isoformat()
