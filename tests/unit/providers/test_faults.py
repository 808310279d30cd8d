"""Fault injection end to end: a provider fails mid-turn, the chain falls over, the checkpoint stays whole.

Both legs are OpenAI-compatible fakes on loopback (``FakeOpenAI``), which answer a
429 with Retry-After, a 500, a hang past the client timeout or a malformed body on
demand. Every graph runs on a real SQLite checkpointer, and every test checks that
the checkpointed thread holds each completed step exactly once. A real llama-server
killed mid-turn is in ``tests/integration/test_faults_llama.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph.state import CompiledStateGraph

from fusion_graph import FusionContext, ProviderChain, build_graph
from fusion_graph.errors import ChainExhausted
from fusion_graph.prompts import MEMORY_MESSAGE_NAME
from fusion_graph.providers import ProviderResolver
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.models import Provider, close_chat_model
from fusion_graph.providers.pricing import Pricing, unit_prices
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.errors import LLAMA_OVERFLOW_BODY
from tests.plugins.fakes import ScriptedModel, split_config

CLOUD_ID, LOCAL_ID = "cloud:gpt-4o-mini", "local:local"
USER = "please do the task"
Graph = CompiledStateGraph[Any, Any, Any, Any]


def replies(*items: Reply) -> Callable[[dict[str, Any]], Reply]:
    """Serve ``items`` in order from the next request on, the last one repeating.

    (``FakeOpenAI.script([...])`` indexes a new list by all requests served so far,
    so it would skip the head of a script given mid-test.)
    """
    queue = list(items)
    return lambda _body: queue.pop(0) if len(queue) > 1 else queue[0]


def calls(text: str, **usage: Any) -> Reply:
    """An answer asking for one ``echo`` call (distinct texts keep the loop detector quiet)."""
    return Reply(content="", tool_calls=[("echo", {"text": text})], **usage)


def completion_body(*, choices: list[Any]) -> bytes:
    """A 200 body shaped like a chat completion except for ``choices``."""
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "local", "choices": choices}
    return json.dumps(
        {**body, "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    ).encode()


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    """A ``text/event-stream`` body of chat-completion chunks (sent raw, whatever the request asked)."""
    base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "local"}
    events = [f"data: {json.dumps({**base, **chunk})}\n\n" for chunk in chunks]
    return ("".join(events) + ("data: [DONE]\n\n" if done else "")).encode()


def delta(content: str, finish: str | None = None) -> dict[str, Any]:
    """One streamed chunk's ``choices``: ``content`` and, optionally, a finish reason."""
    return {
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": finish}]
    }


#: The two ways a run meets a model: ``ainvoke`` (embedded apps) and the messages stream
#: (LangGraph Studio and server), where every chat model streams.
WAYS = ("ainvoke", "messages")


def tool_call_choice(arguments: Any) -> dict[str, Any]:
    """A choice whose one tool call carries ``arguments`` as they are (not necessarily a JSON string)."""
    call = {"id": "c", "type": "function", "function": {"name": "echo", "arguments": arguments}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"index": 0, "finish_reason": "tool_calls", "message": message}


@tool
async def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


def cloud_model(fake: FakeOpenAI) -> ChatOpenAI:
    # stream_usage: a streamed answer reports its tokens (langchain-openai turns it on by itself
    # only for OpenAI's own URL), so runs under Studio and the server are priced too.
    return ChatOpenAI(
        model="gpt-4o-mini",
        base_url=fake.base_url,
        api_key="x",
        max_retries=0,
        timeout=10,
        stream_usage=True,
    )


def local_model(fake: FakeOpenAI, timeout: float = 1.0) -> ChatLlamaServer:
    return ChatLlamaServer(
        model="local",
        base_url=fake.base_url,
        api_key="x",
        max_retries=0,
        timeout=timeout,
        stream_usage=True,  # as the graph's own default local model: streamed answers report usage
    )


