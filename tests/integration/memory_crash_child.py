"""Child process for the durable memory test: a turn whose memory job never ends, then the next turn.

Usage: ``python -m tests.integration.memory_crash_child DIR LEDGER (start|next)``. ``start``
runs a turn in ``background`` memory mode whose memory job hangs, writes
``reply ...`` to the ledger once the run has returned, and waits to be killed.
``next`` runs the thread's next turn in a new process (SQLite checkpoints and
store in ``DIR``), then drains the memory jobs and writes ``final ...``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from langchain_core.tools import tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.store.sqlite.aio import AsyncSqliteStore

from fusion_graph import FusionContext, build_graph, memory
from tests.plugins.fakes import ScriptedModel, ai_calls, call, scripted, user_input

GOOD = json.dumps({"items": [{"kind": "fact", "text": "The user prefers tabs."}]})
#: The second job's fact: a repeat of the first would be left out as a duplicate (``memory.screen``).
OTHER = json.dumps({"items": [{"kind": "fact", "text": "The user formats files with ruff."}]})
CONFIG: Any = {"configurable": {"thread_id": "crash"}}


class HangingMemory(ScriptedModel):
    """Answers steps from its script; a memory job (the job's instructions last) never ends."""

    async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any) -> Any:
        if messages[-1].text == memory.DEFAULT_JOBS[0].instructions:
            await asyncio.sleep(600)  # killed here
        return await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kw)


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


async def main(folder: str, ledger_path: str, mode: str) -> None:
    ledger = Path(ledger_path)

    def log(line: str) -> None:
        with ledger.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()

    root = Path(folder)
    async with (
        AsyncSqliteSaver.from_conn_string(str(root / "threads.sqlite")) as saver,
        AsyncSqliteStore.from_conn_string(str(root / "store.sqlite")) as store,
    ):
        await store.setup()
        context = FusionContext(memory_mode="background", memory_recall_limit=0)
        if mode == "start":
            cloud = scripted("cloud", [ai_calls(call("echo", {"text": "x"}, "c1"))])
            local: ScriptedModel = HangingMemory(messages=iter(["all done"]), model_name="local")
            graph = build_graph(
                cloud_model=cloud, local_model=local, tools=[echo], checkpointer=saver, store=store
            )
            out = await graph.ainvoke(user_input("I like tabs"), CONFIG, context=context)
            log(f"reply {out['messages'][-1].content}")
            await asyncio.sleep(600)  # killed here, its memory job still running
        else:
            cloud = scripted("cloud", ["second answer"])
            local = scripted("local", [GOOD, OTHER])
            graph = build_graph(
                cloud_model=cloud, local_model=local, tools=[echo], checkpointer=saver, store=store
            )
            out = await graph.ainvoke(user_input("format this file"), CONFIG, context=context)
            await memory.drain(timeout=60)
            log(f"final {out['messages'][-1].content}")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
