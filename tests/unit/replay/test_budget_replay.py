"""Replays under a cloud budget, and what re-synthesis of local replies would add."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from fusion_graph.context import FusionContext
from fusion_graph.providers.pricing import TokenPrices
from fusion_graph.replay.history import ReplayedStep
from fusion_graph.replay.replayed import ReplayedTrajectory, replay_trajectory
from fusion_graph.replay.resynthesis import resynthesis_count
from fusion_graph.replay.summary import summarize
from fusion_graph.replay.traces import RecordedTrajectory, StepPrices, load_trajectories
from fusion_graph.routing.score import Leg, RouteDecision, StepSignals

#: $1 in / $2 out per million tokens on cloud; local is free.
PRICES = StepPrices(TokenPrices(1.0, 2.0, None), TokenPrices(0.0, 0.0, 0.0))
M = 1e-6


def three_turns(path: Path) -> RecordedTrajectory:
    """One conversation of three turns, each a single reply (a plan)."""
    messages = []
    for turn in range(3):
        messages += [{"role": "user", "content": f"question {turn} " + "x" * 200}]
        messages += [{"role": "assistant", "content": f"answer {turn} " + "y" * 100}]
    path.write_text(json.dumps({"id": "t", "messages": messages}) + "\n")
    (trajectory,) = load_trajectories([path])
    return trajectory


CONTEXT = FusionContext(cloud_share=30, max_completion_tokens=100)


def test_a_thread_budget_moves_the_plans_it_cannot_afford_local(tmp_path: Path) -> None:
    trajectory = three_turns(tmp_path / "t.jsonl")
    free = summarize([replay_trajectory(trajectory, CONTEXT, PRICES)], PRICES)
    rows = free["trajectories"][0]["steps"]
    assert [r["leg"] for r in rows] == ["cloud"] * 3 and free["budget_local_steps"] == 0
    first = rows[0]["cost_usd"]
    second_estimate = rows[1]["prompt_tokens"] * M + 100 * 2 * M
    budget = first + second_estimate - 1e-9  # the first fits, the second's estimate does not
    limited = dataclasses.replace(CONTEXT, thread_cloud_budget_usd=budget)

    replay = replay_trajectory(trajectory, limited, PRICES)
    out = summarize([replay], PRICES)
    assert [s.leg for s in replay.steps] == ["cloud", "local", "local"]
    assert out["budget_local_steps"] == out["budget_local_plan_steps"] == 2
    assert out["cloud_cost_usd"] == pytest.approx(first)
    assert out["cloud_fraction"] == round(1 / 3, 4)
    assert out["budget"] == {"turn_usd": None, "thread_usd": budget}
    assert all(s.decision.budget is not None for s in replay.steps[1:])
    assert "thread budget $" in replay.steps[1].decision.reason
    assert [r["budget_local"] for r in out["trajectories"][0]["steps"]] == [False, True, True]

    # Room for the second step: only the third moves.
    roomy = dataclasses.replace(CONTEXT, thread_cloud_budget_usd=budget + 2e-9)
    assert [s.leg for s in replay_trajectory(trajectory, roomy, PRICES).steps] == ["cloud", "cloud", "local"]


def test_without_prices_no_budget_applies_and_existing_callers_keep_working(tmp_path: Path) -> None:
    trajectory = three_turns(tmp_path / "t.jsonl")
    tight = dataclasses.replace(CONTEXT, thread_cloud_budget_usd=1e-9)
    unpriced = replay_trajectory(trajectory, tight)
    assert not unpriced.priced and [s.leg for s in unpriced.steps] == ["cloud"] * 3
    out = summarize([unpriced], PRICES)
    assert out["budget"] == {"turn_usd": None, "thread_usd": None} and out["budget_local_steps"] == 0
    priced = replay_trajectory(trajectory, tight, PRICES)
    assert [s.leg for s in priced.steps] == ["local"] * 3


def test_a_turn_budget_resets_each_turn(tmp_path: Path) -> None:
    trajectory = three_turns(tmp_path / "t.jsonl")
    # Each turn's single step fits a turn budget a little above the largest step's estimate.
    rows = summarize([replay_trajectory(trajectory, CONTEXT, PRICES)], PRICES)["trajectories"][0]["steps"]
    largest = max(r["prompt_tokens"] for r in rows) * M + 100 * 2 * M
    per_turn = dataclasses.replace(CONTEXT, turn_cloud_budget_usd=largest + 1e-9)
    assert [s.leg for s in replay_trajectory(trajectory, per_turn, PRICES).steps] == ["cloud"] * 3
    same_as_thread = dataclasses.replace(CONTEXT, thread_cloud_budget_usd=largest + 1e-9)
    assert [s.leg for s in replay_trajectory(trajectory, same_as_thread, PRICES).steps][1:] == ["local"] * 2


# --------------------------------------------------------------------------- re-synthesis


def step(position: int, index: int, leg: Leg, prompt: int) -> ReplayedStep:
    signals = StepSignals(prompt, 4096, index, 25, False, 0, prompt)
    return ReplayedStep(position, index, RouteDecision(leg, None, None, "crafted"), signals)


def crafted(context: FusionContext | None, *, priced: bool = True) -> ReplayedTrajectory:
    """Three turns: a tool loop ending on a local reply, a cloud reply, a local reply."""
    messages = (
        HumanMessage("one"),
        AIMessage("", tool_calls=[{"id": "c1", "name": "read", "args": {}}]),
        ToolMessage("ok", tool_call_id="c1"),
        AIMessage("done"),
        HumanMessage("two"),
        AIMessage("sure"),
        HumanMessage("three"),
        AIMessage("ok"),
    )
    steps = (
        step(1, 0, "cloud", 100),
        step(3, 1, "local", 200),
        step(5, 0, "cloud", 300),
        step(7, 0, "local", 400),
    )
    trajectory = RecordedTrajectory("crafted", 1, "crafted", None, messages)
    return ReplayedTrajectory(trajectory, steps, (10, 20, 30, 40), context, priced)


def test_resynthesis_counts_turns_ending_on_a_local_reply_and_prices_them() -> None:
    out = summarize([crafted(CONTEXT)], PRICES)
    again = out["resynthesis"]
    assert (again["turns"], again["turns_ending_local"], again["resynthesized"]) == (3, 2, 2)
    added = (230 * M + 20 * 2 * M) + (430 * M + 40 * 2 * M)  # prompt + 30 instruction tokens, the reply
    assert again["added_cost_usd"] == pytest.approx(added)
    assert out["cloud_cost_usd"] == pytest.approx(120 * M + 360 * M)
    assert again["fraction_of_cloud_cost"] == round(added / (480 * M), 4)
    assert again["fraction_of_all_cloud_cost"] == round(added / (1200 * M), 4)
    assert again["skipped_by_budget"] == 0
    assert out["trajectories"][0]["turns_ending_local"] == 2


def test_a_turn_ending_on_tool_calls_is_not_re_written() -> None:
    replay = crafted(CONTEXT)
    cut = dataclasses.replace(replay, steps=replay.steps[:1], completion_tokens=(10,))
    local_plan = dataclasses.replace(cut, steps=(step(1, 0, "local", 100),))
    assert resynthesis_count(local_plan, PRICES).local_endings == 0  # its last message asks for a tool


@pytest.mark.parametrize("context", [FusionContext(mode="local"), FusionContext(cloud_share=0)])
def test_a_run_without_cloud_re_writes_nothing(context: FusionContext) -> None:
    count = resynthesis_count(crafted(context), PRICES)
    assert (count.local_endings, count.done, count.cost_usd) == (2, 0, 0.0)


def test_the_budget_skips_a_re_synthesis_counting_the_earlier_ones() -> None:
    # Turn 0 ends with 120 spent: estimate 230 + 100 x 2 = 430 fits 1200; done, costs 270 (spend 390).
    # Turn 1's cloud step adds 360 (750). Turn 2: estimate 430 + 200 = 630; 750 + 630 > 1200: skipped
    # (without the first re-synthesis' 270 it would fit: 480 + 630 = 1110).
    limited = dataclasses.replace(CONTEXT, thread_cloud_budget_usd=1200 * M)
    count = resynthesis_count(crafted(limited), PRICES)
    assert (count.done, count.skipped) == (1, 1)
    assert count.cost_usd == pytest.approx(270 * M)
    assert summarize([crafted(limited)], PRICES)["resynthesis"]["skipped_by_budget"] == 1
    # An unpriced replay ran without its budget: nothing is skipped.
    assert resynthesis_count(crafted(limited, priced=False), PRICES).skipped == 0
