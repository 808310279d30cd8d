"""The cloud API key never persists: a gateway that echoes it in a 401 leaves no trace of it.

The key is planted in ``OPENAI_API_KEY`` and the default cloud model is built from
the context (``build_cloud_model`` registers it). The cloud, an OpenAI-compatible
fake on loopback, answers 401 with the key in the error body, as some gateways do.
The graph runs on real SQLite checkpoints and store; afterwards the key must be in
none of: the database files (WAL included), the store, ``route_log``, the stream
events, the captured logs, the raised error (text, repr, notes, traceback) and the
provider's health record. Two key shapes: an ``sk-`` key (caught by its shape too)
and an opaque gateway key only the registry catches.
"""

from __future__ import annotations

import json
import logging
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.store.sqlite.aio import AsyncSqliteStore

from fusion_graph import FusionContext, build_graph, memory
from fusion_graph.errors import ChainExhausted, ProviderRequestError
from fusion_graph.memory.job_call import JobRunner, dropped_record, run_job
from fusion_graph.providers import ProviderResolver
from fusion_graph.providers.chain import ProviderChain
from fusion_graph.providers.models import Provider, build_cloud_model
from fusion_graph.providers.placement import FixedPlacement
from fusion_graph.providers.pricing import FREE, Pricing
from fusion_graph.redact import REDACTED, scrub
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.errors import response

CLOUD_ID, LOCAL_ID = "cloud:gpt-4o-mini", "local:local"
MEMORY_JSON = json.dumps({"items": [{"kind": "fact", "text": "The user wants the task done."}]})


def sk_key() -> str:
    return f"sk-test-{uuid.uuid4().hex}"


def gateway_key() -> str:
    """No rule matches this shape (dotted chunks too short to look random): only the registry."""
    return "gw." + ".".join(uuid.uuid4().hex[:10] for _ in range(3))


