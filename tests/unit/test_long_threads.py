"""Long-lived threads: a step's write does not grow with the thread, and old threads still load.

``messages`` and ``route_log`` are delta channels (``fusion_graph.state``): a
checkpoint stores a step's additions, and now and then the whole value. The
figures come from the same measure as ``bench.long_thread`` (bytes of the
checkpointer's rows), never from time.
"""

from __future__ import annotations

import json
import shutil
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

import pytest
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, ToolMessage
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages
from typer.testing import CliRunner

from bench.long_thread import TurnFigures, run_thread, sqlite_meter
from bench.overhead import echo, replayed, script
from fusion_graph import FusionContext, build_graph
from fusion_graph.cli.app import app
from fusion_graph.errors import InvalidInput, UsageError
from fusion_graph.state import add_message_batches, append_records, state_reader, tool_result_id

DATA = Path(__file__).parent / "data"
#: A thread of three turns written by the version before delta channels (plain reducer channels).
BEFORE = DATA / "thread_before_delta.sqlite"
#: ``fusion-graph report --json`` over it, as that version printed it (its ``db`` left out).
BEFORE_REPORT = DATA / "thread_before_delta.report.json"
CONTEXT = FusionContext(max_steps=10, sub_runners="off", loop_repeat_limit=100)


def graph_on(saver: Any) -> Any:
    answers = script(2)
    return build_graph(
        cloud_model=replayed(answers[:1]), local_model=replayed(answers[1:]), tools=[echo], checkpointer=saver
    )


async def thread_of(tmp_path: Path, graph: str, turns: int) -> list[TurnFigures]:
    path = tmp_path / f"{graph}.sqlite"
    async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
        await saver.setup()
        return await run_thread(graph, saver, sqlite_meter(path), turns)  # type: ignore[arg-type]


async def test_a_late_step_writes_about_what_an_early_one_did(tmp_path: Path) -> None:
    """Turn 40's steps write what turn 1's did (give or take), and the thread's bytes grow linearly."""
    figures = await thread_of(tmp_path, "fusion", 40)
    first = figures[0].step_bytes
    late = statistics.median(f.step_bytes for f in figures[-10:])
    assert late <= 2 * first, f"a step of turn 40 writes {late:.0f} bytes, one of turn 1 {first:.0f}"
    # The whole history is written at most every 25 turns of this shape: once in turns 16-40.
    window = figures[-25:]
    mean = sum(f.bytes_added for f in window) / sum(f.checkpoints for f in window)
    assert mean <= 3 * first, f"turns 16-40 write {mean:.0f} bytes a step, turn 1 {first:.0f}"
    half, whole = figures[19].bytes_stored, figures[-1].bytes_stored
    assert whole <= 2.3 * half, f"stored {half} bytes after 20 turns and {whole} after 40: not linear"


async def test_the_thread_stores_less_than_create_agent_s_default_state(tmp_path: Path) -> None:
    fusion = await thread_of(tmp_path, "fusion", 30)
    agent = await thread_of(tmp_path, "create_agent", 30)
    assert fusion[-1].bytes_stored < agent[-1].bytes_stored


async def test_message_ids_are_the_same_when_the_thread_is_loaded_again(tmp_path: Path) -> None:
    """Messages sent without ids (a user's dict, a tool's result) keep the ids the live run gave them."""
    path = tmp_path / "ids.sqlite"
    config: Any = {"configurable": {"thread_id": "ids"}}
    async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
        graph = graph_on(saver)
        for turn in range(3):
            out = await graph.ainvoke(
                {"messages": [{"role": "user", "content": f"turn {turn}"}]}, config, context=CONTEXT
            )
        live = [(m.type, m.id) for m in out["messages"]]
        assert all(message_id for _, message_id in live) and len(set(live)) == len(live) == 12
        # A tool's result is named where it is made, from its batch and call: no render of the result.
        results = [(before, m) for before, m in pairwise(out["messages"]) if isinstance(m, ToolMessage)]
        assert len(results) == 3
        assert all(m.id == tool_result_id(str(before.id), m.tool_call_id) for before, m in results)
    with SqliteSaver.from_conn_string(str(path)) as saver:
        loaded = state_reader(saver).get_state(config).values
    assert [(m.type, m.id) for m in loaded["messages"]] == live
    assert loaded["route_log"] == out["route_log"]


def _fold(history: list[Any], batches: list[list[Any]]) -> list[Any]:
    for batch in batches:
        history = cast("list[Any]", add_messages(history, batch))
    return history


def _seen(messages: list[Any]) -> list[tuple[str, Any, Any]]:
    return [(m.type, m.id, m.content) for m in messages]


