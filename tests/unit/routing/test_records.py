"""Route records written before the sub-records: the package's keys in ``extra`` still read."""

from __future__ import annotations

from typing import Any, cast

from fusion_graph.cli.agreement import agreement
from fusion_graph.cli.report import budget_summary
from fusion_graph.memory.job_log import folded_keys
from fusion_graph.nodes.shadow import shadow_key
from fusion_graph.replay.labels import shadow_labels
from fusion_graph.routing.records import RouteRecord, make_record, placement_of, upgraded
from fusion_graph.routing.score import RouteDecision, StepSignals


def old(kind: str, **extra: Any) -> RouteRecord:
    """A record as versions before the sub-records wrote it: every package key in ``extra``."""
    record = make_record(
        turn=0, step=1, kind=cast(Any, kind), decision=RouteDecision("local", None, 50.0, "score 3 < 50")
    )
    record |= {"leg": "local", "provider": "local:l", "extra": extra}
    return record


SHADOW = {
    "key": "t:0:1",
    "of_step": 1,
    "score": 3,
    "local_action": {"reply": True},
    "agrees": False,
    "cloud_action": {"reply": True},
    "cost_usd": 0.001,
}


def test_a_steps_old_keys_move_to_their_sub_records_and_a_users_key_stays() -> None:
    record = old(
        "step",
        estimated_prompt_tokens=900,
        estimate_basis="server",
        window=4096,
        max_tokens=512,
        fit="prompt 900 + 512 fits the local window",
        compaction={
            "cleared_tool_outputs": 1,
            "removed_messages": 0,
            "freed_tokens": 40,
            "need_tokens": 30,
            "times": 1,
        },
        cloud_step_usd=0.002,
        cloud_max_tokens=300,
        cloud_budget="turn budget spent",
        placement="shared",
        box="http://box-a",
        box_moved_from="http://box-b",
        guest=True,
        latency_s=1.5,
        probe=False,
        mine="kept",
    )
    new = upgraded(record)
    assert new["sizing"] == {
        "estimate": 900,
        "estimate_basis": "server",
        "window": 4096,
        "max_tokens": 512,
        "fit": "prompt 900 + 512 fits the local window",
        "compaction": {
            "cleared_tool_outputs": 1,
            "removed_messages": 0,
            "freed_tokens": 40,
            "need_tokens": 30,
            "times": 1,
        },
    }
    assert new["budget"] == {"step_usd": 0.002, "max_tokens": 300, "over": "turn budget spent"}
    assert new["placement"] == {
        "lease": "shared",
        "box": "http://box-a",
        "moved_from": "http://box-b",
        "guest": True,
    }
    assert new["outcome"] == {"latency_s": 1.5, "probe": False}
    assert new["extra"] == {"mine": "kept"}, "a key the package never wrote is the user's"
    assert placement_of(new) == "guest"
    assert record["extra"]["box"] == "http://box-a", "the stored record itself is not changed"


def test_side_inferences_old_keys_move_by_kind() -> None:
    memory = upgraded(
        old("memory", job="facts", job_key="t:0:1", attempt=2, stored=1, dropped=None, outcome="stored")
    )
    assert memory["memory"] == {
        "job": "facts",
        "job_key": "t:0:1",
        "attempt": 2,
        "stored": 1,
        "dropped": None,
        "outcome": "stored",
    }
    assert "outcome" not in memory, "a memory job's outcome is the job's, not the inference's"
    failed = upgraded(
        old("sampling", thread_id="t", in_run=True, max_tokens=100, outcome="failed", error="boom")
    )
    assert failed["sampling"] == {"thread_id": "t", "in_run": True}
    assert (failed["sizing"], failed["outcome"]) == (
        {"max_tokens": 100},
        {"status": "failed", "error": "boom"},
    )
    synthesis = upgraded(old("synthesis", draft="local draft", draft_id="m1", skipped="cloud is down"))
    assert synthesis["synthesis"] == {"draft": "local draft", "draft_id": "m1", "skipped": "cloud is down"}
    assert upgraded(old("shadow", shadow=SHADOW))["shadow"] == SHADOW
    assert upgraded(old("step", thread_id="t"))["extra"] == {"thread_id": "t"}, "only a sample's key moves"


def test_a_new_record_is_returned_as_it_is() -> None:
    record = old("step", mine="kept")
    record["sizing"] = {"estimate": 10}
    assert upgraded(record) is record


def test_the_readers_of_stored_logs_read_old_records() -> None:
    shadow = old("shadow", shadow=SHADOW)
    assert shadow_key(shadow) == "t:0:1"
    assert agreement([shadow])["checked"] == 1
    step = old("step")
    step["signals"] = dict(vars(StepSignals(900, 4096, 1, 25, False, 0, 100)))
    [label] = shadow_labels({"t": [step, shadow]})
    assert label.agrees is False
    assert folded_keys([old("memory", job_key="t:0:1")]) == {"t:0:1"}
    assert budget_summary([old("synthesis", skipped="over budget")])["synthesis_skipped"] == 1
