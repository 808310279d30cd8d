"""MCP sampling through the provider chain: the leg, the request, fallover, errors and the record.

The callback is called as the ``mcp`` SDK calls it (request context, params);
the chat models are scripted fakes, or ``ChatLlamaServer`` against the
OpenAI-compatible fake on loopback where the request body (slot, stop) matters.
The graph tests call the callback from inside a tool, in a task of its own, as
an MCP session's receive loop does; the real MCP round trip is in
``tests/integration/test_mcp_sampling.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Annotated, Any, cast

import httpx
import openai
import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, InjectedToolCallId, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from mcp.client.session import ClientSession, SamplingFnT
from mcp.shared.context import RequestContext
from mcp.types import (
    INTERNAL_ERROR,
    CreateMessageRequestParams,
    CreateMessageResult,
    ErrorData,
    ImageContent,
    ModelPreferences,
    SamplingMessage,
    TextContent,
)
from pydantic import Field

from fusion_graph import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.providers import ProviderResolver
from fusion_graph.providers.chain import ROUTE_EVENT
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.sampling import (
    OUTSIDE_THREAD,
    SamplingCallback,
    sampling_callback,
    sampling_leg,
    sampling_prompt,
    stop_reason,
)
from fusion_graph.redact import register_secret
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.errors import response
from tests.plugins.fakes import ScriptedModel, user_input

CLOUD_ID, LOCAL_ID = "cloud:gpt-4o-mini", "local:local"
WAYS = ("ainvoke", "messages")
SAMPLE_MARK = "SAMPLE:"
USAGE = {"input_tokens": 1000, "output_tokens": 200, "total_tokens": 1200}


class Recording(ScriptedModel):
    """A scripted model that also keeps the ``stop`` argument of each call."""

    stops: list[list[str] | None] = Field(default_factory=list)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.stops.append(stop)
        return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)


class Failing(ScriptedModel):
    """A model whose every call raises ``error``."""

    error: Exception

    def _generate(self, *args: Any, **kwargs: Any) -> ChatResult:
        raise self.error


def recording(name: str, answers: list[AIMessage | str]) -> Recording:
    return Recording(messages=iter(answers), model_name=name)


def failing(name: str, error: Exception) -> Failing:
    return Failing(messages=iter([]), model_name=name, error=error)


def request_context() -> RequestContext[ClientSession, Any]:
    """What the SDK passes beside the params (the callback reads none of it)."""
    return RequestContext(request_id=1, meta=None, session=cast(ClientSession, None), lifespan_context=None)


def params(
    text: str = "summarize this",
    *,
    preferences: ModelPreferences | None = None,
    max_tokens: int = 64,
    stop: list[str] | None = None,
    temperature: float | None = None,
    system: str | None = None,
) -> CreateMessageRequestParams:
    return CreateMessageRequestParams(
        messages=[SamplingMessage(role="user", content=TextContent(type="text", text=text))],
        modelPreferences=preferences,
        maxTokens=max_tokens,
        stopSequences=stop,
        temperature=temperature,
        systemPrompt=system,
    )


def resolver(cloud: Any, local: Any, **settings: Any) -> ProviderResolver:
    return ProviderResolver(cloud=cloud, local=local, settings=FusionSettings(**settings))


def answered(result: object) -> CreateMessageResult:
    assert isinstance(result, CreateMessageResult), result
    return result


def text_of(result: CreateMessageResult) -> str:
    assert isinstance(result.content, TextContent)
    return result.content.text


SMART = ModelPreferences(intelligencePriority=0.9, costPriority=0.1, speedPriority=0.2)


# --------------------------------------------------------------------------- which leg


@pytest.mark.parametrize(
    ("preferences", "context", "leg", "reason"),
    [
        pytest.param(None, {}, "local", "no modelPreferences: local", id="no-preferences"),
        pytest.param(SMART, {}, "cloud", "intelligence 0.9 > cost 0.1, speed 0.2: cloud", id="intelligence"),
        pytest.param(
            ModelPreferences(intelligencePriority=0.5),
            {},
            "cloud",
            "intelligence 0.5 > cost 0, speed 0: cloud",
            id="missing-count-as-zero",
        ),
        pytest.param(
            ModelPreferences(intelligencePriority=0.5, costPriority=0.5),
            {},
            "local",
            "intelligence 0.5 not > cost 0.5, speed 0: local",
            id="tie-is-not-more",
        ),
        pytest.param(
            ModelPreferences(intelligencePriority=0.6, speedPriority=0.8),
            {},
            "local",
            "not > cost 0, speed 0.8: local",
            id="speed-wins",
        ),
        pytest.param(SMART, {"mode": "local"}, "local", "mode=local: local", id="mode-local"),
        pytest.param(None, {"mode": "cloud"}, "cloud", "mode=cloud: cloud", id="mode-cloud"),
        pytest.param(SMART, {"cloud_share": 0}, "local", "cloud_share=0", id="cloud-share-0"),
    ],
)
def test_sampling_leg_reads_the_preferences_within_the_runs_mode(
    preferences: ModelPreferences | None, context: dict[str, Any], leg: str, reason: str
) -> None:
    chosen, why = sampling_leg(preferences, FusionContext(**context))
    assert chosen == leg
    assert reason in why


# --------------------------------------------------------------------------- the request


async def test_the_request_reaches_the_local_model_with_its_budget_stop_temperature_and_prompt() -> None:
    local = recording("local", [AIMessage("a short summary", usage_metadata=USAGE)])
    cloud = recording("gpt-4o-mini", [])
    callback = sampling_callback(resolver(cloud, local))
    result = answered(
        await callback(
            request_context(),
            params(
                "summarize this", max_tokens=32, stop=["\n\n", "END"], temperature=0.3, system="Be terse."
            ),
        )
    )

    assert text_of(result) == "a short summary"
    assert (result.role, result.model, result.stopReason) == ("assistant", LOCAL_ID, "endTurn")
    assert cloud.prompts == []
    [prompt] = local.prompts
    assert [type(m) for m in prompt] == [SystemMessage, HumanMessage]
    assert [m.content for m in prompt] == ["Be terse.", "summarize this"]
    assert local.stops == [["\n\n", "END"]]
    [kwargs] = local.call_kwargs
    assert kwargs["max_tokens"] == 32 and kwargs["temperature"] == 0.3


async def test_max_tokens_is_capped_at_the_runs_completion_budget() -> None:
    local = recording("local", ["ok"])
    callback = sampling_callback(
        resolver(recording("gpt-4o-mini", []), local), context={"max_completion_tokens": 100}
    )
    answered(await callback(request_context(), params(max_tokens=5000)))
    assert local.call_kwargs[0]["max_tokens"] == 100
    [record] = callback.records
    assert (record["sizing"]["max_tokens"], record["sampling"]["requested_max_tokens"]) == (100, 5000)


def test_the_prompt_keeps_roles_and_names_an_image_in_a_text_note() -> None:
    image = ImageContent(type="image", data="aGVsbG8=", mimeType="image/png")
    request = CreateMessageRequestParams(
        messages=[
            SamplingMessage(role="user", content=[TextContent(type="text", text="what is this?"), image]),
            SamplingMessage(role="assistant", content=TextContent(type="text", text="a picture")),
            SamplingMessage(role="user", content=TextContent(type="text", text="of what?")),
        ],
        maxTokens=10,
    )
    prompt = sampling_prompt(request)
    assert [type(m) for m in prompt] == [HumanMessage, AIMessage, HumanMessage]
    first = str(prompt[0].content)
    assert first.startswith("what is this?") and "[image (image/png) omitted" in first
    assert "aGVsbG8=" not in first


@pytest.mark.parametrize(
    ("metadata", "stop", "expected"),
    [
        pytest.param({"finish_reason": "length"}, None, "maxTokens", id="length"),
        pytest.param({"stop_reason": "max_tokens"}, None, "maxTokens", id="anthropic-max-tokens"),
        pytest.param({"finish_reason": "stop"}, ["END"], "endTurn", id="openai-stop-is-unknown"),
        pytest.param(
            {"stop_reason": "stop_sequence", "stop_sequence": "END"}, ["END"], "stopSequence", id="said"
        ),
        pytest.param({"stop_reason": "stop_sequence"}, None, "endTurn", id="no-stop-sent"),
        pytest.param({}, None, "endTurn", id="nothing-said"),
    ],
)
def test_stop_reason(metadata: dict[str, Any], stop: list[str] | None, expected: str) -> None:
    assert stop_reason(AIMessage("x", response_metadata=metadata), stop) == expected


async def test_a_length_cut_answer_reports_max_tokens() -> None:
    cut = AIMessage("a long", response_metadata={"finish_reason": "length"})
    callback = sampling_callback(resolver(recording("gpt-4o-mini", []), recording("local", [cut])))
    assert answered(await callback(request_context(), params(max_tokens=2))).stopReason == "maxTokens"


# --------------------------------------------------------------------------- llama-server's reflection slot


@pytest.fixture
def local_server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI([Reply(content="sampled locally")]) as fake:
        yield fake


async def test_a_local_request_runs_on_the_reserved_reflection_slot(local_server: FakeOpenAI) -> None:
    local = ChatLlamaServer(model="local", base_url=local_server.base_url, api_key="x", max_retries=0)
    chain_resolver = resolver(recording("gpt-4o-mini", []), local, local_slots=4)
    callback = sampling_callback(chain_resolver)
    result = answered(await callback(request_context(), params(max_tokens=16, stop=["END"])))

    assert (text_of(result), result.model) == ("sampled locally", LOCAL_ID)
    [body] = local_server.requests
    assert (body["id_slot"], body["cache_prompt"]) == (3, True)
    # langchain-openai sends max_tokens under OpenAI's newer name.
    assert (body["max_completion_tokens"], body["stop"]) == (16, ["END"])
    [record] = callback.records
    chain = await chain_resolver.chain(FusionContext())
    pool = await chain_resolver.slot_pool(chain.link(LOCAL_ID), FusionContext())
    assert pool is not None and record["slot"] == pool.reflection_slot == 3


async def test_a_cloud_request_carries_no_slot(local_server: FakeOpenAI) -> None:
    with FakeOpenAI([Reply(content="sampled on cloud")]) as cloud_server:
        cloud = ChatLlamaServer(
            model="gpt-4o-mini", base_url=cloud_server.base_url, api_key="x", max_retries=0
        )
        local = ChatLlamaServer(model="local", base_url=local_server.base_url, api_key="x", max_retries=0)
        callback = sampling_callback(resolver(cloud, local, local_slots=4))
        result = answered(await callback(request_context(), params(preferences=SMART)))
        [body] = cloud_server.requests
    assert (text_of(result), result.model) == ("sampled on cloud", CLOUD_ID)
    assert "id_slot" not in body and local_server.requests == []
    assert callback.records[0]["slot"] is None


# --------------------------------------------------------------------------- fallover and failure


@pytest.mark.parametrize(
    ("preferences", "down", "up"),
    [
        pytest.param(None, "local", "cloud", id="local-down"),
        pytest.param(SMART, "cloud", "local", id="cloud-down"),
    ],
)
async def test_the_other_leg_answers_when_the_preferred_one_is_down(
    preferences: ModelPreferences | None, down: str, up: str
) -> None:
    refused = httpx.ConnectError("connection refused", request=httpx.Request("POST", "http://127.0.0.1:9/v1"))
    models: dict[str, Any] = {
        down: failing("gpt-4o-mini" if down == "cloud" else "local", refused),
        up: recording(
            "gpt-4o-mini" if up == "cloud" else "local", [AIMessage("fell over", usage_metadata=USAGE)]
        ),
    }
    chain_resolver = resolver(models["cloud"], models["local"])
    callback = sampling_callback(chain_resolver)
    result = answered(await callback(request_context(), params(preferences=preferences)))

    ids = {"cloud": CLOUD_ID, "local": LOCAL_ID}
    assert (text_of(result), result.model) == ("fell over", ids[up])
    [record] = callback.records
    assert (record["kind"], record["routed_leg"], record["leg"], record["provider"]) == (
        "sampling",
        down,
        up,
        ids[up],
    )
    [attempt] = record["attempts"]
    assert (attempt["provider"], attempt["kind"], attempt["health_failure"]) == (
        ids[down],
        "connection",
        True,
    )
    health = (await chain_resolver.chain(FusionContext())).health(ids[down])
    assert len(health.failures) == 1


async def test_mode_local_never_falls_over_to_cloud() -> None:
    refused = httpx.ConnectError("connection refused", request=httpx.Request("POST", "http://127.0.0.1:9/v1"))
    cloud = recording("gpt-4o-mini", ["never"])
    callback = sampling_callback(resolver(cloud, failing("local", refused)), context={"mode": "local"})
    result = await callback(request_context(), params(preferences=SMART))
    assert isinstance(result, ErrorData) and result.code == INTERNAL_ERROR
    assert cloud.prompts == []


@pytest.mark.parametrize(
    "make_key", [lambda: f"sk-test-{uuid.uuid4().hex}", lambda: "gw." + uuid.uuid4().hex[:12]]
)
async def test_when_every_provider_fails_the_server_gets_an_error_without_the_key(make_key: Any) -> None:
    key = make_key()
    register_secret(key)  # as Provider registers a model's own key
    server_error = openai.InternalServerError(
        f"upstream said: bad key {key}", response=response(500), body={"error": {"message": key}}
    )
    refused = httpx.ConnectError(
        f"refused (key {key})", request=httpx.Request("POST", "http://127.0.0.1:9/v1")
    )
    callback = sampling_callback(resolver(failing("gpt-4o-mini", server_error), failing("local", refused)))
    result = await callback(request_context(), params())

    assert isinstance(result, ErrorData)
    assert result.code == INTERNAL_ERROR
    assert "no provider answered" in result.message and key not in result.message
    [record] = callback.records
    assert (record["kind"], record["provider"], record["outcome"]["status"]) == ("sampling", None, "failed")
    assert len(record["attempts"]) == 2 and key not in repr(record)


async def test_a_context_the_operator_refuses_is_an_error_result() -> None:
    models = resolver(recording("gpt-4o-mini", []), recording("local", []))
    callback = sampling_callback(models, context={"cloud_model": "not-allowed-model"})
    result = await callback(request_context(), params())
    assert isinstance(result, ErrorData) and result.code == INTERNAL_ERROR
    assert "sampling failed" in result.message


# --------------------------------------------------------------------------- the record


async def test_the_record_is_priced_at_the_provider_that_answered() -> None:
    cloud = recording("gpt-4o-mini", [AIMessage("smart answer", usage_metadata=USAGE)])
    callback = sampling_callback(resolver(cloud, recording("local", [])))
    answered(await callback(request_context(), params(preferences=SMART)))
    [record] = callback.records
    assert (record["kind"], record["leg"], record["provider"]) == ("sampling", "cloud", CLOUD_ID)
    assert (record["prompt_tokens"], record["completion_tokens"]) == (1000, 200)
    assert record["cost_usd"] is not None and record["cost_usd"] > 0
    assert "intelligence 0.9 > cost 0.1, speed 0.2: cloud" in record["reason"]
    assert (record["turn"], record["step"]) == (0, 0)
    assert record["sampling"]["in_run"] is False and record["sampling"]["thread_id"] == OUTSIDE_THREAD


async def test_records_are_bounded() -> None:
    local = recording("local", ["one", "two", "three"])
    callback = sampling_callback(resolver(recording("gpt-4o-mini", []), local), max_records=2)
    for _ in range(3):
        answered(await callback(request_context(), params()))
    assert [r["outcome"]["stop_reason"] for r in callback.records] == ["endTurn", "endTurn"]
    assert len(callback.records) == 2


def test_a_graph_or_a_resolver_is_accepted() -> None:
    graph = build_graph(
        cloud_model=recording("gpt-4o-mini", []), local_model=recording("local", []), tools=[]
    )
    typed: SamplingFnT = sampling_callback(graph)  # what ClientSession(sampling_callback=...) takes
    assert isinstance(typed, SamplingCallback)
    assert sampling_callback(graph).resolver is graph.memory_runs.resolver
    with pytest.raises(TypeError, match="build_graph"):
        sampling_callback(object())


def test_the_module_imports_without_mcp_and_names_the_extra() -> None:
    script = (
        "import sys\n"
        "sys.modules['mcp'] = None\n"
        "import fusion_graph.nodes.tools\n"
        "from fusion_graph.providers.sampling import sampling_callback\n"
        "try:\n"
        "    sampling_callback(None)\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert "pip install 'fusion-graph[mcp]'" in done.stdout


# --------------------------------------------------------------------------- inside a graph run


def sampling_tool(callback: SamplingCallback, name: str = "ask") -> BaseTool:
    """A tool that makes one sampling request the way an MCP session does: from a task of its own."""

    @tool(name)
    async def ask(text: str) -> str:
        """Ask the client's model about the text."""
        result = await asyncio.create_task(callback(request_context(), params(f"{SAMPLE_MARK} {text}")))
        return text_of(result) if isinstance(result, CreateMessageResult) else f"error: {result.message}"

    return ask


