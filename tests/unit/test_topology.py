"""Pin the graph's topology: node set, edges and the Mermaid drawing."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from fusion_graph.agent import build_graph

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "graph.mmd"
REGENERATE = "UPDATE_SNAPSHOTS=1 .venv/bin/pytest -q tests/unit/test_topology.py"


def test_nodes_and_edges() -> None:
    drawn = build_graph().get_graph()
    assert set(drawn.nodes) == {
        "__start__",
        "plan",
        "local",
        "cloud",
        "tools",
        "route",
        "repair",
        "step_limit",
        "give_up",
        "unavailable",
        "memory",
        "synthesis",
        "__end__",
    }
    edges = {(e.source, e.target, e.conditional) for e in drawn.edges}
    assert ("__start__", "plan", False) in edges
    for executor in ("plan", "local", "cloud", "repair"):
        after = {target for source, target, conditional in edges if source == executor and conditional}
        assert after == {"tools", "route", "synthesis", "memory", "unavailable", "__end__"}
    after_synthesis = {target for source, target, conditional in edges if source == "synthesis"}
    assert after_synthesis == {"memory", "__end__"}
    # Tool calls fan out as one task each; a one-call batch is routed by the edge after it, the tasks
    # of a larger one join at the node that decides.
    after_tool = {target for source, target, conditional in edges if source == "tools" and conditional}
    assert after_tool == {"route", "local", "cloud", "repair", "step_limit", "give_up", "memory", "__end__"}
    assert not [e for e in edges if e[0] == "tools" and not e[2]]
    routed = {target for source, target, conditional in edges if source == "route" and conditional}
    assert routed == {"tools", "local", "cloud", "repair", "step_limit", "give_up", "memory", "__end__"}
    retried = {target for source, target, conditional in edges if source == "unavailable"}
    assert retried == {"plan", "local", "cloud", "repair"}
    assert {
        ("step_limit", "__end__", False),
        ("give_up", "__end__", False),
        ("memory", "__end__", False),
    } <= edges


def test_mermaid_matches_the_snapshot() -> None:
    actual = build_graph().get_graph().draw_mermaid()
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(actual, encoding="utf-8")
    expected = SNAPSHOT.read_text(encoding="utf-8") if SNAPSHOT.exists() else ""
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                actual.splitlines(keepends=True),
                fromfile=str(SNAPSHOT.relative_to(SNAPSHOT.parents[2])),
                tofile="build_graph().get_graph().draw_mermaid()",
            )
        )
        pytest.fail(
            f"The graph topology changed.\n{diff}\n"
            f"If the change is intended, regenerate the snapshot with: {REGENERATE}",
            pytrace=False,
        )
