"""What a cloud budget does to the cloud cost and share of the shared traces.

Each trajectory is one thread. It is first replayed all-cloud (``mode="cloud"``)
for its own all-cloud cost; then in fusion mode (default ``cloud_share``, the
design rule) with no budget and with ``thread_cloud_budget_usd`` set to 10 %,
25 %, 50 % and 100 % of that cost, and once with a per-turn budget
(``turn_cloud_budget_usd``: half the trajectory's mean all-cloud cost per turn).
The budget applies by the graph's rule (``replay.route_history`` with a cloud
price): a cloud step is priced before its call at its prompt estimate plus the
whole completion budget (``max_completion_tokens``), and runs local when that
would take the spend past a budget; a cloud step then costs its recorded
completion. Plans run on cloud whenever ``cloud_share > 0``, so once a thread's
budget is spent, plans go local too. Every variant is run at the default
``max_completion_tokens`` and at ``--small-completion`` (default 1024), since
the reservation decides how close to its budget a thread can get.

Prices: the operator's cloud model (``FusionSettings().cloud_model``) at the
catalogue's (or ``FUSION_PRICE_OVERRIDES``') prices, no cached input. No model
is called. Run ``python -m bench.budget --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.traces import QUICK_OTHER, QUICK_SWE, add_trace_arguments, is_swe_file
from fusion_graph.context import FusionContext
from fusion_graph.errors import TraceError
from fusion_graph.replay.replayed import ReplayedTrajectory, replay_trajectory
from fusion_graph.replay.summary import summarize
from fusion_graph.replay.traces import RecordedTrajectory, StepPrices, load_trajectories, step_prices
from fusion_graph.settings import FusionSettings

#: Thread budgets, as fractions of each trajectory's own all-cloud cost.
THREAD_FRACTIONS = (0.1, 0.25, 0.5, 1.0)
#: The per-turn budget: this fraction of the trajectory's mean all-cloud cost per turn.
TURN_FRACTION = 0.5
#: The smaller completion budget every variant is also run at.
SMALL_COMPLETION = 1024


@dataclass(frozen=True)
class Variant:
    """One budget setting: ``None`` fractions are no limit."""

    name: str
    thread_fraction: float | None = None
    turn_fraction: float | None = None


VARIANTS = (
    Variant("no budget"),
    *(Variant(f"thread {f:.0%}", thread_fraction=f) for f in THREAD_FRACTIONS),
    Variant(f"turn {TURN_FRACTION:.0%} of mean turn", turn_fraction=TURN_FRACTION),
)


def select_quick(trajectories: Sequence[RecordedTrajectory]) -> list[RecordedTrajectory]:
    """The ``--quick`` subset: the first trajectories of each file (as ``bench.traces.select_quick``)."""
    taken: dict[str, int] = {}
    chosen = []
    for trajectory in trajectories:
        limit = QUICK_SWE if is_swe_file(trajectory.file) else QUICK_OTHER
        if taken.get(trajectory.file, 0) < limit:
            taken[trajectory.file] = taken.get(trajectory.file, 0) + 1
            chosen.append(trajectory)
    return chosen


def turns_of(replay: ReplayedTrajectory) -> int:
    """How many turns a replay has (one plan each)."""
    return sum(step.step == 0 for step in replay.steps)


def budgeted_context(base: FusionContext, variant: Variant, all_cloud: float, turns: int) -> FusionContext:
    """``base`` with the variant's budgets for a trajectory of this all-cloud cost and turn count."""
    thread = None if variant.thread_fraction is None else variant.thread_fraction * all_cloud
    turn = None if variant.turn_fraction is None else variant.turn_fraction * all_cloud / max(turns, 1)
    return dataclasses.replace(base, thread_cloud_budget_usd=thread, turn_cloud_budget_usd=turn)


def overspent(replays: Sequence[ReplayedTrajectory]) -> tuple[int, float]:
    """Threads whose cloud spend (the graph's priced steps) passed their budget, and the worst ratio.

    A thread's budget is its context's ``thread_cloud_budget_usd``; the spend is what
    its cloud steps cost by the graph's rule (each call capped at what the budget pays).
    """
    count, worst = 0, 0.0
    for replay in replays:
        limit = replay.context.thread_cloud_budget_usd if replay.context is not None else None
        if not limit:
            continue
        spent = sum(step.cost_usd or 0.0 for step in replay.steps if step.leg == "cloud")
        count += spent > limit + 1e-12
        worst = max(worst, spent / limit)
    return count, round(worst, 4)


