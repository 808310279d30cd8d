"""Pure helpers of ``bench.kv.reuse --gateway`` (no gateway, no server, no shared trace data)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.kv.gateway import (
    BOX_SLOTS,
    GATEWAY_DEFAULT_VARIANTS,
    GATEWAY_VARIANTS,
    ROUTING_HEADER,
    GatewayStep,
    choose_variants,
    evaluate_gateway_targets,
    format_gateway_table,
    format_gateway_targets,
    summarize_gateway,
)
from bench.kv.results import StepRecord
from bench.kv.reuse import parse_args
from bench.kv.threads import gateway_threads, mark_copy
from bench.traces import Trajectory
from fusion_graph.providers.slots import routing_key

MESSAGES: tuple[dict[str, Any], ...] = (
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": "Looking."},
    {"role": "user", "content": "More."},
)


def test_gateway_arguments_have_their_own_defaults() -> None:
    args = parse_args(["--gateway"])
    assert args.gateway
    assert args.threads == [8]
    assert args.variants == "manual_min_group,cache_aware,round_robin"
    assert args.box_slots == BOX_SLOTS == 9
    assert GATEWAY_DEFAULT_VARIANTS == ("manual_min_group", "cache_aware", "round_robin")
    plain = parse_args([])
    assert not plain.gateway
    assert plain.threads == [1, 4]
    assert plain.variants == "fusion,hazard,no_hysteresis"
    chosen = parse_args(["--gateway", "--threads", "4,8", "--variants", "round_robin", "--box-slots", "6"])
    assert (chosen.threads, chosen.variants, chosen.box_slots) == ([4, 8], "round_robin", 6)


def test_choose_variants_keeps_order_and_rejects_unknown_names() -> None:
    assert [v.name for v in choose_variants("round_robin, manual_min_group,round_robin")] == [
        "round_robin",
        "manual_min_group",
    ]
    with pytest.raises(SystemExit, match="fusion"):
        choose_variants("fusion")
    with pytest.raises(SystemExit):
        choose_variants(" , ")


def test_only_the_manual_variant_sends_a_routing_key_and_no_variant_names_a_slot() -> None:
    by_name = {v.name: v for v in GATEWAY_VARIANTS}
    manual = by_name["manual_min_group"]
    assert manual.gateway_flags() == [
        "--policy",
        "manual",
        "--assignment-mode",
        "min_group",
        "--routing-key-headers",
        ROUTING_HEADER,
    ]
    assert manual.request("thread-a") == ({ROUTING_HEADER: routing_key("thread-a")}, {"cache_prompt": True})
    for name in ("cache_aware", "round_robin"):
        variant = by_name[name]
        assert variant.gateway_flags() == ["--policy", name]
        assert variant.request("thread-a") == ({}, {"cache_prompt": True})


def test_threads_cycle_over_trajectories_and_copies_differ_after_the_system_prompt() -> None:
    bases = [Trajectory("swe-x", line, f"id{line}", MESSAGES) for line in (1, 2, 3)]
    threads = gateway_threads(bases, 8)
    assert len({t.thread_id for t in threads}) == 8
    assert threads[:3] == bases
    assert threads[3].trace_id == "id1#copy1" and threads[6].trace_id == "id1#copy2"
    assert threads[3].messages[0] == MESSAGES[0]
    assert threads[3].messages[1]["content"] == "[copy 1] Fix the bug."
    assert threads[3].messages[3] == MESSAGES[3]  # only the first user message is marked
    assert mark_copy(MESSAGES, 0) == MESSAGES
    listed = mark_copy([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], 2)
    assert listed[0]["content"][0] == {"type": "text", "text": "[copy 2] "}
    with pytest.raises(ValueError):
        gateway_threads([], 2)


def _local(thread: str, box: int, prompt_n: int, cache_n: int, minimum: int, position: int) -> GatewayStep:
    record = StepRecord("swe-x", "local", prompt_n + cache_n, minimum, 0, prompt_n=prompt_n, cache_n=cache_n)
    return GatewayStep(record, thread, position, box)


def test_summary_counts_threads_per_box_moves_and_excess() -> None:
    steps = [
        GatewayStep(StepRecord("swe-x", "cloud", 50, 0, 40), "a", 2, None),
        _local("a", 0, 100, 0, 100, 4),
        _local("a", 0, 10, 100, 10, 6),
        _local("b", 1, 80, 0, 80, 4),
        _local("b", 0, 90, 0, 10, 6),  # moved, and lost its cache
    ]
    leaf = summarize_gateway(steps, 2)
    assert (leaf["processed_tokens"], leaf["cached_tokens"], leaf["minimum_tokens"]) == (280, 100, 200)
    assert leaf["processed_over_minimum"] == 1.4
    assert (leaf["local_steps"], leaf["cloud_steps"]) == (4, 1)
    assert leaf["threads_per_box"] == [2, 1]
    assert leaf["box_moves"] == 1 and leaf["threads_on_several_boxes"] == 1
    assert leaf["boxes"][1] == {"threads": 1, "requests": 1, "processed_tokens": 80, "cached_tokens": 0}
    assert leaf["excess_detail"] == [
        {"thread": "b", "position": 6, "box": 0, "prompt_n": 90, "cache_n": 0, "minimum": 10}
    ]
    assert summarize_gateway([], 2)["processed_over_minimum"] is None


def test_table_and_target() -> None:
    good = {"processed_tokens": 1033, "cached_tokens": 5000, "minimum_tokens": 1000}
    variants: dict[str, Any] = {
        "manual_min_group": {
            "threads": {
                "8": {**good, "processed_over_minimum": 1.033, "threads_per_box": [4, 4], "wall_s": 14.04},
                "4": {**good, "processed_over_minimum": 1.2, "threads_per_box": [3, 1], "wall_s": 9.0},
            }
        },
        "round_robin": {"threads": {"8": {"processed_over_minimum": 1.938, "threads_per_box": [8, 8]}}},
    }
    table = format_gateway_table(variants).splitlines()
    assert table[0].split()[:2] == ["variant", "thr"] and "threads per box" in table[0]
    assert len(table) == 2 + 3
    row = table[2]
    assert row.startswith("manual_min_group") and "1.033" in row and "4 / 4" in row and "14.0" in row
    assert "1,033" in row and "5,000" in row
    assert "-" in table[4].split()  # missing fields print as "-"
    targets = evaluate_gateway_targets(variants)
    assert [(t.threads, t.holds) for t in targets] == [("8", True), ("4", False)]
    lines = format_gateway_targets(targets).splitlines()
    assert "HOLDS" in lines[0] and "FAILS" in lines[1]
    assert evaluate_gateway_targets({"cache_aware": {"threads": {}}}) == []
