"""Slot affinity: the slot pool, the request-body rule, and slot discovery."""

from __future__ import annotations

from typing import TypedDict

import pytest
from langchain_openai import ChatOpenAI

from fusion_graph import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.placement import slot_body
from fusion_graph.providers.slots import SlotPool
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.llama_server import free_port
from tests.plugins.fakes import user_input


def test_a_thread_keeps_its_slot_and_the_preferred_slot_is_stable_across_pools() -> None:
    first, restarted = SlotPool(8), SlotPool(8)
    slots = {f"thread-{i}": first.slot_for(f"thread-{i}") for i in range(3)}
    assert all(first.slot_for(t) == s for t, s in slots.items())  # same across steps
    # A new process (a new pool) gives a thread its hash-preferred slot.
    assert (
        restarted.slot_for("thread-0")
        == first.preferred_slot("thread-0")
        == restarted.preferred_slot("thread-0")
    )


def test_live_threads_never_share_a_slot_while_slots_remain() -> None:
    pool = SlotPool(5)  # 4 conversation slots + 1 reserved
    threads = [f"t{i}" for i in range(40)]
    colliding = [t for t in threads if pool.preferred_slot(t) == pool.preferred_slot(threads[0])][:2]
    assert len(colliding) == 2, "need two threads that hash to the same slot"
    a, b = (pool.slot_for(t) for t in colliding)
    assert a != b
    assert {a, b} <= set(range(pool.conversation_slots))


def test_least_recently_used_thread_gives_up_its_slot_when_all_are_taken() -> None:
    pool = SlotPool(3, reserve_reflection=True)  # slots 0 and 1 for conversations, 2 reserved
    first, second = pool.slot_for("first"), pool.slot_for("second")
    pool.slot_for("first")  # first is now the most recent
    third = pool.slot_for("third")
    assert third == second and third != pool.reflection_slot
    assert pool.slot_for("first") == first
    pool.release("third")
    assert pool.slot_for("fourth") == second


@pytest.mark.parametrize(
    ("total", "reserve", "conversations", "reflection"), [(4, True, 3, 3), (4, False, 4, 3), (1, True, 1, 0)]
)
def test_reflection_slot_is_reserved(total: int, reserve: bool, conversations: int, reflection: int) -> None:
    pool = SlotPool(total, reserve_reflection=reserve)
    assert (pool.conversation_slots, pool.reflection_slot) == (conversations, reflection)
    if reserve and total > 1:
        assert all(pool.slot_for(f"t{i}") != reflection for i in range(50))


def test_invalid_pool() -> None:
    with pytest.raises(ValueError, match="total_slots must be >= 1"):
        SlotPool(0)


def test_slot_fields_follow_the_routed_leg() -> None:
    assert slot_body("local", 2) == {"id_slot": 2, "cache_prompt": True}
    assert slot_body("cloud", 2) is None
    assert slot_body("local", None) is None


class FakeModels(TypedDict):
    cloud_model: ChatOpenAI
    local_model: ChatLlamaServer


def fake_models(cloud: FakeOpenAI, local: FakeOpenAI) -> FakeModels:
    return {
        "cloud_model": ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
        "local_model": ChatLlamaServer(model="l", base_url=local.base_url, api_key="x", max_retries=0),
    }


async def test_a_local_server_that_is_not_llama_server_runs_without_slot_affinity() -> None:
    with FakeOpenAI([Reply(content="plan")]) as cloud, FakeOpenAI([Reply(content="local answer")]) as local:
        graph = build_graph(**fake_models(cloud, local), tools=[])
        # local_slots=0 asks GET /props, which this server answers 404.
        out = await graph.ainvoke(user_input("hi"), context=FusionContext(mode="local"))
    assert out["route_log"][0]["leg"] == "local" and out["route_log"][0]["slot"] is None
    assert "id_slot" not in local.requests[0] and "cache_prompt" not in local.requests[0]


async def test_an_unreachable_local_server_falls_over_instead_of_failing_slot_discovery() -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with FakeOpenAI([Reply(content="cloud answer")]) as cloud:
        graph = build_graph(
            cloud_model=ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
            local_model=ChatLlamaServer(model="l", base_url=dead, api_key="x", max_retries=0, timeout=2),
            tools=[],
            settings=FusionSettings(cross_leg_fallover=True),  # mode=local may fall over to cloud
        )
        out = await graph.ainvoke(user_input("hi"), context=FusionContext(mode="local"))
    record = out["route_log"][0]
    assert (record["routed_leg"], record["leg"]) == ("local", "cloud")
    assert record["attempts"][0]["kind"] == "connection"
    assert "id_slot" not in cloud.requests[0]


async def test_an_unreachable_local_server_is_logged_once_per_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{port}/v1"
    replies = [Reply(content=f"cloud answer {i}") for i in range(3)]
    with FakeOpenAI(replies) as cloud:
        graph = build_graph(
            cloud_model=ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
            local_model=ChatLlamaServer(model="l", base_url=dead, api_key="x", max_retries=0, timeout=2),
            tools=[],
            settings=FusionSettings(cross_leg_fallover=True),
        )
        with caplog.at_level("WARNING", logger="fusion_graph"):
            for _ in range(3):
                out = await graph.ainvoke(user_input("hi"), context=FusionContext(mode="local"))
                assert out["route_log"][0]["leg"] == "cloud"
    said = [r.getMessage() for r in caplog.records if "no slot or window" in r.getMessage()]
    assert len(said) == 1, said
    assert f"127.0.0.1:{port}/props" in said[0] and "start one with" in said[0]
