"""Plots of replayed routing: timelines, a summary of many trajectories, calibration curves.

matplotlib is an optional extra (``pip install 'fusion-graph[plot]'``) and is
imported only when a plot is drawn. Figures are built without pyplot, so no GUI
backend is needed and a notebook's own backend is left alone: save them
(``path=``; PNG through Agg) or let Jupyter's inline backend show them.

Every figure shows the share of *all* steps on cloud beside the share of
*continuation* steps (after each turn's plan), and says that plans run on cloud
whenever ``cloud_share > 0``: that is why the first sits above the second.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_graph.context import FusionContext
from fusion_graph.errors import PlotUnavailable, UsageError
from fusion_graph.replay.calibration import Calibration
from fusion_graph.replay.replayed import ReplayedTrajectory
from fusion_graph.replay.shares import Shares, TargetOf, scored_steps, sweep
from fusion_graph.replay.summary import is_latched, is_paced
from fusion_graph.routing.rule import dial_base, hysteresis_band
from fusion_graph.routing.score import StepScore, TroubleSignals

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LEG_COLOURS = {"cloud": "tab:orange", "local": "tab:blue"}
#: Resolution of saved figures (pixels per inch).
DPI = 110
#: Up to this many trajectories ``replay_figure`` draws timelines; more get a summary figure.
MAX_TIMELINES = 16
#: Columns of the timeline grid.
MAX_COLUMNS = 4
#: Size of one timeline panel, inches.
PANEL_SIZE = (4.6, 2.5)
PLANS_NOTE = "plans (step 0 of each turn) run on cloud whenever cloud_share > 0"


def _figure(rows: int, columns: int, size: tuple[float, float]) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotUnavailable("plots need matplotlib: pip install 'fusion-graph[plot]'") from error
    figure = Figure(figsize=size, layout="constrained", dpi=DPI)
    figure.subplots(rows, columns, squeeze=False)
    return figure


def _save(figure: Figure, path: Path | None) -> Figure:
    if path is not None:
        figure.savefig(path, dpi=DPI)
    return figure


def base_threshold(context: FusionContext) -> float | None:
    """The dial's base threshold ``T`` (calibrated entry, or ``100 - cloud_share``); ``None`` at the ends."""
    if context.mode != "fusion" or context.cloud_share in (0, 100):
        return None
    return dial_base(context.cloud_share, context.score_quantiles)


def band_of(context: FusionContext) -> tuple[float, float, float] | None:
    """``(T, stay-on-cloud bar, escalation bar)`` the graph decides by (``None`` at the dial's ends)."""
    base = base_threshold(context)
    if base is None:
        return None
    escalate_at, stay_down_to = hysteresis_band(base, context.hysteresis)
    return base, stay_down_to, escalate_at


def dial_label(context: FusionContext) -> str:
    """The dial in words: share, hysteresis, pace and rule, e.g. for a title."""
    rule = "calibrated table" if context.score_quantiles is not None else "design rule"
    pace = "no pace" if context.pace_slack is None else f"pace_slack={context.pace_slack:g}"
    mode = "" if context.mode == "fusion" else f"mode={context.mode}, "
    trouble = ", trouble signals" if context.trouble_signals else ""
    return (
        f"{mode}cloud_share={context.cloud_share}, hysteresis={context.hysteresis}, {pace}{trouble} ({rule})"
    )


# -- marks --------------------------------------------------------------------------


@dataclass(frozen=True)
class Mark:
    """One kind of point: its legend label, colour and marker."""

    label: str
    colour: str
    marker: str
    edge: str = "none"