def row(
    name: str,
    completion: int,
    result: dict[str, Any],
    all_cloud: float,
    replays: Sequence[ReplayedTrajectory] = (),
) -> dict[str, Any]:
    """One table row from a ``summarize`` result of the whole run, against the all-cloud total."""
    cloud = result["cloud_cost_usd"]
    over, worst = overspent(replays)
    return {
        "variant": name,
        "max_completion_tokens": completion,
        "cloud_cost_usd": cloud,
        "cost_fraction": round(cloud / all_cloud, 4) if cloud is not None and all_cloud else None,
        "cloud_fraction": result["cloud_fraction"],
        "continuation_cloud_fraction": result["continuation_cloud_fraction"],
        "plan_cloud_steps": result["plan_cloud_steps"],
        "plan_steps": result["plan_steps"],
        "budget_local_steps": result["budget_local_steps"],
        "budget_local_plan_steps": result["budget_local_plan_steps"],
        "turns_ending_local": result["resynthesis"]["turns_ending_local"],
        "resynthesis_cost_usd": result["resynthesis"]["added_cost_usd"],
        "resynthesis_skipped": result["resynthesis"]["skipped_by_budget"],
        "overspent_threads": over,
        "most_of_budget_spent": worst,
    }


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.4f}"


def _part(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


COLUMNS = (
    "variant",
    "max completion",
    "cloud cost",
    "÷ all-cloud",
    "cloud (all)",
    "cloud (cont.)",
    "plans on cloud",
    "moved local (plans)",
    "re-synth. +cost (skipped)",
    "over budget (threads)",
    "most of a budget spent",
)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table (what the README shows)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    for item in rows:
        cells = [
            item["variant"],
            str(item["max_completion_tokens"]),
            _money(item["cloud_cost_usd"]),
            _part(item["cost_fraction"]),
            f"{item['cloud_fraction']:.2f}",
            f"{item['continuation_cloud_fraction']:.2f}",
            f"{item['plan_cloud_steps']}/{item['plan_steps']}",
            f"{item['budget_local_steps']} ({item['budget_local_plan_steps']})",
            f"{_money(item['resynthesis_cost_usd'])} ({item['resynthesis_skipped']})",
            str(item["overspent_threads"]),
            f"{item['most_of_budget_spent']:.2f}" if item["most_of_budget_spent"] else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(
    trajectories: Sequence[RecordedTrajectory],
    prices: StepPrices,
    *,
    completions: Sequence[int],
    base: FusionContext | None = None,
) -> dict[str, Any]:
    """All-cloud first, then every variant at every completion budget; the rows and the all-cloud total."""
    base = base or FusionContext(mode="fusion")
    all_cloud: dict[int, float] = {}
    turns: dict[int, int] = {}
    cloud_context = dataclasses.replace(base, mode="cloud")
    cloud_replays = [replay_trajectory(t, cloud_context, prices) for t in trajectories]
    for index, replay in enumerate(cloud_replays):
        cost = summarize([replay], prices)["cloud_cost_usd"]
        if cost is None:
            raise ValueError(
                f"no cloud price for {base.cloud_model or 'the cloud model'}: set FUSION_PRICE_OVERRIDES"
            )
        all_cloud[index], turns[index] = cost, turns_of(replay)
    total = sum(all_cloud.values())
    rows = [
        row("all cloud (mode cloud)", base.max_completion_tokens, summarize(cloud_replays, prices), total)
    ]
    for completion in completions:
        sized = dataclasses.replace(base, max_completion_tokens=completion)
        for variant in VARIANTS:
            replays = [
                replay_trajectory(t, budgeted_context(sized, variant, all_cloud[i], turns[i]), prices)
                for i, t in enumerate(trajectories)
            ]
            rows.append(row(variant.name, completion, summarize(replays, prices), total, replays))
    return {"all_cloud_cost_usd": total, "rows": rows}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.budget", description=__doc__.split("\n\n")[0])
    add_trace_arguments(parser)
    parser.add_argument(
        "--small-completion",
        type=int,
        default=SMALL_COMPLETION,
        help=f"the smaller max_completion_tokens every variant is also run at (default {SMALL_COMPLETION}; "
        "0: only the default)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trajectories = load_trajectories(args.traces)
    except TraceError as error:
        print(
            f"error: {error}. The shared traces are expected at {args.traces[0]} (pass --traces PATH).",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        trajectories = select_quick(trajectories)
    settings = FusionSettings()
    prices = step_prices(settings)
    base = FusionContext(mode="fusion")
    completions = [base.max_completion_tokens]
    if args.small_completion and args.small_completion != base.max_completion_tokens:
        completions.append(args.small_completion)
    started = time.perf_counter()
    try:
        result = run(trajectories, prices, completions=completions, base=base)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    output = {
        "benchmark": "budget",
        "trajectories": len(trajectories),
        "quick": args.quick,
        "cloud_model": settings.cloud_model,
        "cloud_prices": dataclasses.asdict(prices.cloud) if prices.cloud is not None else None,
        "cloud_share": base.cloud_share,
        "thread_fractions": list(THREAD_FRACTIONS),
        "turn_fraction": TURN_FRACTION,
        "seconds": round(elapsed, 1),
        "python": platform.python_version(),
        **result,
    }
    print(
        f"{len(trajectories)} trajectories, cloud model {settings.cloud_model}, "
        f"cloud_share {base.cloud_share}; "
        f"all-cloud cost {_money(result['all_cloud_cost_usd'])}; {elapsed:.1f} s\n"
    )
    print(markdown(result["rows"]))
    if args.out is not None:
        args.out.write_text(json.dumps(output, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
