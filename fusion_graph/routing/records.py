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
from typing import TYPE_CHECKING, Any, Literal, cast

# NOTE: typing_extensions.TypedDict, not typing.TypedDict: on Python 3.11 the
# LangGraph server's schema endpoint rejects the latter.
from typing_extensions import NotRequired, TypedDict, Unpack  # noqa: UP035

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


class CompactionRecord(TypedDict):
    """What compaction did to make a step fit: the step's compactions added up."""

    cleared_tool_outputs: int
    """Old tool outputs whose text compaction cleared to fit the window."""
    removed_messages: int
    """Messages dropped from the start of the history."""
    freed_tokens: int
    """Tokens the compactions freed (estimated)."""
    need_tokens: int
    """Tokens the largest compaction had to free."""
    times: int
    """Compactions the step made."""


class SizingRecord(TypedDict, total=False):
    """How the inference was sized: its prompt estimate, the window, the completion cap, the fit rule."""

    estimate: int
    """Prompt tokens estimated on the answering leg (beside the provider's ``prompt_tokens``)."""
    estimate_basis: str
    """Where the estimate came from: ``server``, ``anchored`` or ``approximate``."""
    window: int | None
    """Context window of the answering provider, in tokens (``None``: not known)."""
    max_tokens: int
    """Completion cap sent with the request."""
    fit: str
    """Why the fit rule moved or bounded the step (its ``reason`` says it too)."""
    compaction: CompactionRecord
    """What compaction freed before the call."""


class BudgetRecord(TypedDict, total=False):
    """What a cloud budget said of the inference (set only under a budget)."""

    step_usd: float | None
    """The inference's estimated cost on cloud."""
    max_tokens: int
    """The completion cap on cloud that the budget can still pay for."""
    over: str
    """Why cloud was not allowed (only when it was not)."""


class PlacementRecord(TypedDict, total=False):
    """Where a local request was placed: its slot's lease, its box behind a gateway."""

    lease: str
    """``shared``: its slot came from the shared state; ``unplaced: why``: none came, no slot was named."""
    box: str
    """The box the request went to."""
    moved_from: str
    """The thread's earlier box, which stopped answering: one cold prefill on the new one."""
    took_idle_slot: bool
    """It took over a slot another thread had left idle."""
    guest: bool
    """Every slot was held: it ran in the turn of a slot another thread holds."""


class OutcomeRecord(TypedDict, total=False):
    """How the inference ended."""

    latency_s: float
    """Seconds the answering attempt took."""
    probe: bool
    """The answer came from a provider the health logic was probing after a cooldown."""
    status: str
    """Why nothing answered: ``exhausted`` (every provider failed), ``over_budget`` (no call), ``failed``."""
    retry_in_s: float | None
    """After ``exhausted``: seconds until a provider leaves its cooldown."""
    error: str
    """The failed MCP sample's error, scrubbed, at most 500 characters."""
    stop_reason: str
    """Why an MCP sample's completion stopped (``endTurn``, ``maxTokens``, ``stopSequence``)."""


class Rejected(TypedDict):
    """One item a memory job answered and the screen (``memory.screen``) left out."""

    kind: str
    """The item's ``kind`` (``fact``, ``decision``, ``task``), as answered."""
    text: str
    """The item's text, as answered."""
    why: str
    """Which rule left it out (``echo of the job's instructions``, ``already stored as KEY``...)."""


class MemoryRecord(TypedDict, total=False):
    """A memory job's inference: which job, which run, what it stored."""

    job: str
    """The job's name."""
    repair: bool
    """The call asked the model to repair its invalid JSON."""
    job_key: str
    """The job log key of the run (a record is folded into ``route_log`` once by it)."""
    attempt: int
    """Which try of the run this was (a run taken up again counts up)."""
    mode: str
    """How the job ran: ``inline`` or ``background``."""
    primed: bool
    """The reflection slot was primed with the thread's prefix first."""
    stored: int
    """Items the run stored (on its last record)."""
    rejected: list[Rejected]
    """Items the run answered and the screen left out, and why (on its last record)."""
    dropped: str | None
    """Why the job stored nothing (``None``: it did not drop)."""
    outcome: str
    """The run's end, on its last record: ``stored`` or ``dropped``."""


