"""Pure helpers of the KV-reuse benchmark (no server, no shared trace data)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from bench.kv.plan import PlannedStep, common_prefix_len, new_token_counts, plan_thread, route_trajectory
from bench.kv.report import format_table
from bench.kv.results import StepRecord, evaluate_targets, summarize, summarize_with_files
from bench.kv.reuse import parse_threads
from bench.kv.server import per_slot_ctx
from bench.traces import TraceError, Trajectory, assistant_positions, parse_trace_lines, select_quick
from fusion_graph.context import DEFAULTS


def _call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


TINY_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": "Plan: look.", "tool_calls": [_call("c1", "ls", {"path": "."})]},
    {"role": "tool", "content": "a.py b.py", "tool_call_id": "c1"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c2", "cat", {"path": "a.py"})]},
    {"role": "tool", "content": "print(1)", "tool_call_id": "c2"},
    {"role": "assistant", "content": "Done."},
    {"role": "user", "content": "Thanks, one more thing."},
    {"role": "assistant", "content": "Sure."},
]


def _tiny_trace(*ids: str) -> list[str]:
    return [json.dumps({"id": i, "source": "test", "license": "MIT", "messages": TINY_MESSAGES}) for i in ids]


def test_common_prefix_len() -> None:
    assert common_prefix_len([], [1, 2]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_len([1, 2], [1, 2]) == 2


def test_new_token_counts_first_counts_everything_then_only_the_new_tail() -> None:
    requests = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 7, 8], [1, 2, 7, 8]]
    assert new_token_counts(requests) == [3, 2, 2, 0]
    assert new_token_counts([]) == []


def test_parse_trace_lines_skips_blanks_and_keeps_line_numbers() -> None:
    lines = [_tiny_trace("x")[0], "", "  ", _tiny_trace("x")[0]]
    trajectories = parse_trace_lines(lines, file="swe-tiny")
    assert [t.line for t in trajectories] == [1, 4]
    assert trajectories[0].messages == tuple(TINY_MESSAGES)
    # the same trace id twice still gives two distinct threads
    assert len({t.thread_id for t in trajectories}) == 2
    assert trajectories[0].is_swe


@pytest.mark.parametrize(
    "line",
    ["not json", json.dumps({"id": "x"}), json.dumps({"messages": [{"content": "no role"}]})],
)
def test_parse_trace_lines_rejects_malformed_records(line: str) -> None:
    with pytest.raises(TraceError, match="tiny:1"):
        parse_trace_lines([line], file="tiny")


def test_assistant_positions() -> None:
    assert assistant_positions(TINY_MESSAGES) == [2, 4, 6, 8]


def test_route_trajectory_uses_the_turn_structure() -> None:
    routed = route_trajectory(TINY_MESSAGES, hysteresis=DEFAULTS["hysteresis"])
    assert [r.position for r in routed] == [2, 4, 6, 8]
    # step index restarts at each user message; step 0 (the plan) runs on cloud
    assert [r.step for r in routed] == [0, 1, 2, 0]
    assert [r.leg for r in routed] == ["cloud", "local", "local", "cloud"]
    assert all(r.estimate_tokens > 0 for r in routed)


def test_route_trajectory_at_cloud_share_zero_is_all_local() -> None:
    routed = route_trajectory(TINY_MESSAGES, hysteresis=0, cloud_share=0)
    assert {r.leg for r in routed} == {"local"}


def test_plan_thread_minimum_skips_cloud_steps() -> None:
    trajectory = Trajectory("t", 1, "x", tuple(TINY_MESSAGES))
    routed = route_trajectory(TINY_MESSAGES, hysteresis=DEFAULTS["hysteresis"])
    tokens = [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8]]
    plan = plan_thread(trajectory, routed, tokens)
    # local steps 1 and 2: the first counts all its tokens, the next only its new tail
    assert [(s.leg, s.n_tokens, s.minimum) for s in plan.steps] == [
        ("cloud", 2, 0),
        ("local", 4, 4),
        ("local", 6, 2),
        ("cloud", 8, 0),
    ]
    assert isinstance(plan.steps[0], PlannedStep)


def test_summarize_totals_and_diagnostics() -> None:
    records = [
        StepRecord("swe-a", "cloud", n_tokens=10, minimum=0, estimate_tokens=12),
        StepRecord("swe-a", "local", 20, 20, 21, prompt_n=20, cache_n=0, prompt_ms=5.0),
        StepRecord("swe-a", "local", 30, 10, 31, prompt_n=11, cache_n=19, prompt_ms=1.5),
        StepRecord("tau-b", "local", 40, 40, 41, prompt_n=30, cache_n=10, prompt_ms=2.0),
    ]
    leaf = summarize(records)
    assert leaf["processed_tokens"] == 61
    assert leaf["cached_tokens"] == 29
    assert leaf["minimum_tokens"] == 70
    assert leaf["efficiency"] == round(70 / 61, 4)
    assert leaf["prefill_ms"] == 8.5
    assert (leaf["local_steps"], leaf["cloud_steps"]) == (3, 1)
    assert (leaf["cloud_prompt_tokens"], leaf["cloud_prompt_tokens_estimate"]) == (10, 12)
    assert (leaf["excess_tokens"], leaf["excess_requests"], leaf["below_minimum_requests"]) == (1, 1, 1)
    assert leaf["token_mismatches"] == 0
    assert summarize([])["efficiency"] is None
    files = summarize_with_files(records)["files"]
    assert sorted(files) == ["swe-a", "tau-b"]
    assert files["swe-a"]["processed_tokens"] == 31


def _leaf(swe_processed: int, swe_minimum: int) -> dict[str, Any]:
    return {
        "files": {
            "swe-x": {"processed_tokens": swe_processed, "minimum_tokens": swe_minimum},
            "tau-y": {"processed_tokens": 10**9, "minimum_tokens": 1},
        }
    }


def test_evaluate_targets_judges_swe_files_only() -> None:
    variants = {
        "fusion": {"threads": {"1": _leaf(105, 100), "4": _leaf(120, 100)}},
        "hazard": {"threads": {"1": _leaf(600, 100), "4": _leaf(500, 100)}},
    }
    results = {(t.name, t.threads): t.holds for t in evaluate_targets(variants)}
    assert results == {("a", "1"): True, ("b", "1"): True, ("a", "4"): False, ("b", "4"): False}
    table = format_table(variants)
    assert "swe-x" in table and "fusion" in table


def test_evaluate_targets_without_swe_traces_is_not_applicable() -> None:
    variants: dict[str, Any] = {"fusion": {"threads": {"1": {"files": {"tau": {}}}}}}
    assert [t.holds for t in evaluate_targets(variants)] == [None]


def test_select_quick_takes_two_swe_and_three_others_per_file() -> None:
    swe = parse_trace_lines(_tiny_trace("a", "b", "c"), file="swe-agent")
    tau = parse_trace_lines(_tiny_trace("d", "e", "f", "g"), file="tau-airline")
    chosen = select_quick(swe + tau)
    assert [t.trace_id for t in chosen] == ["a", "b", "d", "e", "f"]


def test_parse_threads_and_slot_context() -> None:
    assert parse_threads("1,4") == [1, 4]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_threads("0")
    assert per_slot_ctx(100) == 256
    assert per_slot_ctx(7967) == 8192
