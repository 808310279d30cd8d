"""Per-step overhead of the fusion graph against LangChain's own agent loop (``create_agent``).

For each turn length N (``--steps``, default 3, 30, 100 and 300), both graphs run
the same N-step turn: an instant scripted chat model asks for one tool call
per step (N - 1 times), then answers; the tool echoes its argument. Both use
an in-memory checkpointer. Runs are interleaved in one process (agent, fusion,
fusion, agent, ...) so machine noise hits both alike; the result per length is
the ratio of median per-step times, measured in the same run. A ratio that
grows with N means some per-step work grows with the history. Garbage is
collected before each timed run, so one run does not pay for another's.

``--telemetry`` measures instead what metrics and traces cost a step: the same
fusion turn with both on (metrics into a registry, every span through a batch
processor into an exporter that drops it) against both off, interleaved likewise.

``--middleware`` measures what ``FusionRoutingMiddleware`` costs a ``create_agent``
agent: the same agent with it (the plan routed to the cloud model, every later
step to the local one, each recorded) against without it.

``--floor`` measures what LangGraph alone costs on fusion's shape: a bare graph over
``fusion_graph.state.State`` with fusion's node names (the idle ones only add channels) and
edges: a ``plan`` node, ``ToolNode`` with one ``Send`` per tool call, and after a tool an edge
that sends the next step to ``local`` with a real step order as its payload, ``local`` reading
the state as fusion's executor does; both inference nodes call the model and write what a
fusion step writes (its record, step and totals). No routing rule, no provider chain, no
batch rules, no hooks; against ``create_agent``. What fusion costs beyond that floor is its
own per-step work.

``--warm`` builds each graph once a length, with models that replay the script turn after turn,
and runs every turn through it on a new thread, as an app that builds its graph once does: a
graph's one-off set-up on its first run (fusion builds its provider chain then) is paid by the
warm-up run, not by every timed one.

``--rounds`` is the number of interleaved pairs per length (default 15; for
turns longer than 300 steps the default shrinks in proportion, so each length
costs about as much as 300 steps do). The table goes to stderr, the JSON to
stdout and to ``--out``.

    python -m bench.overhead                              # 3, 30, 100 and 300 steps, 15 rounds each
    python -m bench.overhead --steps 30 --rounds 40 --out overhead.json
    python -m bench.overhead --telemetry --out telemetry.json  # telemetry on against off
    python -m bench.overhead --middleware --out middleware.json  # create_agent with the middleware
    python -m bench.overhead --floor --out floor.json      # LangGraph alone on fusion's shape
    python -m bench.overhead --warm --steps 1 3 30 --out warm.json  # each graph built once
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_config
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Send
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from fusion_graph import FusionContext, build_graph
from fusion_graph.internals import node_state, untraced_edge
from fusion_graph.state import State

#: Turn lengths measured by default.
STEPS = (3, 30, 100, 300)
#: Interleaved pairs per length by default.
ROUNDS = 15
#: Beyond this many steps the default rounds shrink in proportion to the turn length.
LONG_TURN = 300
#: The longest scripted turn: from about 880 steps on its prompt fills the default conversation
#: budget (32,768 tokens), its late steps go to cloud, and the two graphs no longer run one turn.
LONGEST_TURN = 800
#: The ratio the graph should stay under at every length.
TARGET_RATIO = 1.10


class Scripted(GenericFakeChatModel):
    """Answers from a script at once; accepts tool binding (the script decides the calls)."""

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> BaseChatModel:
        """Tools are accepted and ignored."""
        return self


#: One turn of ``steps`` steps on thread ``thread``, timed: its seconds.
Runner = Callable[[int, str], Awaitable[float]]


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


#: Makes the scripted model of a graph from its answers (``model``, or ``replayed`` for many turns).
Models = Callable[[Sequence[AIMessage]], Scripted]


def replayed(answers: Sequence[AIMessage]) -> Scripted:
    """A model that answers ``answers`` in order, then from the first again: one script per turn.

    Each answer is a fresh copy, as a real model's is (LangGraph gives it its id).
    """
    return Scripted(messages=(answer.model_copy() for answer in itertools.cycle(list(answers))))


def fusion_graph(steps: int, models: Models = model) -> Any:
    """A fusion graph whose turns run ``script(steps)``: the plan on cloud, every later step on local."""
    # The plan runs on cloud; every later step on local (low scores at cloud_share 30).
    answers = script(steps)
    return build_graph(
        cloud_model=models(answers[:1]),
        local_model=models(answers[1:]),
        tools=[echo],
        checkpointer=InMemorySaver(),
    )


def agent_graph(steps: int, models: Models = model) -> Any:
    """A ``create_agent`` agent whose turns run ``script(steps)``."""
    return create_agent(models(script(steps)), tools=[echo], checkpointer=InMemorySaver())


async def fusion_turn(graph: Any, steps: int, thread: str) -> float:
    """Seconds one ``steps``-step turn takes through the fusion graph ``graph``."""
    graph_input: Any = {"messages": [HumanMessage("go")]}
    context = FusionContext(max_steps=steps + 5, sub_runners="off", loop_repeat_limit=100)
    gc.collect()  # the garbage of earlier runs is not collected on this run's time
    began = time.perf_counter()
    out = await graph.ainvoke(graph_input, {"configurable": {"thread_id": thread}}, context=context)
    elapsed = time.perf_counter() - began
    assert [r["leg"] for r in out["route_log"]] == ["cloud"] + ["local"] * (steps - 1)
    return elapsed


async def agent_turn(graph: Any, steps: int, thread: str) -> float:
    """Seconds one ``steps``-step turn takes through the ``create_agent`` agent ``graph``."""
    gc.collect()
    began = time.perf_counter()
    out = await graph.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": thread}})
    elapsed = time.perf_counter() - began
    assert sum(isinstance(m, AIMessage) for m in out["messages"]) == steps
    return elapsed


async def run_fusion(steps: int, thread: str) -> float:
    """Seconds one ``steps``-step turn takes through a new fusion graph."""
    return await fusion_turn(fusion_graph(steps), steps, thread)


async def run_agent(steps: int, thread: str) -> float:
    """Seconds one ``steps``-step turn takes through a new ``create_agent`` agent."""
    return await agent_turn(agent_graph(steps), steps, thread)


#: ``--warm``'s graphs, one per side and turn length, built on first use.
WARM_GRAPHS: dict[tuple[str, int], Any] = {}


def warm(side: str, steps: int, build: Callable[[int, Models], Any]) -> Any:
    """The graph of ``side`` for ``steps``-step turns, built once with models that replay the script."""
    if (side, steps) not in WARM_GRAPHS:
        WARM_GRAPHS[side, steps] = build(steps, replayed)
    return WARM_GRAPHS[side, steps]


async def run_fusion_warm(steps: int, thread: str) -> float:
    """Seconds one turn takes through the one fusion graph of its length (as an app builds it once)."""
    return await fusion_turn(warm("fusion", steps, fusion_graph), steps, thread)


async def run_agent_warm(steps: int, thread: str) -> float:
    """Seconds one turn takes through the one ``create_agent`` agent of its length."""
    return await agent_turn(warm("create_agent", steps, agent_graph), steps, thread)


@dataclass(frozen=True)
class Shape:
    """Fusion's graph as LangGraph sees it: its nodes, and what one of its steps writes besides the answer.

    Attributes:
        nodes: The compiled graph's node names.
        writes: A continuation step's writes other than ``messages`` (its record, step index, totals).
        order: The payload of a continuation step's ``Send`` (its order, as plain data).
    """

    nodes: tuple[str, ...]
    writes: dict[str, Any]
    order: dict[str, Any]


#: Fusion's shape, once read.
_SHAPE: list[Shape] = []


async def fusion_shape() -> Shape:
    """Fusion's shape, read once from a real two-step turn (its second step's own update)."""
    if _SHAPE:
        return _SHAPE[0]
    answers = script(2)
    graph = build_graph(
        cloud_model=model(answers[:1]),
        local_model=model(answers[1:]),
        tools=[echo],
        checkpointer=InMemorySaver(),
    )
    context = FusionContext(max_steps=7, sub_runners="off", loop_repeat_limit=100)
    writes: dict[str, Any] = {}
    order: dict[str, Any] = {}
    async for mode, chunk in graph.astream(
        {"messages": [HumanMessage("go")]},
        {"configurable": {"thread_id": "shape"}},
        context=context,
        stream_mode=["updates", "tasks"],
    ):
        if mode == "tasks" and chunk.get("name") == "local" and "input" in chunk:
            order = chunk["input"]
        elif mode == "updates":
            writes = {k: v for k, v in (chunk.get("local") or writes).items() if k != "messages"}
    assert set(writes) >= {"route_log", "step", "totals"}, writes
    assert order.get("__kind__") == "StepOrder", order
    _SHAPE.append(Shape(tuple(name for name in graph.nodes if name != START), writes, order))
    return _SHAPE[0]


async def run_floor(steps: int, thread: str) -> float:
    """Seconds one ``steps``-step turn takes through a bare graph of fusion's shape (the floor).

    Fusion's state, node names and edges: ``plan`` answers first; after an answer each tool call
    is its own ``Send`` to ``ToolNode``; after a tool, an edge reads the state and sends the next
    step to ``local`` with a real step order as its payload, and ``local`` reads the state as
    fusion's executor does (``internals.node_state``). Both inference nodes call the model and
    write what a fusion step writes. No routing rule, no provider chain, no batch rules, no hooks.
    """
    shape = await fusion_shape()
    scripted = model(script(steps))
    counted = {"step": 0}

    async def infer(state: State) -> dict[str, Any]:
        record = {**shape.writes["route_log"][0], "step": counted["step"]}
        update = {**shape.writes, "route_log": [record], "step": counted["step"]}
        counted["step"] += 1
        return {"messages": [await scripted.ainvoke(state["messages"])], **update}

    async def local(state: Mapping[str, Any]) -> dict[str, Any]:  # the payload: its order
        return await infer(node_state(get_config()))

    async def idle(state: State) -> dict[str, Any]:
        return {}

    async def after(state: State) -> Any:
        last = state["messages"][-1]
        calls = last.tool_calls if isinstance(last, AIMessage) else []
        return [Send("tools", [call]) for call in calls] if calls else END

    async def after_tools(state: State) -> Any:
        return Send("local", shape.order)

    builder = StateGraph(State)
    for name in shape.nodes:
        if name not in ("plan", "local", "tools"):
            builder.add_node(name, idle)
            builder.add_edge(name, END)
    builder.add_node("plan", infer)
    builder.add_node("local", local, input_schema=State)
    builder.add_node("tools", ToolNode([echo]))
    builder.add_edge(START, "plan")
    for inference in ("plan", "local"):
        builder.add_conditional_edges(inference, untraced_edge(after), ["tools", END])
    builder.add_conditional_edges("tools", untraced_edge(after_tools), ["local"])
    graph = builder.compile(checkpointer=InMemorySaver())
    graph_input: Any = {"messages": [HumanMessage("go")]}
    gc.collect()
    began = time.perf_counter()
    out = await graph.ainvoke(graph_input, {"configurable": {"thread_id": thread}})
    elapsed = time.perf_counter() - began
    assert sum(isinstance(m, AIMessage) for m in out["messages"]) == steps
    assert len(out["route_log"]) == steps
    return elapsed


def telemetry_on() -> None:
    """Metrics and traces on as FUSION_METRICS and FUSION_TRACES turn them on; spans dropped at export."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from prometheus_client import CollectorRegistry

    from fusion_graph.telemetry import switch
    from fusion_graph.telemetry.metrics import Metrics
    from fusion_graph.telemetry.traces import Traces

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    switch.ACTIVE.metrics = Metrics(CollectorRegistry())
    switch.ACTIVE.traces = Traces(provider.get_tracer("bench"))


