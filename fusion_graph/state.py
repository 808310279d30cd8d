"""Graph state: what the caller sends in, and what the graph keeps per thread.

The route records in it are ``fusion_graph.routing.records``' (no graph runtime there).

``messages`` and ``route_log`` only grow with a thread's age, so they are LangGraph
delta channels (``DeltaChannel``): a checkpoint stores each step's additions and, every
``SNAPSHOT_EVERY`` updates of the channel, the whole value; a step's write no
longer grows with the thread (docs/design.md, "Long-lived threads"). A thread
written when they were plain reducer channels loads as is: its stored value is
the base the later additions replay onto.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from langchain_core.messages import (
    AnyMessage,
    BaseMessage,
    BaseMessageChunk,
    RemoveMessage,
    convert_to_messages,
    message_chunk_to_message,
)
from langgraph.channels import DeltaChannel
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES as REMOVE_ALL
from langgraph.graph.state import CompiledStateGraph

# NOTE: typing_extensions.TypedDict, not typing.TypedDict: on Python 3.11 the
# LangGraph server's schema endpoint rejects the latter.
from typing_extensions import NotRequired, TypedDict  # noqa: UP035

from fusion_graph.errors import InvalidInput, UsageError
from fusion_graph.routing.records import RouteRecord, add_totals
from fusion_graph.routing.score import Leg


class PromptAnchor(TypedDict):
    """What a leg's server last reported for this thread: the base of the next estimate.

    The next step on that leg is estimated as ``prompt_tokens`` plus an estimate
    of only the messages appended since, so the tokenizer, the chat template and
    the tool schemas are counted the way that server counts them.
    """

    prompt_tokens: int
    """The server's ``prompt_tokens`` for the request."""
    messages: int
    """How many state messages that request carried (after the system prompt)."""
    last_id: str | None
    """Id of the last of them: a history changed under the anchor (compaction) voids it."""
    fingerprint: str
    """System prompt and tool schemas the request carried (another run context voids it)."""
    provider: str


class StepTally(TypedDict):
    """The paced dial's count of a route log: of its first ``records`` records, the continuation steps."""

    records: int
    """How many records of ``route_log`` (the first ones) the tally covers."""
    steps: int
    """Continuation steps among them (``kind == "step"``)."""
    cloud: int
    """Those of them the router sent to cloud (``routed_leg``)."""


class Stall(TypedDict):
    """An inference no provider could answer: which node to retry, and what the chain said."""

    node: str
    message: str
    retry_in_s: float | None
    order: NotRequired[dict[str, Any]]
    """A continuation step's order as its ``Send`` carried it: a resume sends it again."""


#: Updates of ``messages`` between two whole copies of it in a checkpoint: a turn of one tool call
#: updates it four times (the user's message, the plan, the tool's result, the reply), so every
#: 25 such turns. Loading a thread replays the updates since the last copy: a higher number writes
#: the whole history less often and replays more (``python -m bench.long_thread``).
SNAPSHOT_EVERY = 100
#: ``route_log`` is updated half as often (a record per inference), so it is copied at half the
#: count: both copies land on the same turns and a load walks back to one place.
LOG_SNAPSHOT_EVERY = SNAPSHOT_EVERY // 2
#: Namespace of the ids given to messages that arrive without one (``add_message_batches``).
MESSAGE_IDS = uuid.UUID("0f6b6c36-5a8e-4c55-9a4c-0d8b5e7f2a11")


def append_records(log: list[RouteRecord], batches: Sequence[list[RouteRecord]]) -> list[RouteRecord]:
    """``route_log``'s reducer: each batch of records appended in order (a new list)."""
    return [*log, *(record for batch in batches for record in batch)]


def _with_ids(batch: Any, start: int) -> list[Any]:
    """``batch`` as messages, each with an id that replaying the write gives again.

    ``add_messages`` stamps a message without an id with a random one, and a
    delta channel replays the stored write when the thread is loaded: were the
    write stored before the stamp, the id would change at every load. This one
    is derived from the message and its place, and stamped on the message
    itself, as LangGraph stamps it, so every later read of the write sees it.
    """
    named: list[Any] = []
    for offset, item in enumerate(batch if isinstance(batch, list) else [batch]):
        if isinstance(item, BaseMessageChunk):
            item = message_chunk_to_message(item)
        elif not isinstance(item, BaseMessage):
            item = convert_to_messages([item])[0]
        if item.id is None:
            seed = f"{start + offset}:{item.type}:{item.model_dump_json(exclude={'id'})}"
            item.id = str(uuid.uuid5(MESSAGE_IDS, seed))
        named.append(item)
    return named


