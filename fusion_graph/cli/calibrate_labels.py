"""``fusion-graph calibrate --labels``: fit the dial to send the steps the local model gets wrong to cloud.

The labels are ``fusion-graph label``'s (the local model asked each recorded
step) or a thread store's shadow checks (``--labels-from-db``: the cloud asked
beside local steps). The fit is ``replay.disagreement.calibrate_labels``; this
module reads the labels, prints the comparison (80 columns, or ``--json``),
saves the context and draws the figure. No model is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_graph.cli.calibrate import print_run_context, save_or_echo
from fusion_graph.cli.common import fail, stderr_console, stdout_console, storage
from fusion_graph.cli.tables import add_number_columns, compact_table

if TYPE_CHECKING:
    from fusion_graph.context import FusionContext
    from fusion_graph.replay.disagreement import LabelCalibration, RecallPoint
    from fusion_graph.replay.labels import Label


def read_all(labels: Path | None, db: Path | None) -> tuple[list[Label], str]:
    """The labels of ``--labels`` and of ``--labels-from-db``, and words saying where they came from."""
    from fusion_graph.errors import TraceError
    from fusion_graph.replay.labels import read_labels, shadow_labels

    found: list[Label] = []
    where = []
    if labels is not None:
        try:
            found += read_labels(labels)
        except TraceError as error:
            raise fail(str(error)) from error
        where.append(str(labels))
    if db is not None:
        from fusion_graph.cli.report import stored_route_logs

        if not db.is_file():
            wrote = "--labels-from-db reads what `fusion-graph run` wrote"
            raise fail(f"no checkpoint database at {db}: {wrote}")
        with storage(f"--labels-from-db {db}"):
            logs = stored_route_logs(db)
        found += shadow_labels(logs, trace=f"threads:{db.name}")
        where.append(f"shadow checks in {db}")
    if not found:
        raise fail(f"no labelled steps in {' and '.join(where)}")
    return found, " and ".join(where)


def _point(point: RecallPoint) -> dict[str, Any]:
    return {
        "cloud_share": point.cloud_share,
        "share": round(point.share, 4),
        "recall": round(point.recall, 4),
        "cloud_steps": point.cloud,
        "caught": point.caught,
    }


def calibrated_context(found: LabelCalibration, given: dict[str, Any]) -> dict[str, Any]:
    """The context the fit gives: ``--context``'s fields with the table, share, pace and trouble weights."""
    chosen = found.chosen.context
    calibrated = {
        **given,
        "mode": "fusion",
        "cloud_share": chosen.cloud_share,
        "hysteresis": chosen.hysteresis,
        "score_quantiles": list(chosen.score_quantiles or ()),
        "pace_slack": found.pace_slack,
        "trouble_signals": chosen.trouble_signals,
    }
    if chosen.trouble_signals:
        calibrated["trouble_weights"] = chosen.trouble_weights
    return calibrated


def label_output(found: LabelCalibration, where: str, calibrated: dict[str, Any]) -> dict[str, Any]:
    """The ``calibrate --labels --json`` object: the counts, the chosen dial, the comparison, the context."""
    chosen = found.chosen
    point = chosen.point
    return {
        "labels": where,
        "target": found.target,
        "of": "continuation",
        "continuation_steps": point.steps,
        "disagreeing": point.disagreeing,
        "labelled": found.labels,
        "unlabelled": found.unlabelled,
        "plans": found.plans,
        "plans_disagreeing": found.plans_disagreeing,
        "trouble_measured": found.trouble_measured,
        "chosen": {
            **_point(point),
            "trouble_signals": chosen.context.trouble_signals,
            "trouble_weights": chosen.context.trouble_weights if chosen.context.trouble_signals else None,
        },
        "comparison": {
            "chosen": _point(point),
            "seed": _point(found.seed),
            "paced": None if found.paced is None else {**_point(found.paced), "pace_slack": found.pace_slack},
            "random": {"share": round(point.share, 4), "recall": round(found.random_recall, 4)},
        },
        "candidates": [
            {"trouble_weights": dial.context.trouble_weights, **_point(dial.point)}
            for dial in found.candidates
            if dial.context.trouble_signals
        ],
        "context": calibrated,
    }


