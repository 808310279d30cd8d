"""MCP sampling end to end: a real MCP server's tool asks the graph's client to sample, mid-turn.

The MCP server (``mcp_sampling_server.py``) runs over stdio, started by
``langchain-mcp-adapters`` for each tool call with ``sampling_callback`` in its
``session_kwargs``. The agent's own steps run on an OpenAI-compatible fake cloud
(``cloud_share=100``), which asks for the MCP tool and then answers; the
sampling request the tool makes goes through the provider chain: to a real
llama-server's reserved reflection slot by default, to the cloud when the
request's preferences ask for intelligence, to the other leg when one is down.
Every case reads the thread's checkpointed state and runs by ``ainvoke`` and by
the messages stream.
"""

from __future__ import annotations

import json
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langchain_mcp_adapters.client import MultiServerMCPClient
from langchain_mcp_adapters.tools import load_mcp_tools
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.providers import ProviderResolver
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.sampling import OUTSIDE_THREAD, SamplingCallback, sampling_callback
from fusion_graph.routing.records import RouteRecord
from fusion_graph.settings import FusionSettings
from fusion_graph_testing import LlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.integration.mcp_sampling_server import MARKER
from tests.plugins.fakes import user_input
from tests.plugins.llama import N_SLOTS
from tests.plugins.scripted_llama import Recorder

SERVER = Path(__file__).with_name("mcp_sampling_server.py")
CLOUD_ID, LOCAL_ID = "cloud:gpt-4o-mini", "local:tiny"
WAYS = ("ainvoke", "messages")
SMART = {"intelligence": 0.9, "cost": 0.1, "speed": 0.2}
#: The fake cloud is priced as OpenAI's gpt-4o-mini (its loopback URL names no vendor).
SETTINGS = FusionSettings(cloud_price_like="openai")
#: The agent's own steps run on the fake cloud; the sampling request picks its own leg.
CONTEXT: dict[str, Any] = {"cloud_share": 100}


def agent(arguments: dict[str, Any], sample: Reply | None = None) -> Callable[[dict[str, Any]], Reply]:
    """The fake cloud: call ``summarize``, answer after its result, and ``sample`` a sampling request."""

    def reply(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        if any(MARKER in str(m.get("content")) for m in messages):
            return sample or Reply(content="cloud summary")
        if messages[-1]["role"] == "tool":
            return Reply(content="all done")
        return Reply(content="", tool_calls=[("summarize", arguments)])

    return reply


@pytest.fixture
def cloud() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


def cloud_model(fake: FakeOpenAI, key: str = "x") -> ChatOpenAI:
    return ChatOpenAI(
        model="gpt-4o-mini", base_url=fake.base_url, api_key=key, max_retries=0, stream_usage=True
    )


def llama_model(base_url: str, recorder: Recorder | None = None) -> ChatLlamaServer:
    """The local leg, on its own HTTP client: langchain-openai's cached default one outlives a test's loop."""
    return ChatLlamaServer(
        model="tiny",
        base_url=base_url,
        api_key="none",
        max_retries=0,
        temperature=0,
        stream_usage=True,
        http_async_client=(recorder or Recorder()).client(),
    )


def closed_port_url() -> str:
    """An OpenAI-style base URL on a loopback port nothing listens on (a local leg that is down)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def connection(callback: SamplingCallback) -> dict[str, Any]:
    return {
        "transport": "stdio",
        "command": sys.executable,
        "args": [str(SERVER)],
        "session_kwargs": {"sampling_callback": callback},
    }


async def mcp_tools(callback: SamplingCallback) -> list[BaseTool]:
    """The server's tools; each call opens its own session (so it runs inside the graph's tool call)."""
    return await MultiServerMCPClient({"sampler": connection(callback)}).get_tools()  # type: ignore[dict-item]


async def run_turn(graph: Any, config: RunnableConfig, way: str) -> dict[str, Any]:
    """One turn by ``ainvoke`` or the messages stream; the checkpointed thread's values."""
    if way == "messages":
        async for _ in graph.astream(
            user_input("summarize it"), config, context=CONTEXT, stream_mode="messages"
        ):
            pass
    else:
        await graph.ainvoke(user_input("summarize it"), config, context=CONTEXT)
    return dict((await graph.aget_state(config)).values)


