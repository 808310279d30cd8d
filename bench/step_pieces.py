"""What each piece of a fusion step costs, timed inside the turns ``bench/overhead.py`` runs.

``bench/overhead.py`` says how much slower a fusion step is than a ``create_agent`` one;
this says where that time goes. The same scripted turns run with a stopwatch around the
pieces fusion adds to a step, interleaved with ``create_agent`` turns in one run:

- the decision: ``RouteNode.decide`` and the plan's ``decide_step`` (measure, score, route,
  budget guard);
- the executor: ``InferenceNodes._infer`` less the provider call (fit, batch rules, update);
- the provider call: ``ask`` less the model's run (placement, chain walk, record, price);
- the tool hook: ``wrap_tool_call`` less the tool call (sampling scope, scrub, cap);
- the model's run (``ainvoke``) in either graph: fusion calls it with its own config.

Each is a mean in microseconds per step. What is left of the difference between a fusion
step and a ``create_agent`` step (``rest``) is LangGraph on fusion's graph, the edges,
the plan and everything per turn. The stopwatch itself adds about 1 us per timed call
(five a fusion step, one a ``create_agent`` step).

    python -m bench.step_pieces                        # 3, 30, 100 and 300 steps, 15 rounds each
    python -m bench.step_pieces --steps 30 --rounds 40 --out pieces.json
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any
from unittest import mock

from rich import box
from rich.table import Table

from bench.overhead import (
    Runner,
    Scripted,
    default_rounds,
    interleaved,
    report,
    run_agent,
    run_fusion,
    turn_options,
    turn_parser,
)
from fusion_graph.nodes import step, tools

#: Fusion's own pieces in the order of a step, as the table and the JSON name them.
PIECES = ("decision", "executor", "provider call", "tool hook")


class Stopwatch:
    """Nanoseconds spent inside each timed function, summed by name."""

    def __init__(self) -> None:
        """Nothing timed yet."""
        self.ns: Counter[str] = Counter()
        self.side = "fusion"
        """The graph whose turn runs now: the model's run is timed per graph."""

    def timed(self, name: str, function: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """``function`` (a coroutine function), its time added to ``name``."""

        async def run(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return await function(*args, **kwargs)
            finally:
                self.ns[name] += time.perf_counter_ns() - began

        return run

    def pieces(self) -> dict[str, int]:
        """Each piece's own time: what a timed function took less the timed call inside it."""
        ns = self.ns
        return {
            "decision": ns["decide"],
            "executor": ns["infer"] - ns["ask"],
            "provider call": ns["ask"] - ns["model fusion"],
            "tool hook": ns["hook"] - ns["tool"],
        }

    def sided(self, side: str, runner: Runner) -> Runner:
        """``runner``, its turns' model runs added to ``side``."""

        async def run(steps: int, thread: str) -> float:
            self.side = side
            return await runner(steps, thread)

        return run

    def model_run(self, function: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """``function`` (the model's ``ainvoke``), its time added to the graph whose turn runs."""

        async def run(*args: Any, **kwargs: Any) -> Any:
            return await self.timed(f"model {self.side}", function)(*args, **kwargs)

        return run


@contextlib.contextmanager
def watching(watch: Stopwatch) -> Iterator[None]:
    """The pieces of every fusion graph built inside timed by ``watch``."""
    hook = tools.wrap_tool_call

    async def timed_hook(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
        return await watch.timed("hook", hook)(request, watch.timed("tool", execute))

    with contextlib.ExitStack() as stack:
        for owner, name, key in (
            (step, "decide_step", "decide"),  # every step's (plan and continuation)
            (step.InferenceNodes, "_infer", "infer"),
            (step, "ask", "ask"),
        ):
            stack.enter_context(mock.patch.object(owner, name, watch.timed(key, getattr(owner, name))))
        stack.enter_context(mock.patch.object(tools, "wrap_tool_call", timed_hook))
        stack.enter_context(mock.patch.object(Scripted, "ainvoke", watch.model_run(Scripted.ainvoke)))
        yield


async def measure(rounds: int, steps: int) -> dict[str, Any]:
    """``rounds`` interleaved pairs of ``steps``-step turns: each piece's mean, both graphs' medians."""
    watch = Stopwatch()
    with watching(watch):
        fusion, agent = await interleaved(
            rounds,
            steps,
            watch.sided("fusion", run_fusion),
            watch.sided("agent", run_agent),
            warmed=watch.ns.clear,  # the warm-up turns are not counted
        )
    us = 1000 * rounds * steps
    per_step = {name: ns / us for name, ns in watch.pieces().items()}
    model = {side: watch.ns[f"model {side}"] / us for side in ("fusion", "agent")}
    fusion_us, agent_us = statistics.median(fusion) * 1e6, statistics.median(agent) * 1e6
    own = sum(per_step.values()) + model["fusion"] - model["agent"]
    return {
        "steps_per_turn": steps,
        "rounds": rounds,
        "us_per_step": {name: round(value, 1) for name, value in per_step.items()},
        "model_run_us_per_step": {side: round(value, 1) for side, value in model.items()},
        "fusion_us_per_step": round(fusion_us, 1),
        "create_agent_us_per_step": round(agent_us, 1),
        # Both graphs run the model and the tool: what fusion adds to neither is the rest.
        "rest_us_per_step": round(fusion_us - agent_us - own, 1),
    }


async def measure_all(steps: Sequence[int], rounds: int | None) -> dict[str, Any]:
    """``measure`` at every turn length, in the order given."""
    results = [await measure(rounds or default_rounds(length), length) for length in steps]
    return {"results": results, "meta": {"python": platform.python_version(), "machine": platform.machine()}}


#: The table's short column names (an 80-column terminal), by piece.
HEADERS = {"decision": "decide", "executor": "execute", "provider call": "provider", "tool hook": "hook"}


def table_of(result: dict[str, Any]) -> Table:
    """One row per turn length: each piece, the model's run, both graphs' step and the rest, in us."""
    table = Table(
        box=box.SIMPLE_HEAD,  # no column rules and one space between columns: ten fit 80 characters
        padding=(0, 0, 0, 1),
        title="a fusion step's pieces, us per step",
        caption="pieces and model runs: means; fusion and agent steps: medians; "
        "model: the model's run under fusion (f) and create_agent (a)",
    )
    for column in ("steps", *HEADERS.values(), "model f", "model a", "fusion", "agent", "rest"):
        table.add_column(column, justify="right")
    for row in result["results"]:
        model = row["model_run_us_per_step"]
        table.add_row(
            str(row["steps_per_turn"]),
            *(f"{row['us_per_step'][name]:.0f}" for name in HEADERS),
            f"{model['fusion']:.0f}",
            f"{model['agent']:.0f}",
            f"{row['fusion_us_per_step']:.0f}",
            f"{row['create_agent_us_per_step']:.0f}",
            f"{row['rest_us_per_step']:.0f}",
        )
    return table


def main(argv: Sequence[str] | None = None) -> None:
    args = turn_options(turn_parser(__doc__), argv)
    result = asyncio.run(measure_all(args.steps, args.rounds))
    report(table_of(result), result, args.out)


if __name__ == "__main__":
    main()
