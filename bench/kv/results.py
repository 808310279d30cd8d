"""Per-step costs summed into result leaves, and the two targets judged on them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.kv.plan import PlannedStep
from bench.traces import is_swe_file
from fusion_graph.routing.score import Leg

#: Targets, judged on the SWE-agent traces.
TARGET_FUSION_OVER_MINIMUM = 1.10
TARGET_HAZARD_OVER_FUSION = 5.0


@dataclass(frozen=True)
class StepRecord:
    """What one step cost: server timings for local steps, token counts for cloud ones."""

    file: str
    leg: Leg
    n_tokens: int
    minimum: int
    estimate_tokens: int
    prompt_n: int = 0
    cache_n: int = 0
    prompt_ms: float = 0.0


def step_record(file: str, step: PlannedStep, timings: Mapping[str, Any] | None = None) -> StepRecord:
    """``step``'s record: its token counts, plus llama-server's ``timings`` when it was sent (local).

    ``timings`` is a response's ``timings`` or a worker's reply (``prompt_n``, ``cache_n``,
    ``prompt_ms``); every replay (one box, gateway, workers) builds its records here, so all of
    them read the server's numbers the same way.
    """
    if timings is None:
        return StepRecord(file, step.leg, step.n_tokens, step.minimum, step.estimate_tokens)
    return StepRecord(
        file,
        step.leg,
        step.n_tokens,
        step.minimum,
        step.estimate_tokens,
        prompt_n=int(timings["prompt_n"]),
        cache_n=int(timings["cache_n"]),
        prompt_ms=float(timings["prompt_ms"]),
    )


def summarize(records: Iterable[StepRecord]) -> dict[str, Any]:
    """The per-variant leaf: token totals, efficiency and step counts.

    ``efficiency`` is ``minimum / processed`` (1.0 is perfect; None when
    nothing was processed). ``excess_*`` counts local requests that processed
    more than their minimum, ``token_mismatches`` those whose
    ``prompt_n + cache_n`` differs from our tokenization of the prompt.
    """
    leaf: dict[str, Any] = {
        "processed_tokens": 0,
        "cached_tokens": 0,
        "minimum_tokens": 0,
        "efficiency": None,
        "prefill_ms": 0.0,
        "local_steps": 0,
        "cloud_steps": 0,
        "local_prompt_tokens": 0,
        "cloud_prompt_tokens": 0,
        "cloud_prompt_tokens_estimate": 0,
        "excess_tokens": 0,
        "excess_requests": 0,
        "below_minimum_requests": 0,
        "token_mismatches": 0,
    }
    for r in records:
        if r.leg == "cloud":
            leaf["cloud_steps"] += 1
            leaf["cloud_prompt_tokens"] += r.n_tokens
            leaf["cloud_prompt_tokens_estimate"] += r.estimate_tokens
            continue
        leaf["local_steps"] += 1
        leaf["local_prompt_tokens"] += r.n_tokens
        leaf["processed_tokens"] += r.prompt_n
        leaf["cached_tokens"] += r.cache_n
        leaf["minimum_tokens"] += r.minimum
        leaf["prefill_ms"] += r.prompt_ms
        if r.prompt_n > r.minimum:
            leaf["excess_tokens"] += r.prompt_n - r.minimum
            leaf["excess_requests"] += 1
        elif r.prompt_n < r.minimum:
            leaf["below_minimum_requests"] += 1
        if r.prompt_n + r.cache_n != r.n_tokens:
            leaf["token_mismatches"] += 1
    leaf["prefill_ms"] = round(leaf["prefill_ms"], 1)
    if leaf["processed_tokens"]:
        leaf["efficiency"] = round(leaf["minimum_tokens"] / leaf["processed_tokens"], 4)
    return leaf


def summarize_with_files(records: Sequence[StepRecord]) -> dict[str, Any]:
    """``summarize`` over everything, plus ``files``: the same per trace file."""
    leaf = summarize(records)
    files = sorted({r.file for r in records})
    leaf["files"] = {name: summarize(r for r in records if r.file == name) for name in files}
    return leaf


@dataclass(frozen=True)
class TargetResult:
    """One target at one concurrency level."""

    name: str
    threads: str
    holds: bool | None
    detail: str


def _swe_totals(leaf: Mapping[str, Any]) -> dict[str, Any] | None:
    """Sum of the SWE-agent files' leaves (None when no SWE file was replayed)."""
    parts = [v for k, v in leaf.get("files", {}).items() if is_swe_file(k)]
    if not parts:
        return None
    return {key: sum(p[key] for p in parts) for key in ("processed_tokens", "minimum_tokens")}


def evaluate_targets(variants: Mapping[str, Mapping[str, Any]]) -> list[TargetResult]:
    """Check the two targets on the SWE-agent traces at every concurrency level replayed.

    (a) ``fusion`` processes at most ``TARGET_FUSION_OVER_MINIMUM`` × the minimum;
    (b) ``hazard`` processes at least ``TARGET_HAZARD_OVER_FUSION`` × what ``fusion`` does.
    """
    results = []
    fusion = variants.get("fusion", {}).get("threads", {})
    hazard = variants.get("hazard", {}).get("threads", {})
    for threads, leaf in fusion.items():
        swe = _swe_totals(leaf)
        if swe is None:
            results.append(TargetResult("a", threads, None, "no SWE-agent traces replayed"))
            continue
        processed, minimum = swe["processed_tokens"], swe["minimum_tokens"]
        ratio = processed / minimum if minimum else float("inf")
        results.append(
            TargetResult(
                "a",
                threads,
                ratio <= TARGET_FUSION_OVER_MINIMUM,
                f"fusion processed {processed} = {ratio:.3f} × minimum {minimum} "
                f"(target <= {TARGET_FUSION_OVER_MINIMUM:.2f})",
            )
        )
        hazard_swe = _swe_totals(hazard[threads]) if threads in hazard else None
        if hazard_swe is None:
            results.append(TargetResult("b", threads, None, "hazard variant not replayed"))
            continue
        hazard_ratio = hazard_swe["processed_tokens"] / processed if processed else float("inf")
        results.append(
            TargetResult(
                "b",
                threads,
                hazard_ratio >= TARGET_HAZARD_OVER_FUSION,
                f"hazard processed {hazard_swe['processed_tokens']} = {hazard_ratio:.2f} × fusion "
                f"(target >= {TARGET_HAZARD_OVER_FUSION:.0f})",
            )
        )
    return results


def over_minimum(leaf: Mapping[str, Any], limit: float, word: str) -> tuple[bool | None, str]:
    """Whether ``leaf`` processed at most ``limit`` × its minimum, and the detail line saying so.

    ``None`` (with ``nothing processed``) when the leaf has no ``processed_over_minimum``; ``word``
    names the bound in the detail (``target``, ``expected``). The gateway target and the workers
    check judge their leaves with it, so both read the same.
    """
    ratio = leaf.get("processed_over_minimum")
    if ratio is None:
        return None, "nothing processed"
    detail = (
        f"processed {leaf['processed_tokens']} = {ratio:.3f} × minimum {leaf['minimum_tokens']} "
        f"({word} <= {limit:.2f})"
    )
    return ratio <= limit, detail