def _table(found: LabelCalibration, where: str) -> Any:
    point = found.chosen.point
    table = compact_table(
        f"calibration on labels: target {found.target:.3f} of continuation steps; "
        f"{point.disagreeing} of {point.steps} continuation steps disagree ({where})",
        "recall: disagreeing continuation steps on cloud; random routing's expected recall is its share",
    )
    table.add_column("dial")
    add_number_columns(table, "cloud_share", "cont. on\ncloud", "share", "caught", "recall")
    context = found.chosen.context
    name = "chosen: calibrated table"
    if context.trouble_signals and context.trouble_weights is not None:
        weights = context.trouble_weights
        name += f", trouble {weights['error_severity']}/{weights['no_progress']}"
    rows: list[tuple[str, RecallPoint | None]] = [(name, point), ("seed score, design rule", found.seed)]
    if found.paced is not None:
        rows.append((f"chosen, paced {found.pace_slack:g}", found.paced))
    for label, row in rows:
        assert row is not None
        table.add_row(
            label,
            str(row.cloud_share),
            f"{row.cloud}/{row.steps}",
            f"{row.share:.3f}",
            f"{row.caught}/{row.disagreeing}",
            f"{row.recall:.3f}",
        )
    chance = f"{found.random_recall:.3f}"
    table.add_row("random, at the chosen share", "-", "-", f"{point.share:.3f}", "-", chance)
    return table


def calibrate_on_labels(
    labels: Path | None,
    db: Path | None,
    target: float,
    base: FusionContext,
    given: dict[str, Any],
    *,
    grid: bool,
    as_json: bool,
    save: Path | None,
    plot: Path | None,
) -> None:
    """Run ``calibrate --labels`` / ``--labels-from-db``: fit, print, save and plot."""
    from fusion_graph.errors import CalibrationError
    from fusion_graph.replay.disagreement import TROUBLE_GRID, calibrate_labels
    from fusion_graph.replay.labels import label_trajectories

    found_labels, where = read_all(labels, db)
    trajectories = label_trajectories(found_labels)
    searched = TROUBLE_GRID if grid else None
    if grid:
        pairs = len(TROUBLE_GRID["error_severity"]) * len(TROUBLE_GRID["no_progress"])
        stderr_console().print(f"trying {pairs} pairs of trouble weights", highlight=False)
    try:
        found = calibrate_labels(
            trajectories, target, base, grid=searched, pace_slack=base.pace_slack, curves=plot is not None
        )
    except CalibrationError as error:
        raise fail(str(error)) from error
    calibrated = calibrated_context(found, given)
    output = label_output(found, where, calibrated)
    if plot is not None:
        from fusion_graph.errors import PlotUnavailable
        from fusion_graph.replay.label_plot import recall_figure

        try:
            recall_figure(found, title=f"labels: {where}", path=plot)
        except PlotUnavailable as error:
            raise fail(str(error)) from error
    if save_or_echo(output, calibrated, save, as_json):
        return
    console = stdout_console()
    console.print(_table(found, where))
    notes = [
        f"plans: {found.plans} (step 0 of each turn, {found.plans_disagreeing} disagreeing) run on cloud "
        "whenever cloud_share > 0 and are left out",
    ]
    if found.unlabelled:
        notes.append(f"{found.unlabelled} step(s) without a label are routed but not counted in recall")
    if grid:
        measured = f"measured on {found.trouble_measured} of {found.chosen.point.steps} continuation steps"
        notes.append(f"trouble weights: {len(found.candidates)} pairs tried; the trouble signals {measured}")
    for note in notes:
        console.print(f"note: {note}", highlight=False)
    if plot is not None:
        console.print(f"recall curves written to {plot}", highlight=False, soft_wrap=True)
    print_run_context(console, calibrated)