def test_the_reducers_give_one_history_whatever_the_batches() -> None:
    """A delta channel replays stored writes in larger batches than they were made: the same result,
    and the same as LangGraph's ``add_messages`` batch after batch."""
    first: list[Any] = [HumanMessage("a", id="h1"), AIMessage("b", id="a1")]
    later: list[list[Any]] = [
        [ToolMessage("c", tool_call_id="x", id="t1")],
        [AIMessage("b2", id="a1")],  # replaces by id
        [RemoveMessage(id="h1"), HumanMessage("d", id="h2")],
        [
            HumanMessage("a again", id="h1"),
            RemoveMessage(id="t1"),
            ToolMessage("c2", tool_call_id="x", id="t1"),
        ],
    ]
    one_by_one: list[Any] = first
    for batch in later:
        one_by_one = add_message_batches(one_by_one, [batch])
    at_once = add_message_batches(first, later)
    assert _seen(at_once) == _seen(one_by_one) == _seen(_fold(list(first), later))
    assert [m.content for m in at_once] == ["b2", "c2", "d", "a again"]
    cleared = add_message_batches(
        at_once, [[RemoveMessage(id=REMOVE_ALL_MESSAGES), HumanMessage("e", id="e")]]
    )
    assert _seen(cleared) == [("human", "e", "e")]
    with pytest.raises(InvalidInput, match="no message with the id 'nope'"):
        add_message_batches(at_once, [[RemoveMessage(id="nope")]])
    records: list[Any] = [{"turn": 0}]
    batches: list[Any] = [[{"turn": 1}], [{"turn": 2}, {"turn": 3}]]
    appended: list[Any] = append_records(records, batches)
    assert appended == [{"turn": t} for t in range(4)]
    assert records == [{"turn": 0}], "the reducer returns a new list"


def test_a_copy_of_a_history_is_reduced_as_the_history_itself() -> None:
    """A node that reads the state with its own writes gets a copy of the history: the same result."""
    history = add_message_batches([], [[HumanMessage("a", id="h"), AIMessage("b", id="a")]])
    batch: list[Any] = [AIMessage("b2", id="a"), ToolMessage("c", tool_call_id="x", id="t")]
    from_copy = add_message_batches(list(history), [batch])
    assert (
        _seen(from_copy)
        == _seen(add_message_batches(history, [batch]))
        == _seen(_fold(list(history), [batch]))
    )
    assert _seen(from_copy) == [("human", "h", "a"), ("ai", "a", "b2"), ("tool", "t", "c")]
    removed = add_message_batches(list(from_copy), [[RemoveMessage(id="a")]])
    assert _seen(add_message_batches(list(removed), [[AIMessage("z", id="a")]])) == [
        ("human", "h", "a"),
        ("tool", "t", "c"),
        ("ai", "a", "z"),
    ]


@pytest.fixture(name="before")
def before_fixture(tmp_path: Path) -> Path:
    copy = tmp_path / BEFORE.name
    shutil.copyfile(BEFORE, copy)
    return copy


async def test_a_thread_written_before_delta_channels_loads_and_continues(before: Path) -> None:
    config: Any = {"configurable": {"thread_id": "before-delta"}}
    with SqliteSaver.from_conn_string(str(before)) as saver:
        stored = saver.get_tuple(config)
        assert stored is not None
        written = stored.checkpoint["channel_values"]  # what that version stored: the whole values
        loaded = state_reader(saver).get_state(config).values
    assert [(m.type, m.id, m.content) for m in loaded["messages"]] == [
        (m.type, m.id, m.content) for m in written["messages"]
    ]
    assert loaded["route_log"] == written["route_log"] and len(loaded["route_log"]) == 6

    async with AsyncSqliteSaver.from_conn_string(str(before)) as saver:
        out = await graph_on(saver).ainvoke({"messages": [HumanMessage("turn 3")]}, config, context=CONTEXT)
    assert [m.id for m in out["messages"][:12]] == [m.id for m in written["messages"]]
    assert len(out["messages"]) == 16 and out["messages"][12].content == "turn 3"
    assert out["route_log"][:6] == written["route_log"] and len(out["route_log"]) == 8
    assert [r["turn"] for r in out["route_log"][6:]] == [3, 3]
    with SqliteSaver.from_conn_string(str(before)) as saver:
        again = state_reader(saver).get_state(config).values
    assert [m.id for m in again["messages"]] == [m.id for m in out["messages"]]
    assert again["route_log"] == out["route_log"]


def test_report_over_a_thread_written_before_is_what_that_version_reported(before: Path) -> None:
    result = CliRunner().invoke(app, ["report", "--db", str(before), "--json"])
    assert result.exit_code == 0, result.output
    now = json.loads(result.output)
    now.pop("db")
    assert now == json.loads(BEFORE_REPORT.read_text())


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LANGGRAPH_THREAD_TTL", '{"strategy": "keep_latest", "default_ttl": 60}'),
        ("LANGGRAPH_CHECKPOINTER", '{"ttl": {"strategy": "keep_latest", "default_ttl": 60}}'),
    ],
)
def test_a_server_set_to_keep_only_the_latest_checkpoint_is_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=f"{name}: a thread TTL with strategy keep_latest"):
        build_graph(cloud_model=replayed(script(1)), local_model=replayed(script(1)), tools=[echo])
    monkeypatch.setenv(name, value.replace("keep_latest", "delete"))
    assert build_graph(cloud_model=replayed(script(1)), local_model=replayed(script(1)), tools=[echo])
