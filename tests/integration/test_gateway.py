"""The graph over two real llama-server boxes (``local_workers``), with a real ``smg`` gateway in front.

The local leg points at the gateway; ``local_workers`` names the boxes. The
graph places each thread on a box and slot by its lease rule and sends its
requests straight to that box (a gateway cannot be told which box to use), so
each thread finds its own history in its box's cache and memory jobs follow the
thread; when a box stops, its threads move to the other and their next turns
complete, on the local leg.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.store.memory import InMemoryStore

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.routing.records import RouteRecord
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input
from tests.plugins.pool import POOL_MODEL, POOL_SLOTS, LlamaPool

#: Every step runs on the local leg (the plan too); short answers keep the tiny model quick.
LOCAL = FusionContext(mode="local", max_completion_tokens=16, memory_mode="inline", memory_max_tokens=32)


def pooled_graph(pool: LlamaPool, cloud: FakeOpenAI, *, store: InMemoryStore | None = None) -> Any:
    settings = FusionSettings(
        local_base_url=pool.gateway.openai_base_url,
        local_workers=pool.worker_urls,
        local_model=POOL_MODEL,
        cloud_base_url=cloud.base_url,
        cloud_api_key="sk-test",
        request_timeout=60,
    )
    return build_graph(settings=settings, tools=[], checkpointer=InMemorySaver(), store=store)


async def turn(graph: Any, thread: str, text: str, context: FusionContext = LOCAL) -> list[RouteRecord]:
    config: Any = {"configurable": {"thread_id": thread}}
    await graph.ainvoke(user_input(text), config, context=context)
    log: list[RouteRecord] = (await graph.aget_state(config)).values["route_log"]
    return log


def steps(log: list[RouteRecord]) -> list[RouteRecord]:
    return [r for r in log if r["kind"] != "memory"]


async def test_eight_threads_spread_over_both_boxes_and_each_finds_its_history_in_its_boxs_cache(
    llama_pool: LlamaPool,
) -> None:
    with FakeOpenAI([Reply(content="cloud")]) as cloud:
        graph = pooled_graph(llama_pool, cloud, store=InMemoryStore())
        threads = [f"pooled-thread-{i}" for i in range(8)]
        await asyncio.gather(
            *(turn(graph, t, f"{t}: please summarise the design of the pooled deployment") for t in threads)
        )
        logs = await asyncio.gather(*(turn(graph, t, f"{t}: and what about failures?") for t in threads))
    assert cloud.requests == []
    box_of: dict[str, str] = {}
    for thread, log in zip(threads, logs, strict=True):
        first, second = steps(log)
        assert first["placement"]["box"] == second["placement"]["box"], thread  # the thread stayed on its box
        assert "moved_from" not in second["placement"]
        box_of[thread] = first["placement"]["box"]
        # The second turn's prompt starts with the whole first one: all of it came from the box's cache.
        assert first["prompt_tokens"] is not None and second["cached_tokens"] is not None
        assert second["cached_tokens"] >= first["prompt_tokens"] - 1, (thread, first, second)
        assert first["slot"] is not None and first["slot"] != POOL_SLOTS - 1  # reflection slot reserved
        # Memory jobs carry the thread's key: they ran on its box, on the reserved slot.
        jobs = [r for r in log if r["kind"] == "memory" and r["provider"] is not None]
        assert jobs, thread
        assert {r["placement"]["box"] for r in jobs} == {box_of[thread]}
        assert {r["slot"] for r in jobs} == {POOL_SLOTS - 1}
    served = Counter(box_of.values())
    assert set(served) == {llama_pool.box(url).base_url for url in served}
    assert sorted(served.values()) == [4, 4], served  # the box with the fewest threads takes the next
    # No two threads of a box shared a slot, so 8 of 8 found their own prefix.
    assert len({(box_of[t], steps(log)[0]["slot"]) for t, log in zip(threads, logs, strict=True)}) == 8


async def test_a_stopped_box_moves_its_threads_and_their_next_turns_complete(
    own_llama_pool: LlamaPool,
) -> None:
    pool = own_llama_pool
    context = FusionContext(mode="local", max_completion_tokens=16, sub_runners="off")
    with FakeOpenAI([Reply(content="cloud")]) as cloud:
        graph = pooled_graph(pool, cloud)
        threads = [f"failover-{i}" for i in range(4)]
        first = {t: steps(await turn(graph, t, f"{t}: first question", context))[-1] for t in threads}
        boxes = {record["placement"]["box"] for record in first.values()}
        assert len(boxes) == 2, first
        dead = first[threads[0]]["placement"]["box"]
        pool.box(dead).stop()
        second = {t: steps(await turn(graph, t, f"{t}: second question", context))[-1] for t in threads}
    assert cloud.requests == []  # mode=local: the other box answered, not cloud
    for thread in threads:
        record = second[thread]
        assert record["provider"] is not None and record["leg"] == "local", record
        assert record["placement"]["box"] != dead
        if first[thread]["placement"]["box"] == dead:  # moved: one cold step, recorded
            assert record["placement"]["moved_from"] == dead
        else:
            assert "moved_from" not in record["placement"]
            before, cached = first[thread]["prompt_tokens"], record["cached_tokens"]
            assert before is not None and cached is not None and cached >= before - 1