def agent(
    calls: list[tuple[str, dict[str, Any]]], sample: Reply | None = None
) -> Callable[[dict[str, Any]], Reply]:
    """The cloud: ``calls`` first, a final answer after the tool results, ``sample`` to a sampling request."""

    def reply(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        if any(SAMPLE_MARK in str(m.get("content")) for m in messages):
            return sample or Reply(content="sampled on cloud")
        if messages[-1]["role"] == "tool":
            return Reply(content="all done")
        return Reply(content="", tool_calls=calls)

    return reply


@pytest.fixture
def cloud_server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


def cloud_model(fake: FakeOpenAI) -> ChatOpenAI:
    # stream_usage: a streamed answer reports its tokens too (Studio and the server stream).
    return ChatOpenAI(
        model="gpt-4o-mini", base_url=fake.base_url, api_key="x", max_retries=0, stream_usage=True
    )


async def run_turn(
    graph: Any, config: RunnableConfig, context: dict[str, Any], way: str, streamed: list[str] | None = None
) -> dict[str, Any]:
    """One turn by ``ainvoke`` or the messages stream; ``streamed`` gets the streamed model text."""
    if way == "messages":
        async for chunk, _meta in graph.astream(
            user_input("go"), config, context=context, stream_mode="messages"
        ):
            if streamed is not None and isinstance(chunk, AIMessageChunk):
                streamed.append(str(chunk.content))
    else:
        await graph.ainvoke(user_input("go"), config, context=context)
    return dict((await graph.aget_state(config)).values)


def tool_replies(out: dict[str, Any]) -> dict[str, str]:
    """Each tool result by the call it answers; every call of the turn has exactly one."""
    asked = [str(c["id"]) for m in out["messages"] if isinstance(m, AIMessage) for c in m.tool_calls]
    replies = {m.tool_call_id: str(m.content) for m in out["messages"] if isinstance(m, ToolMessage)}
    assert sorted(replies) == sorted(asked)
    return replies


@pytest.mark.parametrize("way", WAYS)
async def test_a_request_during_a_tool_call_lands_in_the_threads_route_log(
    cloud_server: FakeOpenAI, way: str
) -> None:
    cloud_server.script(agent([("ask", {"text": "the file"})]))
    local = recording("local", [AIMessage("sampled locally", usage_metadata=USAGE)])
    chain_resolver = ProviderResolver(cloud=cloud_model(cloud_server), local=local, settings=FusionSettings())
    callback = sampling_callback(chain_resolver)
    graph = build_graph(
        resolver=chain_resolver, tools=[sampling_tool(callback)], checkpointer=InMemorySaver()
    )
    config: RunnableConfig = {"configurable": {"thread_id": f"sampling-{way}"}}
    streamed: list[str] = []
    out = await run_turn(graph, config, {"cloud_share": 100}, way, streamed)

    assert [(r["kind"], r["leg"]) for r in out["route_log"]] == [
        ("plan", "cloud"),
        ("sampling", "local"),
        ("step", "cloud"),
    ]
    sampled = out["route_log"][1]
    assert (sampled["turn"], sampled["step"], sampled["provider"]) == (0, 0, LOCAL_ID)
    assert sampled["sampling"]["thread_id"] == f"sampling-{way}" and sampled["sampling"]["in_run"] is True
    assert list(callback.records) == [sampled]
    assert list(tool_replies(out).values()) == ["sampled locally"]
    assert out["totals"]["local"]["inferences"] == 1 and out["totals"]["cloud"]["inferences"] == 2
    assert out["messages"][-1].content == "all done"
    # The sample is the server's, not the conversation's: it never streams as the agent's text.
    assert "all done" in "".join(streamed) or way == "ainvoke"
    assert not any("sampled" in text for text in streamed)


@pytest.mark.parametrize("way", WAYS)
async def test_a_tool_returning_a_command_keeps_its_update_and_the_record(
    cloud_server: FakeOpenAI, way: str
) -> None:
    cloud_server.script(agent([("ask_command", {"text": "x"})]))
    local = recording("local", ["sampled locally"])
    chain_resolver = ProviderResolver(cloud=cloud_model(cloud_server), local=local, settings=FusionSettings())
    callback = sampling_callback(chain_resolver)

    @tool("ask_command")
    async def ask_command(text: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command[Any]:
        """Ask the client's model, answering with a Command."""
        result = answered(
            await asyncio.create_task(callback(request_context(), params(f"{SAMPLE_MARK} {text}")))
        )
        return Command(update={"messages": [ToolMessage(text_of(result), tool_call_id=tool_call_id)]})

    graph = build_graph(resolver=chain_resolver, tools=[ask_command], checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": f"command-{way}"}}
    out = await run_turn(graph, config, {"cloud_share": 100}, way)

    assert [r["kind"] for r in out["route_log"]] == ["plan", "sampling", "step"]
    assert list(tool_replies(out).values()) == ["sampled locally"]
    assert out["totals"]["local"]["inferences"] == 1


async def test_the_record_is_streamed_as_a_route_outcome(cloud_server: FakeOpenAI) -> None:
    cloud_server.script(agent([("ask", {"text": "x"})]))
    chain_resolver = ProviderResolver(
        cloud=cloud_model(cloud_server), local=recording("local", ["sampled"]), settings=FusionSettings()
    )
    graph = build_graph(resolver=chain_resolver, tools=[sampling_tool(sampling_callback(chain_resolver))])
    events = [
        event
        async for event in graph.astream(user_input("go"), context={"cloud_share": 100}, stream_mode="custom")
    ]
    outcomes = [e for e in events if e.get("event") == ROUTE_EVENT and e.get("phase") == "outcome"]
    assert [(e["kind"], e["leg"]) for e in outcomes] == [
        ("plan", "cloud"),
        ("sampling", "local"),
        ("step", "cloud"),
    ]


@pytest.mark.parametrize("way", WAYS)
async def test_requests_of_a_batch_each_land_once(cloud_server: FakeOpenAI, way: str) -> None:
    cloud_server.script(agent([("ask", {"text": "a"}), ("ask_too", {"text": "b"})]))
    local = recording("local", ["first", "second"])
    chain_resolver = ProviderResolver(cloud=cloud_model(cloud_server), local=local, settings=FusionSettings())
    callback = sampling_callback(chain_resolver)
    tools = [sampling_tool(callback), sampling_tool(callback, "ask_too")]
    graph = build_graph(resolver=chain_resolver, tools=tools, checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": f"batch-{way}"}}
    out = await run_turn(graph, config, {"cloud_share": 100}, way)

    assert [r["kind"] for r in out["route_log"]] == ["plan", "sampling", "sampling", "step"]
    assert out["totals"]["local"]["inferences"] == 2
    assert sorted(tool_replies(out).values()) == ["first", "second"]


@pytest.mark.parametrize("way", WAYS)
async def test_a_failed_request_is_logged_but_adds_nothing_to_totals(
    cloud_server: FakeOpenAI, way: str
) -> None:
    # The cloud answers the agent's steps but fails the sampling request; the local leg is down.
    cloud_server.script(agent([("ask", {"text": "x"})], sample=Reply(status=500)))
    refused = httpx.ConnectError("connection refused", request=httpx.Request("POST", "http://127.0.0.1:9/v1"))
    local = failing("local", refused)
    chain_resolver = ProviderResolver(cloud=cloud_model(cloud_server), local=local, settings=FusionSettings())
    callback = sampling_callback(chain_resolver)
    graph = build_graph(
        resolver=chain_resolver, tools=[sampling_tool(callback)], checkpointer=InMemorySaver()
    )
    config: RunnableConfig = {"configurable": {"thread_id": f"failed-{way}"}}
    out = await run_turn(graph, config, {"cloud_share": 100}, way)

    [sampled] = [r for r in out["route_log"] if r["kind"] == "sampling"]
    assert (sampled["routed_leg"], sampled["provider"], sampled["outcome"]["status"]) == (
        "local",
        None,
        "failed",
    )
    assert [a["provider"] for a in sampled["attempts"]] == [LOCAL_ID, CLOUD_ID]
    assert "local" not in out["totals"] and out["totals"]["cloud"]["inferences"] == 2
    [reply] = tool_replies(out).values()
    assert reply.startswith("error: no provider answered")
    assert out["messages"][-1].content == "all done"


# --------------------------------------------------------------------------- the cloud budget


async def test_a_sample_the_cloud_budget_cannot_pay_runs_local_and_never_falls_over_to_cloud() -> None:
    cloud = recording("gpt-4o-mini", [AIMessage("cloud", usage_metadata=USAGE)])
    local = failing("local", httpx.ConnectError("refused"))
    callback = sampling_callback(resolver(cloud, local, thread_cloud_budget_usd=0.0))
    result = await callback(request_context(), params(preferences=SMART))
    assert not isinstance(result, CreateMessageResult)  # local is down and cloud is over budget
    assert cloud.prompts == []
    [record] = callback.records
    assert record["routed_leg"] == "local"
    assert record["budget"]["over"].startswith("thread budget $0.0")
    assert record["reason"].endswith(": local")


async def test_within_budget_a_sample_that_asks_for_intelligence_runs_on_cloud() -> None:
    cloud = recording("gpt-4o-mini", [AIMessage("cloud", usage_metadata=USAGE)])
    local = recording("local", [])
    callback = sampling_callback(resolver(cloud, local, thread_cloud_budget_usd=1.0))
    result = answered(await callback(request_context(), params(preferences=SMART)))
    assert text_of(result) == "cloud" and result.model == CLOUD_ID
    assert "budget" not in callback.records[0]
