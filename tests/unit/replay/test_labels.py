"""Offline labels: the steps asked, the lines read back, shadow checks as labels, and the fit on them."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import ToolException
from langchain_core.utils.function_calling import convert_to_openai_tool

from fusion_graph.context import FusionContext
from fusion_graph.errors import CalibrationError, TraceError
from fusion_graph.replay.disagreement import (
    TROUBLE_GRID,
    calibrate_labels,
    recall_at,
    scored_labels,
)
from fusion_graph.replay.history import route_history
from fusion_graph.replay.labels import (
    Label,
    inferred_tools,
    label_line,
    label_trajectories,
    read_label_lines,
    read_labels,
    schema_tools,
    shadow_labels,
    steps_to_label,
    trajectory_tools,
)
from fusion_graph.replay.traces import RecordedTrajectory, parse_trajectories
from fusion_graph.routing.score import StepSignals, TroubleSignals, score_step


def call(name: str, call_id: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


def trajectory(**fields: Any) -> RecordedTrajectory:
    """Two turns: a plan and a step, then a plan that replies."""
    messages = (
        SystemMessage("You are the desk."),
        HumanMessage("find booking K7"),
        AIMessage("", tool_calls=[call("find", "c1", booking="K7")]),
        ToolMessage("Error: no such booking", tool_call_id="c1"),
        AIMessage("", tool_calls=[call("find", "c2", booking="K7Q", exact=True)]),
        ToolMessage("found", tool_call_id="c2"),
        AIMessage("Found it."),
        HumanMessage("thanks"),
        AIMessage("You are welcome."),
    )
    return RecordedTrajectory(file="desk", line=1, id="d1", reward=None, messages=messages, **fields)


def test_each_step_is_asked_with_the_traces_system_prompt_and_the_history_before_it() -> None:
    recorded = trajectory()
    steps = steps_to_label(recorded, FusionContext())
    assert [(s.key, s.turn, s.step) for s in steps] == [
        (("desk", 1, 2), 0, 0),
        (("desk", 1, 4), 0, 1),
        (("desk", 1, 6), 0, 2),
        (("desk", 1, 8), 1, 0),
    ]
    messages = recorded.messages
    for item in steps:
        position = item.key[2]
        assert list(item.prompt) == list(messages[:position])  # the system prompt, then the history
        assert item.recorded is messages[position]


def test_the_score_follows_the_routing_rule_and_the_signals_keep_the_trouble_terms() -> None:
    plain = steps_to_label(trajectory(), FusionContext())
    troubled = steps_to_label(trajectory(), FusionContext(trouble_signals=True))
    routed = route_history(trajectory().messages, FusionContext())
    assert [s.score for s in plain] == [r.decision.score for r in routed]  # the graph's own score
    after_error = plain[1].signals
    assert isinstance(after_error, TroubleSignals) and after_error.error_severity == 0.5
    assert troubled[1].score == score_step(after_error)
    assert troubled[1].score.points == plain[1].score.points + 25  # 50 × severity 0.5


def test_a_line_holds_where_the_step_is_its_score_and_both_actions() -> None:
    item = steps_to_label(trajectory(), FusionContext())[1]
    local = AIMessage("", tool_calls=[call("find", "x", exact=True, booking="K7Q")])
    line = json.loads(json.dumps(label_line(item, local, agrees=True, provider="local:m")))
    assert (line["trace"], line["line"], line["trajectory"], line["position"]) == ("desk", 1, "d1", 4)
    assert (line["turn"], line["step"], line["score"]) == (0, 1, item.score.score)
    assert (
        line["recorded_action"]
        == line["local_action"]
        == {"tools": [["find", '{"booking": "K7Q", "exact": true}']]}
    )
    assert line["signals"]["error_severity"] == 0.5
    unanswered = label_line(item, None, agrees=None, error="timeout")
    assert unanswered["local_action"] is None and unanswered["error"] == "timeout"


def test_trajectories_that_share_an_id_keep_their_own_steps() -> None:
    twins = [dataclasses.replace(trajectory(), line=line) for line in (1, 2)]  # one id, two records
    keys = [item.key for twin in twins for item in steps_to_label(twin, FusionContext())]
    assert len(keys) == len(set(keys)) == 8


def test_tools_come_from_the_record_else_from_the_calls_when_asked() -> None:
    schema = {"name": "find", "description": "Find a booking.", "parameters": {"type": "object"}}
    line = json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}], "tools": [schema]})
    [parsed] = parse_trajectories([line], file="f")
    assert parsed.tools == ({"type": "function", "function": schema},)
    [tool] = trajectory_tools(parsed)
    assert convert_to_openai_tool(tool) == {"type": "function", "function": schema}
    assert trajectory_tools(trajectory()) == ()
    [inferred] = [convert_to_openai_tool(t) for t in trajectory_tools(trajectory(), "inferred")]
    assert inferred["function"]["name"] == "find"
    assert inferred["function"]["parameters"]["properties"] == {
        "booking": {"type": "string"},
        "exact": {"type": "boolean"},
    }
    assert inferred_tools([AIMessage("no calls")]) == ()
    with pytest.raises(TraceError, match="f:1"):
        parse_trajectories([json.dumps({"messages": [], "tools": [{"nameless": 1}]})], file="f")


def test_schema_tools_are_never_run() -> None:
    [tool] = schema_tools([{"type": "function", "function": {"name": "t"}}])
    with pytest.raises(ToolException, match="recorded trace"):
        tool.invoke({})


def write_lines(path: Path, lines: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + tail, encoding="utf-8")
    return path


def test_labels_read_back_the_last_line_of_each_step_and_skip_a_line_cut_short(tmp_path: Path) -> None:
    steps = steps_to_label(trajectory(), FusionContext())
    first = label_line(steps[0], None, agrees=None, error="timeout")
    again = label_line(steps[0], AIMessage("x"), agrees=False)
    second = label_line(steps[1], AIMessage("x"), agrees=True)
    path = write_lines(tmp_path / "labels.jsonl", [first, second, again], tail='{"trace": "de')
    assert [(line["position"], line["agrees"]) for line in read_label_lines(path)] == [(2, False), (4, True)]
    labels = read_labels(path)
    assert [(label.key, label.agrees) for label in labels] == [
        (("desk", 1, 2), False),
        (("desk", 1, 4), True),
    ]
    assert isinstance(labels[1].signals, TroubleSignals) and not isinstance(labels[0].signals, TroubleSignals)
    broken = write_lines(tmp_path / "broken.jsonl", [first], tail="not json\n" + json.dumps(second) + "\n")
    with pytest.raises(TraceError, match=r"broken\.jsonl:2"):
        read_labels(broken)
    with pytest.raises(TraceError, match="fusion-graph label"):
        read_labels(tmp_path / "missing.jsonl")


def record(kind: str, turn: int, step: int, **parts: Any) -> dict[str, Any]:
    signals = dict(vars(sig(10.0 + step, step)))
    return {"kind": kind, "turn": turn, "step": step, "signals": signals, "extra": {}, **parts}


def test_shadow_checks_label_the_local_steps_they_ran_beside() -> None:
    log = [
        record("plan", 0, 0),
        record("step", 0, 1),
        record("shadow", 0, 1, shadow={"of_step": 1, "agrees": False}),
        record("repair", 0, 2),
        record("step", 0, 2),
        record("memory", 0, 2),
        record("step", 0, 3),
        record("shadow", 0, 3, shadow={"of_step": 3, "agrees": True}),
        record("plan", 1, 0),
        record("step", 1, 1),
        record("shadow", 1, 1, shadow={"of_step": 1, "agrees": None}),
    ]
    labels = shadow_labels({"t": log})  # type: ignore[dict-item]
    assert [(label.turn, label.step, label.agrees) for label in labels] == [
        (0, 0, None),
        (0, 1, False),
        (0, 2, None),
        (0, 3, True),
        (1, 0, None),
        (1, 1, None),
    ]
    assert [label.position for label in labels] == list(range(6))
    assert {(label.trace, label.line, label.trajectory) for label in labels} == {("threads", 1, "t")}


# --- the fit on labels -------------------------------------------------------------------------------


def sig(points: float, step: int, severity: float | None = None) -> StepSignals:
    """Signals worth ``points`` of context pressure at ``step`` (25 steps a turn: about 1 point a step)."""
    base = StepSignals(
        prompt_tokens=round(points / 40 * 100_000),
        conversation_max_tokens=100_000,
        step=step,
        max_steps=25,
        transient_notice=False,
        tool_output_tokens=0,
        stable_prefix_tokens=1000,
    )
    if severity is None:
        return base
    return TroubleSignals(
        **vars(base), error_severity=severity, no_progress=0.0, progress=False, latched=None
    )


def labelled(trajectory: int, steps: list[tuple[StepSignals, bool | None]]) -> list[Label]:
    return [
        Label("synthetic", trajectory, f"t{trajectory}", position, 0, signals.step, signals, agrees)
        for position, (signals, agrees) in enumerate(steps)
    ]


def high_score_failures(seed: int = 1, count: int = 30, failing: float = 0.25) -> list[list[Label]]:
    """Tool loops of 2-6 steps; the local model fails exactly on the steps scoring highest (``failing``)."""
    rng = random.Random(seed)
    shapes = [[sig(rng.uniform(2, 38), k + 1) for k in range(rng.randint(2, 6))] for _ in range(count)]
    values = sorted(score_step(s).points for shape in shapes for s in shape)
    bar = values[int(len(values) * (1 - failing))]
    return [
        labelled(index, [(sig(1, 0), True), *((s, score_step(s).points < bar) for s in shape)])
        for index, shape in enumerate(shapes)
    ]


def test_steps_failing_on_high_scores_all_go_to_cloud_at_the_target_share() -> None:
    trajectories = high_score_failures()
    found = calibrate_labels(trajectories, 0.3, FusionContext(hysteresis=0), pace_slack=0.5, curves=True)
    point = found.chosen.point
    assert point.disagreeing == sum(1 for t in trajectories for label in t if label.agrees is False)
    assert point.share <= 0.3 and point.recall == 1.0  # every failing step on cloud, within the target
    scored = scored_labels(trajectories, found.chosen.context)
    lower = dataclasses.replace(found.chosen.context, cloud_share=point.cloud_share - 1)
    assert recall_at(scored, lower).recall < 1.0  # and no more on cloud than that takes
    assert found.chosen.context.score_quantiles is not None
    # The seed's score ranks these steps too: under the design rule it needs cloud_share ~70 for them.
    assert found.seed.share <= 0.3 and found.seed.recall <= point.recall and found.seed.cloud_share > 50
    assert found.random_recall == point.share
    assert found.paced is not None and found.paced.cloud_share == point.cloud_share
    assert found.plans == len(trajectories) and found.plans_disagreeing == 0
    assert set(found.curves) == {"chosen", "seed", "paced"}
    assert all(len(curve) == 101 for curve in found.curves.values())
    # The fitted context routes the steps as the graph would: re-routing it gives the same point.
    assert recall_at(scored, found.chosen.context) == point


def test_with_hysteresis_the_chosen_share_still_stays_within_the_target() -> None:
    found = calibrate_labels(high_score_failures(seed=2), 0.25, FusionContext())
    assert found.chosen.point.share <= 0.25
    assert found.chosen.point.recall > found.chosen.point.share  # better than random at its share


def error_failures(seed: int = 3, count: int = 80) -> list[list[Label]]:
    """Plan and one step each; a fifth of the steps follow a tool error, and only those fail locally."""
    rng = random.Random(seed)
    found = []
    for index in range(count):
        failing = index % 5 == 0
        step = sig(rng.uniform(5, 45), 1, severity=1.0 if failing else 0.0)
        found.append(labelled(index, [(sig(1, 0), True), (step, not failing)]))
    return found


def test_with_the_trouble_grid_the_weights_that_find_the_failing_steps_are_kept() -> None:
    trajectories = error_failures()
    seed_only = calibrate_labels(trajectories, 0.2, FusionContext())
    found = calibrate_labels(trajectories, 0.2, FusionContext(), grid=TROUBLE_GRID)
    assert len(found.candidates) == len(TROUBLE_GRID["error_severity"]) * len(TROUBLE_GRID["no_progress"])
    chosen = found.chosen
    assert chosen.context.trouble_signals and chosen.context.trouble_weights is not None
    assert chosen.context.trouble_weights["error_severity"] >= 50  # lifts every error step past the rest
    assert chosen.point.recall == 1.0 and chosen.point.share <= 0.2
    assert seed_only.chosen.point.recall < 0.5  # the four terms do not see errors
    assert found.trouble_measured == len(trajectories)  # every continuation step (plans never carry them)


def test_no_disagreeing_step_is_an_error() -> None:
    agreeing = [labelled(0, [(sig(1, 0), False), (sig(10, 1), True), (sig(20, 2), None)])]
    with pytest.raises(CalibrationError, match="no continuation step is labelled disagreeing"):
        calibrate_labels(agreeing, 0.3, FusionContext())


def test_labels_group_by_trajectory_in_step_order() -> None:
    labels = [*labelled(1, [(sig(1, 0), True), (sig(5, 1), False)]), *labelled(2, [(sig(1, 0), True)])]
    grouped = label_trajectories([labels[1], labels[2], labels[0]])
    assert grouped == [[labels[0], labels[1]], [labels[2]]]
    assert dataclasses.replace(labels[0]).key == ("synthetic", 1, 0)
