"""Does a calibrated dial hold on trajectories it has not seen?

For each trace family (one trace file), the trajectories are split into two
halves with several seeds. A ``score_quantiles`` table is fitted on one half
(``fusion_graph.replay.calibration.fit_quantiles``, with the default hysteresis) and
the other half is replayed with the graph's own routing
(``fusion_graph.replay.history.route_history``) at ``cloud_share = 100 × target``; the
achieved share of continuation steps (steps after each turn's plan) on cloud
is compared with the target. Both directions of every split are used.

Each split is run once per *variant*: ``table`` (the calibrated table alone)
and ``paced S`` (the same table replayed with ``pace_slack = S``, the paced
dial: each conversation's cloud count held within ``S`` steps of its share).
How the variants route is reported beside their error: leg switches per
trajectory, the mean score (points) of cloud and local continuation steps and
the rank AUC between them (1: every cloud step outscores every local one; 0.5:
the score does not matter), and an estimate of the tokens a local step must
prefill when llama-server keeps the conversation's prefix from its previous
local step (the cost the hysteresis exists to keep down).

Reference columns, per target:

* ``in-sample``: the same table on the half it was fitted on;
* ``design rule``: the best plain ``cloud_share`` (no table) found on the
  calibration half, replayed on the other half: all the old dial could do;
* ``floor``: a table fitted on the *whole* family, replayed on each half: what
  the evaluation half's own sampling spread costs even with the best table.

It also reports whether the score separates failed (``reward`` 0) from
successful tau-bench tasks (rank AUC with a permutation p-value).

No model is called; the run takes well under a minute on two cores.
Run ``python -m bench.calibration --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.traces import DEFAULT_TRACES, REPO_ROOT, load_recorded, render_and_write
from fusion_graph.cli.common import progress
from fusion_graph.context import DEFAULTS, FusionContext
from fusion_graph.replay.calibration import CALIBRATED_PACE_SLACK, best_plain_share, fit_quantiles, share_for
from fusion_graph.replay.evaluation import permutation_p, rank_auc, split_halves
from fusion_graph.replay.replayed import ReplayedTrajectory, replay_trajectory
from fusion_graph.replay.shares import ScoredStep, scored_steps, share_of
from fusion_graph.replay.traces import RecordedTrajectory, families

TARGETS = (0.1, 0.2, 0.3, 0.5)
GOAL_MAE = 0.03
GOAL_WORST = 0.05


@dataclass(frozen=True)
class Variant:
    """A way to run the calibrated dial: the table alone, or the table with a paced dial."""

    name: str
    pace_slack: float | None


def variants(slacks: Sequence[float]) -> list[Variant]:
    """``table`` first, then one ``paced S`` per slack."""
    return [Variant("table", None), *(Variant(f"paced {slack:g}", slack) for slack in slacks)]


@dataclass(frozen=True)
class Routing:
    """How a replayed half was routed, beyond its share."""

    switches: float
    """Leg changes between consecutive steps (plans included), per trajectory."""
    cloud_points: list[float]
    local_points: list[float]
    prefill_tokens: int
    local_steps: int


@dataclass(frozen=True)
class SplitResult:
    """One target on one evaluation half, under one variant."""

    family: str
    variant: str
    pace_slack: float | None
    seed: int
    direction: int
    target: float
    cloud_share: int
    achieved: float
    in_sample: float
    plain_share: int
    plain_achieved: float
    floor_achieved: float
    evaluation_steps: int
    switches: float
    cloud_points: float | None
    local_points: float | None
    score_auc: float | None
    prefill_per_local_step: float | None


def continuation_fraction(replays: Sequence[ReplayedTrajectory]) -> tuple[float, int]:
    """Continuation cloud fraction and continuation steps of ``route_history`` replays."""
    legs = [s.leg for r in replays for s in r.steps if s.step > 0]
    return (legs.count("cloud") / len(legs) if legs else 0.0), len(legs)


def local_prefill(replay: ReplayedTrajectory) -> tuple[int, int]:
    """Estimated prompt tokens llama-server prefills over a replay's local steps, and how many there are.

    The conversation keeps its own slot, which holds the prompt and answer of its
    previous local step: a local step prefills only what its prompt adds to them
    (all of it for the first). Token counts are the replay's estimates.
    """
    held = tokens = steps = 0
    for step, completion in zip(replay.steps, replay.completion_tokens, strict=True):
        if step.leg == "local":
            prompt = step.signals.prompt_tokens
            tokens += max(prompt - held, 0)
            steps += 1
            held = prompt + completion
    return tokens, steps


def routing_of(replays: Sequence[ReplayedTrajectory]) -> Routing:
    """Switches, the points of cloud and local continuation steps, and local prefill of some replays."""
    switches = [sum(a.leg != b.leg for a, b in pairwise(r.steps)) for r in replays]
    cloud: list[float] = []
    local: list[float] = []
    for replay in replays:
        for step in replay.steps:
            if step.step > 0 and step.decision.score is not None:
                (cloud if step.leg == "cloud" else local).append(step.decision.score.points)
    prefill = [local_prefill(r) for r in replays]
    return Routing(
        switches=statistics.mean(switches) if switches else 0.0,
        cloud_points=cloud,
        local_points=local,
        prefill_tokens=sum(t for t, _ in prefill),
        local_steps=sum(n for _, n in prefill),
    )


def evaluate_family(
    name: str,
    trajectories: Sequence[RecordedTrajectory],
    scored: Sequence[Sequence[ScoredStep]],
    *,
    base: FusionContext,
    seeds: int,
    targets: Sequence[float],
    kinds: Sequence[Variant],
    advance: Any,
) -> list[SplitResult]:
    """All splits of one family: fit on one half, replay the other with ``route_history``."""
    results = []
    whole = fit_quantiles(scored, base.hysteresis)
    for seed in range(seeds):
        halves = split_halves(len(trajectories), seed)
        for direction, (cal, ev) in enumerate((halves, halves[::-1])):
            calibration = [scored[i] for i in cal]
            evaluation = [scored[i] for i in ev]
            plain_shares = {t: best_plain_share(calibration, t, base) for t in targets}
            table = fit_quantiles(calibration, base.hysteresis)  # the same table for every variant
            for variant in kinds:
                paced = dataclasses.replace(base, pace_slack=variant.pace_slack)
                for target in targets:
                    share = share_for(target)
                    context = dataclasses.replace(paced, cloud_share=share, score_quantiles=table)
                    replays = [replay_trajectory(trajectories[i], context) for i in ev]
                    achieved, steps = continuation_fraction(replays)
                    routed = routing_of(replays)
                    plain = dataclasses.replace(base, cloud_share=plain_shares[target])
                    floor = dataclasses.replace(context, score_quantiles=whole)
                    both = routed.cloud_points and routed.local_points
                    results.append(
                        SplitResult(
                            family=name,
                            variant=variant.name,
                            pace_slack=variant.pace_slack,
                            seed=seed,
                            direction=direction,
                            target=target,
                            cloud_share=share,
                            achieved=achieved,
                            in_sample=share_of(calibration, context).fraction,
                            plain_share=plain_shares[target],
                            plain_achieved=share_of(evaluation, plain).fraction,
                            floor_achieved=share_of(evaluation, floor).fraction,
                            evaluation_steps=steps,
                            switches=routed.switches,
                            cloud_points=statistics.mean(routed.cloud_points)
                            if routed.cloud_points
                            else None,
                            local_points=statistics.mean(routed.local_points)
                            if routed.local_points
                            else None,
                            score_auc=rank_auc(routed.cloud_points, routed.local_points) if both else None,
                            prefill_per_local_step=(
                                routed.prefill_tokens / routed.local_steps if routed.local_steps else None
                            ),
                        )
                    )
                    advance()
    return results


def coin_error(steps: int, target: float) -> float:
    """``E|k/n - p|`` for ``k ~ Binomial(n, p)``: the error of an ideal independent coin per step.

    No per-step rule can beat this on average over halves of ``n`` steps
    (steps of one trajectory are correlated, which only adds to it).
    """
    if steps <= 0:
        return 0.0
    return sum(
        math.comb(steps, k) * target**k * (1 - target) ** (steps - k) * abs(k / steps - target)
        for k in range(steps + 1)
    )


def _errors(rows: Sequence[SplitResult], field: str) -> list[float]:
    return [abs(getattr(r, field) - r.target) for r in rows]


def _mean(values: Iterable[float | None], digits: int) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.mean(present), digits) if present else None


def summarize_rows(rows: Sequence[SplitResult]) -> dict[str, Any]:
    """Mean achieved, bias, MAE and worst error (and the reference columns) of some splits."""
    errors = _errors(rows, "achieved")
    return {
        "splits": len(rows),
        "mean_achieved": round(statistics.mean(r.achieved for r in rows), 4),
        "bias": round(statistics.mean(r.achieved - r.target for r in rows), 4),
        "mae": round(statistics.mean(errors), 4),
        "worst": round(max(errors), 4),
        "in_sample_mae": round(statistics.mean(_errors(rows, "in_sample")), 4),
        "design_rule_mae": round(statistics.mean(_errors(rows, "plain_achieved")), 4),
        "design_rule_worst": round(max(_errors(rows, "plain_achieved")), 4),
        "floor_mae": round(statistics.mean(_errors(rows, "floor_achieved")), 4),
        "floor_worst": round(max(_errors(rows, "floor_achieved")), 4),
        "coin_mae": round(statistics.mean(coin_error(r.evaluation_steps, r.target) for r in rows), 4),
        "evaluation_steps": round(statistics.mean(r.evaluation_steps for r in rows), 1),
        "switches": round(statistics.mean(r.switches for r in rows), 2),
        "cloud_points": _mean((r.cloud_points for r in rows), 2),
        "local_points": _mean((r.local_points for r in rows), 2),
        "score_auc": _mean((r.score_auc for r in rows), 3),
        "prefill_per_local_step": _mean((r.prefill_per_local_step for r in rows), 0),
    }


def separation(trajectories: Sequence[RecordedTrajectory], scored: Sequence[Sequence[ScoredStep]]) -> Any:
    """Does the score tell failed (reward 0) from successful (reward 1) tasks? Rank AUC per feature.

    AUC is the chance a failed task's value is above a successful one's (0.5: no separation).
    Trajectory length is given as a reference: the score grows with it.
    """
    failed: list[Sequence[ScoredStep]] = []
    passed: list[Sequence[ScoredStep]] = []
    for trajectory, steps in zip(trajectories, scored, strict=True):
        if trajectory.reward is not None and steps:
            (failed if trajectory.reward == 0 else passed).append(steps)
    if not failed or not passed:
        return None

    def continuation(steps: Sequence[ScoredStep]) -> list[float]:
        return [s.score.points for s in steps if s.step > 0]

    features: dict[str, Callable[[Sequence[ScoredStep]], float]] = {
        "mean continuation score": lambda s: statistics.mean(continuation(s) or [0.0]),
        "max score": lambda s: max(x.score.points for x in s),
        "mean score (all steps)": lambda s: statistics.mean(x.score.points for x in s),
        "steps (reference)": lambda s: float(len(s)),
    }
    rows = {}
    for name, feature in features.items():
        bad = [feature(s) for s in failed]
        good = [feature(s) for s in passed]
        rows[name] = {
            "failed_mean": round(statistics.mean(bad), 3),
            "successful_mean": round(statistics.mean(good), 3),
            "auc": round(rank_auc(bad, good), 3),
            "p_value": round(permutation_p(bad, good), 4),
        }
    step_bad = [p for s in failed for p in continuation(s)]
    step_good = [p for s in passed for p in continuation(s)]
    return {
        "failed": len(failed),
        "successful": len(passed),
        "features": rows,
        "continuation_steps_auc": round(rank_auc(step_bad, step_good), 3) if step_bad and step_good else None,
    }


def _opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(report: dict[str, Any], console: Console) -> None:
    """The results as rich tables."""
    table = Table(title="calibrated dial on unseen halves (continuation steps on cloud)")
    columns = ("family", "variant", "target", "mean achieved", "bias", "MAE", "worst", "in-sample MAE")
    for column in (*columns, "design rule MAE / worst", "floor MAE / worst", "coin MAE"):
        table.add_column(column, justify="left" if column in ("family", "variant") else "right")
    for row in report["rows"]:
        table.add_row(
            row["family"],
            row["variant"],
            f"{row['target']:.2f}",
            f"{row['mean_achieved']:.3f}",
            f"{row['bias']:+.3f}",
            f"{row['mae']:.3f}",
            f"{row['worst']:.3f}",
            f"{row['in_sample_mae']:.3f}",
            f"{row['design_rule_mae']:.3f} / {row['design_rule_worst']:.3f}",
            f"{row['floor_mae']:.3f} / {row['floor_worst']:.3f}",
            f"{row['coin_mae']:.3f}",
        )
    console.print(table)
    routed = Table(title="how each variant routes the unseen halves (means over splits)")
    for column in (
        "family",
        "variant",
        "target",
        "switches / trajectory",
        "points cloud / local",
        "score AUC",
        "local prefill / step",
    ):
        routed.add_column(column, justify="left" if column in ("family", "variant") else "right")
    for row in report["rows"]:
        routed.add_row(
            row["family"],
            row["variant"],
            f"{row['target']:.2f}",
            f"{row['switches']:.2f}",
            f"{_opt(row['cloud_points'], '.1f')} / {_opt(row['local_points'], '.1f')}",
            _opt(row["score_auc"], ".3f"),
            _opt(row["prefill_per_local_step"], ".0f"),
        )
    console.print(routed)
    goals = Table(title=f"goal: MAE <= {GOAL_MAE}, worst <= {GOAL_WORST} per family")
    for column in (
        "family",
        "variant",
        "trajectories",
        "steps per half",
        "splits",
        "MAE",
        "worst",
        "coin MAE",
        "switches",
        "score AUC",
        "met",
    ):
        goals.add_column(column)
    for row in report["families"]:
        goals.add_row(
            row["family"],
            row["variant"],
            str(row["trajectories"]),
            f"{row['evaluation_steps']:g}",
            str(row["splits"]),
            f"{row['mae']:.3f}",
            f"{row['worst']:.3f}",
            f"{row['coin_mae']:.3f}",
            f"{row['switches']:.2f}",
            _opt(row["score_auc"], ".3f"),
            "yes" if row["met"] else "no",
        )
    console.print(goals)
    sep = report.get("separation")
    if sep:
        table = Table(title=f"tau-bench: failed ({sep['failed']}) vs successful ({sep['successful']}) tasks")
        for column in ("per trajectory", "failed mean", "successful mean", "AUC", "p"):
            table.add_column(column, justify="left" if column == "per trajectory" else "right")
        for name, row in sep["features"].items():
            table.add_row(
                name,
                f"{row['failed_mean']:.2f}",
                f"{row['successful_mean']:.2f}",
                f"{row['auc']:.3f}",
                f"{row['p_value']:.3f}",
            )
        console.print(table)
        console.print(
            f"continuation steps of failed vs successful tasks: AUC {sep['continuation_steps_auc']}"
        )
    console.print(
        "floor: a table fitted on the whole family (same variant), replayed on each half; coin: an ideal "
        "independent per-step coin with p = target on halves of the same size; score AUC: chance a cloud "
        "continuation step outscores a local one; local prefill: estimated tokens a local step prefills "
        "when its conversation's slot holds the previous local step"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--traces", type=Path, nargs="+", default=[DEFAULT_TRACES], help="trace files or directories"
    )
    parser.add_argument("--seeds", type=int, default=10, help="random splits per family (default 10)")
    parser.add_argument("--targets", default=",".join(map(str, TARGETS)), help="comma-separated fractions")
    parser.add_argument("--hysteresis", type=int, default=DEFAULTS["hysteresis"])
    parser.add_argument(
        "--slacks",
        default=f"{CALIBRATED_PACE_SLACK:g},1",
        help="comma-separated pace_slack values, one paced variant each (default: "
        f"{CALIBRATED_PACE_SLACK:g},1; empty: the table only)",
    )
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    targets = [float(t) for t in args.targets.split(",")]
    kinds = variants([float(s) for s in args.slacks.split(",") if s.strip()])
    err = Console(stderr=True)
    trajectories = load_recorded(args.traces, err)
    if trajectories is None:
        return 2
    started = time.perf_counter()
    base = FusionContext(mode="fusion", hysteresis=args.hysteresis)
    grouped = families(trajectories)
    scored: dict[str, list[list[ScoredStep]]] = {}
    with progress(err) as bar:
        task = bar.add_task("scoring (route_history)", total=len(trajectories))
        for name, items in grouped.items():
            scored[name] = []
            for trajectory in items:
                scored[name].append(scored_steps(replay_trajectory(trajectory, base).steps))
                bar.advance(task)
        usable = {name: items for name, items in grouped.items() if len(items) >= 2}
        total = len(usable) * 2 * args.seeds * len(targets) * len(kinds)
        task = bar.add_task("splits", total=total)
        results: list[SplitResult] = []
        for name, items in usable.items():
            results += evaluate_family(
                name,
                items,
                scored[name],
                base=base,
                seeds=args.seeds,
                targets=targets,
                kinds=kinds,
                advance=lambda: bar.advance(task),
            )
    rows = []
    family_rows = []
    for name in usable:
        for variant in kinds:
            mine = [r for r in results if r.family == name and r.variant == variant.name]
            for target in targets:
                rows.append(
                    {
                        "family": name,
                        "variant": variant.name,
                        "pace_slack": variant.pace_slack,
                        "target": target,
                        **summarize_rows([r for r in mine if r.target == target]),
                    }
                )
            overall = summarize_rows(mine)
            family_rows.append(
                {
                    "family": name,
                    "variant": variant.name,
                    "pace_slack": variant.pace_slack,
                    "trajectories": len(grouped[name]),
                    **overall,
                    "met": overall["mae"] <= GOAL_MAE and overall["worst"] <= GOAL_WORST,
                }
            )
    pairs = [(t, s) for name in grouped for t, s in zip(grouped[name], scored[name], strict=True)]
    with_reward = [(t, s) for t, s in pairs if t.reward is not None]
    report = {
        "meta": {
            "traces": [os.path.relpath(p, REPO_ROOT) for p in args.traces],
            "seeds": args.seeds,
            "targets": targets,
            "hysteresis": args.hysteresis,
            "variants": [dataclasses.asdict(v) for v in kinds],
            "goal": {"mae": GOAL_MAE, "worst": GOAL_WORST},
            "seconds": round(time.perf_counter() - started, 1),
            "python": platform.python_version(),
            "method": "fit score_quantiles on one half, replay the other half with route_history "
            "(table alone, or with the variant's pace_slack)",
        },
        "rows": rows,
        "families": family_rows,
        "separation": (
            separation([t for t, _ in with_reward], [s for _, s in with_reward]) if with_reward else None
        ),
        "splits": [dataclasses.asdict(r) for r in results],
    }
    render_and_write(report, render, width=200, out=args.out, err=err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
