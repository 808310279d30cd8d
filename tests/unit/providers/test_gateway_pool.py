"""Several llama-server boxes behind a gateway: routing keys, per-box slots, discovery from the boxes.

The gateway and its boxes are fakes here (headers and ``/props`` on demand); the
real thing (two llama-servers behind ``smg``) is in ``tests/integration/test_gateway.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.errors import ContextError, LocalPoolMismatch
from fusion_graph.providers.slots import BoxSlots, routing_key
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input

WORKER_HEADER = "x-smg-routed-worker-id"


def props(model: str = "local", slots: int = 5, n_ctx: int = 4096) -> dict[str, Any]:
    """What llama-server's ``GET /props`` says (the fields the graph reads)."""
    return {
        "total_slots": slots,
        "model_alias": model,
        "model_path": f"/models/{model}.gguf",
        "default_generation_settings": {"n_ctx": n_ctx},
    }


def test_the_routing_key_is_stable_per_thread_and_hides_the_thread_id() -> None:
    assert routing_key("thread-1") == routing_key("thread-1")
    assert routing_key("thread-1") != routing_key("thread-2")
    assert "thread-1" not in routing_key("thread-1")
    assert len({routing_key(f"t{i}") for i in range(1000)}) == 1000


def test_first_requests_take_a_slot_free_on_the_boxes_a_new_key_may_land_on() -> None:
    """Wherever the gateway places a new key, its first request lands on no held slot while any is free."""
    slots = BoxSlots(5, boxes=("http://box-a:8080", "http://box-b:8080/v1"))  # 4 conversation slots each
    threads = [f"thread-{i}" for i in range(8)]
    first = []
    for index, thread in enumerate(threads):
        first.append(slots.slot_for(thread))
        assert slots.served(thread, "http://box-a:8080" if index % 2 == 0 else "http://box-b:8080") is None
    assert first[:4] == [0, 1, 2, 3]  # while a slot is free on every box, no first request shares one
    for box in ("http://box-a:8080", "http://box-b:8080"):
        on_box = [t for t in threads if slots.box_of(t) == box]
        held = [slots.slot_for(t) for t in on_box]
        assert sorted(held) == [0, 1, 2, 3]  # no two threads of a box share a slot
    assert slots.reflection_slot == 4


def test_concurrent_first_requests_do_not_share_a_slot() -> None:
    slots = BoxSlots(5, boxes=("http://a", "http://b"))
    assert [slots.slot_for(f"t{i}") for i in range(4)] == [0, 1, 2, 3]


def test_a_thread_the_gateway_moves_frees_its_slot_on_the_old_box() -> None:
    slots = BoxSlots(3)  # 2 conversation slots per box
    slots.served("a", "box-1")
    slots.served("b", "box-1")
    assert slots.served("a", "box-2") == "box-1"  # box-1 died: the gateway re-placed the key
    assert slots.box_of("a") == "box-2"
    slots.served("c", "box-1")
    assert {slots.slot_for("b"), slots.slot_for("c")} == {0, 1}  # a's old slot went to c


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"local_workers": ("box-1:8080",)}, "http:// or https://"),
        ({"local_workers": ("http://a:1", "http://a:1")}, "twice"),
        ({"local_routing_header": "x fusion"}, "HTTP header name"),
        ({"local_worker_header": "x-smg:id"}, "HTTP header name"),
    ],
)
def test_bad_gateway_settings_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, ContextError), match=message):
        FusionSettings(**values)


@pytest.fixture
def gateway() -> Iterator[tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI]]:
    """A cloud, a gateway that names the box it used, and two boxes that answer ``/props``."""
    with (
        FakeOpenAI([Reply(content="cloud")]) as cloud,
        FakeOpenAI([Reply(content="local answer", headers={WORKER_HEADER: "http://box-b:8080"})]) as gw,
        FakeOpenAI() as box_a,
        FakeOpenAI() as box_b,
    ):
        box_a.props, box_b.props = props(), props()
        yield cloud, gw, box_a, box_b