MARKS: dict[str, Mark] = {
    "cloud": Mark("cloud (score at or above its bar)", LEG_COLOURS["cloud"], "o"),
    "local": Mark("local (score below its bar)", LEG_COLOURS["local"], "o"),
    "plan cloud": Mark("plan on cloud (step 0)", LEG_COLOURS["cloud"], "^"),
    "plan local": Mark("plan on local (step 0)", LEG_COLOURS["local"], "^"),
    "paced cloud": Mark("paced to cloud (pace overruled the band)", LEG_COLOURS["cloud"], "D", "black"),
    "paced local": Mark("paced to local (pace overruled the band)", LEG_COLOURS["local"], "D", "black"),
}
#: The marks of steps the escalation latch held (``trouble_signals`` only): a budget may still move one local.
LATCH_MARKS: dict[str, Mark] = {
    "latched cloud": Mark("held on cloud by the trouble latch", LEG_COLOURS["cloud"], "s", "tab:red"),
    "latched local": Mark("latched, moved local by a cloud budget", LEG_COLOURS["local"], "s", "tab:red"),
}
#: Every mark a figure may draw, by ``mark_of`` key.
ALL_MARKS: dict[str, Mark] = MARKS | LATCH_MARKS
#: Colour of the trouble terms' segment (from the score without them up to the score) and of progress events.
TROUBLE_COLOUR = "tab:red"
PROGRESS_COLOUR = "tab:green"


def mark_of(step: int, leg: str, paced: bool, latched: bool = False) -> str:
    """The ``ALL_MARKS`` key of a step: plans, paced steps, steps the trouble latch held, the rest, by leg."""
    if step == 0:
        return f"plan {leg}"
    if paced:
        return f"paced {leg}"
    return f"latched {leg}" if latched else leg


def _drawn(score: StepScore, calibrated: bool) -> tuple[float, float]:
    """What a timeline draws of a score, as the dial reads it: ``(value, value without trouble)``."""
    if calibrated:
        return score.points, score.base_points
    return score.score, int(score.base_points + 0.5)


def _legend(
    figure: Figure, used: Sequence[str], extras: Sequence[tuple[str, str]], *, columns: int = 4
) -> None:
    """A figure legend naming every mark drawn (``used``) and every line or band (``extras``)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = []
    for key in ALL_MARKS:
        if key in used:
            mark = ALL_MARKS[key]
            handles.append(
                Line2D(
                    [],
                    [],
                    linestyle="none",
                    marker=mark.marker,
                    markerfacecolor=mark.colour,
                    markeredgecolor=mark.edge if mark.edge != "none" else mark.colour,
                    markersize=6,
                    label=mark.label,
                )
            )
    for kind, label in extras:
        if kind == "band":
            handles.append(Patch(color="0.88", label=label))
        elif kind == "threshold":
            handles.append(Line2D([], [], color="0.5", linestyle="--", linewidth=0.8, label=label))
        elif kind == "turn":
            handles.append(Line2D([], [], color="0.7", linestyle=":", linewidth=0.8, label=label))
        elif kind == "trouble":
            handles.append(Line2D([], [], color=TROUBLE_COLOUR, linewidth=2, alpha=0.6, label=label))
        elif kind == "progress":
            handles.append(
                Line2D([], [], linestyle="none", marker="|", color=PROGRESS_COLOUR, markersize=8, label=label)
            )
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), columns), fontsize=7)


# -- timelines ----------------------------------------------------------------------


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _counts(replays: Sequence[ReplayedTrajectory]) -> tuple[int, int, int, int]:
    steps = [s for r in replays for s in r.steps]
    continuation = [s for s in steps if s.step > 0]
    return (
        len(steps),
        sum(s.leg == "cloud" for s in steps),
        len(continuation),
        sum(s.leg == "cloud" for s in continuation),
    )


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.2f}" if whole else "-"


def share_line(replays: Sequence[ReplayedTrajectory]) -> str:
    """Both shares and the plan note, for a figure's title."""
    steps, cloud, continuation, continuation_cloud = _counts(replays)
    plans = steps - continuation
    return (
        f"on cloud: {_ratio(cloud, steps)} of all steps ({cloud}/{steps}), "
        f"{_ratio(continuation_cloud, continuation)} of continuation steps "
        f"({continuation_cloud}/{continuation}); {PLANS_NOTE}: {plans} of {steps} steps are plans"
    )


def title_counts(drawn: Sequence[ReplayedTrajectory], run: Sequence[ReplayedTrajectory] | None) -> str:
    """A figure's share line, counted over the whole ``run`` (as its table is), naming what was left out."""
    whole = list(run) if run is not None else list(drawn)
    line = share_line(whole)
    if len(drawn) < len(whole):
        line += f"; drawn: the first {len(drawn)} of {len(whole)} trajectories"
    return line


