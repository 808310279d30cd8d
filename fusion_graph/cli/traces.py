"""``fusion-graph replay`` and ``fusion-graph calibrate``: the dial on recorded trajectories.

Both route with the graph's own code (``replay.route_history``) and call no model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from fusion_graph.cli.common import (
    build_context,
    build_settings,
    context_dict,
    fail,
    load_or_fail,
    progress,
    run_prices,
    stdout_console,
)

if TYPE_CHECKING:
    from fusion_graph.context import FusionContext
    from fusion_graph.replay.calibration import (
        Calibration,
        ScoredStep,
        TargetOf,
    )
    from fusion_graph.replay.traces import (
        RecordedTrajectory,
        ReplayedTrajectory,
        StepPrices,
    )

#: The calibrated dial's default pace (``replay.calibration.CALIBRATED_PACE_SLACK``; a test keeps them equal).
CALIBRATED_PACE_SLACK = 0.5

TracesArg = Annotated[
    list[Path],
    typer.Argument(help="Trace files (JSONL) or directories of *.jsonl, e.g. ../shared/data/traces."),
]
ContextOpt = Annotated[
    str | None,
    typer.Option(help="FusionContext fields as a JSON object (or a JSON file), e.g. a calibrated context."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]


TurnBudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--turn-budget",
        help="USD a turn may spend on cloud (the run's turn_cloud_budget_usd): a cloud step that would "
        "pass it runs local, by the graph's rule (priced before the call with max_completion_tokens).",
        min=0,
    ),
]
ThreadBudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--thread-budget",
        help="USD a thread (one trajectory) may spend on cloud (the run's thread_cloud_budget_usd).",
        min=0,
    ),
]


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
    from fusion_graph.replay.traces import replay_trajectory

    replays = []
    with progress() as bar:
        task = bar.add_task(label, total=len(trajectories))
        for trajectory in trajectories:
            replays.append(replay_trajectory(trajectory, context, prices))
            bar.advance(task)
    return replays


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
        f"({result['budget_local_plan_steps']} of them plans); cloud spend {_money(result['cloud_cost_usd'])}"
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
        f"{_money(again['added_cost_usd'])}{fractions}"
    )


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.4f}"


def _share(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def summary_table(title: str, rows: dict[str, dict[str, Any]], *, paced: bool = False) -> Table:
    """One row per trace family (and the total) of ``summarize`` results.

    Both shares side by side: of all steps (plans included) and of continuation
    steps; ``paced`` adds the count of steps the paced dial forced.
    """
    table = Table(title=title)
    table.add_column("traces", overflow="fold", min_width=12)
    names = ["runs", "steps", "plans", "cont.", "cloud\nall", "cloud\ncont."]
    names += ["paced"] if paced else []
    names += ["switches", "cost", "all-cloud"]
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for name, row in rows.items():
        cells = [
            name,
            str(len(row["trajectories"])),
            str(row["steps"]),
            str(row["plan_steps"]),
            str(row["continuation_steps"]),
            f"{row['cloud_fraction']:.2f}",
            f"{row['continuation_cloud_fraction']:.2f}",
        ]
        cells += [str(row["paced_steps"])] if paced else []
        cells += [str(row["switches"]), _money(row["cost_usd"]), _money(row["all_cloud_cost_usd"])]
        table.add_row(*cells)
    return table


def dial_words(context: FusionContext) -> str:
    """The dial of a run context, for a title."""
    dial = "calibrated table" if context.score_quantiles is not None else "design rule"
    if context.pace_slack is not None:
        dial += f", paced within {context.pace_slack:g} steps"
    return f"cloud_share={context.cloud_share}, hysteresis={context.hysteresis} ({dial})"


def share_sentence(result: dict[str, Any]) -> str:
    """Both shares of a ``summarize`` result, and its cost against all-cloud, in one line."""
    cost = (
        f"cost {_money(result['cost_usd'])} = {result['cost_fraction']:.2f} of all-cloud"
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
    traces: TracesArg,
    cloud_share: Annotated[int | None, typer.Option(help="The dial, 0-100 (overrides --context).")] = None,
    context: ContextOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write a PNG: timelines (score vs the T ± h band) of up to 16 trajectories in a grid, "
            "or for more a summary (share by cloud_share, score histogram)."
        ),
    ] = None,
    plot_limit: Annotated[
        int, typer.Option(help="Trajectories drawn by --plot (more than 16: a summary figure).", min=1)
    ] = 8,
    turn_budget: TurnBudgetOpt = None,
    thread_budget: ThreadBudgetOpt = None,
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
    from fusion_graph.replay.traces import families, summarize

    run_context = build_context(
        context,
        cloud_share=cloud_share,
        turn_cloud_budget_usd=turn_budget,
        thread_cloud_budget_usd=thread_budget,
    )
    trajectories = load_or_fail(traces)
    prices = run_prices(run_context, build_settings())
    replays = replay_with_progress(trajectories, run_context, prices=prices)
    result = summarize(replays, prices)
    if plot is not None:
        from fusion_graph.errors import PlotUnavailable
        from fusion_graph.replay.plot import MAX_TIMELINES, replay_figure

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
    title = f"replay at {dial_words(run_context)}"
    console.print(summary_table(title, by_family, paced=run_context.pace_slack is not None))
    console.print(share_sentence(result), highlight=False, soft_wrap=True)
    budget = budget_sentence(result)
    if budget is not None:
        console.print(budget, highlight=False, soft_wrap=True)
    if resynthesize:
        console.print(resynthesis_sentence(result), highlight=False, soft_wrap=True)
    console.print(f"note: {result['note']}", highlight=False, soft_wrap=True)
    if plot is not None:
        shown = min(plot_limit, len(replays))
        what = "timelines" if shown <= MAX_TIMELINES else f"summary of {shown} trajectories"
        console.print(f"{what} written to {plot}", highlight=False)


#: Targets ``calibrate --plot`` draws, beside the requested one.
PLOT_TARGETS = tuple(round(0.05 * k, 2) for k in range(1, 20))
OfOpt = Annotated[
    str | None,
    typer.Option(
        "--of",
        help="What --target-cloud-fraction is a fraction of: 'continuation' steps (after each "
        "turn's plan; the default) or 'all' steps (plans included).",
    ),
]


def _target(cloud: float | None, cost: float | None, of: str | None) -> tuple[float, TargetOf]:
    """The target and its kind from the three options, or a usage error."""
    if cost is not None and cloud is None:
        if of is not None:
            raise fail(
                "--of applies to --target-cloud-fraction; --target-cost-fraction is a fraction of cost"
            )
        return cost, "cost"
    if cloud is None or cost is not None:
        raise fail(
            "give one target: --target-cloud-fraction F [--of all|continuation], or --target-cost-fraction F"
        )
    if of not in (None, "all", "continuation"):
        raise fail(f"--of must be 'all' or 'continuation', got {of!r}")
    return cloud, "all" if of == "all" else "continuation"


def _priced(replays: Sequence[ReplayedTrajectory], prices: StepPrices) -> list[list[ScoredStep]]:
    from fusion_graph.replay.calibration import scored_steps
    from fusion_graph.replay.traces import step_costs

    return [scored_steps(r.steps, step_costs(r, prices)) for r in replays]


def calibration_output(
    found: Calibration,
    checked: dict[str, Any],
    calibrated: dict[str, Any],
    unbudgeted: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``calibrate --json`` object: the target, both shares, cost and the context.

    Under a cloud budget, ``checked`` is the budgeted replay (what the shares and
    cost report), ``unbudgeted`` the same dial without the budget.
    """
    achieved = {
        "continuation": checked["continuation_cloud_fraction"],
        "all": checked["cloud_fraction"],
        "cost": checked["cost_fraction"],
    }[found.of]
    return {
        "target": found.target,
        "of": found.of,
        "achieved": achieved,
        "cloud_fraction": checked["cloud_fraction"],
        "continuation_cloud_fraction": checked["continuation_cloud_fraction"],
        "cost_fraction": checked["cost_fraction"],
        "steps": checked["steps"],
        "plan_steps": checked["plan_steps"],
        "continuation_steps": checked["continuation_steps"],
        "note": checked["note"],
        "cost_usd": checked["cost_usd"],
        "cloud_cost_usd": checked["cloud_cost_usd"],
        "budget": checked["budget"],
        "budget_local_steps": checked["budget_local_steps"],
        "without_budget": None
        if unbudgeted is None
        else {
            "cloud_fraction": unbudgeted["cloud_fraction"],
            "continuation_cloud_fraction": unbudgeted["continuation_cloud_fraction"],
            "cost_fraction": unbudgeted["cost_fraction"],
            "cloud_cost_usd": unbudgeted["cloud_cost_usd"],
        },
        "context": calibrated,
    }


