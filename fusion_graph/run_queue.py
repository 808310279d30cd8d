"""The per-thread run queue of an embedded graph, and no run without a new user message.

The LangGraph server already serialises runs on a thread; an app that embeds
the compiled graph gets the same here: a second run on a ``thread_id`` waits
for the first (runs queue, in order) instead of interleaving with it, which
would fork the thread's history. That queue is this process's; with shared
state (``shared_state="postgres"``) a run also holds the thread's lock in the
deployment's Postgres, so a run of the thread in another process on the same
checkpointer is refused (``ThreadBusy``) before anything is written. Input that cannot start a turn is refused
before anything is written or sent to a model.

The queue is keyed by the checkpoint store, not the saver object: two graphs
with savers of their own on one SQLite file share it (``store_key``). Every run
gets at least the operator's durability (``sync``: a step's checkpoint is saved
before the next step starts, ``run_durability``), and input that would rewrite
the thread's history is refused unless the operator allows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Iterator
from typing import Any, TypeVar

from langchain_core.messages import AIMessageChunk, BaseMessage, BaseMessageChunk
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph.state import CompiledStateGraph
from pydantic import TypeAdapter

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.coordination.shared_base import SharedStateUnavailable
from fusion_graph.errors import InvalidInput, SyncInEventLoop, ThreadBusy
from fusion_graph.inputs import (
    check_history_edits,
    check_identity,
    check_input,
    check_thread_id,
    input_messages,
)
from fusion_graph.internals import reclass
from fusion_graph.memory.runs import MemoryRuns
from fusion_graph.redact import StreamScrubber, registered_secrets, scrub_content, scrub_known
from fusion_graph.state import InputState, State
from fusion_graph.telemetry import switch as telemetry
from fusion_graph.tools.files import check_run_root

logger = logging.getLogger(__name__)
#: Seconds a run waits for the thread's run in another process to end before it is refused.
THREAD_WAIT_S = 5.0


class _Gates:
    """Per-(event loop, checkpoint store, thread) locks, dropped when no run holds or awaits them."""

    def __init__(self) -> None:
        self._locks: dict[tuple[int, Hashable, str], tuple[asyncio.Lock, int]] = {}

    def acquire_key(self, key: tuple[int, Hashable, str]) -> asyncio.Lock:
        """The lock of ``key``, counting this run as a user until ``release_key``."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        return lock

    def release_key(self, key: tuple[int, Hashable, str]) -> None:
        """One user fewer; the lock is dropped with its last user."""
        lock, users = self._locks[key]
        if users <= 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)


_GATES = _Gates()
T = TypeVar("T")
#: Each saver's store key (``store_key``), found once per saver object.
_STORE_KEYS: weakref.WeakKeyDictionary[Any, Hashable] = weakref.WeakKeyDictionary()


async def store_name(saver: Any) -> str:
    """Where ``saver`` keeps its threads, the same in every process that reaches that store.

    A SQLite file (its resolved path), a Postgres database (host, port and name),
    and ``""`` for none (a LangGraph server brings its own, one per deployment);
    any other saver is this process's own (an in-memory saver holds no thread
    another process could run). Names the run lock of a thread across processes.
    """
    if saver is None:
        return ""
    key = await store_key(saver)
    if isinstance(key, tuple) and key and key[0] == "sqlite":
        return f"sqlite:{key[1]}"
    conn: Any = getattr(saver, "conn", None)
    info = getattr(conn, "info", None)  # a psycopg connection
    if info is not None and type(conn).__module__.startswith("psycopg"):
        return f"postgres:{info.host}:{info.port}/{info.dbname}"
    conninfo = getattr(conn, "conninfo", None)  # a psycopg_pool pool
    if isinstance(conninfo, str) and type(conn).__module__.startswith("psycopg"):
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(conninfo)
        return f"postgres:{parts.get('host', '')}:{parts.get('port', '')}/{parts.get('dbname', '')}"
    return f"process:{os.getpid()}:{id(saver)}"


