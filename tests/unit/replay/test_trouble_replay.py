"""Replay, calibration, the summary, the plot and the CLI with the trouble signals and the latch."""

from __future__ import annotations

import dataclasses
import json
import random
from itertools import pairwise
from pathlib import Path
from typing import Any

import matplotlib
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from matplotlib.figure import Figure
from typer.testing import CliRunner

from fusion_graph.cli.app import app
from fusion_graph.context import FusionContext
from fusion_graph.providers.pricing import TokenPrices
from fusion_graph.replay.calibration import calibrate, fit_quantiles, fraction_at
from fusion_graph.replay.history import route_history
from fusion_graph.replay.plot import LATCH_MARKS, timelines
from fusion_graph.replay.replayed import ReplayedTrajectory, replay_trajectory
from fusion_graph.replay.shares import ScoredStep, Trace, route_scores, scored_steps, share_of
from fusion_graph.replay.summary import summarize
from fusion_graph.replay.traces import RecordedTrajectory, StepPrices
from fusion_graph.routing.rule import QUANTILE_TABLE_LENGTH
from fusion_graph.routing.score import TroubleScore, TroubleSignals

ON = FusionContext(trouble_signals=True)
PRICES = StepPrices(TokenPrices(1.0, 2.0, None), TokenPrices(0.0, 0.0, 0.0))


def conversation(seed: int) -> list[BaseMessage]:
    """1-3 turns of tool loops whose results fail, loop or pass at random."""
    rng = random.Random(seed)
    messages: list[BaseMessage] = [SystemMessage("You are an agent.")]
    ids = iter(range(10_000))
    for turn in range(rng.randint(1, 3)):
        messages.append(HumanMessage(f"task {turn} " + "word " * rng.randint(5, 60)))
        for _ in range(rng.randint(1, 9)):
            calls = []
            for _ in range(rng.choice([1, 1, 1, 2])):
                calls.append(
                    {
                        "name": "run",
                        "args": {"n": rng.randint(0, 3)},
                        "id": f"c{next(ids)}",
                        "type": "tool_call",
                    }
                )
            messages.append(AIMessage("thinking " * rng.randint(0, 20), tool_calls=calls))
            for c in calls:
                text = rng.choice(
                    [
                        "ok " * rng.randint(1, 200),
                        "Error: it failed",
                        "Traceback (most recent call last):\n x",
                        "5 passed",
                    ]
                )
                messages.append(ToolMessage(text, tool_call_id=c["id"]))
        messages.append(AIMessage("done"))
    return messages


def trajectories(count: int = 12) -> list[RecordedTrajectory]:
    return [
        RecordedTrajectory("synthetic", i, f"t{i}", float(i % 2), tuple(conversation(i)))
        for i in range(count)
    ]


# --------------------------------------------------------------------------- replay and re-routing


@pytest.mark.parametrize("seed", range(4))
def test_re_routing_scores_reproduces_route_history_with_the_latch(seed: int) -> None:
    rng = random.Random(seed)
    messages = conversation(seed)
    scored = scored_steps(route_history(messages, ON))
    assert all(isinstance(s.score, TroubleScore) for s in scored if s.step > 0)
    for _ in range(15):
        context = dataclasses.replace(
            ON,
            cloud_share=rng.randint(1, 99),
            hysteresis=rng.choice([0, 5, 10]),
            pace_slack=rng.choice([None, None, 0.5, 2.0]),
            score_quantiles=rng.choice([None, tuple(sorted(rng.uniform(0, 60) for _ in range(101)))]),
        )
        replayed = route_history(messages, context)
        decisions = route_scores(scored, context)
        assert [(d.leg, d.latch, d.reason) for d in decisions] == [
            (s.leg, s.decision.latch, s.decision.reason) for s in replayed
        ]


def test_replay_carries_the_latch_and_resets_it_at_each_plan() -> None:
    latched_somewhere = False
    for seed in range(20):
        steps = route_history(conversation(seed), dataclasses.replace(ON, cloud_share=60))
        for previous, item in pairwise(steps):
            signals = item.signals
            if item.step == 0:
                assert not isinstance(signals, TroubleSignals)
                continue
            assert isinstance(signals, TroubleSignals)
            assert signals.latched == previous.decision.latch  # what the last step left
            if signals.held:
                latched_somewhere = True
                assert item.leg == "cloud"
    assert latched_somewhere


def test_with_trouble_signals_off_replays_the_seed_rule() -> None:
    messages = conversation(3)
    for item in route_history(messages, FusionContext(cloud_share=60)):
        assert type(item.signals).__name__ == "StepSignals"
        assert item.decision.latch is None and "trouble" not in item.decision.reason


# --------------------------------------------------------------------------- calibration


def troubled_traces(seed: int, count: int = 20) -> list[Trace]:
    """Scored trajectories with trouble points and progress events, as route_history gives them."""
    rng = random.Random(seed)
    traces: list[Trace] = []
    for _ in range(count):
        trace: list[ScoredStep] = []
        for _ in range(rng.randint(1, 3)):
            trace.append(ScoredStep(0, TroubleScore(1, 1.0, 0, 0, 0, 0, 0)))
            level = rng.uniform(0, 30)
            for step in range(1, rng.randint(2, 9)):
                level = min(max(level + rng.uniform(-4, 6), 0), 50)
                trouble = rng.choice([0.0, 0.0, 12.5, 25.0, 37.5, 50.0])
                score = TroubleScore(int(level + trouble + 0.5), round(level, 2), 0, 0, 0, trouble, 0)
                trace.append(ScoredStep(step, score, progress=rng.random() < 0.3))
        traces.append(trace)
    return traces


