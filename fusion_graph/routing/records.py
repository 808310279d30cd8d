"""Route records: the typed entry every inference leaves in ``route_log``, and the totals over them.

Plain data with no graph runtime, so the CLI, replay, the benchmarks and the
nodes all import the same step kinds, record type and totals instead of
copying them. A record's token and cost fields come from the answering
provider's own report, or are ``None`` when it reported nothing: never an estimate.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

# NOTE: typing_extensions.TypedDict, not typing.TypedDict: on Python 3.11 the
# LangGraph server's schema endpoint rejects the latter.
from typing_extensions import NotRequired, TypedDict  # noqa: UP035

from fusion_graph.routing.score import Leg, RouteDecision, StepSignals

if TYPE_CHECKING:
    from langchain_core.messages import AIMessage

StepKind = Literal["plan", "step", "repair", "memory", "synthesis", "sampling", "shadow"]

#: Inferences beside the turn's steps (memory jobs, a reply's re-write, MCP samples, shadow checks):
#: not routed by the score, so step counts and the share of steps on cloud leave them out.
SIDE_KINDS: frozenset[str] = frozenset({"memory", "synthesis", "sampling", "shadow"})

ErrorClass = Literal[
    "rate_limited",
    "timeout",
    "connection",
    "server_error",
    "misconfigured",
    "malformed_response",
    "context_overflow",
    "bad_request",
    "other",
]


@dataclass(frozen=True)
class Attempt:
    """One failed try within a call; ``error`` is the exception's class name.

    ``message`` is the error text scrubbed of secrets (``redact.scrub``), at most 500 characters.
    ``prompt_tokens``: the request's size as a ``context_overflow`` error reported it.
    """

    provider: str
    leg: Leg
    error: str
    kind: ErrorClass
    message: str
    latency_s: float
    health_failure: bool
    probe: bool
    retry_after_s: float | None = None
    prompt_tokens: int | None = None


class RouteRecord(TypedDict):
    """One inference of a turn: where it ran, why, who answered and what it cost."""

    turn: int
    step: int
    kind: StepKind
    leg: Leg
    """The leg that answered (differs from ``routed_leg`` after a fallover)."""
    routed_leg: Leg
    """The leg the router (or the repair rule) chose."""
    score: int | None
    breakdown: dict[str, float] | None
    """The score's points per term (``StepScore.breakdown``)."""
    threshold: float | None
    reason: str
    signals: dict[str, Any]
    provider: str | None
    """Id of the provider that answered; ``cost_usd`` is priced at its prices."""
    attempts: list[dict[str, Any]]
    """Failed attempts before the answer: provider, leg, error class, kind, latency."""
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    cost_usd: float | None
    slot: int | None
    """llama-server slot of a local step (``None`` on cloud)."""
    processed_tokens: int | None
    """Prompt tokens the local server actually processed (``timings.prompt_n``)."""
    prompt_ms: float | None
    """Local prefill time (``timings.prompt_ms``); comparable only within one run."""
    extra: dict[str, Any]
    kept_local_by_budget: NotRequired[bool]
    """A cloud budget moved this inference from cloud to local (``budget.guard``)."""


def action(answer: AIMessage) -> dict[str, Any]:
    """What an answer does: a reply, or its tool calls (names and canonical arguments, in order).

    Shadow checks (``nodes.shadow``) and offline labels (``replay.labelling``) record it as
    ``local_action``, ``cloud_action`` or ``recorded_action``.
    """
    if not answer.tool_calls:
        return {"reply": True}
    return {"tools": [[call["name"], json.dumps(call["args"], sort_keys=True)] for call in answer.tool_calls]}


def same_action(first: AIMessage, second: AIMessage) -> bool:
    """Both reply, or both call the same tools with equal arguments (the order of the calls aside)."""
    one, other = action(first), action(second)
    if "reply" in one or "reply" in other:
        return one == other
    return sorted(map(tuple, one["tools"])) == sorted(map(tuple, other["tools"]))


def is_step(record: Mapping[str, Any]) -> bool:
    """Whether a record is a step of the turn (plan, continuation step, repair), not a side inference."""
    return record["kind"] not in SIDE_KINDS


def unanswered(record: Mapping[str, Any]) -> bool:
    """Whether every provider failed this inference: attempts, and no answer.

    Such a step is tried again (a resume, or the thread's next run retrying the
    turn), so it is no step of its own; a replayed step has neither attempts nor a provider.
    """
    return record["provider"] is None and bool(record["attempts"])


def kept_local_by_budget(record: Mapping[str, Any]) -> bool:
    """Whether a cloud budget moved this inference local (the record's own field)."""
    return bool(record.get("kept_local_by_budget"))


def in_all_cloud_baseline(record: RouteRecord) -> bool:
    """Whether an inference would have been made all-cloud too: every kind but a shadow check.

    A shadow check exists only because steps run local, so its cost counts in what
    was spent and not in the all-cloud baseline: savings are net of it.
    """
    return record["kind"] != "shadow"