class ShadowRecord(TypedDict):
    """A shadow check: the cloud asked beside a local step, and whether it would have acted the same."""

    key: str
    """The check's key in the store (a check is recorded once by it)."""
    of_step: int
    """The local step it checked."""
    score: int | None
    """That step's score."""
    local_action: dict[str, Any]
    """What the local step did (``action``)."""
    agrees: bool | None
    """The cloud took the same action (``None``: the cloud did not answer)."""
    cloud_action: dict[str, Any] | None
    """What the cloud did (``None``: it did not answer)."""
    cost_usd: float | None
    """The check's cost."""


class SamplingRecord(TypedDict, total=False):
    """An MCP sample: whose run it served and what it asked for."""

    thread_id: str
    """The thread of the run that asked (a fixed id outside a run)."""
    in_run: bool
    """It was asked within a run (not by a server on its own)."""
    requested_max_tokens: int
    """The completion cap the MCP server asked for (``sizing.max_tokens``: the one sent)."""


class SynthesisRecord(TypedDict, total=False):
    """A re-write of a local reply on cloud."""

    draft: str
    """The local reply's text."""
    draft_id: str | None
    """The local reply's message id (the re-write replaces it)."""
    skipped: str
    """Why no re-write replaced the draft."""


class RecordParts(TypedDict, total=False):
    """The sub-records of a ``RouteRecord``, each grouping one concern; a record has those that apply."""

    sizing: SizingRecord
    """How the inference was sized."""
    budget: BudgetRecord
    """What a cloud budget said of it."""
    placement: PlacementRecord
    """Where a local request was placed."""
    outcome: OutcomeRecord
    """How it ended."""
    memory: MemoryRecord
    """A memory job's inference."""
    shadow: ShadowRecord
    """A shadow check."""
    sampling: SamplingRecord
    """An MCP sample."""
    synthesis: SynthesisRecord
    """A re-write of a local reply."""


class RouteRecord(RecordParts):
    """One inference of a turn: where it ran, why, who answered and what it cost.

    The sub-records (``RecordParts``) are optional keys; ``extra`` is the user's.
    """

    turn: int
    """Index of the turn (a turn continued after an error or a kill keeps its number)."""
    step: int
    """Index of the inference in its turn (a side inference: the step it sits beside)."""
    kind: StepKind
    """What it is for: ``plan``, ``step``, ``repair`` or a side inference (``SIDE_KINDS``)."""
    leg: Leg
    """The leg that answered (differs from ``routed_leg`` after a fallover)."""
    routed_leg: Leg
    """The leg the router (or the repair rule) chose."""
    score: int | None
    """The step's score (``None``: not routed by the score)."""
    breakdown: dict[str, float] | None
    """The score's points per term (``StepScore.breakdown``)."""
    threshold: float | None
    """The threshold the score was compared with."""
    reason: str
    """Why it went where it went: the rule and its numbers."""
    signals: dict[str, Any]
    """The score's raw inputs (``StepSignals``)."""
    provider: str | None
    """Id of the provider that answered; ``cost_usd`` is priced at its prices."""
    attempts: list[dict[str, Any]]
    """Failed attempts before the answer: provider, leg, error class, kind, latency."""
    prompt_tokens: int | None
    """Prompt tokens the provider reported."""
    cached_tokens: int | None
    """Prompt tokens the provider reported as read from its cache."""
    completion_tokens: int | None
    """Completion tokens the provider reported."""
    cost_usd: float | None
    """Cost at the answering provider's prices (``None``: not priced)."""
    slot: int | None
    """llama-server slot of a local step (``None`` on cloud)."""
    processed_tokens: int | None
    """Prompt tokens the local server actually processed (``timings.prompt_n``)."""
    prompt_ms: float | None
    """Local prefill time (``timings.prompt_ms``); comparable only within one run."""
    extra: dict[str, Any]
    """The user's own keys: the package writes none (its keys are in the sub-records)."""
    kept_local_by_budget: NotRequired[bool]
    """A cloud budget moved this inference from cloud to local (``rule.BudgetCheck.guard``)."""


