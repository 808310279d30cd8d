"""The figure of ``calibrate --labels --plot``: recall of disagreeing steps against the share sent to cloud.

One curve per dial routed over every ``cloud_share`` (``disagreement.recall_curve``):
the chosen dial, the seed's score under the design rule, the chosen dial paced,
and random routing (expected recall = share, the diagonal). Like every figure of
the package it is built without pyplot (``plot``) and needs the ``plot`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_graph.errors import UsageError
from fusion_graph.replay.disagreement import LabelCalibration, RecallPoint
from fusion_graph.replay.plot import PLANS_NOTE, _figure, _save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: How each curve of ``LabelCalibration.curves`` is named in the legend.
CURVE_NAMES = {
    "chosen": "chosen dial (calibrated table{trouble})",
    "seed": "seed score, design rule (T = 100 - cloud_share)",
    "paced": "chosen dial, paced (pace_slack={pace:g})",
}
STYLES = {"chosen": "o-", "seed": "s:", "paced": "D--"}


def _line(points: Sequence[RecallPoint]) -> tuple[list[float], list[float]]:
    ordered = sorted(points, key=lambda point: (point.share, point.recall))
    return [point.share for point in ordered], [point.recall for point in ordered]


def recall_figure(
    found: LabelCalibration,
    *,
    title: str = "",
    path: Path | None = None,
    curves: Mapping[str, Sequence[RecallPoint]] | None = None,
) -> Figure:
    """Recall of disagreeing continuation steps (y) against their share on cloud (x), one curve per dial.

    ``curves`` defaults to ``found.curves`` (``calibrate_labels(..., curves=True)``).
    The target is a vertical line; the chosen dial is starred.
    """
    drawn = found.curves if curves is None else curves
    if not drawn:
        raise UsageError("no recall curves to plot: calibrate_labels(..., curves=True) draws them")
    figure = _figure(1, 1, (6.4, 5.0))
    axes = figure.axes[0]
    axes.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=0.9, label="random (recall = share)")
    trouble = ""
    if found.chosen.context.trouble_signals and found.chosen.context.trouble_weights is not None:
        weights = found.chosen.context.trouble_weights
        trouble = f", trouble {weights['error_severity']}/{weights['no_progress']}"
    for name, points in drawn.items():
        label = CURVE_NAMES.get(name, name).format(trouble=trouble, pace=found.pace_slack or 0)
        xs, ys = _line(points)
        axes.plot(xs, ys, STYLES.get(name, "^-."), markersize=3, linewidth=1.1, label=label)
    axes.axvline(
        found.target, color="tab:red", linestyle=":", linewidth=0.9, label=f"target {found.target:g}"
    )
    point = found.chosen.point
    axes.plot(
        [point.share],
        [point.recall],
        "*",
        color="black",
        markersize=12,
        zorder=4,
        label=f"chosen: cloud_share={point.cloud_share}, share {point.share:.2f}, recall {point.recall:.2f}",
    )
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1.02)
    axes.set_xlabel("continuation steps on cloud (share)", fontsize=8)
    axes.set_ylabel("disagreeing continuation steps on cloud (recall)", fontsize=8)
    axes.legend(fontsize=7, loc="lower right")
    heading = title or "recall of the steps the local model got wrong"
    figure.suptitle(f"{heading}\n{PLANS_NOTE}; they are left out", fontsize=9)
    return _save(figure, path)
