"""``fusion-graph replay`` and ``fusion-graph calibrate``: the dial on recorded trajectories.

Both route with the graph's own code (``replay.route_history``) and call no model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

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
from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.replay.calibration import CALIBRATED_PACE_SLACK, CalibrationError, calibrate, scored_steps
from fusion_graph.replay.traces import (
    RecordedTrajectory,
    ReplayedTrajectory,
    families,
    replay_trajectory,
    summarize,
)
from fusion_graph.settings import ContextError

TracesArg = Annotated[
    list[Path],
    typer.Argument(help="Trace files (JSONL) or directories of *.jsonl, e.g. ../shared/data/traces."),
]
ContextOpt = Annotated[
    str | None,
    typer.Option(help="FusionContext fields as a JSON object (or a JSON file), e.g. a calibrated context."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]


def replay_with_progress(
    trajectories: Sequence[RecordedTrajectory], context: FusionContext, *, label: str = "replaying"
) -> list[ReplayedTrajectory]:
    """Replay every trajectory, with a progress bar on stderr."""
    replays = []
    with progress() as bar:
        task = bar.add_task(label, total=len(trajectories))
        for trajectory in trajectories:
            replays.append(replay_trajectory(trajectory, context))
            bar.advance(task)
    return replays


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.4f}"


def summary_table(title: str, rows: dict[str, dict[str, Any]]) -> Table:
    """One row per trace family (and the total) of ``summarize`` results."""
    table = Table(title=title)
    table.add_column("traces", overflow="fold", min_width=12)
    for name in ("runs", "steps", "cloud", "cont.", "cont. cloud", "switches", "cost", "all-cloud"):
        table.add_column(name, justify="right", no_wrap=True)
    for name, row in rows.items():
        table.add_row(
            name,
            str(len(row["trajectories"])),
            str(row["steps"]),
            f"{row['cloud_fraction']:.2f}",
            str(row["continuation_steps"]),
            f"{row['continuation_cloud_fraction']:.2f}",
            str(row["switches"]),
            _money(row["cost_usd"]),
            _money(row["all_cloud_cost_usd"]),
        )
    return table


def replay(
    traces: TracesArg,
    cloud_share: Annotated[int | None, typer.Option(help="The dial, 0-100 (overrides --context).")] = None,
    context: ContextOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write per-trajectory timelines (score vs the T ± h band) to this PNG."),
    ] = None,
    plot_limit: Annotated[int, typer.Option(help="Trajectories drawn by --plot.")] = 8,
) -> None:
    """Route every step of recorded trajectories with the graph's own routing (no model calls).

    Token counts are estimates (the graph's own estimator): a step's
    prompt is what it would send, its completion the recorded assistant
    message. cost_usd prices cloud steps at the cloud model's prices (the
    operator's FUSION_PRICE_OVERRIDES or the genai-prices catalogue) and local
    steps at FUSION_LOCAL_PRICE_PER_MTOK, with no cached input;
    all_cloud_cost_usd prices every step on cloud.
    """
    run_context = build_context(context, cloud_share=cloud_share)
    trajectories = load_or_fail(traces)
    replays = replay_with_progress(trajectories, run_context)
    prices = run_prices(run_context, build_settings())
    result = summarize(replays, prices)
    if plot is not None:
        from fusion_graph.replay.plot import PlotUnavailable, timelines

        try:
            timelines(replays, run_context, limit=plot_limit, path=plot)
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
    dial = "calibrated table" if run_context.score_quantiles is not None else "design rule"
    if run_context.pace_slack is not None:
        dial += f", paced within {run_context.pace_slack:g} steps"
    title = f"replay at cloud_share={run_context.cloud_share}, hysteresis={run_context.hysteresis} ({dial})"
    console = stdout_console()
    console.print(summary_table(title, by_family))
    if plot is not None:
        console.print(f"timelines written to {plot}")


def calibrate_command(
    traces: TracesArg,
    target_cloud_fraction: Annotated[
        float, typer.Option(help="Wanted fraction (0-1) of continuation steps on cloud.")
    ],
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
) -> None:
    """Find the context that sends the target fraction of continuation steps to cloud.

    Fits a score_quantiles table (the calibrated dial, for the context's
    hysteresis and pace) on the traces, sets cloud_share to 100 × the target,
    and checks the result by replaying the traces with it. The context paces
    each thread (pace_slack) unless told not to: a table alone holds the share
    on the traces it was fitted on, not on other conversations. Pass the
    printed context as the run context (or to replay --context); any other
    cloud_share then means its own share of continuation steps.
    """
    given = context_dict(context)
    if pace_slack is None:
        pace_slack = given.get("pace_slack", CALIBRATED_PACE_SLACK)
    try:
        base = ensure_context({**given, "pace_slack": pace_slack or None})
    except ContextError as error:
        raise fail(f"{error} (--pace-slack 0 calibrates the table alone)") from error
    trajectories = load_or_fail(traces)
    replays = replay_with_progress(trajectories, base, label="scoring")
    try:
        found = calibrate([scored_steps(r.steps) for r in replays], target_cloud_fraction, base)
    except CalibrationError as error:
        raise fail(str(error)) from error
    checked = summarize(
        replay_with_progress(trajectories, found.context, label="checking"),
        run_prices(base, build_settings()),
    )
    calibrated = {
        **given,
        "mode": "fusion",
        "cloud_share": found.context.cloud_share,
        "hysteresis": found.context.hysteresis,
        "score_quantiles": list(found.context.score_quantiles or ()),
        "pace_slack": found.context.pace_slack,
    }
    output = {
        "target": target_cloud_fraction,
        "achieved": checked["continuation_cloud_fraction"],
        "continuation_steps": checked["continuation_steps"],
        "context": calibrated,
    }
    if save is not None:
        save.write_text(json.dumps(calibrated, indent=1) + "\n", encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(output))
        return
    console = stdout_console()
    table = Table(title="calibration")
    for name in ("traces", "continuation steps", "target", "achieved"):
        table.add_column(name, justify="right")
    table.add_row(
        str(len(trajectories)),
        str(checked["continuation_steps"]),
        f"{target_cloud_fraction:.3f}",
        f"{checked['continuation_cloud_fraction']:.3f}",
    )
    console.print(table)
    console.print("run context (pass as --context, or context= when embedding the graph):")
    typer.echo(json.dumps(calibrated))
