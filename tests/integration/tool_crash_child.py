"""Child process for the per-call durability test: one turn whose second tool call hangs.

Usage: ``python -m tests.integration.tool_crash_child DB LEDGER (start|resume) (ainvoke|astream)``.
``start`` runs a turn whose plan asks for calls A and B; A returns at once, B
hangs until the parent kills the process. ``resume`` continues the thread from
its checkpoint in a new process, where B returns at once. The models are
OpenAI-compatible fakes over HTTP, so ``astream(stream_mode="messages")``
streams real answers; the graph runs with its default durability.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from fusion_graph import FusionContext, build_graph
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input


async def main(db: str, ledger_path: str, mode: str, how: str) -> None:
    ledger = Path(ledger_path)

    def log(line: str) -> None:
        with ledger.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()

    @tool
    async def job(name: str) -> str:
        """Run a job with a side effect."""
        log(f"{name} start")
        if name == "B" and mode == "start":
            await asyncio.Event().wait()  # killed here: nothing ever sets it
        log(f"{name} done")
        return f"{name} ok"

    calls = Reply(content="", tool_calls=[("job", {"name": "A"}), ("job", {"name": "B"})])
    done = Reply(content="all done")
    config: Any = {"configurable": {"thread_id": "crash"}}
    context = FusionContext(sub_runners="off", cloud_share=100)  # every step on the cloud fake
    with FakeOpenAI([calls, done] if mode == "start" else [done]) as cloud:
        async with AsyncSqliteSaver.from_conn_string(db) as saver:
            graph = build_graph(
                cloud_model=ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
                local_model=ChatLlamaServer(model="l", base_url=cloud.base_url, api_key="x", max_retries=0),
                tools=[job],
                checkpointer=saver,
            )
            payload = user_input("run A and B") if mode == "start" else None
            if how == "ainvoke":
                await graph.ainvoke(payload, config, context=context)
            else:
                async for _ in graph.astream(payload, config, context=context, stream_mode="messages"):
                    pass
            out = (await graph.aget_state(config)).values
            log(f"final {out['messages'][-1].content}")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
