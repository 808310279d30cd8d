"""A graph over two OpenAI-compatible fake servers (``FakeOpenAI``): a priced cloud, a llama-server local leg.

For tests of what real HTTP answers do to a turn (usage, prices, budgets, shadow checks).
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input

#: USD per million tokens (input, output, cached input) of the scripted cloud model ``c``.
PRICES = {"c": (10.0, 10.0, 1.0)}


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def lookup_then_done() -> list[Reply]:
    """A local leg's script: a ``lookup`` call (300 prompt tokens), then ``done`` (500, 420 cached)."""
    return [
        Reply(content="", tool_calls=[("lookup", {"key": "k1"})], prompt_tokens=300),
        Reply(content="done", prompt_tokens=500, cached_tokens=420),
    ]


def graph_over(
    cloud: FakeOpenAI,
    local: FakeOpenAI,
    *,
    saver: Any = None,
    store: Any = None,
    cloud_key: str = "x",
    **settings: Any,
) -> Any:
    """The graph with ``lookup``: cloud model ``c`` on ``cloud``, llama-server ``l`` on ``local``.

    ``cloud_key`` is the cloud model's API key (a test may plant a secret there).
    """
    return build_graph(
        cloud_model=ChatOpenAI(
            model="c", base_url=cloud.base_url, api_key=cloud_key, max_retries=0, stream_usage=True
        ),
        local_model=ChatLlamaServer(
            model="l", base_url=local.base_url, api_key="x", max_retries=0, stream_usage=True
        ),
        tools=[lookup],
        checkpointer=saver if saver is not None else InMemorySaver(),
        store=store,
        settings=FusionSettings(**{"price_overrides": PRICES, "local_slots": 2, **settings}),
    )


async def turn_state(
    graph: Any, text: str, how: str, context: FusionContext, config: RunnableConfig | None = None
) -> dict[str, Any]:
    """One turn of ``text``, by ``ainvoke`` or drained from ``astream(stream_mode="messages")`` (``how``).

    Every fault test runs both ways; either way the thread's state after the turn is returned.
    ``config`` defaults to thread ``t``.
    """
    config = config if config is not None else {"configurable": {"thread_id": "t"}}
    if how == "ainvoke":
        await graph.ainvoke(user_input(text), config, context=context)
    else:
        async for _ in graph.astream(user_input(text), config, context=context, stream_mode="messages"):
            pass
    return dict((await graph.aget_state(config)).values)
