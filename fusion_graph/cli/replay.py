"""``fusion-graph replay``: route recorded trajectories with the graph's own routing (no model calls).

Also the pieces ``calibrate`` reuses: replaying with a progress bar and the
sentence that says what a cloud budget did.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from fusion_graph.cli.common import build_context, build_settings, fail, progress, run_prices, stdout_console
from fusion_graph.cli.tables import add_number_columns, compact_table
from fusion_graph.cli.trace_options import (
    ContextOpt,
    JsonOpt,
    ThreadBudgetOpt,
    TracesArg,
    TroubleOpt,
    TurnBudgetOpt,
    load_traces,
)

if TYPE_CHECKING:
    from fusion_graph.context import FusionContext
    from fusion_graph.replay.replayed import ReplayedTrajectory
    from fusion_graph.replay.traces import RecordedTrajectory, StepPrices


def replay_with_progress(
    trajectories: Sequence[RecordedTrajectory],
    context: FusionContext,
    *,
    label: str = "replaying",
    prices: StepPrices | None = None,
) -> list[ReplayedTrajectory]:
    """Replay every trajectory, with a progress bar on stderr.

    With ``prices``, cloud steps are priced while routing, so the context's cloud budgets apply.
    """
    from fusion_graph.replay.replayed import replay_all

    with progress() as bar:
        task = bar.add_task(label, total=len(trajectories))
        return replay_all(trajectories, context, advance=lambda: bar.advance(task), prices=prices)


def budget_sentence(result: dict[str, Any]) -> str | None:
    """The budget a ``summarize`` result ran under and what it did, or ``None`` when none was set."""
    budget = result["budget"]
    if budget is None or (isinstance(budget, dict) and not any(v is not None for v in budget.values())):
        return None
    if isinstance(budget, dict):
        limits = ", ".join(
            f"{name} ${budget[key]:g}"
            for name, key in (("turn", "turn_usd"), ("thread", "thread_usd"))
            if budget[key] is not None
        )
    else:
        limits = "per trajectory"
    return (
        f"cloud budget ({limits}): {result['budget_local_steps']} step(s) moved local "
        f"({result['budget_local_plan_steps']} of them plans); cloud spend {money(result['cloud_cost_usd'])}"
    )


def resynthesis_sentence(result: dict[str, Any]) -> str:
    """What re-synthesis of local replies would add, from a ``summarize`` result."""
    again = result["resynthesis"]
    fractions = (
        f" = {again['fraction_of_cloud_cost']:.2f} of the run's cloud cost"
        if again["fraction_of_cloud_cost"] is not None
        else ""
    ) + (
        f", {again['fraction_of_all_cloud_cost']:.3f} of all-cloud"
        if again["fraction_of_all_cloud_cost"] is not None
        else ""
    )
    skipped = f"; the budget skips {again['skipped_by_budget']}" if again["skipped_by_budget"] else ""
    return (
        f"re-synthesis (resynthesize=local_replies): {again['turns_ending_local']} of {again['turns']} turns "
        f"end on a local reply; {again['resynthesized']} re-written on cloud{skipped}, adding "
        f"{money(again['added_cost_usd'])}{fractions}"
    )


def money(value: float | None) -> str:
    """Dollars to 4 places, or ``unknown`` (no price)."""
    return "unknown" if value is None else f"${value:.4f}"


def summary_tables(rows: dict[str, dict[str, Any]], *, paced: bool = False) -> list[Table]:
    """One row per trace family (and the total) of ``summarize`` results: steps and shares, then cost.

    Both shares side by side: of all steps (plans included) and of continuation
    steps; ``paced`` adds the count of steps the paced dial forced. Two tables,
    so that each fits 80 columns with its numbers whole (``tables``).
    """
    steps, costs = compact_table(), compact_table()
    for table in (steps, costs):
        table.add_column("traces", overflow="fold", min_width=12)
    names = ["runs", "steps", "plans", "cont.", "cloud\nall", "cloud\ncont."]
    add_number_columns(steps, *names, *(["paced"] if paced else []), "switches")
    add_number_columns(costs, "cost", "all-cloud")
    for name, row in rows.items():
        cells = [
            str(len(row["trajectories"])),
            str(row["steps"]),
            str(row["plan_steps"]),
            str(row["continuation_steps"]),
            f"{row['cloud_fraction']:.2f}",
            f"{row['continuation_cloud_fraction']:.2f}",
        ]
        cells += [str(row["paced_steps"])] if paced else []
        steps.add_row(name, *cells, str(row["switches"]))
        costs.add_row(name, money(row["cost_usd"]), money(row["all_cloud_cost_usd"]))
    return [steps, costs]


def dial_words(context: FusionContext) -> str:
    """The dial of a run context, for a title."""
    dial = "calibrated table" if context.score_quantiles is not None else "design rule"
    if context.pace_slack is not None:
        dial += f", paced within {context.pace_slack:g} steps"
    if context.trouble_signals:
        dial += ", trouble signals and latch"
    return f"cloud_share={context.cloud_share}, hysteresis={context.hysteresis} ({dial})"


def share_sentence(result: dict[str, Any]) -> str:
    """Both shares of a ``summarize`` result, and its cost against all-cloud, in one line."""
    cost = (
        f"cost {money(result['cost_usd'])} = {result['cost_fraction']:.2f} of all-cloud"
        if result["cost_fraction"] is not None
        else "cost unknown (no price for the cloud model; set FUSION_PRICE_OVERRIDES)"
    )
    return (
        f"on cloud: {result['cloud_fraction']:.2f} of all steps ({result['cloud_steps']} of "
        f"{result['steps']}), {result['continuation_cloud_fraction']:.2f} of continuation steps "
        f"({result['continuation_cloud_steps']} of {result['continuation_steps']}, the steps after "
        f"each turn's plan); {cost}"
    )


def replay(
    traces: TracesArg = None,
    cloud_share: Annotated[int | None, typer.Option(help="The dial, 0-100 (overrides --context).")] = None,
    context: ContextOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write a PNG of every trajectory: up to 16 as timelines (score vs the T ± h band) in a "
            "grid, more as a summary (share by cloud_share, score histogram)."
        ),
    ] = None,
    plot_limit: Annotated[
        int | None,
        typer.Option(
            help="Draw only the first N trajectories (default: all; more than 16 make a summary figure).",
            min=1,
            show_default=False,
        ),
    ] = None,
    turn_budget: TurnBudgetOpt = None,
    thread_budget: ThreadBudgetOpt = None,
    trouble_signals: TroubleOpt = None,
    resynthesize: Annotated[
        bool,
        typer.Option(
            "--resynthesize",
            help="Also print what resynthesize=local_replies would add: turns ending on a local reply "
            "and the cloud cost of re-writing them (always in --json, under 'resynthesis').",
        ),
    ] = False,
) -> None:
    """Route every step of recorded trajectories with the graph's own routing (no model calls).

    Shows the share of all steps on cloud beside the share of continuation
    steps (after each turn's plan): plans run on cloud whenever cloud_share > 0,
    so the first sits above the second. Token counts are estimates (the graph's
    own estimator): a step's prompt is what it would send, its completion the
    recorded assistant message. cost_usd prices cloud steps at the cloud model's
    prices (the operator's FUSION_PRICE_OVERRIDES or the genai-prices catalogue)
    and local steps at FUSION_LOCAL_PRICE_PER_MTOK, with no cached input;
    all_cloud_cost_usd prices every step on cloud.

    --turn-budget / --thread-budget apply the graph's cloud budget (each
    trajectory is one thread): a cloud step whose estimate would pass it runs
    local; the budgeted run's cloud spend and the steps moved are shown.
    """
    from fusion_graph.replay.summary import summarize
    from fusion_graph.replay.traces import families

    run_context = build_context(
        context,
        cloud_share=cloud_share,
        turn_cloud_budget_usd=turn_budget,
        thread_cloud_budget_usd=thread_budget,
        trouble_signals=trouble_signals,
    )
    trajectories = load_traces(traces)
    prices = run_prices(run_context, build_settings())
    replays = replay_with_progress(trajectories, run_context, prices=prices)
    result = summarize(replays, prices)
    if plot is not None:
        from fusion_graph.errors import PlotUnavailable
        from fusion_graph.replay.plot import replay_figure

        try:
            replay_figure(replays, run_context, limit=plot_limit, path=plot)
        except PlotUnavailable as error:
            raise fail(str(error)) from error
    if as_json:
        typer.echo(json.dumps(result))
        return
    by_family = {
        name: summarize([r for r in replays if r.trajectory.file == name], prices)
        for name in families(trajectories)
    }
    if len(by_family) > 1:
        by_family["all"] = result
    console = stdout_console()
    console.print(f"replay at {dial_words(run_context)}", highlight=False, soft_wrap=True)
    for table in summary_tables(by_family, paced=run_context.pace_slack is not None):
        console.print(table)
    console.print(share_sentence(result), highlight=False, soft_wrap=True)
    if "latched_steps" in result:
        console.print(
            f"trouble latch: {result['latched_steps']} continuation step(s) held on cloud until a "
            "progress event",
            highlight=False,
            soft_wrap=True,
        )
    budget = budget_sentence(result)
    if budget is not None:
        console.print(budget, highlight=False, soft_wrap=True)
    if resynthesize:
        console.print(resynthesis_sentence(result), highlight=False, soft_wrap=True)
    console.print(f"note: {result['note']}", highlight=False, soft_wrap=True)
    if plot is not None:
        console.print(
            f"{plot_words(len(replays), plot_limit)} written to {plot}", highlight=False, soft_wrap=True
        )


def plot_words(count: int, limit: int | None) -> str:
    """What ``--plot`` drew, in the words the figure's title uses: timelines or a summary, and of how many."""
    from fusion_graph.replay.plot import MAX_TIMELINES

    drawn = count if limit is None else min(limit, count)
    what = f"timelines of {drawn}" if drawn <= MAX_TIMELINES else f"a summary of {drawn}"
    left_out = f" (the first {drawn} of {count}: --plot-limit {limit})" if drawn < count else ""
    return f"{what} trajectories{left_out}"