def calibrate_command(
    traces: TracesArg,
    target_cloud_fraction: Annotated[
        float | None,
        typer.Option(
            help="Wanted fraction (0-1) of steps on cloud: of continuation steps (after each turn's "
            "plan), or of all steps with --of all."
        ),
    ] = None,
    of: OfOpt = None,
    target_cost_fraction: Annotated[
        float | None,
        typer.Option(
            help="Instead: wanted cost as a fraction (0-1) of running every step on cloud "
            "(the replay's cost_usd / all_cloud_cost_usd)."
        ),
    ] = None,
    context: ContextOpt = None,
    as_json: JsonOpt = False,
    save: Annotated[
        Path | None, typer.Option(help="Also write the context to this JSON file (for --context).")
    ] = None,
    pace_slack: Annotated[
        float | None,
        typer.Option(
            help="The paced dial's slack in steps (pace_slack): each thread's cloud count stays "
            "within it of the share. Default: --context's pace_slack if it sets one, else "
            f"{CALIBRATED_PACE_SLACK:g}. 0: the table alone (no pacing).",
            min=0,
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write a PNG of target against achieved (continuation steps, all steps, cost) "
            "for targets 0.05-0.95 and the requested one."
        ),
    ] = None,
    turn_budget: TurnBudgetOpt = None,
    thread_budget: ThreadBudgetOpt = None,
) -> None:
    """Find the context that sends the target fraction of steps (or of cost) to cloud.

    Fits a score_quantiles table (the calibrated dial, for the context's
    hysteresis) on the traces. For a target of continuation steps (the
    default) cloud_share is 100 × the target; for --of all or a cost target,
    cloud_share is searched on the traces with the same table and pace. Plans
    (step 0 of each turn) run on cloud whenever cloud_share > 0, so the share of
    all steps, and cost, cannot go below what the plans alone give: such a
    target fails with the numbers. The result is checked by replaying the
    traces with it; both shares are shown. The context paces each thread
    (pace_slack) unless told not to: a table alone holds the share on the
    traces it was fitted on, not on other conversations. Pass the printed
    context as the run context (or to replay --context).

    With --turn-budget / --thread-budget the table and cloud_share are fitted
    on the traces without the budget (the dial's own share), then checked with
    it: the shares and cost shown are those of the budgeted run (the budget only
    moves cloud steps local, so they can fall below the target; the unbudgeted
    figures are in --json under without_budget). The context carries the budgets.
    """
    from fusion_graph.context import ensure_context
    from fusion_graph.errors import CalibrationError, ContextError
    from fusion_graph.replay.calibration import calibrate_many
    from fusion_graph.replay.traces import summarize

    target, kind = _target(target_cloud_fraction, target_cost_fraction, of)
    given = context_dict(context)
    budgets = {"turn_cloud_budget_usd": turn_budget, "thread_cloud_budget_usd": thread_budget}
    given.update({key: value for key, value in budgets.items() if value is not None})
    if pace_slack is None:
        pace_slack = given.get("pace_slack", CALIBRATED_PACE_SLACK)
    try:
        base = ensure_context({**given, "pace_slack": pace_slack or None})
    except ContextError as error:
        raise fail(f"{error} (--pace-slack 0 calibrates the table alone)") from error
    trajectories = load_or_fail(traces)
    prices = run_prices(base, build_settings())
    replays = replay_with_progress(trajectories, base, label="scoring")
    scored = _priced(replays, prices)
    targets = [target, *(PLOT_TARGETS if plot is not None else ())]
    try:
        found, *curve = calibrate_many(scored, targets, base, of=kind)
    except CalibrationError as error:
        raise fail(str(error)) from error
    if plot is not None:
        from fusion_graph.errors import PlotUnavailable
        from fusion_graph.replay.plot import calibration_curve

        try:
            calibration_curve(
                {"calibrated": [(c.target, c.shares) for c in curve if c.shares is not None]},
                of=kind,
                requested=found,
                title=f"calibrated on {len(trajectories)} trajectories: hysteresis={base.hysteresis}, "
                + ("no pace" if base.pace_slack is None else f"pace_slack={base.pace_slack:g}"),
                path=plot,
            )
        except PlotUnavailable as error:
            raise fail(str(error)) from error
    missed = found.unreachable()
    if missed is not None:
        hint = " (--of continuation targets the steps the dial decides)" if kind == "all" else ""
        raise fail(missed + hint)
    checked = summarize(
        replay_with_progress(trajectories, found.context, label="checking", prices=prices), prices
    )
    limited = (
        found.context.turn_cloud_budget_usd is not None or found.context.thread_cloud_budget_usd is not None
    )
    unbudgeted = (
        summarize(replay_with_progress(trajectories, found.context, label="unbudgeted"), prices)
        if limited
        else None
    )
    calibrated = {
        **given,
        "mode": "fusion",
        "cloud_share": found.context.cloud_share,
        "hysteresis": found.context.hysteresis,
        "score_quantiles": list(found.context.score_quantiles or ()),
        "pace_slack": found.context.pace_slack,
    }
    output = calibration_output(found, checked, calibrated, unbudgeted)
    if save is not None:
        save.write_text(json.dumps(calibrated, indent=1) + "\n", encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(output))
        return
    console = stdout_console()
    words = {"continuation": "of continuation steps", "all": "of all steps", "cost": "of all-cloud cost"}
    table = Table(title=f"calibration: target {target:.3f} {words[kind]}")
    names = ["traces", "steps", "plans", "cont.", "cloud_share", "achieved", "cloud all", "cloud cont."]
    for name in [*names, "cost ÷ all-cloud"]:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_row(
        str(len(trajectories)),
        str(checked["steps"]),
        str(checked["plan_steps"]),
        str(checked["continuation_steps"]),
        str(found.context.cloud_share),
        f"{output['achieved']:.3f}" if output["achieved"] is not None else "unknown",
        f"{checked['cloud_fraction']:.3f}",
        f"{checked['continuation_cloud_fraction']:.3f}",
        _share(checked["cost_fraction"]),
    )
    console.print(table)
    budget = budget_sentence(checked)
    if budget is not None and unbudgeted is not None:
        console.print(
            f"{budget}; without it: {unbudgeted['cloud_fraction']:.3f} of all steps, "
            f"{unbudgeted['continuation_cloud_fraction']:.3f} of continuation steps, "
            f"cost {_share(unbudgeted['cost_fraction'])} of all-cloud",
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"note: {checked['note']}", highlight=False, soft_wrap=True)
    if plot is not None:
        console.print(f"calibration curve written to {plot}", highlight=False)
    console.print("run context (pass as --context, or context= when embedding the graph):")
    typer.echo(json.dumps(calibrated))