def timelines(
    replays: Sequence[ReplayedTrajectory],
    context: FusionContext,
    *,
    limit: int = 8,
    path: Path | None = None,
    run: Sequence[ReplayedTrajectory] | None = None,
) -> Figure:
    """A grid of panels (up to ``MAX_COLUMNS`` wide), one per trajectory: each step's score against the band.

    The score drawn is what the dial compares: points under a calibrated table,
    the integer score otherwise. Circles are steps the band decided, diamonds with
    a black edge steps the paced dial forced onto the other leg (a cloud one may
    sit below the band, a local one above it), triangles plans; dotted lines
    start turns. With ``trouble_signals``, a red segment rises from a step's score
    without the trouble terms to its score, squares with a red edge are steps the
    escalation latch held on cloud, and green ticks on the axis mark progress
    events (which release it). The legend names every mark drawn; the title gives
    the dial (pace included) and both shares, counted over ``run`` (the whole
    replay the panels come from; default the panels' own), so they match the
    table printed beside it. For more than ``MAX_TIMELINES`` trajectories see
    ``replay_figure``.
    """
    shown = list(replays)[:limit]
    if not shown:
        raise UsageError("no trajectories to plot")
    columns = min(MAX_COLUMNS, math.ceil(math.sqrt(len(shown))))
    rows = math.ceil(len(shown) / columns)
    width, height = PANEL_SIZE
    figure = _figure(rows, columns, (width * columns + 0.4, height * rows + 1.5))
    from matplotlib.ticker import MaxNLocator  # importable once _figure found matplotlib

    band = band_of(context)
    calibrated = context.score_quantiles is not None
    used: set[str] = set()
    turns = trouble = progress = False
    for axes, replay in zip(figure.axes, shown, strict=False):
        if band is not None:
            base, stay_down_to, escalate_at = band
            axes.axhspan(stay_down_to, escalate_at, color="0.88")
            axes.axhline(base, color="0.5", linestyle="--", linewidth=0.8)
        for index, item in enumerate(replay.steps):
            score = item.decision.score
            if score is None:
                continue
            if item.step == 0 and index:
                axes.axvline(index - 0.5, color="0.7", linestyle=":", linewidth=0.8)
                turns = True
            key = mark_of(item.step, item.leg, is_paced(item.decision), is_latched(item.signals))
            used.add(key)
            mark = ALL_MARKS[key]
            value, without = _drawn(score, calibrated)
            if score.trouble > 0:
                axes.vlines(index, without, value, color=TROUBLE_COLOUR, linewidth=2, alpha=0.6, zorder=2)
                trouble = True
            if isinstance(item.signals, TroubleSignals) and item.signals.progress:
                axes.scatter([index], [0], marker="|", color=PROGRESS_COLOUR, s=60, zorder=3)
                progress = True
            axes.scatter(
                [index],
                [value],
                color=mark.colour,
                marker=mark.marker,
                edgecolors=mark.edge,
                linewidths=0.8,
                s=26,
                zorder=3,
                label=mark.label,
            )
        steps, cloud, continuation, continuation_cloud = _counts([replay])
        reward = replay.trajectory.reward
        outcome = "" if reward is None else f", reward {reward:g}"
        axes.set_title(
            f"{_short(replay.trajectory.id, 44)}\ncloud {cloud}/{steps} steps, "
            f"{continuation_cloud}/{continuation} continuation{outcome}",
            fontsize=7,
        )
        axes.set_ylabel("points" if calibrated else "score", fontsize=7)
        axes.set_xlabel("step of the trajectory", fontsize=7)
        axes.tick_params(labelsize=7)
        axes.set_xlim(-0.8, max(len(replay.steps) - 0.2, 1.0))
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    for axes in figure.axes[len(shown) :]:
        axes.set_axis_off()
    extras: list[tuple[str, str]] = []
    if band is not None:
        base, stay_down_to, escalate_at = band
        extras.append(("band", f"hysteresis band {stay_down_to:g}-{escalate_at:g} (T ± h)"))
        extras.append(("threshold", f"T = {base:g}"))
    if turns:
        extras.append(("turn", "a new turn starts"))
    if trouble:
        extras.append(("trouble", "trouble terms (error severity + no progress)"))
    if progress:
        extras.append(("progress", "progress event (releases the latch)"))
    _legend(figure, sorted(used), extras, columns=min(4, 2 * columns))
    figure.suptitle(
        f"{dial_label(context)}\n" + "\n".join(textwrap.wrap(title_counts(shown, run), 60 * columns)),
        fontsize=9,
    )
    return _save(figure, path)