@pytest.fixture(params=[sk_key, gateway_key], ids=["sk-key", "gateway-key"])
def key(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    value: str = request.param()
    monkeypatch.setenv("OPENAI_API_KEY", value)
    return value


def echo_401(key: str) -> Reply:
    """A gateway's 401 that repeats the key it was sent."""
    body = {
        "error": {
            "message": f"Incorrect API key provided: {key}. Check your gateway settings.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return Reply(status=401, raw=json.dumps(body).encode())


def local_answers(body: dict[str, Any]) -> Reply:
    """llama-server stand-in: memory JSON for memory jobs (they ask for a schema), else a reply."""
    return Reply(content=MEMORY_JSON) if "response_format" in body else Reply(content="done locally")


@pytest.fixture
def cloud() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
def local() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(local_answers) as fake:
        yield fake


@dataclass
class Run:
    """A graph with default models on SQLite checkpoints and store, and all it left behind."""

    graph: Any
    resolver: ProviderResolver
    store: AsyncSqliteStore
    context: dict[str, Any]
    config: RunnableConfig = field(default_factory=lambda: RunnableConfig(configurable={"thread_id": "t"}))
    events: list[Any] = field(default_factory=list)

    async def turn(self, text: str) -> None:
        stream = self.graph.astream(
            {"messages": [("user", text)]},
            self.config,
            context=self.context,
            stream_mode=["custom", "values"],
        )
        async for event in stream:
            self.events.append(event)

    async def route_log(self) -> list[dict[str, Any]]:
        log: list[dict[str, Any]] = (await self.graph.aget_state(self.config)).values.get("route_log", [])
        return log

    async def stored(self) -> list[dict[str, Any]]:
        items = []
        for ns in await self.store.alist_namespaces():
            items += [
                {"ns": item.namespace, **item.value} for item in await self.store.asearch(ns, limit=1000)
            ]
        return items

    async def texts(self) -> dict[str, str]:
        """Everything the run persisted or streamed, as text, by where it came from."""
        state = await self.graph.aget_state(self.config)
        chain = await self.resolver.chain(FusionContext(**self.context))
        return {
            "route_log": json.dumps(await self.route_log(), default=repr),
            "state": repr(state),
            "stream events": json.dumps(self.events, default=repr),
            "store": json.dumps(await self.stored(), default=repr),
            "health": repr([chain.health(link.id) for link in chain.links]),
        }


@pytest.fixture
async def run(tmp_path: Path, cloud: FakeOpenAI, local: FakeOpenAI) -> AsyncIterator[Run]:
    async with (
        AsyncSqliteSaver.from_conn_string(str(tmp_path / "checkpoints.sqlite")) as saver,
        AsyncSqliteStore.from_conn_string(str(tmp_path / "store.sqlite")) as store,
    ):
        await store.setup()
        settings = FusionSettings(
            cloud_base_url=cloud.base_url, local_base_url=local.base_url, local_slots=4, request_timeout=10.0
        )
        resolver = ProviderResolver(settings=settings)
        graph = build_graph(resolver=resolver, tools=[], checkpointer=saver, store=store)
        yield Run(graph, resolver, store, {"memory_mode": "inline"})  # jobs inside the run
        await resolver.aclose()


def database_bytes(folder: Path) -> dict[str, bytes]:
    """Every SQLite file in ``folder``: the databases and their ``-wal``/``-shm`` files."""
    files = {path.name: path.read_bytes() for path in folder.iterdir() if ".sqlite" in path.name}
    assert {"checkpoints.sqlite", "store.sqlite"} <= set(files)
    return files


def assert_nowhere(key: str, texts: dict[str, str], blobs: dict[str, bytes]) -> None:
    assert [where for where, text in texts.items() if key in text] == []
    assert [name for name, blob in blobs.items() if key.encode() in blob] == []


async def test_an_exhausted_chain_leaves_no_key_anywhere(
    key: str, run: Run, cloud: FakeOpenAI, local: FakeOpenAI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cloud.script([echo_401(key)])
    local.script([Reply(status=500)])
    caplog.set_level(logging.DEBUG)

    with pytest.raises(ChainExhausted) as raised:
        await run.turn("please do the task")
    error = raised.value

    assert len(cloud.requests) == 1 and len(local.requests) == 1, "both legs were really called"
    cloud_attempt = next(a for a in error.attempts if a.provider == CLOUD_ID)
    assert cloud_attempt.error.endswith("AuthenticationError") and cloud_attempt.kind == "misconfigured"
    assert "Incorrect API key provided: " + REDACTED in cloud_attempt.message, "the echo was scrubbed"
    assert error.__cause__ is None and error.__context__ is None, "no raw provider error is chained"
    last_error = (await run.resolver.chain(FusionContext(**run.context))).health(CLOUD_ID).last_error
    assert last_error is not None and REDACTED in last_error

    texts = await run.texts()
    texts |= {
        "logs": caplog.text,
        "str(error)": str(error),
        "repr(error)": repr(error),
        "notes": repr(getattr(error, "__notes__", [])),
        "traceback": "".join(traceback.format_exception(error)),
        "attempts": repr(error.attempts),
    }
    assert REDACTED in texts["str(error)"] and CLOUD_ID in texts["str(error)"]
    blobs = database_bytes(tmp_path)
    assert_nowhere(key, texts, blobs)


def echo_400(key: str) -> Reply:
    """A 400 whose body repeats the key (a request the provider refuses: no fallover)."""
    body = {"error": {"message": f"Invalid parameter for key {key}", "type": "invalid_request_error"}}
    return Reply(status=400, raw=json.dumps(body).encode())


@pytest.mark.parametrize("streamed", [False, True], ids=["ainvoke", "messages"])
async def test_a_refused_request_echoing_the_key_leaves_it_nowhere(
    key: str,
    run: Run,
    cloud: FakeOpenAI,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    streamed: bool,
) -> None:
    cloud.script([echo_400(key)])
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ProviderRequestError) as raised:
        if streamed:
            stream = run.graph.astream(
                {"messages": [("user", "plan it")]}, run.config, context=run.context, stream_mode="messages"
            )
            async for event in stream:
                run.events.append(event)
        else:
            await run.turn("plan it")
    error = raised.value
    assert error.__cause__ is None and error.__context__ is None
    texts = await run.texts()
    texts |= {
        "logs": caplog.text,
        "str(error)": str(error),
        "notes": repr(getattr(error, "__notes__", [])),
        "traceback": "".join(traceback.format_exception(error)),
    }
    assert REDACTED in texts["str(error)"]
    assert_nowhere(key, texts, database_bytes(tmp_path))


async def test_a_cloud_failure_in_route_log_leaves_no_key_anywhere(
    key: str, run: Run, cloud: FakeOpenAI, local: FakeOpenAI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cloud.script([echo_401(key), Reply(content="done on cloud")])
    caplog.set_level(logging.DEBUG)

    await run.turn("please do the task")  # the plan fails on cloud and runs on local
    await run.turn("and once more")  # cloud is back (one failure is within the allowed two)

    log = await run.route_log()
    plans = [(r["turn"], r["provider"]) for r in log if r["kind"] == "plan"]
    assert plans == [(0, LOCAL_ID), (1, CLOUD_ID)]
    [attempt] = next(r for r in log if r["kind"] == "plan")["attempts"]
    assert (attempt["provider"], attempt["kind"]) == (CLOUD_ID, "misconfigured")
    assert attempt["message"].startswith("Error code: 401") and REDACTED in attempt["message"]
    assert any(r["kind"] == "memory" for r in log) and await run.stored(), "memory jobs ran and stored"
    routed = [e for mode, e in run.events if mode == "custom" and e.get("attempts")]
    assert routed and REDACTED in json.dumps(routed), "the attempt was streamed, scrubbed"

    texts = await run.texts() | {"logs": caplog.text}
    assert_nowhere(key, texts, database_bytes(tmp_path))


# --------------------------------------------------------------------------- the chain alone


def holding(provider_id: str, key: str) -> Provider:
    """A cloud link whose model holds ``key`` (the tests' ``invoke`` never calls it)."""
    model = ChatOpenAI(model="gpt-4o-mini", api_key=key, base_url="http://127.0.0.1:9/v1")
    return Provider(provider_id, "cloud", model, Pricing.flat(FREE))


def echoed(key: str) -> openai.AuthenticationError:
    return openai.AuthenticationError(f"Incorrect API key provided: {key}", response=response(401), body=None)


def test_the_default_cloud_model_registers_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = gateway_key()
    monkeypatch.setenv("GATEWAY_KEY", key)
    assert scrub(f"sent {key}") == f"sent {key}", "no rule knows this shape"
    build_cloud_model(FusionSettings(cloud_api_key_env="GATEWAY_KEY"))
    assert scrub(f"sent {key}") == f"sent {REDACTED}"


def test_a_chain_link_registers_the_key_its_model_holds() -> None:
    key = gateway_key()
    assert scrub(f"sent {key}") == f"sent {key}", "no rule knows this shape"
    holding(CLOUD_ID, key)
    assert scrub(f"sent {key}") == f"sent {REDACTED}"


async def test_the_note_on_a_reraised_error_lists_scrubbed_attempts() -> None:
    key = gateway_key()
    local = Provider(LOCAL_ID, "local", GenericFakeChatModel(messages=iter([])), Pricing.flat(FREE))
    chain = ProviderChain([holding(CLOUD_ID, key), local])
    refused = openai.BadRequestError("context too long", response=response(400), body=None)

    async def invoke(link: Provider) -> AIMessage:
        raise echoed(key) if link.leg == "cloud" else refused

    with pytest.raises(ProviderRequestError) as raised:
        await chain.call(invoke, preferred_leg="cloud")
    assert raised.value.error_type == "BadRequestError", "a bad request is raised as our own error"
    assert raised.value.__cause__ is None and raised.value.__context__ is None
    notes = "\n".join(raised.value.__notes__)
    assert CLOUD_ID in notes and f"Incorrect API key provided: {REDACTED}" in notes
    assert key not in notes
    last_error = chain.health(CLOUD_ID).last_error
    assert last_error == f"AuthenticationError: Incorrect API key provided: {REDACTED}"


async def test_chain_exhausted_chains_no_provider_error() -> None:
    key = gateway_key()
    chain = ProviderChain([holding(CLOUD_ID, key)])

    async def invoke(link: Provider) -> AIMessage:
        raise echoed(key)

    with pytest.raises(ChainExhausted) as raised:
        await chain.call(invoke)
    error = raised.value
    assert error.__cause__ is None and error.__suppress_context__
    shown = "".join(traceback.format_exception(error))
    assert f"Incorrect API key provided: {REDACTED}" in shown
    assert key not in shown and "direct cause" not in shown and "During handling" not in shown


class Buggy(GenericFakeChatModel):
    """A model whose call fails with an unknown error (re-raised by the chain, never failed over)."""

    detail: str = ""

    async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"binding bug near {self.detail}")


async def test_a_dropped_memory_job_says_why_without_the_key(caplog: pytest.LogCaptureFixture) -> None:
    key = gateway_key()
    holding("cloud:registers", key)
    buggy = Buggy(messages=iter([]), detail=key)
    chain = ProviderChain([Provider(LOCAL_ID, "local", buggy, Pricing.flat(FREE))])

    job = memory.DEFAULT_JOBS[0]
    runner = JobRunner(
        chain=chain,
        leg="local",
        system_prompt="",
        tools=[],
        placer=FixedPlacement(),
        thread_id="t",
        max_tokens=64,
    )
    result, records, why = await run_job(job, [HumanMessage("x")], runner, turn=0, step=0)
    assert result is None and records == []
    assert why is not None and why.startswith("provider error: ProviderRequestError: ")
    assert why.endswith(f"RuntimeError: binding bug near {REDACTED}")
    assert "binding bug near" in caplog.text and key not in caplog.text
    record = dropped_record(job, "local", 0, 0, f"store write failed: {key}")
    assert record["memory"]["dropped"] == f"store write failed: {REDACTED}"


# --------------------------------------------------------------------------- streams, other libraries' logs


@pytest.mark.parametrize("streamed", [False, True], ids=["ainvoke", "messages"])
async def test_a_key_the_model_streams_back_in_pieces_reaches_no_event(
    key: str, run: Run, cloud: FakeOpenAI, tmp_path: Path, streamed: bool
) -> None:
    text = f"Your key is {key}, keep it safe."
    cut = text.index(key) + len(key) // 2  # the key is split between two chunks
    cloud.script([Reply(content=text, pieces=[text[:cut], text[cut:]])])
    events: list[Any] = []
    context = {**run.context, "sub_runners": "off"}
    if streamed:
        async for event in run.graph.astream(
            {"messages": [("user", "what is my key?")]}, run.config, context=context, stream_mode="messages"
        ):
            events.append(event)
    else:
        await run.graph.ainvoke({"messages": [("user", "what is my key?")]}, run.config, context=context)
    state = await run.graph.aget_state(run.config)
    answer = state.values["messages"][-1].content
    assert answer == f"Your key is {REDACTED}, keep it safe."
    if streamed:
        pieces = [message.content for message, _ in events if message.type in ("AIMessageChunk", "ai")]
        assert len(pieces) >= 2 and "".join(pieces) == answer  # everything came out, scrubbed
        assert not any(key[: len(key) // 2] in piece for piece in pieces), "half the key left in a chunk"
    assert_nowhere(
        key, {"events": json.dumps(events, default=repr), "state": repr(state)}, database_bytes(tmp_path)
    )


@pytest.mark.parametrize("streamed", [False, True], ids=["ainvoke", "messages"])
async def test_a_401_echoing_the_key_only_in_its_headers_leaves_it_in_no_log_line(
    key: str, run: Run, cloud: FakeOpenAI, caplog: pytest.LogCaptureFixture, streamed: bool
) -> None:
    body = json.dumps({"error": {"message": "unauthorized", "type": "invalid_request_error"}}).encode()
    cloud.script(
        [Reply(status=401, raw=body, headers={"x-echoed-authorization": f"Bearer {key}", "x-key": key})]
    )
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "openai"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    context = {**run.context, "sub_runners": "off"}
    try:
        if streamed:
            async for _ in run.graph.astream(
                {"messages": [("user", "hi")]}, run.config, context=context, stream_mode="messages"
            ):
                pass
        else:
            await run.graph.ainvoke({"messages": [("user", "hi")]}, run.config, context=context)
    finally:
        for name in ("httpx", "httpcore", "openai"):
            logging.getLogger(name).setLevel(logging.NOTSET)
    assert any(r.name.startswith(("httpcore", "openai", "httpx")) for r in caplog.records), "they logged"
    assert len(cloud.requests) == 1
    assert key not in caplog.text
