"""The graph on a real PostgreSQL server, as LangGraph server replicas share it.

Each turn runs on a new graph with its own saver (and store) object on its own
connection, as another replica behind a load balancer would: everything a turn
needs must come back from Postgres, not from the process that ran the last one.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.store.postgres.aio import AsyncPostgresStore

from fusion_graph import build_graph, memory
from fusion_graph.context import FusionContext
from fusion_graph.memory.jobs import MEMORY_MESSAGE_NAME
from fusion_graph.state import InputState
from fusion_graph_testing.postgres import PostgresUnavailableError, find_bin_dir
from tests.plugins.fakes import ai_calls, call, check_two_turns, scripted
from tests.plugins.postgres import unavailable

CONFIG: RunnableConfig = {"configurable": {"thread_id": "shared-thread"}}
NS = memory.namespace("fusion", "anonymous")
TABS = "The user prefers tabs."
#: Memory jobs inside the run, so each turn's route_log has them.
INLINE = FusionContext(memory_mode="inline")


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


TOOLS: list[BaseTool] = [echo]


def said(text: str) -> InputState:
    return {"messages": [HumanMessage(text)]}


def check_each_step_once(out: dict[str, Any]) -> None:
    """Every message is in the thread once, and each inference left one AI message."""
    ids = [m.id for m in out["messages"]]
    assert None not in ids
    assert [i for i, n in Counter(ids).items() if n > 1] == []
    steps = [r for r in out["route_log"] if r["kind"] != "memory"]
    assert sum(isinstance(m, AIMessage) for m in out["messages"]) == len(steps)
    assert len({(r["turn"], r["step"], r["kind"]) for r in out["route_log"]}) == len(out["route_log"])


async def test_a_thread_continues_on_another_replica(postgres_db: str) -> None:
    context = FusionContext(loop_repeat_limit=2)
    async with AsyncPostgresSaver.from_conn_string(postgres_db) as saver_a:
        await saver_a.setup()
        cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "a"}, "t0"), content="1. echo")])
        local = scripted("localfake", ["first answer"])
        replica_a = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=saver_a)
        first = await replica_a.ainvoke(said("do the task"), CONFIG, context=context)
        assert [(r["turn"], r["step"], r["kind"]) for r in first["route_log"]] == [
            (0, 0, "plan"),
            (0, 1, "step"),
        ]

        # Replica B: its own connection, saver, graph and models; replica A stays up.
        async with AsyncPostgresSaver.from_conn_string(postgres_db) as saver_b:
            await saver_b.setup()  # idempotent: every replica runs it at start-up
            cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "a"}, "t1"))])
            local = scripted("localfake", ["second answer"])
            replica_b = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=saver_b)
            second = await replica_b.ainvoke(said("again"), CONFIG, context=context)

            # The second plan saw the whole first turn, read back from Postgres.
            seen = [(m.type, m.text) for m in cloud.prompts[0][1:]]
            assert seen == [
                ("human", "do the task"),
                ("ai", "1. echo"),
                ("tool", "a"),
                ("ai", "first answer"),
                ("human", "again"),
            ]
            other = await replica_b.aget_state({"configurable": {"thread_id": "someone-else"}})
            assert other.values == {}

        # Replica A reads the thread as B left it.
        state = (await replica_a.aget_state(CONFIG)).values

    for out in (second, state):
        check_two_turns(out)
        assert [type(m) for m in out["messages"]] == [HumanMessage, AIMessage, ToolMessage, AIMessage] * 2
        check_each_step_once(out)
    assert [m.id for m in state["messages"]] == [m.id for m in second["messages"]]


async def test_memories_from_one_replica_are_recalled_on_another(postgres_db: str) -> None:
    good = json.dumps({"items": [{"kind": "fact", "text": TABS}]})
    async with (
        AsyncPostgresSaver.from_conn_string(postgres_db) as saver,
        AsyncPostgresStore.from_conn_string(postgres_db) as store,
    ):
        await saver.setup()
        await store.setup()
        cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "x"}, "c1"), content="1. echo")])
        local = scripted("localfake", ["done", good])
        graph = build_graph(
            cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=saver, store=store
        )
        first = await graph.ainvoke(said("I like tabs"), CONFIG, context=INLINE)
    assert [(r["turn"], r["kind"]) for r in first["route_log"]] == [(0, "plan"), (0, "step"), (0, "memory")]
    assert first["route_log"][-1]["memory"]["stored"] == 1
    assert cloud.prompts[0][-1].text == "I like tabs"  # nothing to recall yet

    async with (
        AsyncPostgresSaver.from_conn_string(postgres_db) as saver,
        AsyncPostgresStore.from_conn_string(postgres_db) as store,
    ):
        items = [item.value for item in await store.asearch(NS, limit=100)]
        assert [(i["kind"], i["text"], i["thread_id"], i["turn"], i["step"]) for i in items] == [
            ("fact", TABS, "shared-thread", 0, 1)
        ]
        cloud = scripted("cloudfake", ["Using tabs."])
        local = scripted("localfake", [json.dumps({"items": []})])
        graph = build_graph(
            cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=saver, store=store
        )
        second = await graph.ainvoke(said("format this file"), CONFIG, context=INLINE)
        assert len(await store.asearch(NS, limit=100)) == 1  # the empty job stored nothing

    plan_prompt = cloud.prompts[0]
    recalled = plan_prompt[-1]
    assert isinstance(recalled, HumanMessage) and recalled.name == MEMORY_MESSAGE_NAME
    assert TABS in recalled.text
    assert plan_prompt[-2].text == "format this file"
    assert any(m.text == "done" for m in plan_prompt)  # the first turn came back from the checkpoint
    # The recalled message stays in the thread right after the user's, once.
    texts = [m.text for m in second["messages"]]
    assert texts.index(recalled.text) == texts.index("format this file") + 1
    assert texts.count(recalled.text) == 1
    assert [(r["turn"], r["kind"]) for r in second["route_log"]] == [
        (0, "plan"),
        (0, "step"),
        (0, "memory"),
        (1, "plan"),
        (1, "memory"),
    ]
    check_each_step_once(second)


def test_missing_binaries_skip_locally_and_fail_under_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PostgresUnavailableError, match="initdb"):
        find_bin_dir([str(tmp_path / "*" / "bin")])
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        unavailable("no postgres")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but no postgres"):
        unavailable("no postgres")


def test_doctor_names_the_postgres_version_as_postgres_prints_it(postgres_db: str) -> None:
    import re

    from fusion_graph.cli.doctor.checkpoints import postgres_check

    check = postgres_check(postgres_db, timeout=5)
    assert check.status == "ok", check
    found = re.search(r"\(PostgreSQL (\d+)\.(\d+)\)", check.detail)
    assert found is not None and int(found[1]) >= 10, check.detail


async def test_a_long_thread_s_late_steps_write_about_what_its_first_did(postgres_db: str) -> None:
    """On Postgres as on SQLite: turn 40's steps write what turn 1's did, and ``report`` reads it all."""
    import statistics

    from typer.testing import CliRunner

    from bench.long_thread import postgres_meter, run_thread
    from fusion_graph.cli.app import app

    async with AsyncPostgresSaver.from_conn_string(postgres_db) as saver:
        await saver.setup()
        figures = await run_thread("fusion", saver, postgres_meter(postgres_db), 40)
        state = await saver.aget_tuple({"configurable": {"thread_id": "long-fusion"}})
    assert state is not None
    first = figures[0].step_bytes
    late = statistics.median(f.step_bytes for f in figures[-10:])
    assert late <= 2 * first, f"a step of turn 40 writes {late:.0f} bytes, one of turn 1 {first:.0f}"
    half, whole = figures[19].bytes_stored, figures[-1].bytes_stored
    assert whole <= 2.3 * half, f"stored {half} bytes after 20 turns and {whole} after 40: not linear"

    result = CliRunner().invoke(app, ["report", "--postgres", postgres_db, "--json"])
    assert result.exit_code == 0, result.output
    thread = json.loads(result.output)["threads"]["long-fusion"]
    assert (thread["turns"], thread["plans"], thread["continuation_steps"]) == (40, 40, 40)