def legs(out: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(r["kind"], r["routed_leg"], r["leg"]) for r in out["route_log"]]


async def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.05)


@dataclass
class Rig:
    """One graph on one thread, with the resolver whose chains the test inspects."""

    graph: Graph
    resolver: ProviderResolver
    context: dict[str, Any]
    config: RunnableConfig = field(
        default_factory=lambda: RunnableConfig(configurable={"thread_id": "faults"})
    )

    async def chain(self) -> ProviderChain:
        return await self.resolver.chain(FusionContext(**self.context))

    async def turn(self, text: str | None = USER, way: str = "ainvoke") -> dict[str, Any]:
        payload = None if text is None else {"messages": [("user", text)]}
        if way == "messages":  # as Studio and the server run it: the models stream
            async for _ in self.graph.astream(
                payload, self.config, context=self.context, stream_mode="messages"
            ):
                pass
            return dict((await self.graph.aget_state(self.config)).values)
        out: dict[str, Any] = await self.graph.ainvoke(payload, self.config, context=self.context)
        return out


def make_rig(cloud: BaseChatModel, local: BaseChatModel, saver: AsyncSqliteSaver, **config: Any) -> Rig:
    settings, context = split_config(local_slots=4, **config)
    resolver = ProviderResolver(cloud=cloud, local=local, settings=settings)
    graph = build_graph(resolver=resolver, tools=[echo], checkpointer=saver)
    return Rig(graph, resolver, context)


async def checkpointed_once(graph: Graph, config: RunnableConfig, users: list[str]) -> dict[str, Any]:
    """Assert the checkpointed thread holds every completed step exactly once; return its values."""
    values: dict[str, Any] = (await graph.aget_state(config)).values
    messages = values["messages"]
    # Memory jobs answer no turn; an inference no provider answered has a record but no message.
    log = [r for r in values.get("route_log", []) if r["kind"] != "memory" and r["provider"] is not None]
    ids = [m.id for m in messages]
    assert None not in ids and len(set(ids)) == len(ids), f"duplicated message ids: {ids}"
    answers = [m for m in messages if isinstance(m, AIMessage)]
    assert len(answers) == len(log), "each completed inference is one AI message and one route record"
    assert len({(r["turn"], r["step"]) for r in log}) == len(log), "a step was recorded twice"
    asked = [c["id"] for m in answers for c in m.tool_calls]
    answered = [m.tool_call_id for m in messages if isinstance(m, ToolMessage)]
    assert Counter(answered) == Counter(asked) and len(set(asked)) == len(asked), (asked, answered)
    said = [m.content for m in messages if isinstance(m, HumanMessage) and m.name != MEMORY_MESSAGE_NAME]
    assert said == users
    return values


@pytest.fixture
def cloud() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
def local() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
async def saver(tmp_path: Path) -> AsyncIterator[AsyncSqliteSaver]:
    async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "cp.sqlite")) as checkpointer:
        yield checkpointer


