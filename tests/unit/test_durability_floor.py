"""Every run gets at least the operator's durability: a saved tool result always has its checkpoint.

LangGraph files a finished task's writes (``put_writes``) under the checkpoint
its superstep started from. Under ``durability="async"`` that checkpoint is
saved in the background while the step's tasks run, so a tool call's result
can be saved before its checkpoint is: a crash in between loses both, and the
call runs again on resume (what the kill test in
``tests/integration/test_durability.py`` once saw under load: each checkpoint
save waits for the one before, so a slow save holds the step's checkpoint back
while the first call's write takes the SQLite saver's lock ahead of it). Under
``sync`` the checkpoint is saved before the tasks start. The saver here saves
checkpoints slowly (it yields to every ready task first, as a busy machine
would) and records each model answer or tool result filed under a checkpoint
not saved yet: no timing is involved, only the order of the saver's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.run_queue import run_durability
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input

CONFIG: Any = {"configurable": {"thread_id": "t1"}}


class OrderedSaver(InMemorySaver):
    """An in-memory saver that saves checkpoints last and notes writes filed ahead of their checkpoint.

    ``hold``: each checkpoint save waits until a tool result was written (only a run
    that does not await its checkpoints gets there); otherwise it lets every ready task run first.
    """

    def __init__(self, *, hold: bool = False) -> None:
        super().__init__()
        self.hold = hold
        self.result_written = asyncio.Event()
        self.saved: set[str] = set()
        self.orphans: list[str] = []
        """Model answers and tool results saved under a checkpoint not saved yet (a crash loses them)."""
        self.results: list[str] = []
        """Every tool result saved (``result <content>``)."""

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        if self.hold:
            with contextlib.suppress(TimeoutError):  # a bound on a hang only; nothing asserts on time
                await asyncio.wait_for(self.result_written.wait(), 60)
        for _ in range(50):  # every task that is ready runs first, as on a busy machine
            await asyncio.sleep(0)
        saved = await super().aput(config, checkpoint, metadata, new_versions)
        self.saved.add(checkpoint["id"])
        return saved

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        produced = [
            f"result {m.content}" if isinstance(m, ToolMessage) else f"answer {m.content}"
            for channel, value in writes
            if channel == "messages"
            for m in (value if isinstance(value, list) else [value])
            if isinstance(m, AIMessage | ToolMessage)
        ]
        self.results += [p for p in produced if p.startswith("result ")]
        if config["configurable"]["checkpoint_id"] not in self.saved:
            self.orphans += produced
        if any(p.startswith("result ") for p in produced):
            self.result_written.set()
        await super().aput_writes(config, writes, task_id, task_path)


async def run_turn(saver: OrderedSaver, how: str, settings: FusionSettings, **kwargs: Any) -> list[str]:
    """One turn whose plan calls two tools at once; the ledger of tool starts."""
    ledger: list[str] = []

    @tool
    async def job(name: str) -> str:
        """Run a job with a side effect."""
        ledger.append(name)
        return f"{name} ok"

    calls = Reply(content="", tool_calls=[("job", {"name": "A"}), ("job", {"name": "B"})])
    done = Reply(content="all done")
    with FakeOpenAI([calls, done]) as cloud, FakeOpenAI([done]) as local:
        graph = build_graph(
            cloud_model=ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
            local_model=ChatLlamaServer(model="l", base_url=local.base_url, api_key="x", max_retries=0),
            tools=[job],
            checkpointer=saver,
            settings=settings,
        )
        context = FusionContext(sub_runners="off", cloud_share=100)
        if how == "ainvoke":
            await graph.ainvoke(user_input("run A and B"), CONFIG, context=context, **kwargs)
        else:
            async for _ in graph.astream(
                user_input("run A and B"), CONFIG, context=context, stream_mode="messages", **kwargs
            ):
                pass
        out = (await graph.aget_state(CONFIG)).values
    assert out["messages"][-1].content == "all done"
    return ledger


@pytest.mark.parametrize("how", ["ainvoke", "astream"])
@pytest.mark.parametrize(
    "asked", [{}, {"durability": "async"}, {"durability": "exit"}, {"checkpoint_during": False}]
)
async def test_a_tool_result_is_never_saved_ahead_of_its_checkpoint(how: str, asked: dict[str, Any]) -> None:
    saver = OrderedSaver()
    ledger = await run_turn(saver, how, FusionSettings(), **asked)

    assert sorted(ledger) == ["A", "B"]
    # Both results were saved on their own (a run asking for "exit" saves none without the floor) ...
    assert sorted(saver.results) == ["result A ok", "result B ok"]
    # ... each under a checkpoint already saved: a crash after a result is saved never loses it.
    assert saver.orphans == []


async def test_the_operator_may_trade_that_for_speed_and_then_a_result_can_precede_its_checkpoint() -> None:
    """Why the floor exists: under ``async`` the same turn files a result ahead of its checkpoint.

    The saver holds every checkpoint save until a tool result is written: under
    ``async`` the calls run meanwhile, so the first result lands under a
    checkpoint that a crash right then would lose (with the result).
    """
    saver = OrderedSaver(hold=True)
    await run_turn(saver, "ainvoke", FusionSettings(durability="async"))

    assert any(orphan.startswith("result ") for orphan in saver.orphans), saver.orphans


def test_a_run_may_ask_for_more_durability_never_less() -> None:
    assert run_durability({}, "sync") == "sync"
    assert run_durability({"durability": "exit"}, "sync") == "sync"
    assert run_durability({"durability": "sync"}, "async") == "sync"
    assert run_durability({"durability": "exit"}, "async") == "async"
    assert run_durability({"checkpoint_during": True}, "exit") == "async"
    assert run_durability({"checkpoint_during": False}, "exit") == "exit"
    kwargs: dict[str, Any] = {"durability": "async", "checkpoint_during": True, "stream_mode": "values"}
    run_durability(kwargs, "sync")
    assert kwargs == {"stream_mode": "values"}  # LangGraph refuses both arguments at once: both are taken