def placement_of(record: RouteRecord) -> str | None:
    """How a local inference was placed: ``shared`` (a lease), ``guest``, ``in_process`` or ``unplaced``.

    ``unplaced``: the deployment's database could not give a slot's turn, so the
    request named no slot. ``None`` for a cloud inference or one no provider answered.
    """
    if record["leg"] != "local" or record["provider"] is None:
        return None
    extra = record["extra"]
    placed = str(extra.get("placement", ""))
    if placed.startswith("unplaced"):
        return "unplaced"
    if extra.get("guest"):
        return "guest"
    return "shared" if placed == "shared" else "in_process"


def money(value: float | None) -> str:
    """USD with enough digits for sub-cent steps: ``$0.05``, ``$0.0041`` (``-`` when unknown)."""
    if value is None:
        return "-"
    text = f"{value:.4f}".rstrip("0")
    return "$" + (text + "0" if text.endswith(".") else text)


def usage_numbers(message: AIMessage) -> tuple[int | None, int | None, int | None]:
    """``(prompt, cached, completion)`` tokens as the provider reported them, else ``None``."""
    usage = message.usage_metadata
    if not usage:
        return None, None, None
    details = usage.get("input_token_details") or {}
    cached = details.get("cache_read")
    return usage.get("input_tokens"), cached, usage.get("output_tokens")


def timings_numbers(message: AIMessage) -> tuple[int | None, int | None, float | None]:
    """``(processed, reused, prompt_ms)`` from llama-server's ``timings``, else ``None``."""
    timings = message.response_metadata.get("timings")
    if not isinstance(timings, dict):
        return None, None, None
    return timings.get("prompt_n"), timings.get("cache_n"), timings.get("prompt_ms")


def make_record(
    *,
    turn: int,
    step: int,
    kind: StepKind,
    decision: RouteDecision,
    signals: StepSignals | None = None,
    leg: Leg | None = None,
    provider: str | None = None,
    answer: AIMessage | None = None,
    slot: int | None = None,
    attempts: Iterable[Attempt] = (),
    extra: dict[str, Any] | None = None,
) -> RouteRecord:
    """The ``route_log`` entry of one inference, answered (``answer``) or not (``extra`` says why).

    ``leg`` is the leg that answered (the routed one when none did). Token
    counts come from the provider's answer; ``cost_usd`` stays ``None`` until a
    priced provider fills it (never a guess).
    """
    prompt, cached, completion = usage_numbers(answer) if answer is not None else (None, None, None)
    processed, reused, prompt_ms = timings_numbers(answer) if answer is not None else (None, None, None)
    if cached is None:
        cached = reused
    score = decision.score
    return RouteRecord(
        turn=turn,
        step=step,
        kind=kind,
        leg=leg or decision.leg,
        routed_leg=decision.leg,
        score=score.score if score is not None else None,
        breakdown=score.breakdown() if score is not None else None,
        threshold=decision.threshold,
        reason=decision.reason,
        signals=dict(vars(signals)) if signals is not None else {},  # numbers and flags: no deep copy
        provider=provider,
        attempts=[dict(vars(attempt)) for attempt in attempts],  # plain dicts, as state keeps them
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cost_usd=None,
        slot=slot,
        processed_tokens=processed,
        prompt_ms=prompt_ms,
        extra=extra or {},
        kept_local_by_budget=decision.budget is not None,
    )


def totals_of(record: RouteRecord) -> dict[str, Any]:
    """One record's contribution to the thread's running ``totals``."""
    return {
        "cost_usd": record["cost_usd"] or 0.0,
        # Only an answer can lack a price: an inference nobody answered cost nothing.
        "unpriced": 1 if record["cost_usd"] is None and record["provider"] is not None else 0,
        record["leg"]: {
            "inferences": 1,
            "prompt_tokens": record["prompt_tokens"] or 0,
            "cached_tokens": record["cached_tokens"] or 0,
            "completion_tokens": record["completion_tokens"] or 0,
        },
    }


def add_totals(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    """Reducer: add running totals (numbers add up, nested tables add key by key)."""
    merged: dict[str, Any] = dict(left or {})
    for key, value in (right or {}).items():
        if isinstance(value, dict):
            merged[key] = add_totals(merged.get(key), value)
        elif isinstance(value, int | float):
            merged[key] = merged.get(key, 0) + value
        else:
            merged[key] = value
    return merged


def records_totals(records: Iterable[RouteRecord]) -> dict[str, Any]:
    """The ``totals`` of the answered ``records`` (one no provider answered adds nothing)."""
    totals: dict[str, Any] = {}
    for record in records:
        if record["provider"] is not None:
            totals = add_totals(totals, totals_of(record))
    return totals