# --------------------------------------------------------------------------- one leg fails


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        pytest.param(Reply(status=429, headers={"Retry-After": "7"}), "rate_limited", id="429"),
        pytest.param(Reply(status=500), "server_error", id="500"),
        pytest.param(Reply(delay=3.0), "timeout", id="hang"),
        pytest.param(Reply(raw=b"{not json"), "malformed_response", id="malformed-json"),
        pytest.param(Reply(raw=completion_body(choices=[])), "malformed_response", id="empty-choices"),
        pytest.param(
            Reply(raw=completion_body(choices=[{"index": 0, "finish_reason": "stop"}])),
            "malformed_response",
            id="choice-without-message",
        ),
        pytest.param(
            Reply(raw=completion_body(choices=[tool_call_choice({"text": "not a JSON string"})])),
            "malformed_response",
            id="arguments-not-a-string",
            marks=pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning"),
        ),
        pytest.param(
            Reply(raw=b'{"id": "x", "choices": [{"index": 0, "mess'), "malformed_response", id="truncated"
        ),
        pytest.param(
            Reply(raw=b"<html><body>502 Bad Gateway</body></html>"), "malformed_response", id="html-200"
        ),
        pytest.param(
            Reply(
                raw=completion_body(
                    choices=[
                        {
                            "index": 0,
                            "finish_reason": "length",
                            "message": {"role": "assistant", "content": ""},
                        }
                    ]
                )
            ),
            "malformed_response",
            id="empty-length-cut",
        ),
        pytest.param(
            Reply(raw=sse(delta(""), delta("", "length"))), "malformed_response", id="sse-empty-length-cut"
        ),
        pytest.param(Reply(raw=sse(delta("partial "), done=False)), "malformed_response", id="sse-cut"),
        pytest.param(
            Reply(raw=b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n'),
            {"ainvoke": "malformed_response", "messages": "server_error"},
            id="sse-error-event",
        ),
    ],
)
@pytest.mark.parametrize("way", WAYS)
async def test_local_fault_mid_turn_falls_over_to_cloud(
    cloud: FakeOpenAI, local: FakeOpenAI, saver: AsyncSqliteSaver, fault: Reply, kind: Any, way: str
) -> None:
    kind = kind[way] if isinstance(kind, dict) else kind
    cloud.script(replies(calls("plan"), Reply(content="done on cloud")))
    local.script(replies(calls("local-1"), fault))
    rig = make_rig(cloud_model(cloud), local_model(local, timeout=1.0), saver)
    began = time.monotonic()
    out = await rig.turn(way=way)
    now = time.monotonic()

    assert legs(out) == [("plan", "cloud", "cloud"), ("step", "local", "local"), ("step", "local", "cloud")]
    fallover = out["route_log"][2]
    assert fallover["provider"] == CLOUD_ID
    [attempt] = fallover["attempts"]
    assert (attempt["provider"], attempt["leg"], attempt["kind"]) == (LOCAL_ID, "local", kind)
    assert attempt["health_failure"] is True and attempt["probe"] is False
    assert out["messages"][-1].content == "done on cloud"
    assert (len(cloud.requests), len(local.requests)) == (2, 2)

    health = (await rig.chain()).health(LOCAL_ID)
    if kind == "rate_limited":  # cools down at once, for exactly the Retry-After
        assert attempt["retry_after_s"] == 7.0
        assert health.state(now) == "cooldown" and health.cooldown_until is not None
        assert 7.0 - (now - began) <= health.cooldown_until - now <= 7.0
    else:  # the default policy tolerates two failures in the window
        assert attempt["retry_after_s"] is None
        assert health.state(now) == "healthy" and len(health.failures) == 1
    if kind == "timeout":  # abandoned at the client timeout, not when the reply came
        assert 0.9 <= attempt["latency_s"] < 2.5
    await checkpointed_once(rig.graph, rig.config, [USER])


@pytest.mark.parametrize("way", WAYS)
async def test_a_local_context_overflow_walks_on_to_cloud_without_hurting_health(
    cloud: FakeOpenAI, local: FakeOpenAI, saver: AsyncSqliteSaver, way: str
) -> None:
    cloud.script(replies(calls("plan"), Reply(content="done on cloud")))
    overflow = Reply(status=400, raw=json.dumps(LLAMA_OVERFLOW_BODY).encode())
    local.script(replies(overflow))
    rig = make_rig(cloud_model(cloud), local_model(local), saver)
    out = await rig.turn(way=way)

    assert legs(out) == [("plan", "cloud", "cloud"), ("step", "local", "cloud")]
    [attempt] = out["route_log"][1]["attempts"]
    assert (attempt["provider"], attempt["kind"], attempt["health_failure"]) == (
        LOCAL_ID,
        "context_overflow",
        False,
    )
    assert attempt["prompt_tokens"] == 4019, "the size llama-server reported"
    assert (await rig.chain()).health(LOCAL_ID).failures == []
    assert out["messages"][-1].content == "done on cloud"


