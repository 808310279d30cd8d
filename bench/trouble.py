"""Do the trouble signals tell failed from successful tasks, and where do they send steps?

Every trajectory is replayed twice with the graph's own routing
(``fusion_graph.replay.history.route_history``): with the seed's four-term score
(``trouble_signals`` off, the default) and with the trouble signals and the
escalation latch on. Scores do not depend on the dial, so each replay's scores
are then re-routed under several dials (``shares.route_scores``, the graph's
rule, latch included).

1. **Separation** (tau-bench, ``reward`` 0 or 1): the rank AUC of per-trajectory
   score features for failed against successful tasks (the chance a failed task's
   value is above a successful one's; 0.5: no separation), with a permutation
   p-value, as ``bench/calibration.py`` reports it for the seed's score; and the
   trouble terms alone.
2. **Routing** at design-rule dials and with a table calibrated on the family
   itself (in sample, latch inside the fit): the share of continuation steps on
   cloud, and how many of them the latch held there.

No model is called; it takes a few seconds. Run ``python -m bench.trouble --help``;
see bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.calibration import separation
from bench.traces import DEFAULT_TRACES, REPO_ROOT, load_recorded, render_and_write
from fusion_graph.context import FusionContext
from fusion_graph.replay.calibration import calibrate
from fusion_graph.replay.evaluation import permutation_p, rank_auc
from fusion_graph.replay.history import ReplayedStep
from fusion_graph.replay.replayed import replay_trajectory
from fusion_graph.replay.shares import ScoredStep, route_scores, scored_steps
from fusion_graph.replay.traces import RecordedTrajectory, families
from fusion_graph.routing.score import TroubleSignals
from fusion_graph.routing.trouble import ERROR_UNIT

#: Design-rule dials the routing table shows (30 is the default).
SHARES = (30, 50, 70)
#: Continuation targets of the calibrated rows (in sample).
TARGETS = (0.1, 0.3)


@dataclasses.dataclass(frozen=True)
class Replayed:
    """One trajectory replayed with the trouble signals off and on."""

    trajectory: RecordedTrajectory
    off: list[ScoredStep]
    on: list[ScoredStep]
    signals: list[TroubleSignals]
    """The trouble signals of each continuation step (replay with them on)."""
    after_error: list[bool]
    """Per step: the results just before it hold an error (error severity at least ``ERROR_UNIT``)."""


def replay_both(trajectory: RecordedTrajectory, context: FusionContext) -> Replayed:
    """``trajectory`` replayed without and with ``trouble_signals``."""
    off = replay_trajectory(trajectory, dataclasses.replace(context, trouble_signals=False)).steps
    on = replay_trajectory(trajectory, dataclasses.replace(context, trouble_signals=True)).steps
    after_error = [
        isinstance(s.signals, TroubleSignals) and s.signals.error_severity >= ERROR_UNIT for s in on
    ]
    return Replayed(trajectory, scored_steps(off), scored_steps(on), _trouble_signals(on), after_error)


def _trouble_signals(steps: Sequence[ReplayedStep]) -> list[TroubleSignals]:
    return [s.signals for s in steps if isinstance(s.signals, TroubleSignals)]


def term_separation(replays: Sequence[Replayed]) -> dict[str, Any] | None:
    """The trouble terms alone, per trajectory (mean over continuation steps): failed vs successful AUC."""
    rated = [r for r in replays if r.trajectory.reward is not None]
    failed = [r for r in rated if r.trajectory.reward == 0]
    passed = [r for r in rated if r.trajectory.reward != 0]
    if not failed or not passed:
        return None
    features: dict[str, Callable[[Replayed], float]] = {
        "mean error severity": lambda r: statistics.mean([s.error_severity for s in r.signals] or [0.0]),
        "mean no progress": lambda r: statistics.mean([s.no_progress for s in r.signals] or [0.0]),
        "mean trouble points": lambda r: statistics.mean(
            [s.score.trouble for s in r.on if s.step > 0] or [0.0]
        ),
    }
    rows = {}
    for name, feature in features.items():
        bad = [feature(r) for r in failed]
        good = [feature(r) for r in passed]
        rows[name] = {
            "failed_mean": round(statistics.mean(bad), 3),
            "successful_mean": round(statistics.mean(good), 3),
            "auc": round(rank_auc(bad, good), 3),
            "p_value": round(permutation_p(bad, good), 4),
        }
    with_trouble = {
        "failed": sum(any(s.score.trouble > 0 for s in r.on) for r in failed),
        "successful": sum(any(s.score.trouble > 0 for s in r.on) for r in passed),
    }
    return {"features": rows, "trajectories_with_trouble": with_trouble}


def routed(
    traces: Sequence[Sequence[ScoredStep]], context: FusionContext, after_error: Sequence[Sequence[bool]]
) -> dict[str, Any]:
    """Continuation steps on cloud under ``context`` (``route_scores``): all, those just after an error,
    and how many the latch held there."""
    steps = cloud = held = errors = errors_cloud = 0
    for trace, flags in zip(traces, after_error, strict=True):
        latch: int | None = None  # as the step finds it
        for item, decision, flag in zip(trace, route_scores(trace, context), flags, strict=True):
            if item.step > 0:
                steps += 1
                cloud += decision.leg == "cloud"
                held += latch is not None and not item.progress
                errors += flag
                errors_cloud += flag and decision.leg == "cloud"
            latch = decision.latch
    return {
        "continuation_steps": steps,
        "cloud_fraction": round(cloud / steps, 3) if steps else 0.0,
        "latched_steps": held,
        "after_error_steps": errors,
        "after_error_cloud_fraction": round(errors_cloud / errors, 3) if errors else None,
    }


def routing_rows(name: str, replays: Sequence[Replayed], base: FusionContext) -> list[dict[str, Any]]:
    """Per dial: the share of continuation steps on cloud with the trouble signals off and on."""
    rows = []
    off = [r.off for r in replays]
    on = [r.on for r in replays]
    flags = [r.after_error for r in replays]
    plain_on = dataclasses.replace(base, trouble_signals=True)
    for share in SHARES:
        rows.append(
            {
                "family": name,
                "dial": f"design rule, cloud_share={share}",
                "off": routed(off, dataclasses.replace(base, cloud_share=share), flags),
                "on": routed(on, dataclasses.replace(plain_on, cloud_share=share), flags),
            }
        )
    for target in TARGETS:
        fitted_off = calibrate(off, target, dataclasses.replace(base, pace_slack=None)).context
        fitted_on = calibrate(on, target, dataclasses.replace(plain_on, pace_slack=None)).context
        rows.append(
            {
                "family": name,
                "dial": f"table fitted in sample, target {target:g}",
                "off": routed(off, fitted_off, flags),
                "on": routed(on, fitted_on, flags),
            }
        )
    return rows


def run(trajectories: Sequence[RecordedTrajectory], base: FusionContext) -> dict[str, Any]:
    """The whole report (see the module docstring), as plain data."""
    started = time.perf_counter()
    grouped = families(trajectories)
    replays = {name: [replay_both(t, base) for t in items] for name, items in grouped.items()}
    rated = [r for items in replays.values() for r in items if r.trajectory.reward is not None]
    seps = None
    if rated:
        seps = {
            "off": separation([r.trajectory for r in rated], [r.off for r in rated]),
            "on": separation([r.trajectory for r in rated], [r.on for r in rated]),
            "terms": term_separation(rated),
        }
    rows = [row for name, items in replays.items() for row in routing_rows(name, items, base)]
    return {
        "meta": {
            "trajectories": len(trajectories),
            "families": {name: len(items) for name, items in grouped.items()},
            "seconds": round(time.perf_counter() - started, 1),
            "method": "route_history with trouble_signals off and on; separation as bench/calibration.py",
        },
        "separation": seps,
        "routing": rows,
    }


def render(report: dict[str, Any], console: Console) -> None:
    """The report as rich tables."""
    seps = report["separation"]
    if seps is not None and seps["off"] is not None and seps["on"] is not None:
        counts = f"failed ({seps['on']['failed']}) vs successful ({seps['on']['successful']})"
        table = Table(title=f"{counts} tasks: rank AUC")
        for column in ("feature", "AUC off", "p off", "AUC on", "p on", "failed / successful mean, on"):
            table.add_column(column, justify="left" if column == "feature" else "right")
        for name, on in seps["on"]["features"].items():
            off = seps["off"]["features"][name]
            table.add_row(
                name,
                f"{off['auc']:.3f}",
                f"{off['p_value']:.3f}",
                f"{on['auc']:.3f}",
                f"{on['p_value']:.3f}",
                f"{on['failed_mean']:.2f} / {on['successful_mean']:.2f}",
            )
        terms = seps["terms"]
        if terms is not None:
            for name, row in terms["features"].items():
                table.add_row(
                    name,
                    "-",
                    "-",
                    f"{row['auc']:.3f}",
                    f"{row['p_value']:.3f}",
                    f"{row['failed_mean']:.3f} / {row['successful_mean']:.3f}",
                )
        console.print(table)
        console.print(
            f"continuation steps pooled: AUC {seps['off']['continuation_steps_auc']} off, "
            f"{seps['on']['continuation_steps_auc']} on"
            + (
                f"; trajectories with any trouble: {terms['trajectories_with_trouble']['failed']} failed, "
                f"{terms['trajectories_with_trouble']['successful']} successful"
                if terms is not None
                else ""
            )
        )
    table = Table(
        title="continuation steps on cloud (after error: steps right after an error result; "
        "latched: held on cloud by the latch)"
    )
    columns = ("family", "dial", "steps", "cloud off", "cloud on", "after error", "off", "on", "latched on")
    for column in columns:
        table.add_column(column, justify="left" if column in ("family", "dial") else "right")
    for row in report["routing"]:
        off, on = row["off"], row["on"]
        table.add_row(
            row["family"],
            row["dial"],
            str(on["continuation_steps"]),
            f"{off['cloud_fraction']:.3f}",
            f"{on['cloud_fraction']:.3f}",
            str(on["after_error_steps"]),
            _fraction(off["after_error_cloud_fraction"]),
            _fraction(on["after_error_cloud_fraction"]),
            str(on["latched_steps"]),
        )
    console.print(table)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--traces", type=Path, nargs="+", default=[DEFAULT_TRACES], help="trace files or directories"
    )
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    err = Console(stderr=True)
    trajectories = load_recorded(args.traces, err)
    if trajectories is None:
        return 2
    report = run(trajectories, FusionContext(mode="fusion"))
    report["meta"]["traces"] = [os.path.relpath(p, REPO_ROOT) for p in args.traces]
    render_and_write(report, render, width=160, out=args.out, err=err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