def tool_result_id(batch_id: str, call_id: str) -> str:
    """The id of a tool call's result, given where it is made: from its batch's message id and its call id.

    Unique in the thread (message ids are, and call ids within a batch), and the
    same on every load (it is stored with the write). It spares ``_with_ids``
    rendering the whole result to derive one.
    """
    return str(uuid.uuid5(MESSAGE_IDS, f"result:{batch_id}:{call_id}"))


#: The id index of the histories ``add_message_batches`` returned last (the channel hands its
#: value back at the next update), so a step does not index the whole history again.
_INDEXES: OrderedDict[int, tuple[list[Any], dict[Any, int]]] = OrderedDict()
_INDEXES_LOCK = threading.Lock()


def _index_of(messages: list[AnyMessage]) -> dict[Any, int] | None:
    """The id index of ``messages`` when this reducer returned that history lately, else ``None``.

    The channel hands back the list it got; a node reading the state with its own
    writes (``Send`` tasks, edges) gets a copy of it, the same messages in a new list.
    """
    with _INDEXES_LOCK:
        known = _INDEXES.get(id(messages))
        if known is not None and known[0] is messages and len(known[1]) == len(messages):
            return known[1]
        for seen, where in reversed(_INDEXES.values()):  # a copy: the same message objects, in order
            same_end = messages and len(seen) == len(messages) == len(where) and seen[-1] is messages[-1]
            if same_end and seen == messages:
                return where
    return None


def add_message_batches(messages: list[AnyMessage], batches: Sequence[Any]) -> list[AnyMessage]:
    """``messages``' reducer: what ``add_messages`` gives batch after batch, in one pass.

    A thread's load replays up to ``SNAPSHOT_EVERY`` stored writes; folding
    ``add_messages`` over them would rebuild the history's id index for each.
    The same rules, per batch: a message whose id is known replaces it in place,
    a new one is appended, ``RemoveMessage`` drops its id (an unknown one is an
    error, ``InvalidInput``), and ``REMOVE_ALL_MESSAGES`` starts the history again after it.
    """
    merged = list(messages)
    index = _index_of(messages)
    where = dict(index) if index is not None else {m.id: i for i, m in enumerate(merged)}
    for batch in batches:
        named = _with_ids(batch, len(merged))
        cleared = [i for i, m in enumerate(named) if isinstance(m, RemoveMessage) and m.id == REMOVE_ALL]
        if cleared:
            merged = named[cleared[-1] + 1 :]
            where = {m.id: i for i, m in enumerate(merged)}
            continue
        removed: set[str | None] = set()
        for message in named:
            known = where.get(message.id)
            if isinstance(message, RemoveMessage):
                if known is None:
                    raise InvalidInput(f"no message with the id {message.id!r} to remove (RemoveMessage)")
                removed.add(message.id)
            elif known is None:
                where[message.id] = len(merged)
                merged.append(message)
            else:
                removed.discard(message.id)
                merged[known] = message
        if removed:
            merged = [m for m in merged if m.id not in removed]
            where = {m.id: i for i, m in enumerate(merged)}
    with _INDEXES_LOCK:
        _INDEXES[id(merged)] = (merged, where)
        while len(_INDEXES) > 16:
            _INDEXES.popitem(last=False)
    return merged


class InputState(TypedDict):
    """What a caller sends: new messages (usually one user message)."""

    messages: Annotated[
        list[AnyMessage], DeltaChannel(add_message_batches, snapshot_frequency=SNAPSHOT_EVERY)
    ]