class Hanging(ScriptedModel):
    """An injected model that never answers (its own client has no timeout)."""

    async def _agenerate(self, *args: Any, **kwargs: Any) -> ChatResult:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def _astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        await asyncio.sleep(3600)  # streamed (Studio, the server): the same hang
        raise AssertionError("unreachable")
        yield  # an async generator


class Unparsable(ScriptedModel):
    """An injected model whose own response parsing fails."""

    error: str = "index"

    async def _agenerate(self, *args: Any, **kwargs: Any) -> ChatResult:
        if self.error == "index":
            raise IndexError("list index out of range")  # e.g. response["choices"][0] of []
        AIMessage.model_validate({"content": "", "tool_calls": [{"name": "x", "args": [1], "id": "c"}]})
        raise AssertionError("unreachable")

    async def _astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        await self._agenerate()  # streamed: the same parse failure
        yield ChatGenerationChunk(message=AIMessageChunk(content=""))  # pragma: no cover - never reached


@pytest.mark.parametrize("way", WAYS)
async def test_request_timeout_bounds_an_injected_model(
    cloud: FakeOpenAI, saver: AsyncSqliteSaver, way: str
) -> None:
    cloud.script(replies(calls("plan"), Reply(content="done on cloud")))
    rig = make_rig(cloud_model(cloud), Hanging(messages=iter([])), saver, request_timeout=0.5)
    out = await rig.turn(way=way)

    assert legs(out) == [("plan", "cloud", "cloud"), ("step", "local", "cloud")]
    [attempt] = out["route_log"][1]["attempts"]
    assert (attempt["kind"], attempt["health_failure"]) == ("timeout", True)
    assert "request_timeout=0.5 s" in attempt["message"]


@pytest.mark.parametrize("error", ["index", "validation"])
@pytest.mark.parametrize("way", WAYS)
async def test_an_injected_models_parse_failure_is_a_malformed_answer(
    cloud: FakeOpenAI, saver: AsyncSqliteSaver, error: str, way: str
) -> None:
    cloud.script(replies(calls("plan"), Reply(content="done on cloud")))
    rig = make_rig(cloud_model(cloud), Unparsable(messages=iter([]), error=error), saver)
    out = await rig.turn(way=way)

    assert legs(out) == [("plan", "cloud", "cloud"), ("step", "local", "cloud")]
    [attempt] = out["route_log"][1]["attempts"]
    assert (attempt["error"], attempt["kind"], attempt["health_failure"]) == (
        "MalformedAnswer",
        "malformed_response",
        True,
    )


async def test_every_inference_sends_the_completion_budget(
    cloud: FakeOpenAI, local: FakeOpenAI, saver: AsyncSqliteSaver
) -> None:
    cloud.script(replies(calls("plan")))
    local.script(replies(Reply(content="done")))
    rig = make_rig(cloud_model(cloud), local_model(local), saver, max_completion_tokens=300)
    out = await rig.turn()

    assert legs(out) == [("plan", "cloud", "cloud"), ("step", "local", "local")]
    assert [r["max_completion_tokens"] for r in cloud.requests + local.requests] == [300, 300]
    assert [r["sizing"]["max_tokens"] for r in out["route_log"]] == [300, 300]


@pytest.mark.parametrize("way", WAYS)
async def test_cloud_failing_the_plan_runs_the_plan_on_local(
    cloud: FakeOpenAI, local: FakeOpenAI, saver: AsyncSqliteSaver, way: str
) -> None:
    cloud.script(replies(Reply(status=500)))
    local.script(replies(calls("plan-on-local"), Reply(content="done locally")))
    rig = make_rig(cloud_model(cloud), local_model(local), saver)
    out = await rig.turn(way=way)

    assert legs(out) == [("plan", "cloud", "local"), ("step", "local", "local")]
    plan = out["route_log"][0]
    assert plan["provider"] == LOCAL_ID and plan["slot"] is not None
    [attempt] = plan["attempts"]
    assert (attempt["provider"], attempt["leg"], attempt["kind"]) == (CLOUD_ID, "cloud", "server_error")
    assert attempt["health_failure"] is True
    assert out["messages"][-1].content == "done locally"
    assert len(cloud.requests) == 1 and "id_slot" not in cloud.requests[0]
    assert [body["id_slot"] for body in local.requests] == [plan["slot"]] * 2
    await checkpointed_once(rig.graph, rig.config, [USER])


