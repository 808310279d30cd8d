"""A real llama-server killed mid-turn: the step falls over to cloud, and a restart restores the local leg.

The local model is ``ScriptedLlama`` (a real request to a real server; only the
answer's tool calls are scripted), on a server of this test's own at a fixed port
so it can be restarted where the client expects it. A tool of the turn stops the
server, so the outage starts between two local steps of one ``ainvoke``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from fusion_graph import FusionContext, build_graph
from fusion_graph.providers import ProviderResolver
from fusion_graph.settings import FusionSettings
from fusion_graph_testing import LlamaServer, free_port
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.scripted_llama import Script, scripted_llama
from tests.unit.providers.test_faults import (
    CLOUD_ID,
    Graph,
    calls,
    checkpointed_once,
    cloud_model,
    echo,
    replies,
    wait_until,
)

pytestmark = pytest.mark.llama

LOCAL_ID = "local:tiny"
FIRST, SECOND = "turn one: read, then keep going", "turn two: carry on"


@pytest.fixture
async def server(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> AsyncIterator[LlamaServer]:
    port = free_port()  # fixed, so a restart comes back where the client points
    log = tmp_path / "llama-server.log"
    async with LlamaServer(tiny_model, binary=llama_server_bin, n_slots=2, port=port, log_path=log) as srv:
        yield srv


def records(out: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    return [r for r in out["route_log"] if r["turn"] == turn]


async def test_killed_llama_server_falls_over_to_cloud_and_recovers_after_restart(
    server: LlamaServer, tmp_path: Path
) -> None:
    @tool
    async def stop_local_server() -> str:
        """Stop the local model server."""
        await asyncio.to_thread(server.stop)
        return "stopped"

    script: Script = [[("stop_local_server", {})], [("echo", {"text": "local again"})], []]
    local = scripted_llama(server.openai_base_url, script, max_retries=0, timeout=10)
    cloud_script = [calls("plan 1"), calls("rescued"), Reply(content="turn one done"), calls("plan 2")]
    settings = FusionSettings(provider_allowed_failures=0, provider_cooldown_s=1.5, local_slots=2)
    context: dict[str, Any] = {}
    config: RunnableConfig = {"configurable": {"thread_id": "killed"}}
    with FakeOpenAI(replies(*cloud_script)) as cloud:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "cp.sqlite")) as saver:
            resolver = ProviderResolver(cloud=cloud_model(cloud), local=local, settings=settings)
            graph: Graph = build_graph(resolver=resolver, tools=[echo, stop_local_server], checkpointer=saver)
            health = (await resolver.chain(FusionContext(**context))).health(LOCAL_ID)

            first = await graph.ainvoke({"messages": [("user", FIRST)]}, config, context=context)
            after_first = time.monotonic()
            assert not server.running
            turn = records(first, 0)
            assert [(r["kind"], r["routed_leg"], r["leg"]) for r in turn] == [
                ("plan", "cloud", "cloud"),
                ("step", "local", "local"),  # its tool call stops the server
                ("step", "local", "cloud"),  # the local call is refused: fall over
                ("step", "local", "cloud"),  # local cools down: skipped without a call
            ]
            [refused] = turn[2]["attempts"]
            assert (refused["provider"], refused["kind"], refused["health_failure"]) == (
                LOCAL_ID,
                "connection",
                True,
            )
            assert turn[2]["provider"] == CLOUD_ID and turn[3]["attempts"] == []
            assert first["messages"][-1].content == "turn one done"
            assert health.state(after_first) == "cooldown" and "Connection" in (health.last_error or "")

            await asyncio.to_thread(server.start)  # same port; start() polls /health until ready
            assert server.health()
            await wait_until(lambda: health.state(time.monotonic()) == "half_open")
            second = await graph.ainvoke({"messages": [("user", SECOND)]}, config, context=context)

            turn = records(second, 1)
            assert [(r["kind"], r["routed_leg"], r["leg"]) for r in turn] == [
                ("plan", "cloud", "cloud"),
                ("step", "local", "local"),  # the first call after the cooldown: succeeds
                ("step", "local", "local"),  # and local steps resume
            ]
            assert all(r["attempts"] == [] and r["provider"] == LOCAL_ID for r in turn[1:])
            # The routed start was half-open: probed (it closed the circuit), not reported as a probe.
            assert turn[1]["outcome"]["probe"] is False
            assert turn[1]["prompt_tokens"] and turn[1]["slot"] == records(first, 0)[1]["slot"]
            assert health.state(time.monotonic()) == "healthy" and health.cooldown_until is None
            assert len(cloud.requests) == 4
            await checkpointed_once(graph, config, [FIRST, SECOND])
