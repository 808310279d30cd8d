"""Plots drawn with matplotlib's Agg backend: sizes, legends that name every mark, both shares."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
from pathlib import Path
from typing import Any

import matplotlib
import numpy
import pytest
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure

from fusion_graph.context import FusionContext
from fusion_graph.replay.calibration import calibrate_many
from fusion_graph.replay.history import ReplayedStep
from fusion_graph.replay.plot import (
    DPI,
    MARKS,
    MAX_TIMELINES,
    PLANS_NOTE,
    calibration_curve,
    replay_figure,
    summary,
    timelines,
)
from fusion_graph.replay.replayed import ReplayedTrajectory, replay_trajectory
from fusion_graph.replay.shares import scored_steps, sweep
from fusion_graph.replay.summary import is_paced
from fusion_graph.replay.traces import RecordedTrajectory, load_trajectories
from fusion_graph.routing.rule import hysteresis_band
from fusion_graph.routing.score import Leg, RouteDecision, StepScore, StepSignals


@pytest.fixture(autouse=True)
def _agg() -> None:
    """Draw with the headless Agg backend, as ``--plot`` does."""
    matplotlib.use("Agg")


def png_size(figure: Figure) -> tuple[int, int]:
    """Width and height in pixels of ``figure`` saved as PNG (as ``--plot`` saves it)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    data = buffer.getvalue()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def legend_labels(figure: Figure) -> set[str]:
    legends = [*figure.legends, *(a.get_legend() for a in figure.axes)]
    return {text.get_text() for legend in legends if legend is not None for text in legend.get_texts()}


def axes_legend(figure: Figure, index: int) -> set[str]:
    legend = figure.axes[index].get_legend()
    assert legend is not None
    return {text.get_text() for text in legend.get_texts()}


def y_of(collection: PathCollection) -> float:
    return float(numpy.asarray(collection.get_offsets())[0, 1])


def y_data(line: Any) -> list[float]:
    return [float(y) for y in numpy.asarray(line.get_ydata())]


def flat(text: str) -> str:
    return " ".join(text.split())


def tool_call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "read", "arguments": "{}"}}