class State(InputState):
    """Per-thread state; everything except ``messages`` is managed by the graph."""

    route_log: NotRequired[
        Annotated[list[RouteRecord], DeltaChannel(append_records, snapshot_frequency=LOG_SNAPSHOT_EVERY)]
    ]
    totals: NotRequired[Annotated[dict[str, Any], add_totals]]
    """Running totals of the thread: ``cost_usd``, ``unpriced`` inferences, tokens per leg."""
    # NOTE: the fields below describe the turn in progress and are reset by `plan`.
    turn: NotRequired[int]
    """Index of the current turn in the thread (0-based)."""
    step: NotRequired[int]
    """Index of the last inference in this turn (the plan is 0)."""
    leg: NotRequired[Leg]
    """Leg of the last inference: hysteresis reads it, repairs reuse it."""
    provider: NotRequired[str | None]
    """Provider that answered the last inference (repairs prefer it)."""
    notice: NotRequired[bool]
    """A batch was trimmed or the loop detector fired since the previous step."""
    # NOTE: only with ``trouble_signals``: the step's executor writes the escalation latch its
    # decision leaves (``RouteDecision.latch``), the next one reads it (``routing.score.Latch``).
    latch: NotRequired[int | None]
    """The step whose trouble latched this turn on cloud until a progress event (``None``: not held)."""
    repair_attempts: NotRequired[int]
    """Consecutive repairs of malformed tool calls in this turn."""
    repair_error: NotRequired[str | None]
    """Why the last batch needs repair (``None`` when it was valid)."""
    stall: NotRequired[Stall | None]
    """Set when every provider failed an inference; resuming the thread retries it."""
    # NOTE: per leg, the last server-reported prompt size of this thread; kept in state so it
    # survives checkpoints and process restarts (``fusion_graph.sizing.turn``).
    anchors: NotRequired[dict[str, PromptAnchor]]
    """Per leg: the prompt tokens its server last reported and the messages they covered."""
    # NOTE: the paced dial's running count of ``route_log`` (``turn.step_tally``), written by the
    # step's executor only when ``pace_slack`` is set, so a step counts the records appended since
    # the last one instead of the whole thread's log. ``route_log`` only grows (its reducer
    # appends), so the first ``records`` records stay the ones counted; a tally that covers more
    # records than the log holds is ignored, and without one the whole log is counted.
    step_tally: NotRequired[StepTally]
    """Of the first ``records`` route records: the continuation steps and those routed to cloud."""


class Answered(InputState):
    """What the edge after an inference reads: the edge is handed only these channels, not the state."""

    leg: NotRequired[Leg]
    stall: NotRequired[Stall | None]


def _nothing(state: State) -> dict[str, Any]:
    return {}


def state_reader(saver: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any, Any, Any, Any]:
    """A graph over ``State`` on ``saver``, to read stored threads: ``reader.get_state(config).values``.

    A checkpoint of a delta channel holds only the step's additions, so a thread's
    ``messages`` and ``route_log`` are read the way LangGraph loads them (replayed
    from the last whole copy), never from ``checkpoint["channel_values"]``.
    """
    builder = StateGraph(State)
    builder.add_node("read", _nothing)
    builder.add_edge(START, "read")
    return builder.compile(checkpointer=saver)


def check_thread_ttl(environ: Mapping[str, str]) -> None:
    """Refuse a LangGraph server set to prune threads with ``keep_latest``.

    Kept alone, a thread's latest checkpoint holds only its last step's additions
    to ``messages`` and ``route_log``: the thread would load empty, silently.

    Raises:
        UsageError: ``LANGGRAPH_THREAD_TTL`` (or the ``ttl`` of ``LANGGRAPH_CHECKPOINTER``,
            ``langgraph.json``'s ``checkpointer``) has the strategy ``keep_latest``.
    """
    for name in ("LANGGRAPH_THREAD_TTL", "LANGGRAPH_CHECKPOINTER"):
        raw = environ.get(name, "").strip()
        try:
            value = json.loads(raw) if raw.startswith("{") else None
        except ValueError:
            continue  # the server reports its own settings' errors
        ttl = value.get("ttl") if isinstance(value, dict) and name == "LANGGRAPH_CHECKPOINTER" else value
        if isinstance(ttl, dict) and ttl.get("strategy") == "keep_latest":
            raise UsageError(
                f"{name}: a thread TTL with strategy keep_latest keeps only a thread's latest checkpoint, "
                "which holds its last step's messages, not the whole thread; use strategy delete "
                "(docs/deploying.md, long-lived threads)"
            )
