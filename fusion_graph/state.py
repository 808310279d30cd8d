"""Graph state: what the caller sends in, and what the graph keeps per thread.

The route records in it are ``fusion_graph.routing.records``' (no graph runtime there).
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

from langchain_core.messages import AnyMessage
from langgraph.graph.message import add_messages

# NOTE: typing_extensions.TypedDict, not typing.TypedDict: on Python 3.11 the
# LangGraph server's schema endpoint rejects the latter.
from typing_extensions import NotRequired, TypedDict  # noqa: UP035

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


class InputState(TypedDict):
    """What a caller sends: new messages (usually one user message)."""

    messages: Annotated[list[AnyMessage], add_messages]


class State(InputState):
    """Per-thread state; everything except ``messages`` is managed by the graph."""

    route_log: NotRequired[Annotated[list[RouteRecord], operator.add]]
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
    # decision leaves (``RouteDecision.latch``), the next one reads it (``routing.Latch``).
    latch: NotRequired[int | None]
    """The step whose trouble latched this turn on cloud until a progress event (``None``: not held)."""
    repair_attempts: NotRequired[int]
    """Consecutive repairs of malformed tool calls in this turn."""
    repair_error: NotRequired[str | None]
    """Why the last batch needs repair (``None`` when it was valid)."""
    stall: NotRequired[Stall | None]
    """Set when every provider failed an inference; resuming the thread retries it."""
    # NOTE: per leg, the last server-reported prompt size of this thread; kept in state so it
    # survives checkpoints and process restarts (``fusion_graph.sizing.estimate``).
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