def summary(
    replays: Sequence[ReplayedTrajectory],
    context: FusionContext,
    *,
    path: Path | None = None,
    run: Sequence[ReplayedTrajectory] | None = None,
) -> Figure:
    """One figure for many trajectories: the share by ``cloud_share``, and continuation scores by leg.

    Left: the share of all steps and of continuation steps on cloud at every
    ``cloud_share`` (the rest of ``context`` kept: table, pace, hysteresis),
    routed as the graph routes (``shares.route_scores``), with the plans'
    floor and this run's ``cloud_share`` marked. Right: a histogram of the
    continuation steps' scores (points under a calibrated table) stacked by mark
    (paced steps hatched), against the ``T ± h`` band. The title counts over
    ``run``, as ``timelines`` does.
    """
    shown = list(replays)
    if not shown:
        raise UsageError("no trajectories to plot")
    figure = _figure(1, 2, (13.0, 5.2))
    shares_axes, scores_axes = figure.axes
    swept = sweep([scored_steps(r.steps) for r in shown], context)
    _share_panel(shares_axes, swept, context.cloud_share)
    calibrated = context.score_quantiles is not None
    groups: dict[str, list[float]] = {}
    for replay in shown:
        for item in replay.steps:
            score = item.decision.score
            if item.step == 0 or score is None:
                continue
            key = mark_of(item.step, item.leg, is_paced(item.decision), is_latched(item.signals))
            groups.setdefault(key, []).append(score.points if calibrated else score.score)
    keys = [key for key in ALL_MARKS if key in groups]
    values = [v for key in keys for v in groups[key]]
    band = band_of(context)
    base = band[0] if band is not None else None
    if band is not None:
        base, stay_down_to, escalate_at = band
        scores_axes.axvspan(
            stay_down_to, escalate_at, color="0.88", label=f"hysteresis band {stay_down_to:g}-{escalate_at:g}"
        )
        scores_axes.axvline(base, color="0.5", linestyle="--", linewidth=0.8, label=f"T = {base:g}")
    if keys:
        top = max([*values, base or 0.0]) + 1
        _, _, bars = scores_axes.hist(
            [groups[key] for key in keys],
            bins=[top * k / 40 for k in range(41)],
            stacked=True,
            color=[ALL_MARKS[key].colour for key in keys],
            label=[ALL_MARKS[key].label for key in keys],
        )
        containers: list[Any] = list(bars) if isinstance(bars, list) else [bars]
        for key, container in zip(keys, containers, strict=True):
            for bar in container:
                bar.set_edgecolor("white" if ALL_MARKS[key].edge == "none" else ALL_MARKS[key].edge)
                bar.set_linewidth(0.4)
                if key.startswith("paced"):
                    bar.set_hatch("////")
    scores_axes.set_xlabel("continuation step " + ("points" if calibrated else "score"))
    scores_axes.set_ylabel("continuation steps")
    scores_axes.set_title(f"scores at cloud_share={context.cloud_share} (plans are not scored)", fontsize=9)
    scores_axes.legend(fontsize=7)
    figure.suptitle(
        f"{len(shown)} trajectories, {dial_label(context)}\n"
        + "\n".join(textwrap.wrap(title_counts(shown, run), 150)),
        fontsize=9,
    )
    return _save(figure, path)


def _plans_line(axes: Axes, shares: Shares, note: str | None = None) -> None:
    """The share of steps the plans alone put on cloud, as a dotted line (none without steps)."""
    plans, total = shares.plans, shares.all.steps
    if total:
        note = note or f"{plans.steps / total:.2f}"
        axes.axhline(
            plans.steps / total,
            color="tab:red",
            linestyle=":",
            linewidth=0.9,
            label=f"plans alone: {plans.steps} of {total} steps ({note})",
        )


