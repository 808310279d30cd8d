"""``fusion-graph calibrate``: fit the dial on recorded trajectories and print the run context it gives.

It routes with the graph's own code (``replay.route_history``) and calls no model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fusion_graph.cli.common import build_settings, context_dict, fail, run_prices, stdout_console
from fusion_graph.cli.replay import budget_sentence, replay_with_progress
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
    from rich.console import Console

    from fusion_graph.replay.calibration import Calibration
    from fusion_graph.replay.replayed import ReplayedTrajectory
    from fusion_graph.replay.shares import ScoredStep, TargetOf
    from fusion_graph.replay.traces import StepPrices

#: The calibrated dial's default pace (``replay.calibration.CALIBRATED_PACE_SLACK``; a test keeps them equal).
CALIBRATED_PACE_SLACK = 0.5


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


def save_or_echo(
    output: dict[str, Any], calibrated: dict[str, Any], save: Path | None, as_json: bool
) -> bool:
    """Write ``calibrated`` to ``--save``; with ``--json`` print ``output``. ``True``: nothing more to print.

    Both ``calibrate`` paths (trajectories, labels) end the same way, so their files and JSON agree.
    """
    if save is not None:
        save.write_text(json.dumps(calibrated, indent=1) + "\n", encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(output))
    return as_json


def print_run_context(console: Console, calibrated: dict[str, Any]) -> None:
    """The table's last lines: the calibrated context as one JSON line, plain, for ``--context``."""
    console.print("run context (pass as --context, or context= when embedding the graph):")
    typer.echo(json.dumps(calibrated))


def _share(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


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
    from fusion_graph.replay.replayed import step_costs
    from fusion_graph.replay.shares import scored_steps

    return [scored_steps(r.steps, step_costs(r, prices)) for r in replays]


def _on_labels(
    labels: Path | None,
    db: Path | None,
    target: float,
    kind: TargetOf,
    given: dict[str, Any],
    *,
    traces: list[Path] | None,
    pace_slack: float | None,
    trouble_signals: bool | None,
    budgets: bool,
    as_json: bool,
    save: Path | None,
    plot: Path | None,
) -> None:
    """``calibrate --labels`` / ``--labels-from-db``: the options checked, then ``calibrate_labels``'s run."""
    from fusion_graph.cli.calibrate_labels import calibrate_on_labels
    from fusion_graph.context import ensure_context
    from fusion_graph.errors import ContextError

    if traces:
        raise fail("give either TRACES or --labels/--labels-from-db: the labels hold the steps")
    if kind != "continuation":
        raise fail("--labels calibrates a share of continuation steps: use --target-cloud-fraction F")
    if budgets:
        raise fail("--turn-budget/--thread-budget price trace replays; labels are not priced")
    if trouble_signals is not None:
        given["trouble_signals"] = trouble_signals
    grid = bool(given.get("trouble_signals")) and "trouble_weights" not in given
    slack = given.get("pace_slack", CALIBRATED_PACE_SLACK) if pace_slack is None else pace_slack
    try:
        base = ensure_context({**given, "pace_slack": slack or None})
    except ContextError as error:
        raise fail(f"{error} (--pace-slack 0 compares no paced dial)") from error
    calibrate_on_labels(labels, db, target, base, given, grid=grid, as_json=as_json, save=save, plot=plot)


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
    traces: TracesArg = None,
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
    trouble_signals: TroubleOpt = None,
    labels: Annotated[
        Path | None,
        typer.Option(
            "--labels",
            help="Calibrate on labels instead of traces: a `fusion-graph label` output file. The dial "
            "sends the most disagreeing steps to cloud within --target-cloud-fraction.",
        ),
    ] = None,
    labels_from_db: Annotated[
        Path | None,
        typer.Option(
            "--labels-from-db",
            help="Calibrate on the shadow checks of a thread store (the SQLite file `fusion-graph run` "
            "writes): a local step the cloud, asked beside it, acted otherwise on counts as disagreeing.",
        ),
    ] = None,
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

    With --trouble-signals (or trouble_signals in --context) the traces are
    scored with the trouble terms and the table is fitted with the escalation
    latch in place; the context carries the switch.

    With --labels (or --labels-from-db) the steps are the labelled ones and the
    dial is the one that sends the most disagreeing continuation steps (where
    the local model did not take the recorded action) to cloud within the
    target share; with --trouble-signals a small grid of trouble weights is
    tried too, and the best kept (trouble_weights in the context). The table
    compares it with the seed's score under the design rule, the paced dial
    and random routing; --plot draws recall against share for each.
    """
    from fusion_graph.context import ensure_context
    from fusion_graph.errors import CalibrationError, ContextError
    from fusion_graph.replay.calibration import calibrate_many, target_verdict
    from fusion_graph.replay.summary import summarize

    target, kind = _target(target_cloud_fraction, target_cost_fraction, of)
    given = context_dict(context)
    if labels is not None or labels_from_db is not None:
        _on_labels(
            labels,
            labels_from_db,
            target,
            kind,
            given,
            traces=traces,
            pace_slack=pace_slack,
            trouble_signals=trouble_signals,
            budgets=turn_budget is not None or thread_budget is not None,
            as_json=as_json,
            save=save,
            plot=plot,
        )
        return
    budgets = {"turn_cloud_budget_usd": turn_budget, "thread_cloud_budget_usd": thread_budget}
    given.update({key: value for key, value in budgets.items() if value is not None})
    if trouble_signals is not None:
        given["trouble_signals"] = trouble_signals
    if pace_slack is None:
        pace_slack = given.get("pace_slack", CALIBRATED_PACE_SLACK)
    try:
        base = ensure_context({**given, "pace_slack": pace_slack or None})
    except ContextError as error:
        raise fail(f"{error} (--pace-slack 0 calibrates the table alone)") from error
    trajectories = load_traces(traces)
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
    if save_or_echo(output, calibrated, save, as_json):
        return
    console = stdout_console()
    words = {"continuation": "of continuation steps", "all": "of all steps", "cost": "of all-cloud cost"}
    table = compact_table(f"calibration: target {target:.3f} {words[kind]}")
    names = ["traces", "steps", "plans", "cont.", "cloud_share", "achieved", "cloud\nall", "cloud\ncont."]
    add_number_columns(table, *names, "cost ÷\nall-cloud")
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
    if output["achieved"] is not None:
        console.print(
            f"achieved {output['achieved']:.3f} {words[kind]} for the target {target:.3f}: "
            + target_verdict(target, output["achieved"]),
            highlight=False,
            soft_wrap=True,
        )
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
        console.print(f"calibration curve written to {plot}", highlight=False, soft_wrap=True)
    print_run_context(console, calibrated)