#: Where each key that versions before the sub-records wrote in ``extra`` lives now:
#: ``(sub-record, field)``; a field of ``None`` moves the whole value (a shadow check's).
_MOVED: dict[str, tuple[str, str | None]] = {
    "estimated_prompt_tokens": ("sizing", "estimate"),
    "estimate_basis": ("sizing", "estimate_basis"),
    "window": ("sizing", "window"),
    "max_tokens": ("sizing", "max_tokens"),
    "fit": ("sizing", "fit"),
    "compaction": ("sizing", "compaction"),
    "cloud_step_usd": ("budget", "step_usd"),
    "cloud_max_tokens": ("budget", "max_tokens"),
    "cloud_budget": ("budget", "over"),
    "placement": ("placement", "lease"),
    "box": ("placement", "box"),
    "box_moved_from": ("placement", "moved_from"),
    "took_idle_slot": ("placement", "took_idle_slot"),
    "guest": ("placement", "guest"),
    "latency_s": ("outcome", "latency_s"),
    "probe": ("outcome", "probe"),
    "outcome": ("outcome", "status"),
    "retry_in_s": ("outcome", "retry_in_s"),
    "error": ("outcome", "error"),
    "stop_reason": ("outcome", "stop_reason"),
}


def _own(part: str, *keys: str) -> dict[str, tuple[str, str | None]]:
    """``keys`` kept under the same names in the sub-record ``part``."""
    return {key: (part, key) for key in keys}


#: The same for the keys only one kind of side inference wrote (they win over ``_MOVED``).
_MOVED_BY_KIND: dict[str, dict[str, tuple[str, str | None]]] = {
    "memory": _own(
        "memory",
        "job",
        "repair",
        "job_key",
        "attempt",
        "mode",
        "primed",
        "stored",
        "rejected",
        "dropped",
        "outcome",
    ),
    "shadow": {"shadow": ("shadow", None)},
    "sampling": _own("sampling", "thread_id", "in_run", "requested_max_tokens"),
    "synthesis": _own("synthesis", "draft", "draft_id", "skipped"),
}


def upgraded(record: RouteRecord) -> RouteRecord:
    """``record`` as this version writes it: the package's keys an older version left in ``extra`` moved.

    Checkpoints, job logs and shadow stores written before the sub-records hold
    such records; every reader of a stored ``route_log`` reads it through this.
    Keys this package never wrote stay in ``extra``; a record with none to move
    is returned as it is (not copied).
    """
    extra = record.get("extra") or {}
    moves = _MOVED | _MOVED_BY_KIND.get(str(record.get("kind")), {})
    if not any(key in moves for key in extra):
        return record
    out: dict[str, Any] = dict(record)
    kept: dict[str, Any] = {}
    for key, value in extra.items():
        where = moves.get(key)
        if where is None:
            kept[key] = value
            continue
        part, name = where
        if name is None:
            out.setdefault(part, value)
        else:
            out[part] = {name: value, **out.get(part, {})}  # a key the record already has in place wins
    out["extra"] = kept
    return cast(RouteRecord, out)


def joined(*parts: RecordParts) -> RecordParts:
    """``parts`` in one: each sub-record's keys together, a later part's value winning for a key."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            out[name] = {**out.get(name, {}), **value} if isinstance(value, dict) else value
    return cast(RecordParts, out)


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
    placement = record.get("placement") or {}
    placed = placement.get("lease", "")
    if placed.startswith("unplaced"):
        return "unplaced"
    if placement.get("guest"):
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
    **parts: Unpack[RecordParts],
) -> RouteRecord:
    """The ``route_log`` entry of one inference, answered (``answer``) or not (``outcome`` says why).

    ``leg`` is the leg that answered (the routed one when none did). Token
    counts come from the provider's answer; ``cost_usd`` stays ``None`` until a
    priced provider fills it (never a guess). ``parts`` are the sub-records;
    ``extra`` is for a user's own keys (the package passes none).
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
        **parts,
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
