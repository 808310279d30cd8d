"""How many package modules a continuation step runs code in: what a maintainer reads to follow a step.

Measured between two model calls of a scripted turn (the second and third: a
continuation step after a one-call batch): every ``fusion_graph`` module one of
whose functions is entered, with sub-runners off (memory jobs, when on, add
``memory/background.py``: a step then tells them it is in flight). The house's bound is 16: a
change that spreads a step over more modules fails here.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from bench.overhead import Scripted, echo, script
from fusion_graph import FusionContext, build_graph
from fusion_graph.telemetry import switch

PACKAGE = Path(__file__).resolve().parents[2] / "fusion_graph"
#: Modules a continuation step may run code in (36 before the step became one pipeline).
CEILING = 16
CONFIG: Any = {"configurable": {"thread_id": "t"}}


#: The modules entered since the last model call, and each closed window.
SEEN: set[str] = set()
WINDOWS: list[set[str]] = []


class Marking(Scripted):
    """A scripted model that closes the current window of modules at each call."""

    async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
        WINDOWS.append(set(SEEN))
        SEEN.clear()
        return await super()._agenerate(*args, **kwargs)


async def test_a_continuation_step_runs_code_in_at_most_the_ceiling_of_package_modules() -> None:
    SEEN.clear()
    WINDOWS.clear()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(PACKAGE):
                SEEN.add(path.relative_to(PACKAGE).as_posix())

    answers: list[AIMessage] = script(4)
    cloud = Marking(messages=iter(answers[:1]))
    local = Marking(messages=iter(answers[1:]))
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[echo], checkpointer=InMemorySaver())
    context = FusionContext(max_steps=10, sub_runners="off")
    active = switch.ACTIVE
    kept = active.metrics, active.traces  # what an earlier test left on is not this step's code
    active.metrics, active.traces = switch.METRICS_OFF, switch.TRACES_OFF
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        await graph.ainvoke(
            {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "t"}}, context=context
        )
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        active.metrics, active.traces = kept
    step = WINDOWS[2]  # between the second model call (a step) and the third
    assert "nodes/step.py" in step and "routing/score.py" in step, sorted(step)
    assert len(step) <= CEILING, f"a continuation step runs code in {len(step)} modules: {sorted(step)}"