# --------------------------------------------------------------------------- everything fails


@pytest.mark.parametrize("way", WAYS)
async def test_all_providers_down_raises_then_resumes_from_the_checkpoint(
    cloud: FakeOpenAI, local: FakeOpenAI, saver: AsyncSqliteSaver, way: str
) -> None:
    cloud.script(replies(calls("plan"), Reply(status=500)))
    local.script(replies(Reply(status=500)))
    rig = make_rig(
        cloud_model(cloud), local_model(local), saver, provider_allowed_failures=0, provider_cooldown_s=0.5
    )
    with pytest.raises(ChainExhausted) as raised:
        await rig.turn(way=way)
    message = str(raised.value)
    assert CLOUD_ID in message and LOCAL_ID in message and message.count("[server_error]") == 2
    assert [(a.provider, a.kind) for a in raised.value.attempts] == [
        (LOCAL_ID, "server_error"),
        (CLOUD_ID, "server_error"),
    ]
    assert raised.value.retry_in_s is not None and 0 < raised.value.retry_in_s <= 0.5

    # What completed before the outage is checkpointed, and so is the failed inference's record;
    # resuming retries that inference.
    snapshot = await rig.graph.aget_state(rig.config)
    assert snapshot.next == ("unavailable",)
    values = await checkpointed_once(rig.graph, rig.config, [USER])
    assert [type(m).__name__ for m in values["messages"]] == ["HumanMessage", "AIMessage", "ToolMessage"]
    assert [(r["kind"], r["leg"], r["provider"]) for r in values["route_log"]] == [
        ("plan", "cloud", CLOUD_ID),
        ("step", "local", None),
    ]
    failed = values["route_log"][1]
    assert failed["outcome"]["status"] == "exhausted"
    assert [(a["provider"], a["kind"]) for a in failed["attempts"]] == [
        (LOCAL_ID, "server_error"),
        (CLOUD_ID, "server_error"),
    ]

    cloud.script(replies(Reply(content="cloud is not needed")))
    local.script(replies(calls("after-outage"), Reply(content="recovered")))
    chain = await rig.chain()
    await wait_until(
        lambda: all(chain.health(p).state(time.monotonic()) == "half_open" for p in (CLOUD_ID, LOCAL_ID))
    )
    out = await rig.turn(None, way=way)  # resume the interrupted turn from its checkpoint

    assert legs(out) == [
        ("plan", "cloud", "cloud"),
        ("step", "local", "local"),  # the failed attempt, recorded
        ("step", "local", "local"),
        ("step", "local", "local"),
    ]
    assert [r["provider"] for r in out["route_log"]] == [CLOUD_ID, None, LOCAL_ID, LOCAL_ID]
    assert out["messages"][-1].content == "recovered"
    assert len(cloud.requests) == 2, "the resumed turn re-ran the plan or asked the cloud"
    assert chain.health(LOCAL_ID).state(time.monotonic()) == "healthy"
    await checkpointed_once(rig.graph, rig.config, [USER])


# --------------------------------------------------------------------------- cost attribution


class ToFake(httpx.AsyncHTTPTransport):
    """Sends every request to a loopback fake, so a model can keep OpenAI's own base URL."""

    def __init__(self, fake: FakeOpenAI) -> None:
        super().__init__()
        self.port = httpx.URL(fake.base_url).port

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(scheme="http", host="127.0.0.1", port=self.port)
        return await super().handle_async_request(request)


