"""Many more threads than slots through the graph: no request ever names a slot another one runs on.

llama-server takes a request naming a busy slot as that slot's and, with its host
prompt cache on, loads a cached prompt into the slot before deferring the
request: the generation running there is corrupted (``coordination.slot_turns``).
The fake llama-server here counts every request that arrives naming a slot
another request in flight named, and every moment an unnamed request (which
llama-server puts on any idle slot) runs beside a named one. The real server and
the answers themselves are compared in ``tests/integration/test_crowd_answers.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from fusion_graph import FusionContext
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.served import graph_over, turn_state

#: Conversation slots of the fake server: ``local_slots`` 4, the last kept for memory jobs.
CONVERSATION_SLOTS = 3
LOCAL = FusionContext(mode="local", sub_runners="off", max_completion_tokens=16)


@pytest.fixture
def crowd() -> Iterator[tuple[FakeOpenAI, FakeOpenAI]]:
    """A cloud nobody should reach, and a slow llama-server with 4 slots (requests overlap in time)."""

    def answer(body: dict[str, Any]) -> Reply:
        last = body["messages"][-1]
        if last["role"] == "tool":  # the lookup came back: finish the turn
            return Reply(content="done", delay=0.02)
        return Reply(content="", tool_calls=[("lookup", {"key": "k"})], delay=0.02)

    with FakeOpenAI([Reply(content="cloud")]) as cloud, FakeOpenAI(answer) as local:
        local.props = {"total_slots": 4, "default_generation_settings": {"n_ctx": 4096}}
        yield cloud, local


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_ten_times_the_slots_in_threads_never_share_a_slot_in_flight(
    crowd: tuple[FakeOpenAI, FakeOpenAI], how: str
) -> None:
    cloud, local = crowd
    graph = graph_over(cloud, local, local_slots=4, request_timeout=30)
    threads = [f"crowd-{i}" for i in range(10 * CONVERSATION_SLOTS)]

    async def two_turns(thread: str) -> dict[str, Any]:
        config: Any = {"configurable": {"thread_id": thread}}
        await turn_state(graph, "first", how, LOCAL, config)
        return await turn_state(graph, "second", how, LOCAL, config)

    states = await asyncio.gather(*(two_turns(t) for t in threads))

    asked = [body for body in local.requests if "model" in body]
    assert len(asked) == len(threads) * 2 * 2  # two turns of two steps each, all local
    assert cloud.requests == []
    assert local.slot_overlaps == 0
    assert local.unnamed_beside_named == 0
    assert all(isinstance(body.get("id_slot"), int) for body in asked)  # guests name a slot too
    assert {body["id_slot"] for body in asked} <= set(range(CONVERSATION_SLOTS))
    records = [r for state in states for r in state["route_log"]]
    assert all(r["leg"] == "local" and r["provider"] is not None for r in records)
    guests = Counter(bool(r.get("placement", {}).get("guest")) for r in records)
    assert guests[True] > 0, "with 10x the slots in threads some requests must have been guests"


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_request_the_client_gave_up_on_keeps_its_slot_until_the_server_shows_it_idle(
    how: str,
) -> None:
    """A client-side timeout falls over at once; the slot's next request waits for the server to finish."""

    def answer(body: dict[str, Any]) -> Reply:
        slow = "slow" in json.dumps(body["messages"][-1])
        return Reply(content="local answer", delay=1.5 if slow else 0.0)

    with FakeOpenAI([Reply(content="cloud answer")]) as cloud, FakeOpenAI(answer) as local:
        local.props = {
            "total_slots": 2,
            "default_generation_settings": {"n_ctx": 4096},
        }  # one conversation slot
        graph = graph_over(cloud, local, request_timeout=0.5)
        context = FusionContext(mode="fusion", cloud_share=0, sub_runners="off", max_completion_tokens=16)
        first = await turn_state(graph, "slow question", how, context, {"configurable": {"thread_id": "a"}})
        second = await turn_state(graph, "quick question", how, context, {"configurable": {"thread_id": "b"}})
    plan_a, plan_b = first["route_log"][0], second["route_log"][0]
    assert (plan_a["routed_leg"], plan_a["leg"]) == ("local", "cloud")  # timed out, fell over
    assert plan_a["attempts"][0]["kind"] == "timeout"
    assert (plan_b["leg"], plan_b["slot"]) == ("local", 0)  # the same slot, once the server let it go
    assert local.slot_overlaps == 0  # b's request did not meet a's, still running on the server
