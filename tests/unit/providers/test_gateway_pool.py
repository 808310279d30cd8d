"""Several llama-server boxes (``local_workers``): one lease rule places each thread on a box and slot.

Requests go straight to the box the thread's lease names (a gateway cannot be
told which box to use); a box that refuses connections is left out and its
threads move. The boxes are fakes here (``/props`` and ``/slots`` on demand); the
real thing (two llama-servers behind ``smg``) is in ``tests/integration/test_gateway.py``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.errors import ContextError, LocalPoolMismatch
from fusion_graph.providers.slots import routing_key
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input


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
    """A cloud, a gateway in front, and two boxes that answer ``/props``, ``/slots`` and chat requests."""
    with (
        FakeOpenAI([Reply(content="cloud")]) as cloud,
        FakeOpenAI([Reply(content="gateway answer")]) as gw,
        FakeOpenAI([Reply(content="answer from a")]) as box_a,
        FakeOpenAI([Reply(content="answer from b")]) as box_b,
    ):
        box_a.props, box_b.props = props(), props()
        yield cloud, gw, box_a, box_b


def pooled_settings(cloud: FakeOpenAI, gw: FakeOpenAI, *boxes: str) -> FusionSettings:
    return FusionSettings(
        cloud_base_url=cloud.base_url,
        cloud_api_key="sk-test",
        local_base_url=gw.base_url,
        local_workers=boxes,
        local_window_tokens=4096,
        request_timeout=10,
    )


def box(fake: FakeOpenAI) -> str:
    return fake.base_url.removesuffix("/v1")


def chats(fake: FakeOpenAI) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """The chat requests a box got, with their headers (the prompt counts left out)."""
    return [(b, h) for b, h in zip(fake.requests, fake.request_headers, strict=True) if "model" in b]


async def run_turn(graph: Any, thread: str, text: str, how: str) -> dict[str, Any]:
    config: Any = {"configurable": {"thread_id": thread}}
    context = FusionContext(mode="local", memory_mode="inline", sub_runners="off")
    if how == "ainvoke":
        await graph.ainvoke(user_input(text), config, context=context)
    else:
        async for _ in graph.astream(user_input(text), config, context=context, stream_mode="messages"):
            pass
    values: dict[str, Any] = (await graph.aget_state(config)).values
    return values


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_local_requests_go_straight_to_the_box_their_lease_names_and_keep_their_slot(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI], how: str
) -> None:
    cloud, gw, box_a, box_b = gateway
    graph = build_graph(
        settings=pooled_settings(cloud, gw, box(box_a), box(box_b)), tools=[], checkpointer=InMemorySaver()
    )
    for turn in range(2):
        state = await run_turn(graph, "thread-7", f"hi {turn}", how)
    other = await run_turn(graph, "thread-8", "hello", how)  # the box with the fewest threads
    records = state["route_log"]
    assert [r.get("placement", {}).get("box") for r in records] == [box(box_a)] * 2
    assert other["route_log"][-1]["placement"]["box"] == box(box_b)
    assert all("moved_from" not in r.get("placement", {}) for r in records)
    key = routing_key("thread-7")
    assert [h.get("x-fusion-thread") for _, h in chats(box_a)] == [key, key]
    assert len({body["id_slot"] for body, _ in chats(box_a)}) == 1  # the same slot, turn after turn
    assert all(body["id_slot"] != 4 for body, _ in chats(box_a))  # the reflection slot stays reserved
    assert gw.requests == [] and cloud.requests == []  # mode=local: straight to the boxes
    # Each box's slots were warmed once on first contact, one short request naming each slot.
    assert sorted(body["id_slot"] for body in box_a.completions) == [0, 1, 2, 3, 4]
    assert sorted(body["id_slot"] for body in box_b.completions) == [0, 1, 2, 3, 4]
    assert all("headers" not in m.response_metadata for m in state["messages"])


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_box_that_refuses_connections_moves_its_threads_and_the_step_completes_locally(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI], how: str
) -> None:
    cloud, gw, _, box_b = gateway
    with socket.socket() as sock:  # a port nothing listens on: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    graph = build_graph(
        settings=pooled_settings(cloud, gw, dead, box(box_b)), tools=[], checkpointer=InMemorySaver()
    )
    state = await run_turn(graph, "t", "one", how)
    record = state["route_log"][-1]
    assert record["leg"] == "local" and record["provider"] is not None  # no fallover to cloud
    assert record["placement"]["box"] == box(box_b)
    assert record["placement"]["moved_from"] == dead
    assert cloud.requests == [] and len(chats(box_b)) == 1


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_boxes_that_disagree_stop_the_first_step_with_a_clear_error(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI], how: str
) -> None:
    cloud, gw, box_a, box_b = gateway
    box_b.props = props(slots=3)
    graph = build_graph(settings=pooled_settings(cloud, gw, box(box_a), box(box_b)), tools=[])
    context = FusionContext(mode="local", memory_mode="inline", sub_runners="off")
    with pytest.raises(LocalPoolMismatch, match="same model with the same -np") as raised:
        if how == "ainvoke":
            await graph.ainvoke(user_input("hi"), context=context)
        else:
            async for _ in graph.astream(user_input("hi"), context=context, stream_mode="messages"):
                pass
    assert "5 slots" in str(raised.value) and "3 slots" in str(raised.value)
    assert gw.requests == [] and chats(box_a) == chats(box_b) == []  # nothing was sent


async def test_without_a_routing_header_no_header_is_sent(
    gateway: tuple[FakeOpenAI, FakeOpenAI, FakeOpenAI, FakeOpenAI],
) -> None:
    cloud, gw, box_a, box_b = gateway
    settings = pooled_settings(cloud, gw, box(box_a), box(box_b))
    graph = build_graph(settings=settings.model_copy(update={"local_routing_header": ""}), tools=[])
    await graph.ainvoke(user_input("hi"), context=FusionContext(mode="local", sub_runners="off"))
    assert "x-fusion-thread" not in chats(box_a)[0][1]