@pytest.mark.parametrize("way", WAYS)
async def test_costs_follow_the_provider_that_answered(
    cloud: FakeOpenAI, local: FakeOpenAI, saver: AsyncSqliteSaver, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    for name in ("OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(name, raising=False)
    # OpenAI's base URL (the catalogue prices a known model there; an unknown URL stays unpriced).
    http_client = httpx.AsyncClient(transport=ToFake(cloud), timeout=10)
    priced_cloud = ChatOpenAI(
        model="gpt-4o-mini", api_key="x", max_retries=0, http_async_client=http_client, stream_usage=True
    )
    cloud.script(
        replies(calls("plan", prompt_tokens=2000, cached_tokens=500), calls("rescue", prompt_tokens=3000))
    )
    local.script(
        replies(
            Reply(content="one two three", tool_calls=[("echo", {"text": "l1"})], prompt_tokens=1000),
            Reply(status=500),
            Reply(content="done", prompt_tokens=4000, cached_tokens=3500),
        )
    )
    rig = make_rig(
        priced_cloud, local_model(local), saver, local_price_per_mtok=(1.0, 2.0), override_provider=CLOUD_ID
    )
    out = await rig.turn(way=way)
    await http_client.aclose()

    assert (await rig.chain()).override == CLOUD_ID
    log = out["route_log"]
    assert [(r["routed_leg"], r["leg"]) for r in log] == [
        ("cloud", "cloud"),
        ("local", "local"),  # the routed leg beats the override
        ("local", "cloud"),  # fell over
        ("local", "local"),
    ]
    assert (log[1]["prompt_tokens"], log[1]["completion_tokens"]) == (1000, 3)
    assert log[1]["cost_usd"] == pytest.approx((1000 * 1.0 + 3 * 2.0) / 1e6, rel=1e-12)
    # The local price has no cache discount: cached prompt tokens cost the input price.
    assert log[3]["cost_usd"] == pytest.approx((4000 * 1.0 + 1 * 2.0) / 1e6, rel=1e-12)

    mini = unit_prices(Pricing.catalog("gpt-4o-mini"))
    assert mini is not None and mini.input > 0 and mini.output > 0 and mini.cached_input is not None
    for record in (log[0], log[2]):  # the plan and the fallover are billed at gpt-4o-mini's prices
        cached = record["cached_tokens"] or 0
        expected = (record["prompt_tokens"] - cached) * mini.input + cached * mini.cached_input
        expected = (expected + record["completion_tokens"] * mini.output) / 1e6
        assert record["cost_usd"] > 0 and record["cost_usd"] == pytest.approx(expected, rel=1e-9)
    assert log[2]["cost_usd"] != pytest.approx((3000 * 1.0 + 1 * 2.0) / 1e6)

    totals = out["totals"]
    assert totals["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in log), rel=1e-12)
    assert totals["unpriced"] == 0
    assert (totals["cloud"]["inferences"], totals["local"]["inferences"]) == (2, 2)
    assert totals["local"]["prompt_tokens"] == 5000 and totals["cloud"]["cached_tokens"] == 500
    await checkpointed_once(rig.graph, rig.config, [USER])


# --------------------------------------------------------------------------- lifecycle


def count_closes(links: Iterable[Provider]) -> Counter[str]:
    """Count each link's teardowns (its ``close`` callable), not just its ``closed`` flag."""
    counts: Counter[str] = Counter()
    for link in links:

        async def counted(model: BaseChatModel, link: Provider = link, close: Any = link.close) -> None:
            counts[link.id] += 1
            await close(model)

        link.close = counted
    return counts


def client_closed(link: Provider) -> bool:
    """Whether the HTTP client a default-built model owns is closed."""
    model = link.model
    assert isinstance(model, ChatOpenAI) and isinstance(model.http_async_client, httpx.AsyncClient)
    return model.http_async_client.is_closed


@pytest.fixture
def default_models(cloud: FakeOpenAI, local: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> FusionSettings:
    """Operator settings for default-built models (key from the environment) pointed at the fakes."""
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    cloud.script(lambda body: calls(f"plan-{len(cloud.requests)}"))
    local.script(lambda body: calls("step") if body["messages"][-1]["content"] != "step" else Reply("done"))
    return FusionSettings(
        cloud_model="gpt-4o-mini",
        cloud_models=("gpt-4o",),
        cloud_base_url=cloud.base_url,
        local_base_url=local.base_url,
        local_slots=4,
        request_timeout=10.0,
    )


async def test_context_swap_keeps_the_local_provider_and_close_tears_down_each_once(
    local: FakeOpenAI, saver: AsyncSqliteSaver, default_models: FusionSettings
) -> None:
    swap = {"cloud_model": "gpt-4o"}  # a run may pick another model the operator allowed
    resolver = ProviderResolver(settings=default_models)
    graph: Graph = build_graph(resolver=resolver, tools=[echo], checkpointer=saver)
    config: RunnableConfig = {"configurable": {"thread_id": "swap"}}
    first: dict[str, Any] = {}
    second: dict[str, Any] = swap
    await graph.ainvoke({"messages": [("user", "turn one")]}, config, context=first)
    asked_before = len(local.requests)
    out = await graph.ainvoke({"messages": [("user", "turn two")]}, config, context=second)

    one = await resolver.chain(FusionContext(**first))
    two = await resolver.chain(FusionContext(**second))
    assert one is not two
    assert one.links[1] is two.links[1], "the local provider was rebuilt by a context swap"
    cloud_two = "cloud:gpt-4o" if "cloud_model" in swap else CLOUD_ID
    assert (one.links[0] is two.links[0]) == (cloud_two == CLOUD_ID)
    turn_two = [(r["kind"], r["leg"], r["provider"]) for r in out["route_log"] if r["turn"] == 1]
    assert turn_two == [
        ("plan", "cloud", cloud_two),
        ("step", "local", LOCAL_ID),
        ("step", "local", LOCAL_ID),
    ]
    assert len(local.requests) == asked_before + 2
    await checkpointed_once(graph, config, ["turn one", "turn two"])

    links = list({id(link): link for link in one.links + two.links}.values())
    assert len(links) == (3 if "cloud_model" in swap else 2)
    assert not any(link.closed or client_closed(link) for link in links)
    closes = count_closes(links)
    await resolver.aclose()
    assert closes == Counter({link.id: 1 for link in links})
    assert all(link.closed and client_closed(link) for link in links)
    await resolver.aclose()  # closing twice is harmless and tears nothing down again
    for link in links:
        await link.aclose()
        await close_chat_model(link.model)
    assert closes == Counter({link.id: 1 for link in links})

    async def invoke(link: Provider) -> Any:
        return await link.model.ainvoke("hi")

    with pytest.raises(RuntimeError, match="closed"):
        await two.call(invoke, preferred_leg="local")


async def test_the_graph_refuses_to_run_after_its_resolver_closed(
    local: FakeOpenAI, saver: AsyncSqliteSaver, default_models: FusionSettings
) -> None:
    resolver = ProviderResolver(settings=default_models)
    graph: Graph = build_graph(resolver=resolver, tools=[echo], checkpointer=saver)
    config: RunnableConfig = {"configurable": {"thread_id": "closed"}}
    await graph.ainvoke({"messages": [("user", "before close")]}, config)
    await resolver.aclose()
    asked = len(local.requests)
    try:
        await graph.ainvoke({"messages": [("user", "after close")]}, config)
    except Exception as error:  # any loud failure will do; a silent success will not
        assert "close" in str(error), f"failed, but not saying the providers are closed: {error!r}"
    else:
        rebuilt = len(resolver._links)
        raise AssertionError(
            f"a run after resolver.aclose() succeeded: the resolver silently rebuilt {rebuilt} providers "
            f"(new HTTP clients nobody closes) and sent {len(local.requests) - asked} local requests"
        )