def write_traces(path: Path, count: int) -> Path:
    """``count`` conversations of two turns each, with tool output of varied size."""
    lines = []
    for index in range(count):
        messages: list[dict[str, Any]] = []
        for turn in range(2):
            messages.append({"role": "user", "content": f"task {index}.{turn}"})
            for step in range(2 + (index + turn) % 4):
                call_id = f"t{index}-{turn}-{step}"
                messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call(call_id)]})
                size = 60 * ((index * 7 + step * 13) % 23 + 1)
                messages.append({"role": "tool", "tool_call_id": call_id, "content": "y" * size})
            messages.append({"role": "assistant", "content": "done"})
        lines.append(json.dumps({"id": f"run-{index}", "messages": messages, "reward": index % 2}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trajectories(tmp_path: Path) -> list[RecordedTrajectory]:
    return load_trajectories([write_traces(tmp_path / "synthetic.jsonl", 64)])


def calibrated_paced(replays: list[ReplayedTrajectory], share: int = 30) -> FusionContext:
    base = FusionContext(conversation_max_tokens=4096, pace_slack=0.5)
    found = calibrate_many([scored_steps(r.steps) for r in replays], [share / 100], base)[0]
    return found.context


# --------------------------------------------------------------------------- marks


def step(position: int, index: int, leg: Leg, value: float, reason: str) -> ReplayedStep:
    score = StepScore(
        score=int(value + 0.5), context_pressure=value, turn_depth=0, transient_notice=0, tail_growth=0
    )
    signals = StepSignals(100, 4096, index, 25, False, 0, 100)
    decision = RouteDecision(leg, score, 60, reason, paced="; paced to " in reason)
    return ReplayedStep(position, index, decision, signals)


def crafted() -> ReplayedTrajectory:
    """One turn with every kind of step: a plan, band decisions and paced ones on both legs."""
    paced = "; paced to {}: 1 of 2 continuation steps on cloud, ... 30% (slack 0.5)"
    steps = (
        step(1, 0, "cloud", 2.0, "step 0 (plan) runs on cloud because cloud_share=30 > 0"),
        step(2, 1, "local", 10.0, "score 10 < 80 (T=70 + h=10): stay local"),
        step(3, 2, "cloud", 12.0, "score 12 < 80 (T=70 + h=10): stay local" + paced.format("cloud")),
        step(4, 3, "cloud", 75.0, "score 75 >= 60 (T=70 - h=10): stay on cloud"),
        step(5, 4, "local", 90.0, "score 90 >= 60 (T=70 - h=10): stay on cloud" + paced.format("local")),
    )
    trajectory = RecordedTrajectory("crafted", 1, "crafted", None, ())
    return ReplayedTrajectory(trajectory, steps, (5,) * len(steps))


def test_paced_steps_get_their_own_marks_and_the_legend_names_every_mark() -> None:
    context = FusionContext(cloud_share=30, pace_slack=0.5)
    replay = crafted()
    assert [is_paced(s.decision) for s in replay.steps] == [False, False, True, False, True]
    figure = timelines([replay], context)
    labels = legend_labels(figure)
    assert {mark.label for key, mark in MARKS.items() if key != "plan local"} <= labels
    assert MARKS["plan local"].label not in labels  # only marks that were drawn
    assert {"T = 70", "hysteresis band 60-80 (T ± h)"} <= labels
    escalate_at, stay_down_to = hysteresis_band(70, 10)
    drawn = [c for c in figure.axes[0].collections if isinstance(c, PathCollection)]
    assert len(drawn) == len(replay.steps)
    for collection in drawn:
        label = collection.get_label()
        assert label in labels, label  # every point's mark is in the legend
        value = y_of(collection)
        # Unpaced points never contradict the band; the paced ones that do are marked as paced.
        if label == MARKS["cloud"].label:
            assert value >= stay_down_to
        if label == MARKS["local"].label:
            assert value < escalate_at
    title = flat(figure.get_suptitle())
    assert "pace_slack=0.5" in title
    assert "of all steps" in title and "of continuation steps" in title and PLANS_NOTE in title


def test_real_paced_timelines_mark_every_step_that_crosses_the_band(
    trajectories: list[RecordedTrajectory],
) -> None:
    plain = FusionContext(conversation_max_tokens=4096)
    replays = [replay_trajectory(t, plain) for t in trajectories[:16]]
    context = calibrated_paced(replays)
    replays = [replay_trajectory(t, context) for t in trajectories[:16]]
    assert any(is_paced(s.decision) for r in replays for s in r.steps)
    base = context.score_quantiles[100 - context.cloud_share] if context.score_quantiles else 70
    escalate_at, stay_down_to = hysteresis_band(base, context.hysteresis)
    figure = timelines(replays, context, limit=16)
    labels = legend_labels(figure)
    for axes in figure.axes:
        for collection in axes.collections:
            if not isinstance(collection, PathCollection):
                continue
            assert collection.get_label() in labels
            value = y_of(collection)
            if collection.get_label() == MARKS["cloud"].label:
                assert value >= stay_down_to
            if collection.get_label() == MARKS["local"].label:
                assert value < escalate_at


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(("count", "columns"), [(1, 1), (4, 2), (8, 3), (16, 4)])
def test_timelines_are_a_grid_of_at_most_four_columns(
    trajectories: list[RecordedTrajectory], count: int, columns: int
) -> None:
    context = FusionContext(cloud_share=30, conversation_max_tokens=4096)
    replays = [replay_trajectory(t, context) for t in trajectories[:count]]
    figure = replay_figure(replays, context, limit=count)
    visible = [a for a in figure.axes if a.axison]
    assert len(visible) == count
    assert len({round(a.get_position().x0, 3) for a in visible}) == columns
    width, height = png_size(figure)
    assert width <= 2200 and height <= 1400, (width, height)


def test_many_trajectories_become_one_summary_figure(trajectories: list[RecordedTrajectory]) -> None:
    plain = FusionContext(conversation_max_tokens=4096)
    replays = [replay_trajectory(t, plain) for t in trajectories]
    context = calibrated_paced(replays)
    replays = [replay_trajectory(t, context) for t in trajectories]
    assert len(replays) == 64 > MAX_TIMELINES
    figure = replay_figure(replays, context, limit=64)
    width, height = png_size(figure)
    assert height < 4000 and width < 2000, (width, height)  # was 1,100 x 15,554 as one strip
    assert len(figure.axes) == 2
    labels = legend_labels(figure)
    assert {
        "all steps on cloud",
        "continuation steps on cloud",
        f"this run: cloud_share={context.cloud_share}",
    } <= (labels)
    assert any(label.startswith("plans alone:") for label in labels)
    drawn = {
        key
        for r in replays
        for s in r.steps
        if s.step > 0
        for key in [("paced " if is_paced(s.decision) else "") + s.leg]
    }
    assert {MARKS[key].label for key in drawn} <= labels
    assert "pace_slack=0.5" in flat(figure.get_suptitle()) and PLANS_NOTE in flat(figure.get_suptitle())


def test_the_summary_sweeps_the_dial_with_the_graphs_routing(trajectories: list[RecordedTrajectory]) -> None:
    context = FusionContext(cloud_share=30, conversation_max_tokens=4096)
    replays = [replay_trajectory(t, context) for t in trajectories[:20]]
    figure = summary(replays, context)
    lines = {str(line.get_label()): line for line in figure.axes[0].get_lines()}
    swept = sweep([scored_steps(r.steps) for r in replays], context)
    all_steps = y_data(lines["all steps on cloud"])
    assert all_steps == [s.all.fraction for s in swept]
    at_30 = [replay_trajectory(t, dataclasses.replace(context, cloud_share=30)) for t in trajectories[:20]]
    steps = [s for r in at_30 for s in r.steps]
    assert all_steps[30] == sum(s.leg == "cloud" for s in steps) / len(steps)


def test_the_calibration_curve_shows_both_shares(trajectories: list[RecordedTrajectory]) -> None:
    context = FusionContext(conversation_max_tokens=4096, pace_slack=0.5)
    scored = [scored_steps(replay_trajectory(t, context).steps) for t in trajectories]
    targets = [0.1, 0.3, 0.5, 0.7]
    found = calibrate_many(scored, [0.3, *targets], context)
    figure = calibration_curve(
        {"calibrated": [(c.target, c.shares) for c in found[1:] if c.shares is not None]}, requested=found[0]
    )
    assert [a.get_title() for a in figure.axes] == [
        "achieved continuation steps on cloud",
        "achieved all steps on cloud",
    ]  # no cost panel: the steps are not priced
    for index, axes in enumerate(figure.axes):
        labels = axes_legend(figure, index)
        assert "calibrated" in labels
        assert any(label.startswith("requested 0.3: achieved") for label in labels)
        assert {str(line.get_label()) for line in axes.get_lines()} <= labels  # every mark is named
    all_panel = {str(line.get_label()): line for line in figure.axes[1].get_lines()}
    assert y_data(all_panel["calibrated"]) == [c.shares.all.fraction for c in found[1:] if c.shares]
    assert any(label.startswith("plans alone:") for label in all_panel)
    assert PLANS_NOTE in flat(figure.get_suptitle())
    width, height = png_size(figure)
    assert width < 1600 and height < 700


# --------------------------------------------------------------------------- counts


@pytest.mark.parametrize("limit", [None, 5, 40])
def test_the_title_counts_what_the_table_counts_and_names_what_was_left_out(
    trajectories: list[RecordedTrajectory], limit: int | None
) -> None:
    from fusion_graph.replay.summary import summarize
    from fusion_graph.replay.traces import step_prices
    from fusion_graph.settings import FusionSettings

    context = FusionContext(cloud_share=60, conversation_max_tokens=4096)
    replays = [replay_trajectory(t, context) for t in trajectories[:12]]
    table = summarize(replays, step_prices(FusionSettings()))
    title = flat(replay_figure(replays, context, limit=limit).get_suptitle())
    assert f"({table['cloud_steps']}/{table['steps']})" in title
    assert f"({table['continuation_cloud_steps']}/{table['continuation_steps']})" in title
    if limit is not None and limit < len(replays):
        assert f"drawn: the first {limit} of 12 trajectories" in title
    else:
        assert "drawn:" not in title


def test_every_trajectory_is_drawn_unless_a_limit_is_given(trajectories: list[RecordedTrajectory]) -> None:
    context = FusionContext(cloud_share=30, conversation_max_tokens=4096)
    replays = [replay_trajectory(t, context) for t in trajectories[:12]]
    assert len([a for a in replay_figure(replays, context).axes if a.axison]) == 12
    assert len([a for a in replay_figure(replays, context, limit=3).axes if a.axison]) == 3


def test_a_two_step_timeline_has_whole_step_ticks(tmp_path: Path) -> None:
    messages = [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ]
    (tmp_path / "two.jsonl").write_text(json.dumps({"id": "two", "messages": messages}) + "\n")
    (short,) = load_trajectories([tmp_path / "two.jsonl"])
    context = FusionContext(cloud_share=30, conversation_max_tokens=4096)
    replay = replay_trajectory(short, context)
    assert len(replay.steps) == 2
    figure = timelines([replay], context)
    figure.canvas.draw()
    ticks = [float(t) for t in figure.axes[0].get_xticks()]
    assert ticks and all(t == int(t) for t in ticks), ticks
