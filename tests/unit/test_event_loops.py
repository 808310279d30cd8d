"""One compiled graph serves any event loop: ``asyncio.run`` per OS thread, as web apps and notebooks do."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.providers.chain import classify
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input


@pytest.fixture
def servers() -> Iterator[tuple[FakeOpenAI, FakeOpenAI]]:
    with (
        FakeOpenAI([Reply(content="cloud answer")]) as cloud,
        FakeOpenAI([Reply(content="local answer")]) as local,
    ):
        yield cloud, local


def test_one_graph_from_four_event_loops_completes_every_turn(servers: tuple[FakeOpenAI, FakeOpenAI]) -> None:
    cloud, local = servers
    settings = FusionSettings(
        cloud_base_url=cloud.base_url, cloud_api_key="sk-test-loops-0000", local_base_url=local.base_url
    )
    graph = build_graph(settings=settings, tools=[])
    context = FusionContext(sub_runners="off")
    done: list[str] = []
    failed: list[BaseException] = []

    async def turns(worker: int) -> None:
        for turn in range(8):
            config: Any = {"configurable": {"thread_id": f"w{worker}-t{turn}"}}
            out = await graph.ainvoke(user_input("hi"), config, context=context)
            done.append(out["messages"][-1].content)

    def run(worker: int) -> None:
        try:
            asyncio.run(turns(worker))
        except BaseException as error:
            failed.append(error)

    threads = [threading.Thread(target=run, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failed == [] and len(done) == 32
    chain = asyncio.run(graph.memory_runs.resolver.chain(context))
    assert all(not chain.health(link.id).failures for link in chain.links), "no failure counted"


def test_a_loop_bound_client_error_is_never_a_provider_failure() -> None:
    wrapped = ConnectionError("send failed")
    wrapped.__cause__ = RuntimeError("<asyncio.locks.Event object> is bound to a different event loop")
    assert classify(wrapped) == "other"