async def run_fusion_telemetry(steps: int, thread: str) -> float:
    """Seconds one ``steps``-step fusion turn takes with metrics and traces on."""
    from fusion_graph.telemetry import switch

    telemetry_on()
    try:
        return await run_fusion(steps, thread)
    finally:
        switch.reset()


async def interleaved(
    rounds: int,
    steps: int,
    first: Runner,
    second: Runner,
    progress: Progress | None = None,
    warmed: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Seconds per step of ``rounds`` interleaved pairs of turns (first, second, second, first, ...).

    One turn of each warms up first, untimed; ``warmed`` is called after them.
    """
    times: tuple[list[float], list[float]] = ([], [])
    await first(steps, "warm-1")
    await second(steps, "warm-2")
    if warmed is not None:
        warmed()
    task = progress.add_task(f"{steps} steps", total=rounds) if progress is not None else None
    for i in range(rounds):
        pair = (first, times[0]), (second, times[1])
        for runner, kept in pair if i % 2 == 0 else reversed(pair):
            kept.append(await runner(steps, f"r{i}") / steps)
        if progress is not None and task is not None:
            progress.advance(task)
    return times


async def run_agent_routed(steps: int, thread: str) -> float:
    """Seconds one ``steps``-step turn takes through ``create_agent`` with ``FusionRoutingMiddleware``."""
    from fusion_graph.middleware import FusionRoutingMiddleware

    answers = script(steps)
    routing = FusionRoutingMiddleware(
        cloud_model=model(answers[:1]),
        local_model=model(answers[1:]),
        context={"max_steps": steps + 5, "sub_runners": "off", "loop_repeat_limit": 100},
    )
    agent = create_agent(model(answers), tools=[echo], middleware=[routing], checkpointer=InMemorySaver())
    gc.collect()
    began = time.perf_counter()
    out = await agent.ainvoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": thread}})
    elapsed = time.perf_counter() - began
    assert [r["leg"] for r in out["route_log"]] == ["cloud"] + ["local"] * (steps - 1)
    return elapsed


@dataclass(frozen=True)
class Pair:
    """Two ways to run one turn, timed against each other: ``off`` is the baseline, ``on`` is measured.

    Attributes:
        off: The baseline's runner.
        on: The measured runner.
        names: Their names in the JSON keys (``{name}_ms_per_step``) and the table's columns.
        title: What the table compares.
    """

    off: Runner
    on: Runner
    names: tuple[str, str]
    title: str


#: What each mode of the command measures.
PAIRS: dict[str, Pair] = {
    "fusion": Pair(run_agent, run_fusion, ("create_agent", "fusion"), "of create_agent and fusion"),
    "warm": Pair(
        run_agent_warm,
        run_fusion_warm,
        ("create_agent", "fusion"),
        "of create_agent and fusion, each graph built once a length",
    ),
    "telemetry": Pair(run_fusion, run_fusion_telemetry, ("off", "on"), "with telemetry off and on"),
    "middleware": Pair(run_agent, run_agent_routed, ("off", "on"), "with the middleware off and on"),
    "floor": Pair(
        run_agent,
        run_floor,
        ("off", "on"),
        "of create_agent (off) and of a bare graph of fusion's shape (on)",
    ),
}


def default_rounds(steps: int) -> int:
    """``ROUNDS``, shrunk in proportion for turns longer than ``LONG_TURN`` steps (at least 3)."""
    if steps <= LONG_TURN:
        return ROUNDS
    return max(3, ROUNDS * LONG_TURN // steps)


async def measure(rounds: int, steps: int, pair: Pair, progress: Progress | None = None) -> dict[str, Any]:
    """Interleaved ``rounds`` pairs of ``steps``-step turns: median ms per step of each, and the ratio."""
    off, on = await interleaved(rounds, steps, pair.off, pair.on, progress)
    off_med, on_med = statistics.median(off), statistics.median(on)
    off_name, on_name = pair.names
    return {
        "steps_per_turn": steps,
        "rounds": rounds,
        f"{off_name}_ms_per_step": round(off_med * 1000, 3),
        f"{on_name}_ms_per_step": round(on_med * 1000, 3),
        "added_ms_per_step": round((on_med - off_med) * 1000, 3),
        "ratio": round(on_med / off_med, 3),
        # Noise only adds time: the fastest runs show the graphs' own cost on a busy machine.
        "ratio_of_minima": round(min(on) / min(off), 3),
        f"{off_name}_ms_per_step_all": [round(t * 1000, 3) for t in off],
        f"{on_name}_ms_per_step_all": [round(t * 1000, 3) for t in on],
    }


async def measure_all(
    steps: Sequence[int], rounds: int | None, pair: Pair = PAIRS["fusion"]
) -> dict[str, Any]:
    """``measure`` of ``pair`` at every turn length, in the order given."""
    results = []
    with Progress(transient=True, console=Console(stderr=True)) as progress:
        for length in steps:
            results.append(await measure(rounds or default_rounds(length), length, pair, progress))
    return {
        "results": results,
        "target_ratio": TARGET_RATIO,
        "meta": {"python": platform.python_version(), "machine": platform.machine()},
    }


def table_of(result: dict[str, Any], pair: Pair) -> Table:
    """One row per turn length: ms per step of each side, what ``on`` adds, and the ratio."""
    table = Table(title=f"per-step time {pair.title}, median of interleaved runs")
    off_name, on_name = pair.names
    for column in (
        "steps",
        "rounds",
        f"{off_name} ms / step",
        f"{on_name} ms / step",
        "added ms / step",
        "ratio",
    ):
        table.add_column(column, justify="right")
    for row in result["results"]:
        table.add_row(
            str(row["steps_per_turn"]),
            str(row["rounds"]),
            f"{row[f'{off_name}_ms_per_step']:.3f}",
            f"{row[f'{on_name}_ms_per_step']:.3f}",
            f"{row['added_ms_per_step']:.3f}",
            f"{row['ratio']:.2f}",
        )
    return table


def turn_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser with the options every scripted-turn benchmark takes: ``--steps``, ``--rounds``, ``--out``."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, nargs="+", default=list(STEPS), help="turn lengths (default: 3 30 100 300)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"interleaved pairs per length (default {ROUNDS}, fewer beyond {LONG_TURN} steps)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser


def turn_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``argv`` parsed by ``parser`` (a ``turn_parser``), lengths and rounds checked."""
    args = parser.parse_args(argv)
    if any(steps < 1 for steps in args.steps) or (args.rounds is not None and args.rounds < 1):
        parser.error("--steps and --rounds must be at least 1")
    if max(args.steps) > LONGEST_TURN:
        parser.error(
            f"--steps may be at most {LONGEST_TURN}: a longer scripted turn fills the conversation "
            "budget and goes to cloud, so fusion would no longer run the turn create_agent runs"
        )
    return args


def report(table: Table, result: dict[str, Any], out: Path | None) -> None:
    """The table to stderr; the JSON to stdout, and to ``out`` when given."""
    Console(stderr=True).print(table)
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    parser = turn_parser(__doc__)
    parser.add_argument(
        "--telemetry", action="store_true", help="measure metrics and traces on against off instead"
    )
    parser.add_argument(
        "--middleware",
        action="store_true",
        help="measure create_agent with FusionRoutingMiddleware against without it instead",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="measure a bare LangGraph graph of fusion's shape against create_agent instead",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="build each graph once a length and run every turn through it, as an app does",
    )
    args = turn_options(parser, argv)
    chosen = [mode for mode in ("telemetry", "middleware", "floor", "warm") if getattr(args, mode)]
    if len(chosen) > 1:
        parser.error("--telemetry, --middleware, --floor and --warm measure different things: give one")
    pair = PAIRS[chosen[0] if chosen else "fusion"]
    result = asyncio.run(measure_all(args.steps, args.rounds, pair))
    report(table_of(result, pair), result, args.out)


if __name__ == "__main__":
    main()
