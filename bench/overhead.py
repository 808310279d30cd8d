"""Per-step overhead of the fusion graph against LangChain's own agent loop (``create_agent``).

Both run the same 30-step turn: an instant scripted chat model asks for one
tool call per step (29 times), then answers; the tool echoes its argument.
Both use an in-memory checkpointer. Runs are interleaved in one process
(fusion, agent, agent, fusion, ...) so machine noise hits both alike; the
result is the ratio of median per-step times, measured in the same run.

    python -m bench.overhead                 # 15 rounds
    python -m bench.overhead --rounds 40 --out overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fusion_graph import FusionContext, build_graph

STEPS = 30


class Scripted(GenericFakeChatModel):
    """Answers from a script at once; accepts tool binding (the script decides the calls)."""

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> BaseChatModel:
        """Tools are accepted and ignored."""
        return self


def script(steps: int) -> list[AIMessage]:
    """``steps - 1`` answers with one distinct tool call each, then a final answer."""
    calls = [
        AIMessage(
            content="",
            tool_calls=[{"name": "echo", "args": {"text": f"step {i}"}, "id": f"c{i}", "type": "tool_call"}],
        )
        for i in range(steps - 1)
    ]
    return [*calls, AIMessage(content="done")]


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


def model(answers: Sequence[AIMessage]) -> Scripted:
    return Scripted(messages=iter(list(answers)))


async def run_fusion(steps: int, thread: str) -> float:
    # The plan runs on cloud; every later step on local (low scores at cloud_share 30).
    answers = script(steps)
    graph = build_graph(
        cloud_model=model(answers[:1]),
        local_model=model(answers[1:]),
        tools=[echo],
        checkpointer=InMemorySaver(),
    )
    graph_input: Any = {"messages": [HumanMessage("go")]}
    context = FusionContext(max_steps=steps + 5, sub_runners="off", loop_repeat_limit=100)
    began = time.perf_counter()
    out = await graph.ainvoke(graph_input, {"configurable": {"thread_id": thread}}, context=context)
    elapsed = time.perf_counter() - began
    assert [r["leg"] for r in out["route_log"]] == ["cloud"] + ["local"] * (steps - 1)
    return elapsed


async def run_agent(steps: int, thread: str) -> float:
    agent = create_agent(model(script(steps)), tools=[echo], checkpointer=InMemorySaver())
    began = time.perf_counter()
    out = await agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": thread}})
    elapsed = time.perf_counter() - began
    assert sum(isinstance(m, AIMessage) for m in out["messages"]) == steps
    return elapsed


async def measure(rounds: int, steps: int) -> dict[str, Any]:
    fusion: list[float] = []
    agent: list[float] = []
    await run_fusion(steps, "warm-f")
    await run_agent(steps, "warm-a")
    with Progress(transient=True) as progress:
        task = progress.add_task("interleaved runs", total=rounds)
        for i in range(rounds):
            pair = (run_fusion, fusion), (run_agent, agent)
            for runner, times in pair if i % 2 == 0 else reversed(pair):
                times.append(await runner(steps, f"r{i}") / steps)
            progress.advance(task)
    f_med, a_med = statistics.median(fusion), statistics.median(agent)
    return {
        "steps_per_turn": steps,
        "rounds": rounds,
        "fusion_ms_per_step": round(f_med * 1000, 3),
        "create_agent_ms_per_step": round(a_med * 1000, 3),
        "ratio": round(f_med / a_med, 3),
        "fusion_ms_per_step_all": [round(t * 1000, 3) for t in fusion],
        "create_agent_ms_per_step_all": [round(t * 1000, 3) for t in agent],
        "target_ratio": 1.10,
        "meta": {"python": platform.python_version(), "machine": platform.machine()},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.rounds, args.steps))
    table = Table(title=f"per-step time, {args.steps}-step turn, median of {args.rounds} interleaved runs")
    for column in ("graph", "ms / step", "ratio"):
        table.add_column(column)
    table.add_row("create_agent", f"{result['create_agent_ms_per_step']:.3f}", "1.00")
    table.add_row("fusion-graph", f"{result['fusion_ms_per_step']:.3f}", f"{result['ratio']:.2f}")
    Console(stderr=True).print(table)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