async def store_key(saver: Any) -> Hashable:
    """What a thread's run queue is keyed by: the checkpoint store ``saver`` writes to.

    Two savers on one SQLite file (two graphs, each with its own
    ``AsyncSqliteSaver``) hold the same threads: keyed by the saver object, two
    runs of one thread through them would each write a child of the same
    checkpoint, and one turn would silently drop out of the thread's history.
    So a SQLite saver is keyed by its database file (as SQLite reports it,
    symlinks resolved); any other saver, and an in-memory SQLite database, by
    the object itself.
    """
    try:
        return _STORE_KEYS[saver]
    except (KeyError, TypeError):
        pass
    key: Hashable = ("saver", id(saver))
    conn: Any = getattr(saver, "conn", None)
    if type(conn).__module__.startswith("aiosqlite"):
        try:
            async with conn.execute("PRAGMA database_list") as cursor:
                rows = await cursor.fetchall()
        except Exception as error:  # noqa: BLE001 - unreadable now: this run queues per saver, as before
            logger.debug("the SQLite saver's database file is unknown (%s): its runs queue per saver", error)
            return key  # not remembered: the next run asks again
        path = next((str(row[2]) for row in rows if row[1] == "main"), "")
        if path:  # "" for an in-memory or temporary database: only this saver reaches it
            key = ("sqlite", await asyncio.to_thread(os.path.realpath, path))
    with contextlib.suppress(TypeError):  # a saver that takes no weak reference is looked up again
        _STORE_KEYS[saver] = key
    return key


#: LangGraph's durability modes, least durable first.
_DURABILITY = ("exit", "async", "sync")


def run_durability(kwargs: dict[str, Any], least: str) -> str:
    """The durability a run gets: what it asked for, but at least ``least``; pops both run arguments.

    What it asked for is ``durability``, or the older ``checkpoint_during``
    (a LangGraph server may pass either; LangGraph refuses both at once). Under
    a server the run's parameters are the caller's, and the server asks for
    ``async`` unless told otherwise: the operator's floor
    (``FusionSettings.durability``, ``sync`` by default) is the least it gets, so
    a step's checkpoint is saved before the next step starts and a finished tool
    call's saved result is never lost with the checkpoint it belongs to (under
    ``async`` a task's write can land before that checkpoint does, and a crash
    in between loses both: the calls run again on resume).
    """
    asked = kwargs.pop("durability", None)
    during = kwargs.pop("checkpoint_during", None)
    if asked is None and during is not None:
        asked = "async" if during else "exit"
    if asked not in _DURABILITY:
        return least
    return str(max(asked, least, key=_DURABILITY.index))


class _SyncLoop:
    """One event loop on a daemon thread, shared by the sync entry points of every graph.

    Every node is async (``langgraph dev`` rejects blocking calls), so ``invoke``
    and ``stream`` run the async graph here; memory jobs detached by one call
    go on running after it returns, as they do under ``ainvoke``.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The shared loop, started on first use."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="fusion-graph-sync", daemon=True).start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the shared loop and wait for its result here."""
        _refuse_in_loop()
        return asyncio.run_coroutine_threadsafe(coro, self.loop()).result()

    def iterate(self, stream: AsyncIterator[T]) -> Iterator[T]:
        """Yield what ``stream`` yields, running it on the shared loop."""
        _refuse_in_loop()
        items: queue.Queue[tuple[str, Any]] = queue.Queue()

        async def pump() -> None:
            try:
                async for item in stream:
                    items.put(("item", item))
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                items.put(("error", error))
            else:
                items.put(("done", None))

        asyncio.run_coroutine_threadsafe(pump(), self.loop())
        while True:
            kind, value = items.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return


def _refuse_in_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise SyncInEventLoop(
        "the sync invoke/stream/batch of the fusion graph would block this running event loop: "
        "use await graph.ainvoke(...) or async for ... in graph.astream(...)"
    )


_SYNC = _SyncLoop()


