"""The routing decisions of recorded replays and of scripted graph turns, pinned against a snapshot.

A refactor of how a step is decided, handed over or recorded must leave every
decision as it was: the leg, the score, the threshold, the reason and the
fields beside them. The snapshot was written by the code before the last such
change; a change of the rule itself regenerates it on purpose with
``UPDATE_SNAPSHOTS=1`` (and says why in its commit).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, build_graph
from fusion_graph.replay.history import route_history
from fusion_graph.replay.traces import load_trajectories
from tests.plugins.fakes import ScriptedModel, ai_calls, call, user_input

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "route_logs.json"
SAMPLE = Path(__file__).resolve().parents[2] / "fusion_graph" / "replay" / "sample_traces"

#: Run contexts the replays are routed under: the default, trouble signals, the paced dial, budgets.
REPLAY_CONTEXTS: dict[str, dict[str, Any]] = {
    "default": {},
    "trouble": {"cloud_share": 60, "trouble_signals": True},
    "paced": {"cloud_share": 40, "pace_slack": 0.5},
    "budget": {"cloud_share": 70, "turn_cloud_budget_usd": 0.02},
}


def cloud_cost(prompt: int, completion: int) -> float:
    """A fixed cloud price (2.5 and 10 USD per million tokens) for the budget replays."""
    return (prompt * 2.5 + completion * 10.0) / 1_000_000


def replayed() -> dict[str, list[list[Any]]]:
    """Every sample trajectory routed under every replay context, one row per step."""
    out: dict[str, list[list[Any]]] = {}
    trajectories = load_trajectories(sorted(SAMPLE.glob("*.jsonl")))
    for name, fields in REPLAY_CONTEXTS.items():
        context = FusionContext(**fields)
        priced = cloud_cost if "turn_cloud_budget_usd" in fields else None
        for trajectory in trajectories:
            steps = route_history(list(trajectory.messages), context, cloud_cost=priced)
            out[f"{name}/{trajectory.file}/{trajectory.id}"] = [
                [
                    s.position,
                    s.step,
                    s.decision.leg,
                    s.decision.score.score if s.decision.score is not None else None,
                    s.decision.threshold,
                    s.decision.reason,
                    s.decision.budget,
                    s.decision.paced,
                    s.decision.latch,
                ]
                for s in steps
            ]
    return out


@tool
def echo(text: str, times: int = 1) -> str:
    """Return the text ``times`` times."""
    return " ".join([text] * times)


@tool
def broken(path: str) -> str:
    """Always fails."""
    raise ValueError(f"cannot read {path}")


def shared(answers: list[AIMessage | str]) -> tuple[ScriptedModel, ScriptedModel]:
    """A cloud and a local model answering from one script, whichever leg a step is routed to."""
    script: Iterator[AIMessage | str] = iter(answers)
    cloud = ScriptedModel(messages=script, model_name="cloud")
    return cloud, ScriptedModel(messages=script, model_name="local")


def graph_script() -> list[AIMessage | str]:
    """Two turns: one-call steps with growing output, a three-call batch (the join), failures, a repair."""
    first: list[AIMessage | str] = [
        ai_calls(call("echo", {"text": "plan", "times": 1}, "p1")),
        *(ai_calls(call("echo", {"text": f"w{i}", "times": 40 * i}, f"a{i}")) for i in range(1, 5)),
        ai_calls(*(call("echo", {"text": f"j{k}", "times": 30}, f"j{k}") for k in range(3))),
        *(ai_calls(call("broken", {"path": f"f{i}"}, f"b{i}")) for i in range(3)),
        ai_calls(call("missing_tool", {}, "m1")),
        ai_calls(call("echo", {"text": "fixed"}, "r1")),
        "first turn done",
    ]
    second: list[AIMessage | str] = [
        ai_calls(call("echo", {"text": "again", "times": 5}, "p2")),
        ai_calls(call("echo", {"text": "more", "times": 200}, "s2")),
        "second turn done",
    ]
    return [*first, *second]


async def graph_logs() -> dict[str, list[list[Any]]]:
    """The route log of the scripted two-turn thread under each graph context."""
    contexts = {
        "graph-default": FusionContext(sub_runners="off", loop_repeat_limit=100),
        "graph-trouble": FusionContext(
            sub_runners="off", loop_repeat_limit=100, cloud_share=60, trouble_signals=True
        ),
        "graph-cloud-heavy": FusionContext(
            sub_runners="off", loop_repeat_limit=100, cloud_share=85, conversation_max_tokens=6000
        ),
    }
    out: dict[str, list[list[Any]]] = {}
    for name, context in contexts.items():
        cloud, local = shared(graph_script())
        graph = build_graph(
            cloud_model=cloud, local_model=local, tools=[echo, broken], checkpointer=InMemorySaver()
        )
        config: Any = {"configurable": {"thread_id": name}}
        await graph.ainvoke(user_input("start"), config, context=context)
        state = await graph.ainvoke(user_input("continue"), config, context=context)
        out[name] = [
            [
                r["turn"],
                r["step"],
                r["kind"],
                r["routed_leg"],
                r["leg"],
                r["score"],
                r["threshold"],
                r["reason"],
                r.get("kept_local_by_budget", False),
            ]
            for r in state["route_log"]
        ]
    return out


async def test_route_logs_match_the_snapshot() -> None:
    actual = {**replayed(), **(await graph_logs())}
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    expected = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    assert sorted(actual) == sorted(expected)
    for key in sorted(expected):
        assert json.loads(json.dumps(actual[key])) == expected[key], key
