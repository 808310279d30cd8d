"""Child process for the per-call durability test: one turn whose second tool call hangs.

Usage: ``python -m tests.integration.tool_crash_child DB LEDGER (start|resume)``. ``start`` runs
a turn whose plan asks for calls A and B; A returns at once, B hangs until the
parent kills the process. ``resume`` continues the thread from its checkpoint
in a new process, where B returns at once.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from langchain_core.tools import tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from fusion_graph import FusionContext, build_graph
from tests.plugins.fakes import ai_calls, call, scripted, user_input


async def main(db: str, ledger_path: str, mode: str) -> None:
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
            await asyncio.sleep(600)  # killed here
        log(f"{name} done")
        return f"{name} ok"

    cloud = scripted("cloud", [ai_calls(call("job", {"name": "A"}, "a"), call("job", {"name": "B"}, "b"))])
    local = scripted("local", ["all done"])
    config: Any = {"configurable": {"thread_id": "crash"}}
    async with AsyncSqliteSaver.from_conn_string(db) as saver:
        graph = build_graph(cloud_model=cloud, local_model=local, tools=[job], checkpointer=saver)
        payload = user_input("run A and B") if mode == "start" else None
        out = await graph.ainvoke(payload, config, context=FusionContext(sub_runners="off"))
        log(f"final {out['messages'][-1].content}")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