class FusionGraph(CompiledStateGraph[State, FusionContext, InputState, State]):
    """The compiled fusion graph: runs on one thread queue; input without a user message is refused."""

    memory_runs: MemoryRuns
    """The graph's memory jobs (``fusion_graph.memory.sweep``/``drain(graph=...)`` use them)."""
    run_defaults: dict[str, Any]
    """The operator's run defaults (``FUSION_<FIELD>``), read when the graph was built."""

    def __init__(
        self,
        *args: Any,
        memory_runs: MemoryRuns | None = None,
        run_defaults: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """As ``CompiledStateGraph``; ``copy()`` (the server copies graphs) keeps both of its own."""
        super().__init__(*args, **kwargs)
        if memory_runs is not None:
            self.memory_runs = memory_runs
        if run_defaults is not None:
            self.run_defaults = run_defaults

    def get_context_jsonschema(self) -> dict[str, Any] | None:
        """The context schema Studio renders, with the operator's run defaults as the defaults shown."""
        schema = super().get_context_jsonschema()
        if schema is not None:
            for name, value in self.run_defaults.items():
                schema["properties"][name]["default"] = TypeAdapter(Any).dump_python(value, mode="json")
        return schema

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        """Sync ``invoke`` (and so ``batch``): ``ainvoke`` on the package's own event loop thread."""
        _refuse_in_loop()
        return _SYNC.run(self.ainvoke(input, config, **kwargs))

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        """Sync ``stream``: ``astream`` on the package's own event loop thread."""
        _refuse_in_loop()
        return _SYNC.iterate(self.astream(input, config, **kwargs))

    async def _check_resumable(self, config: RunnableConfig | None, thread: Any) -> None:
        """Refuse ``None`` input (a resume) where there is nothing to resume."""
        saver = self.checkpointer
        found = (
            await saver.aget_tuple(config or {})
            if isinstance(saver, BaseCheckpointSaver) and thread is not None
            else None
        )
        if found is None:
            where = f"thread {thread!r} has no checkpoint" if thread is not None else "no thread_id was given"
            raise InvalidInput(
                f"nothing to resume: {where}; start a turn with {{'messages': [('user', '...')]}}"
            )

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """``CompiledStateGraph.astream`` (and so ``ainvoke``), one run per thread at a time."""
        settings = self.memory_runs.resolver.settings
        check_input(input, settings.max_input_chars, allow_history_edits=settings.allow_history_edits)
        check_identity(config)
        saver = self.checkpointer if isinstance(self.checkpointer, BaseCheckpointSaver) else None
        # An id the savers cannot write is refused here, not by their first write (a bare encoding error).
        check_thread_id(
            (config or {}).get("configurable", {}).get("thread_id"), checkpointer=saver, store=self.store
        )
        # Over the operator's defaults, checked once here: a clear error before anything runs, and
        # every node reads the same FusionContext.
        run_context = kwargs["context"] = ensure_context(kwargs.get("context"), self.run_defaults)
        if input is not None:
            # Refused for its context (an operator bound, a provider that cannot be built, a run root
            # reached through a symlink) before the input is written: a refused run leaves the thread
            # as it was, with no orphaned message, and no model is asked.
            await self.memory_runs.resolver.chain(run_context)
            if run_context.workspace_root is not None:
                operator_root = self.memory_runs.resolver.settings.workspace_root
                await asyncio.to_thread(check_run_root, operator_root, run_context.workspace_root)
        thread = (config or {}).get("configurable", {}).get("thread_id")
        if input is None:
            await self._check_resumable(config, thread)
        if saver is not None:
            kwargs["durability"] = run_durability(kwargs, settings.durability)
        if thread is None or self.checkpointer is None:
            async for chunk in self._released(input, config, thread, **kwargs):
                yield chunk
            return
        key = (id(asyncio.get_running_loop()), await store_key(self.checkpointer), str(thread))
        lock = _GATES.acquire_key(key)
        try:
            async with lock, self._across_processes(str(thread)):
                # Inside the queue: the thread's messages as this run will find them.
                await self._check_history_edits(input, config)
                async for chunk in self._released(input, config, thread, **kwargs):
                    yield chunk
        finally:
            _GATES.release_key(key)

    async def _check_history_edits(self, input: Any, config: RunnableConfig | None) -> None:
        """Refuse input reusing the id of a message already in the thread (it would replace it).

        The thread is read only when an input message carries an id (Studio and
        the SDK set one; ``("user", "...")`` has none), and never when the
        operator allows history edits.
        """
        if self.memory_runs.resolver.settings.allow_history_edits:
            return
        if not any(message.id for message in input_messages(input) or []):
            return
        snapshot = await self.aget_state(config or {})
        existing = {str(m.id) for m in (snapshot.values or {}).get("messages", []) if m.id}
        check_history_edits(input, existing)

    async def _released(
        self, input: Any, config: RunnableConfig | None, thread: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """The run's chunks, scrubbed; at its end (inside the thread's queue) its slot is marked idle.

        Inside the queue, so the thread's next run never has its new lease marked idle.
        """
        metadata = dict((config or {}).get("metadata") or {})
        run_id = (config or {}).get("run_id")
        if run_id is not None and "run_id" not in metadata:  # a LangGraph server sets the run's id here
            metadata["run_id"] = str(run_id)
        try:
            chunks = _scrubbed(super().astream(input, config, **kwargs))
            async for chunk in telemetry.turn(
                chunks, self.name, None if thread is None else str(thread), metadata
            ):
                yield chunk
        finally:
            if thread is not None:  # the run is over: its slot may go to a thread that needs one now
                await self.memory_runs.resolver.placement.release(str(thread))

    @contextlib.asynccontextmanager
    async def _across_processes(self, thread: str) -> AsyncIterator[None]:
        """Hold the thread's run lock in the shared state, if any; refuse the run if another process has it.

        A run that another one just left waits for it a moment (``THREAD_WAIT_S``);
        an unreachable database never fails the run (it is logged).
        """
        shared = self.memory_runs.resolver.shared
        if shared is None:
            yield
            return
        # Keyed by where the thread's checkpoints live too: two apps on one shared-state database with
        # checkpointers of their own never wait for each other's runs of a same-named thread.
        name = f"{self.name}:{await store_name(self.checkpointer)}:{thread}"
        deadline = time.monotonic() + THREAD_WAIT_S
        async with contextlib.AsyncExitStack() as stack:
            while True:
                try:
                    held = await stack.enter_async_context(shared.locks.thread_run(name))
                except SharedStateUnavailable as error:
                    logger.debug("runs of thread %r are not serialised across processes: %s", thread, error)
                    break
                if held:
                    break
                if time.monotonic() >= deadline:
                    raise ThreadBusy(
                        f"thread {thread!r} is running in another process on the shared checkpointer; "
                        "runs of one thread must not interleave (nothing was written): wait for it and "
                        "try again, or run them through one queue (a LangGraph server does)"
                    )
                await asyncio.sleep(0.1)
            yield


def _messages_part(chunk: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """The ``(message, metadata)`` of a ``messages`` stream chunk, and how to put a new one back.

    Chunks come as ``(message, metadata)`` (``stream_mode="messages"``), ``(mode,
    payload)`` (several modes), with a namespace in front (``subgraphs=True``),
    or as a ``{"type": "messages", "data": ...}`` part.
    """
    if isinstance(chunk, dict) and chunk.get("type") == "messages" and "data" in chunk:
        return chunk["data"], lambda data: {**chunk, "data": data}
    if not isinstance(chunk, tuple) or not chunk:
        return None
    if len(chunk) == 2 and isinstance(chunk[0], BaseMessage) and isinstance(chunk[1], dict):
        return chunk, lambda data: data
    if chunk[-2:-1] == ("messages",) or (len(chunk) == 2 and isinstance(chunk[1], tuple)):
        inner = _messages_part(chunk[-1])
        if inner is not None:
            head = chunk[:-1]
            return inner[0], lambda data: (*head, inner[1](data))
    return None


def _is_last(message: BaseMessage) -> bool:
    """Whether a streamed chunk ends its message (or is a whole message)."""
    if not isinstance(message, BaseMessageChunk):
        return True
    metadata = message.response_metadata or {}
    return getattr(message, "chunk_position", None) == "last" or bool(metadata.get("finish_reason"))


async def _scrubbed(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``stream`` with the operator's keys scrubbed from every streamed message, also across chunks.

    The state is scrubbed where answers are recorded; the ``messages`` stream
    carries the model's tokens before that, so each message's text is let out
    through a ``StreamScrubber`` (a split key never leaves in pieces). What a
    message still holds when the stream ends goes out as one more chunk.

    The registered secrets are read once per chunk; with none registered (nor any
    before: they are only ever added, so nothing is held back) a chunk goes out as it came.
    """
    scrubber = StreamScrubber()
    envelopes: dict[str, tuple[Any, Callable[[Any], Any]]] = {}
    async for chunk in stream:
        part = _messages_part(chunk)
        known = registered_secrets()
        if part is None or not known:
            yield chunk
            continue
        (message, metadata), rebuild = part
        stream_id = str(message.id or id(message))
        update: dict[str, Any] = {}
        if isinstance(message.content, str):
            update["content"] = scrubber.feed(stream_id, message.content, last=_is_last(message), known=known)
        else:
            update["content"] = scrub_content(message.content, known)
        chunks = getattr(message, "tool_call_chunks", None)
        if chunks:
            update["tool_call_chunks"] = [{**c, "args": scrub_known(c["args"] or "", known)} for c in chunks]
        envelopes[stream_id] = (metadata, rebuild)
        yield rebuild((message.model_copy(update=update), metadata))
    for stream_id in scrubber.holding():
        metadata, rebuild = envelopes[stream_id]
        yield rebuild((AIMessageChunk(content=scrubber.flush(stream_id), id=stream_id), metadata))


def serialised(
    compiled: CompiledStateGraph[State, FusionContext, InputState, State],
    memory_runs: MemoryRuns,
    run_defaults: dict[str, Any],
) -> FusionGraph:
    """The compiled graph as a ``FusionGraph``: the same object, with thread queues, memory runs, defaults."""
    graph = reclass(compiled, FusionGraph)
    graph.memory_runs = memory_runs
    graph.run_defaults = run_defaults
    return graph