def _share_panel(axes: Axes, swept: Sequence[Shares], current: int) -> None:
    shares = range(len(swept))
    axes.plot(shares, [s.all.fraction for s in swept], "-", color="tab:red", label="all steps on cloud")
    axes.plot(
        shares,
        [s.continuation.fraction for s in swept],
        "-",
        color="tab:purple",
        label="continuation steps on cloud",
    )
    _plans_line(axes, swept[-1], "on cloud whenever cloud_share > 0")
    axes.axvline(
        current, color="0.4", linestyle="--", linewidth=0.8, label=f"this run: cloud_share={current}"
    )
    axes.set_xlim(0, 100)
    axes.set_ylim(0, 1.02)
    axes.set_xlabel("cloud_share")
    axes.set_ylabel("fraction on cloud")
    axes.set_title("share on cloud by cloud_share (this run's rule, pace, hysteresis)", fontsize=9)
    axes.legend(fontsize=7, loc="lower right")


def replay_figure(
    replays: Sequence[ReplayedTrajectory],
    context: FusionContext,
    *,
    limit: int | None = None,
    path: Path | None = None,
) -> Figure:
    """``replay --plot``: timelines of every trajectory (the first ``limit``), or a ``summary`` past 16.

    The title counts the whole replay, like the table, and says how many were
    drawn when ``limit`` left some out: nothing is dropped without a word.
    """
    shown = list(replays)[:limit]
    if len(shown) > MAX_TIMELINES:
        return summary(shown, context, path=path, run=replays)
    return timelines(shown, context, limit=len(shown), path=path, run=replays)


# -- calibration curves ---------------------------------------------------------------

TARGET_WORDS: dict[TargetOf, str] = {
    "continuation": "continuation steps on cloud",
    "all": "all steps on cloud",
    "cost": "cost / all-cloud cost",
}


def calibration_curve(
    series: Mapping[str, Sequence[tuple[float, Shares]]],
    *,
    of: TargetOf = "continuation",
    requested: Calibration | None = None,
    title: str = "",
    path: Path | None = None,
) -> Figure:
    """Achieved against target: one panel per share (continuation steps, all steps, and cost when priced).

    ``series`` maps a label (e.g. ``calibrated``, ``paced``, ``design rule``) to
    ``(target, shares achieved)`` points, targets being fractions ``of`` one kind.
    The diagonal (achieved = target) is drawn in the panel of that kind; the
    all-steps panel marks what the plans alone put on cloud; ``requested`` (a
    ``calibrate`` result) is starred at its target. Every panel's legend names its marks.
    """
    points = [shares for values in series.values() for _, shares in values]
    if not points:
        raise UsageError("no calibration points to plot")
    kinds: list[TargetOf] = ["continuation", "all"]
    if of == "cost" or all(shares.cost_fraction is not None for shares in points):
        kinds.append("cost")
    figure = _figure(1, len(kinds), (4.4 * len(kinds) + 0.3, 4.6))
    styles = ["o-", "s:", "D--", "^-."]
    for axes, kind in zip(figure.axes, kinds, strict=True):
        if kind == of:
            axes.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=0.8, label="achieved = target")
        if kind == "all":
            _plans_line(axes, points[0])
        for style, (label, values) in zip(styles * len(series), series.items(), strict=False):
            axes.plot(
                [target for target, _ in values],
                [shares.fraction(kind) or 0.0 for _, shares in values],
                style,
                markersize=4,
                label=label,
            )
        if requested is not None and requested.shares is not None:
            value = requested.shares.fraction(kind) or 0.0
            axes.plot(
                [requested.target],
                [value],
                "*",
                color="black",
                markersize=11,
                zorder=4,
                label=f"requested {requested.target:g}: achieved {value:.2f} "
                f"(cloud_share={requested.context.cloud_share})",
            )
        axes.set_xlabel(f"target: {TARGET_WORDS[of]}", fontsize=8)
        axes.set_ylabel(f"achieved: {TARGET_WORDS[kind]}", fontsize=8)
        axes.set_title(f"achieved {TARGET_WORDS[kind]}", fontsize=9)
        axes.set_xlim(0, 1)
        axes.set_ylim(0, 1.02)
        axes.legend(fontsize=7, loc="best")
    heading = title or "calibrated dial"
    figure.suptitle(f"{heading}\n{PLANS_NOTE}", fontsize=9)
    return _save(figure, path)
