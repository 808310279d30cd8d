"""``FusionRoutingMiddleware`` in a ``create_agent`` agent against a real llama-server: a thread stays warm.

As ``test_local_leg`` checks the graph: the local steps of a thread carry its slot
and reuse the prompt the step before sent (server-reported cache numbers), and
the cloud plan in between costs the local cache nothing.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, make_workspace_tools
from fusion_graph.middleware import FusionRoutingMiddleware
from fusion_graph_testing import LlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.integration.test_local_leg import cloud_model, local_model, local_requests
from tests.plugins.scripted_llama import Recorder, Script

pytestmark = pytest.mark.llama


async def test_an_agent_s_local_steps_keep_their_slot_and_reuse_the_cache(
    own_llama_server: LlamaServer, tmp_path: Path
) -> None:
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(f"contents of {name}\n" * 20)
    local_rec, cloud_rec = Recorder(), Recorder()
    script: Script = [[("read_file", {"path": "b.txt"})], [("read_file", {"path": "c.txt"})], []]
    script += [[("list_dir", {"path": "."})], []]
    plans = [
        Reply(content="Plan: read a.txt", tool_calls=[("read_file", {"path": "a.txt"})]),
        Reply(content="Plan: list it", tool_calls=[("list_dir", {"path": "."})]),
    ]
    with FakeOpenAI(plans) as cloud:
        cloud_chat = cloud_model(cloud, cloud_rec)
        middleware = FusionRoutingMiddleware(
            cloud_model=cloud_chat, local_model=local_model(own_llama_server, local_rec, script)
        )
        agent = create_agent(
            model=cloud_chat,
            tools=make_workspace_tools(tmp_path),
            system_prompt=FusionContext().system_prompt,
            middleware=[middleware],
            context_schema=FusionContext,
            checkpointer=InMemorySaver(),
        )
        config: Any = {"configurable": {"thread_id": "agent-cache"}}
        context = FusionContext(cloud_share=30)
        first = await agent.ainvoke(
            {"messages": [HumanMessage("Summarise a, b and c")]}, config, context=context
        )
        second = await agent.ainvoke({"messages": [HumanMessage("Now list it")]}, config, context=context)
    assert [(r["kind"], r["leg"]) for r in first["route_log"]] == [
        ("plan", "cloud"),
        ("step", "local"),
        ("step", "local"),
        ("step", "local"),
    ]
    local = [r for r in first["route_log"] if r["leg"] == "local"]
    slot = local[0]["slot"]
    assert slot is not None and all(r["slot"] == slot for r in local)
    for previous, current in itertools.pairwise(local):
        assert current["cached_tokens"] >= previous["prompt_tokens"]
        assert current["processed_tokens"] == current["prompt_tokens"] - current["cached_tokens"]
    turn2 = [r for r in second["route_log"] if r["turn"] == 1]
    assert [(r["kind"], r["leg"]) for r in turn2][:2] == [("plan", "cloud"), ("step", "local")]
    assert turn2[1]["slot"] == slot and turn2[1]["cached_tokens"] >= local[-1]["prompt_tokens"]
    bodies = local_requests(local_rec.bodies)
    assert bodies and all(b["id_slot"] == slot and b["cache_prompt"] is True for b in bodies)
    assert cloud_rec.bodies and all("id_slot" not in b for b in cloud_rec.bodies)