def pooled_settings(cloud: FakeOpenAI, gw: FakeOpenAI, *boxes: FakeOpenAI) -> FusionSettings:
    return FusionSettings(
        cloud_base_url=cloud.base_url,
        cloud_api_key="sk-test",
        local_base_url=gw.base_url,
        local_workers=tuple(box.base_url.removesuffix("/v1") for box in boxes),
        local_window_tokens=4096,
    )


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_local_requests_carry_the_routing_key_and_keep_their_slot_on_the_box_that_served(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI], how: str
) -> None:
    cloud, gw, box_a, box_b = gateway
    graph = build_graph(
        settings=pooled_settings(cloud, gw, box_a, box_b), tools=[], checkpointer=InMemorySaver()
    )
    config: Any = {"configurable": {"thread_id": "thread-7"}}
    context = FusionContext(mode="local", memory_mode="inline", sub_runners="off")
    for turn in range(2):
        if how == "ainvoke":
            await graph.ainvoke(user_input(f"hi {turn}"), config, context=context)
        else:
            async for _ in graph.astream(
                user_input(f"hi {turn}"), config, context=context, stream_mode="messages"
            ):
                pass
    state = (await graph.aget_state(config)).values
    records = state["route_log"]
    assert [r["extra"].get("box") for r in records] == ["http://box-b:8080"] * 2
    assert all("box_moved_from" not in r["extra"] for r in records)
    key = routing_key("thread-7")
    assert [h.get("x-fusion-thread") for h in gw.request_headers] == [key, key]
    assert len({body["id_slot"] for body in gw.requests}) == 1  # the same slot on its box, turn after turn
    assert all(body["id_slot"] != 4 for body in gw.requests)  # the reflection slot stays reserved
    assert cloud.requests == []  # mode=local: nothing went to cloud
    assert all("served_by" not in str(m.response_metadata.get("headers", "")) for m in state["messages"])
    assert all("headers" not in m.response_metadata for m in state["messages"])  # only the box is kept


async def test_a_box_move_is_recorded_on_the_step_that_found_its_cache_cold(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI],
) -> None:
    cloud, gw, box_a, box_b = gateway
    gw.script(
        [
            Reply(content="first", headers={WORKER_HEADER: "http://box-a:8080"}),
            Reply(content="second", headers={WORKER_HEADER: "http://box-b:8080"}),
        ]
    )
    graph = build_graph(
        settings=pooled_settings(cloud, gw, box_a, box_b), tools=[], checkpointer=InMemorySaver()
    )
    config: Any = {"configurable": {"thread_id": "t"}}
    context = FusionContext(mode="local", memory_mode="inline", sub_runners="off")
    await graph.ainvoke(user_input("one"), config, context=context)
    out = await graph.ainvoke(user_input("two"), config, context=context)
    assert out["route_log"][-1]["extra"]["box"] == "http://box-b:8080"
    assert out["route_log"][-1]["extra"]["box_moved_from"] == "http://box-a:8080"


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_boxes_that_disagree_stop_the_first_step_with_a_clear_error(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI], how: str
) -> None:
    cloud, gw, box_a, box_b = gateway
    box_b.props = props(slots=3)
    graph = build_graph(settings=pooled_settings(cloud, gw, box_a, box_b), tools=[])
    context = FusionContext(mode="local", memory_mode="inline", sub_runners="off")
    with pytest.raises(LocalPoolMismatch, match="same model with the same -np") as raised:
        if how == "ainvoke":
            await graph.ainvoke(user_input("hi"), context=context)
        else:
            async for _ in graph.astream(user_input("hi"), context=context, stream_mode="messages"):
                pass
    assert "5 slots" in str(raised.value) and "3 slots" in str(raised.value)
    assert gw.requests == []  # nothing was sent


async def test_without_a_routing_header_no_header_is_sent(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI],
) -> None:
    cloud, gw, box_a, box_b = gateway
    settings = pooled_settings(cloud, gw, box_a, box_b).model_copy(update={"local_routing_header": ""})
    graph = build_graph(settings=settings, tools=[])
    await graph.ainvoke(user_input("hi"), context=FusionContext(mode="local", sub_runners="off"))
    assert "x-fusion-thread" not in gw.request_headers[0]


def test_with_every_slot_held_two_new_threads_do_not_start_on_one_slot() -> None:
    slots = BoxSlots(3, boxes=("http://a",))  # 2 conversation slots
    for thread in ("t0", "t1"):
        slots.slot_for(thread)
        slots.served(thread, "http://a")
    assert slots.slot_for("t2") != slots.slot_for("t3")  # both first requests still in flight
