"""Child process for the traces test: one turn with ``FUSION_TRACES=true``, spans exported as configured.

Usage: ``python -m tests.integration.traced_turn_child CLOUD_URL LOCAL_URL OUT KEY``. The
OpenTelemetry destination comes from the standard ``OTEL_*`` variables, as in a
deployment; the turn's route log goes to ``OUT`` (JSON). At exit the SDK flushes
the spans it still holds.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.providers.llama_server import ChatLlamaServer
from tests.plugins.fakes import user_input


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


async def main(cloud_url: str, local_url: str, out: Path, key: str) -> None:
    graph = build_graph(
        cloud_model=ChatOpenAI(model="c", base_url=cloud_url, api_key=key, max_retries=0, stream_usage=True),
        local_model=ChatLlamaServer(
            model="l", base_url=local_url, api_key="x", max_retries=0, stream_usage=True
        ),
        tools=[lookup],
        checkpointer=InMemorySaver(),
        settings=FusionSettings(traces=True, price_overrides={"c": (10.0, 10.0, 1.0)}),
    )
    config: Any = {"configurable": {"thread_id": "traced"}}
    state = await graph.ainvoke(user_input("look it up"), config, context=FusionContext(cloud_share=30))
    out.write_text(json.dumps(state["route_log"], default=str), encoding="utf-8")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]))