def tool_result(out: dict[str, Any]) -> dict[str, Any]:
    """The JSON the MCP tool returned (the one tool call of the turn, answered once)."""
    [asked] = [c["id"] for m in out["messages"] if isinstance(m, AIMessage) for c in m.tool_calls]
    [reply] = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert reply.tool_call_id == asked
    content = reply.content
    text = content if isinstance(content, str) else "".join(b["text"] for b in content if isinstance(b, dict))
    result: dict[str, Any] = json.loads(text)
    return result


def sampling_record(out: dict[str, Any]) -> RouteRecord:
    """The thread's one sampling record, logged between the plan and the step after the tool."""
    assert [r["kind"] for r in out["route_log"]] == ["plan", "sampling", "step"]
    record: RouteRecord = out["route_log"][1]
    assert (record["turn"], record["step"]) == (0, 0)
    assert record["sampling"]["in_run"] is True
    return record


async def graph_for(
    cloud: ChatOpenAI, local: ChatLlamaServer, thread: str
) -> tuple[Any, SamplingCallback, RunnableConfig]:
    """The resolver first: the callback needs it, the MCP tools need the callback, the graph the tools."""
    resolver = ProviderResolver(cloud=cloud, local=local, settings=SETTINGS)
    callback = sampling_callback(resolver)
    graph = build_graph(resolver=resolver, tools=await mcp_tools(callback), checkpointer=InMemorySaver())
    return graph, callback, {"configurable": {"thread_id": thread}}


# --------------------------------------------------------------------------- the local leg (llama-server)


@pytest.mark.llama
@pytest.mark.parametrize("way", WAYS)
async def test_sampling_runs_on_llama_servers_reflection_slot(
    llama_server: LlamaServer, cloud: FakeOpenAI, way: str
) -> None:
    cloud.script(agent({"text": "the quick brown fox", "max_tokens": 6, "stop": ["\n\n"]}))
    recorder = Recorder()
    local = llama_model(llama_server.openai_base_url, recorder)
    graph, callback, config = await graph_for(cloud_model(cloud), local, f"local-{way}")
    out = await run_turn(graph, config, way)

    result = tool_result(out)
    assert result["model"] == LOCAL_ID and isinstance(result["text"], str)
    assert result["stop_reason"] in ("maxTokens", "endTurn")  # llama-server does not say if a stop matched
    record = sampling_record(out)
    assert (record["leg"], record["routed_leg"], record["provider"]) == ("local", "local", LOCAL_ID)
    resolver = graph.memory_runs.resolver
    link = (await resolver.chain(FusionContext(**CONTEXT))).link(LOCAL_ID)
    pool = await resolver.slot_pool(link, FusionContext(**CONTEXT))
    assert pool is not None and record["slot"] == pool.reflection_slot == N_SLOTS - 1
    [body] = [b for b in recorder.bodies if MARKER in json.dumps(b["messages"])]
    assert (body["id_slot"], body["cache_prompt"]) == (N_SLOTS - 1, True)
    assert (body["max_completion_tokens"], body["stop"]) == (6, ["\n\n"])
    assert body["messages"][0] == {"role": "system", "content": "Summarize in a few words."}
    # Priced at the local leg's (free) prices from the server's own token counts.
    assert record["prompt_tokens"] and record["completion_tokens"] and record["cost_usd"] == 0.0
    assert out["totals"]["local"]["inferences"] == 1 and out["totals"]["cloud"]["inferences"] == 2
    assert list(callback.records) == [record]
    assert out["messages"][-1].content == "all done"


# --------------------------------------------------------------------------- the cloud leg


@pytest.fixture
def idle_local() -> Iterator[FakeOpenAI]:
    """A local leg that answers, to show it was not asked."""
    with FakeOpenAI([Reply(content="local summary")]) as fake:
        yield fake


@pytest.mark.parametrize("way", WAYS)
async def test_sampling_goes_to_cloud_when_the_server_asks_for_intelligence(
    cloud: FakeOpenAI, idle_local: FakeOpenAI, way: str
) -> None:
    cloud.script(agent({"text": "a hard question", **SMART}))
    graph, _, config = await graph_for(cloud_model(cloud), llama_model(idle_local.base_url), f"cloud-{way}")
    out = await run_turn(graph, config, way)

    result = tool_result(out)
    assert (result["model"], result["text"], result["stop_reason"]) == (CLOUD_ID, "cloud summary", "endTurn")
    record = sampling_record(out)
    assert (record["leg"], record["routed_leg"], record["slot"]) == ("cloud", "cloud", None)
    assert "intelligence 0.9 > cost 0.1, speed 0.2: cloud" in record["reason"]
    assert record["cost_usd"] is not None and record["cost_usd"] > 0
    assert out["totals"]["cloud"]["inferences"] == 3 and "local" not in out["totals"]
    assert not [b for b in idle_local.requests if MARKER in json.dumps(b["messages"])]


