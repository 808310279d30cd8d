"""Plots of replayed routing: per-trajectory timelines and calibration curves.

matplotlib is an optional extra (``pip install 'fusion-graph[plot]'``) and is
imported only when a plot is drawn, with the headless ``Agg`` backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_graph.context import FusionContext
from fusion_graph.replay.traces import ReplayedTrajectory
from fusion_graph.routing import cloud_threshold, hysteresis_band

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LEG_COLOURS = {"cloud": "tab:orange", "local": "tab:blue"}


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def _figure(rows: int, columns: int, size: tuple[float, float]) -> Figure:
    try:
        import matplotlib
    except ImportError as error:
        raise PlotUnavailable("plots need matplotlib: pip install 'fusion-graph[plot]'") from error
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    figure.subplots(rows, columns, squeeze=False)
    return figure


def base_threshold(context: FusionContext) -> float | None:
    """The dial's base threshold ``T`` (calibrated entry, or ``100 - cloud_share``); ``None`` at the ends."""
    if context.mode != "fusion" or context.cloud_share in (0, 100):
        return None
    if context.score_quantiles is not None:
        return context.score_quantiles[100 - context.cloud_share]
    return cloud_threshold(context.cloud_share)


def timelines(
    replays: Sequence[ReplayedTrajectory],
    context: FusionContext,
    *,
    limit: int = 8,
    path: Path | None = None,
) -> Figure:
    """One panel per trajectory: each step's score against the ``T ± h`` band, coloured by leg.

    The score drawn is what the dial compares: points under a calibrated table,
    the integer score otherwise. Plans are triangles; dotted lines mark turns.
    """
    shown = list(replays)[:limit]
    if not shown:
        raise ValueError("no trajectories to plot")
    figure = _figure(len(shown), 1, (10.0, 2.2 * len(shown) + 0.6))
    base = base_threshold(context)
    calibrated = context.score_quantiles is not None
    for axes, replay in zip(figure.axes, shown, strict=True):
        if base is not None:
            escalate_at, stay_down_to = hysteresis_band(base, context.hysteresis)
            axes.axhspan(stay_down_to, escalate_at, color="0.9", label="T ± h")
            axes.axhline(base, color="0.5", linestyle="--", linewidth=0.8, label=f"T = {base:g}")
        for index, item in enumerate(replay.steps):
            score = item.decision.score
            if score is None:
                continue
            value = score.points if calibrated else score.score
            if item.step == 0 and index:
                axes.axvline(index - 0.5, color="0.7", linestyle=":", linewidth=0.8)
            axes.scatter(
                [index],
                [value],
                color=LEG_COLOURS[item.leg],
                marker="^" if item.step == 0 else "o",
                s=28,
                zorder=3,
            )
        cloud = sum(s.leg == "cloud" for s in replay.steps)
        reward = replay.trajectory.reward
        outcome = "" if reward is None else f", reward {reward:g}"
        axes.set_title(
            f"{replay.trajectory.id}: {cloud}/{len(replay.steps)} steps on cloud{outcome}", fontsize=9
        )
        axes.set_ylabel("points" if calibrated else "score")
        axes.set_xlim(-0.8, max(len(replay.steps) - 0.2, 1.0))
    for leg, colour in LEG_COLOURS.items():
        figure.axes[0].scatter([], [], color=colour, label=leg)
    figure.axes[0].legend(loc="upper left", fontsize=7, ncols=4)
    figure.axes[-1].set_xlabel("step of the trajectory (triangles: plans)")
    dial = "calibrated" if calibrated else "design rule"
    figure.suptitle(f"cloud_share={context.cloud_share}, hysteresis={context.hysteresis} ({dial})")
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


def calibration_curve(
    points: Sequence[tuple[float, float]],
    *,
    label: str = "calibrated",
    baseline: Sequence[tuple[float, float]] = (),
    path: Path | None = None,
) -> Figure:
    """Achieved against target cloud fraction (the diagonal is perfect), optionally with a baseline."""
    figure = _figure(1, 1, (4.6, 4.2))
    axes = figure.axes[0]
    axes.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=0.8, label="target")
    axes.plot([t for t, _ in points], [a for _, a in points], "o-", label=label)
    if baseline:
        axes.plot([t for t, _ in baseline], [a for _, a in baseline], "s:", label="design rule")
    axes.set_xlabel("target continuation cloud fraction")
    axes.set_ylabel("achieved")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1)
    axes.legend(fontsize=8)
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure
