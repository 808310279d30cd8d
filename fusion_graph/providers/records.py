"""Route records: one typed entry per inference, built from the decision and the answer."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from langchain_core.messages import AIMessage

from fusion_graph.providers.chain import ChainOutcome
from fusion_graph.providers.pricing import price
from fusion_graph.routing import Leg, RouteDecision, StepSignals
from fusion_graph.state import RouteRecord, StepKind


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
    leg: Leg,
    decision: RouteDecision,
    signals: StepSignals | None,
    provider: str | None,
    answer: AIMessage | None,
    slot: int | None = None,
    attempts: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> RouteRecord:
    """The ``route_log`` entry of one inference.

    Token counts come from the provider's answer; ``cost_usd`` stays ``None``
    until a priced provider fills it (never a guess).
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
        leg=leg,
        routed_leg=decision.leg,
        score=score.score if score is not None else None,
        breakdown=score.breakdown() if score is not None else None,
        threshold=decision.threshold,
        reason=decision.reason,
        signals=dict(vars(signals)) if signals is not None else {},  # numbers and flags: no deep copy
        provider=provider,
        attempts=attempts or [],
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cost_usd=None,
        slot=slot,
        processed_tokens=processed,
        prompt_ms=prompt_ms,
        extra=extra or {},
    )


def totals_of(record: RouteRecord) -> dict[str, Any]:
    """One record's contribution to the thread's running ``totals``."""
    return {
        "cost_usd": record["cost_usd"] or 0.0,
        "unpriced": 1 if record["cost_usd"] is None else 0,
        record["leg"]: {
            "inferences": 1,
            "prompt_tokens": record["prompt_tokens"] or 0,
            "cached_tokens": record["cached_tokens"] or 0,
            "completion_tokens": record["completion_tokens"] or 0,
        },
    }


def answered_record(
    outcome: ChainOutcome[AIMessage],
    *,
    turn: int,
    step: int,
    kind: StepKind,
    decision: RouteDecision,
    signals: StepSignals | None,
    slot: int | None,
    extra: dict[str, Any] | None = None,
) -> RouteRecord:
    """The record of an inference the chain got an answer for, priced at the answering provider."""
    link = outcome.provider
    record = make_record(
        turn=turn,
        step=step,
        kind=kind,
        leg=link.leg,
        decision=decision,
        signals=signals,
        provider=link.id,
        answer=outcome.answer,
        slot=slot,
        attempts=[asdict(attempt) for attempt in outcome.attempts],
        extra={"probe": outcome.probe, "latency_s": round(outcome.latency_s, 4), **(extra or {})},
    )
    record["cost_usd"] = price(
        link.pricing, record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]
    )
    return record