# --------------------------------------------------------------------------- one leg down


@pytest.mark.parametrize("way", WAYS)
async def test_sampling_falls_over_to_cloud_when_llama_server_is_down(cloud: FakeOpenAI, way: str) -> None:
    cloud.script(agent({"text": "anything"}))
    graph, _, config = await graph_for(
        cloud_model(cloud), llama_model(closed_port_url()), f"local-down-{way}"
    )
    out = await run_turn(graph, config, way)

    assert tool_result(out)["model"] == CLOUD_ID
    record = sampling_record(out)
    assert (record["routed_leg"], record["leg"], record["provider"]) == ("local", "cloud", CLOUD_ID)
    [attempt] = record["attempts"]
    assert (attempt["provider"], attempt["kind"]) == (LOCAL_ID, "connection")


@pytest.mark.llama
@pytest.mark.parametrize("way", WAYS)
async def test_sampling_falls_over_to_llama_server_when_the_cloud_fails_it(
    llama_server: LlamaServer, cloud: FakeOpenAI, way: str
) -> None:
    cloud.script(agent({"text": "a hard question", "max_tokens": 4, **SMART}, sample=Reply(status=500)))
    local = llama_model(llama_server.openai_base_url)
    graph, _, config = await graph_for(cloud_model(cloud), local, f"cloud-down-{way}")
    out = await run_turn(graph, config, way)

    assert tool_result(out)["model"] == LOCAL_ID
    record = sampling_record(out)
    assert (record["routed_leg"], record["leg"], record["slot"]) == ("cloud", "local", N_SLOTS - 1)
    [attempt] = record["attempts"]
    assert (attempt["provider"], attempt["kind"]) == (CLOUD_ID, "server_error")
    assert out["messages"][-1].content == "all done"


@pytest.mark.parametrize("way", WAYS)
async def test_when_no_provider_answers_the_server_gets_an_error_without_the_key(
    cloud: FakeOpenAI, way: str
) -> None:
    key = f"sk-test-{uuid.uuid4().hex}"
    echo = json.dumps({"error": {"message": f"upstream rejected key {key}", "type": "server_error"}})
    cloud.script(agent({"text": "anything"}, sample=Reply(status=500, raw=echo.encode())))
    graph, _, config = await graph_for(cloud_model(cloud, key), llama_model(closed_port_url()), f"down-{way}")
    out = await run_turn(graph, config, way)

    result = tool_result(out)
    assert "no provider answered the sampling request" in result["error"] and key not in result["error"]
    record = sampling_record(out)
    assert (record["provider"], record["outcome"]["status"]) == (None, "failed")
    assert [a["provider"] for a in record["attempts"]] == [LOCAL_ID, CLOUD_ID]
    assert key not in json.dumps(out["route_log"], default=str)
    assert "local" not in out["totals"] and out["totals"]["cloud"]["inferences"] == 2


# --------------------------------------------------------------------------- a long-lived session


@pytest.mark.parametrize("way", WAYS)
async def test_a_session_opened_outside_the_run_keeps_its_records_on_the_callback(
    cloud: FakeOpenAI, way: str
) -> None:
    cloud.script(agent({"text": "anything", **SMART}))
    resolver = ProviderResolver(
        cloud=cloud_model(cloud), local=llama_model(closed_port_url()), settings=SETTINGS
    )
    callback = sampling_callback(resolver, context={"cloud_share": 50})
    client = MultiServerMCPClient({"sampler": connection(callback)})  # type: ignore[dict-item]
    async with client.session("sampler") as session:
        graph = build_graph(
            resolver=resolver, tools=await load_mcp_tools(session), checkpointer=InMemorySaver()
        )
        config: RunnableConfig = {"configurable": {"thread_id": f"long-lived-{way}"}}
        out = await run_turn(graph, config, way)

    assert tool_result(out)["model"] == CLOUD_ID
    assert [r["kind"] for r in out["route_log"]] == ["plan", "step"]
    [record] = callback.records
    assert (record["kind"], record["provider"]) == ("sampling", CLOUD_ID)
    assert record["sampling"]["in_run"] is False and record["sampling"]["thread_id"] == OUTSIDE_THREAD
