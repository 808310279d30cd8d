"""A graph over two OpenAI-compatible fake servers (``FakeOpenAI``): a priced cloud, a llama-server local leg.

For tests of what real HTTP answers do to a turn (usage, prices, budgets, shadow checks).
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionSettings, build_graph
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI

#: USD per million tokens (input, output, cached input) of the scripted cloud model ``c``.
PRICES = {"c": (10.0, 10.0, 1.0)}


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def graph_over(
    cloud: FakeOpenAI, local: FakeOpenAI, *, saver: Any = None, store: Any = None, **settings: Any
) -> Any:
    """The graph with ``lookup``: cloud model ``c`` on ``cloud``, llama-server ``l`` on ``local``."""
    return build_graph(
        cloud_model=ChatOpenAI(
            model="c", base_url=cloud.base_url, api_key="x", max_retries=0, stream_usage=True
        ),
        local_model=ChatLlamaServer(
            model="l", base_url=local.base_url, api_key="x", max_retries=0, stream_usage=True
        ),
        tools=[lookup],
        checkpointer=saver if saver is not None else InMemorySaver(),
        store=store,
        settings=FusionSettings(price_overrides=PRICES, local_slots=2, **settings),
    )