@pytest.mark.parametrize("seed", range(4))
def test_the_fast_fraction_applies_the_latch_as_decide_leg_does(seed: int) -> None:
    rng = random.Random(seed)
    traces = troubled_traces(seed)
    pairs = [[(s.step, s.score.points) for s in t] for t in traces]
    troubles = [[(s.score.trouble, s.score.base_points, s.progress) for s in t] for t in traces]
    latched = unlatched = 0
    for _ in range(20):
        bar = round(rng.uniform(0, 70), 2)
        hysteresis = rng.choice([0, 3, 10])
        context = FusionContext(
            cloud_share=rng.randint(1, 99),
            hysteresis=hysteresis,
            score_quantiles=(bar,) * QUANTILE_TABLE_LENGTH,
            trouble_signals=True,
        )
        fast = fraction_at(pairs, bar, hysteresis, troubles=troubles)
        assert fast == share_of(traces, context).fraction
        plain = fraction_at(pairs, bar, hysteresis)
        latched += fast > plain
        unlatched += fast == plain
    assert latched  # the latch does move shares


@pytest.mark.parametrize("target", [0.1, 0.3, 0.5])
def test_a_table_fitted_with_the_latch_gives_its_share_in_sample(target: float) -> None:
    traces = troubled_traces(5, count=40)
    found = calibrate(traces, target, ON)
    assert found.context.trouble_signals
    assert found.context.score_quantiles == fit_quantiles(traces, ON.hysteresis, latch=True)
    steps = share_of(traces, found.context).steps
    assert abs(found.achieved - target) <= 4 / steps


# --------------------------------------------------------------------------- summary and plot


def replays(context: FusionContext) -> list[ReplayedTrajectory]:
    return [replay_trajectory(t, dataclasses.replace(context, cloud_share=60)) for t in trajectories()]


def test_the_summary_shows_the_latch_only_with_trouble_signals() -> None:
    plain = summarize(replays(FusionContext()), PRICES)
    assert "latched_steps" not in plain
    assert all("latch" not in row for t in plain["trajectories"] for row in t["steps"])
    on = summarize(replays(ON), PRICES)
    rows = [row for t in on["trajectories"] for row in t["steps"] if row["step"] > 0]
    assert on["latched_steps"] == sum(row["latched"] for row in rows) > 0
    assert all({"progress", "latched", "latch"} <= set(row) for row in rows)
    assert all("error_severity" in row["breakdown"] for row in rows)


def labels(figure: Figure) -> set[str]:
    return {text.get_text() for legend in figure.legends for text in legend.get_texts()}


def test_timelines_draw_the_trouble_terms_the_latch_and_progress_events() -> None:
    matplotlib.use("Agg")
    trouble = {
        "trouble terms (error severity + no progress)",
        "progress event (releases the latch)",
        LATCH_MARKS["latched cloud"].label,
    }
    on = labels(timelines(replays(ON), dataclasses.replace(ON, cloud_share=60), limit=12))
    assert trouble <= on
    plain = labels(timelines(replays(FusionContext()), FusionContext(cloud_share=60), limit=12))
    assert not trouble & plain


# --------------------------------------------------------------------------- the CLI


def write_traces(path: Path) -> Path:
    lines = []
    for trajectory in trajectories(6):
        messages: list[dict[str, Any]] = []
        for m in trajectory.messages:
            if isinstance(m, SystemMessage):
                messages.append({"role": "system", "content": m.text})
            elif isinstance(m, HumanMessage):
                messages.append({"role": "user", "content": m.text})
            elif isinstance(m, ToolMessage):
                messages.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text})
            elif isinstance(m, AIMessage):
                calls = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c["args"])},
                    }
                    for c in m.tool_calls
                ]
                messages.append(
                    {"role": "assistant", "content": m.text, **({"tool_calls": calls} if calls else {})}
                )
        lines.append(json.dumps({"id": trajectory.id, "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replay_and_calibrate_take_the_trouble_switch(tmp_path: Path) -> None:
    traces = str(write_traces(tmp_path / "t.jsonl"))
    runner = CliRunner()
    plain = runner.invoke(app, ["replay", traces, "--cloud-share", "60", "--json"])
    assert plain.exit_code == 0, plain.output
    assert "latched_steps" not in json.loads(plain.stdout)
    on = runner.invoke(app, ["replay", traces, "--cloud-share", "60", "--trouble-signals", "--json"])
    assert on.exit_code == 0, on.output
    result = json.loads(on.stdout)
    assert result["latched_steps"] > 0
    same = runner.invoke(
        app, ["replay", traces, "--cloud-share", "60", "--context", '{"trouble_signals": true}', "--json"]
    )
    assert json.loads(same.stdout)["latched_steps"] == result["latched_steps"]
    text = runner.invoke(app, ["replay", traces, "--cloud-share", "60", "--trouble-signals"])
    assert "trouble signals and latch" in text.stdout and "trouble latch:" in text.stdout

    fitted = runner.invoke(
        app, ["calibrate", traces, "--target-cloud-fraction", "0.3", "--trouble-signals", "--json"]
    )
    assert fitted.exit_code == 0, fitted.output
    assert json.loads(fitted.stdout)["context"]["trouble_signals"] is True
