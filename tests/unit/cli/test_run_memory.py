"""``fusion-graph run`` keeps memories: a SQLite store beside the checkpoints, jobs awaited before exit
(at most as long as the answer took; what is left runs at the next turn), and Ctrl-C says how to go on."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatResult
from langgraph.store.sqlite import SqliteStore

from fusion_graph.cli import memory_wait
from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.cli.stores import store_path
from fusion_graph.context import FusionContext
from fusion_graph.memory import namespace
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import ScriptedModel, ai_calls, call, scripted
from tests.unit.cli.test_traces import runner

FACT = "The user keeps the shopping list in notes.txt."
GOOD = json.dumps({"items": [{"kind": "fact", "text": FACT}]})


def test_memory_jobs_run_in_the_store_beside_the_checkpoints_and_reach_the_next_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each turn: the cloud plan answers at once; the memory job (sub_runners=local) asks the local model.
    clouds = [scripted("cloudfake", ["Noted."]), scripted("cloudfake", ["It is in notes.txt."])]
    second_cloud = clouds[1]
    locals_ = [scripted("localfake", [GOOD]), scripted("localfake", [GOOD])]

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return clouds.pop(0), locals_.pop(0)

    monkeypatch.setattr(cli_run, "MODELS", models)
    db = tmp_path / "threads.sqlite"
    common = ["--workspace", str(tmp_path), "--db", str(db), "--json"]
    first = runner.invoke(app, ["run", "My shopping list is in notes.txt", *common])
    assert first.exit_code == 0, first.output
    thread = json.loads(first.stdout)["thread_id"]

    # The background job finished before the command returned: its memory is in the store.
    assert store_path(db) == tmp_path / "threads.store.sqlite"
    with SqliteStore.from_conn_string(str(store_path(db))) as store:
        items = [item.value for item in store.search(namespace("fusion", "anonymous"), limit=10)]
    assert [item["text"] for item in items] == [FACT]

    second = runner.invoke(app, ["run", "Where is my list?", *common, "--thread", thread])
    assert second.exit_code == 0, second.output
    out = json.loads(second.stdout)
    # The first turn's job record is folded into the thread's route_log at this turn's plan ...
    memory = [r for r in out["route_log"] if r["kind"] == "memory"]
    assert [(r["turn"], r["leg"], r["memory"]["outcome"]) for r in memory] == [(0, "local", "stored")]
    # ... and the plan was given the memory.
    [prompt] = second_cloud.prompts
    assert any(FACT in message.text for message in prompt)
    assert clouds == [] and locals_ == []


def test_memory_off_writes_no_store_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = ScriptedModel(messages=iter([]), model_name="localfake")

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return scripted("cloudfake", ["ok"]), local

    monkeypatch.setattr(cli_run, "MODELS", models)
    db = tmp_path / "t.sqlite"
    args = ["run", "hi", "--workspace", str(tmp_path), "--db", str(db), "--context", '{"sub_runners": "off"}']
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert local.prompts == []
    with SqliteStore.from_conn_string(str(store_path(db))) as store:
        assert store.search((), limit=10) == []


# --------------------------------------------------------------------------- the wait, and Ctrl-C


class Hanging(ScriptedModel):
    """A local model whose answer never comes (a memory job that outlives any wait)."""

    async def _agenerate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        self.prompts.append(list(messages))
        await asyncio.Event().wait()
        raise AssertionError("never answered")


class Interrupting(ScriptedModel):
    """A model that is interrupted (Ctrl-C) while it answers."""

    async def _agenerate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        raise KeyboardInterrupt


def use_models(monkeypatch: pytest.MonkeyPatch, *pairs: tuple[BaseChatModel, BaseChatModel]) -> None:
    queue = list(pairs)

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return queue.pop(0)

    monkeypatch.setattr(cli_run, "MODELS", models)


def test_the_memory_wait_ends_with_the_answers_time_and_the_next_turn_runs_what_was_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hanging = Hanging(messages=iter([]), model_name="localfake")
    second_local = scripted("localfake", [GOOD, GOOD])  # the job left pending, then this turn's own
    use_models(
        monkeypatch,
        (scripted("cloudfake", ["Noted."]), hanging),
        (scripted("cloudfake", ["Yes."]), second_local),
        (scripted("cloudfake", ["In notes.txt."]), scripted("localfake", [GOOD])),
    )
    common = ["--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite"), "--thread", "t1"]
    monkeypatch.setattr(memory_wait, "MIN_MEMORY_WAIT_S", 0.0)  # wait just as long as the answer took
    first = runner.invoke(app, ["run", "My list is in notes.txt", *common, "--new-thread"])
    assert first.exit_code == 0, first.output
    said = " ".join(first.stderr.split())
    assert "memory jobs still running after" in said and memory_wait.LEFT_PENDING in said
    assert "continue it with --thread t1" in first.stdout

    monkeypatch.setattr(memory_wait, "MIN_MEMORY_WAIT_S", 2.0)
    second = runner.invoke(app, ["run", "Is it?", *common, "--json"])
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["memory_pending"] is False
    assert len(second_local.prompts) == 2  # the pending job ran again at this turn, beside its own

    third = runner.invoke(app, ["run", "Where?", *common, "--json"])
    assert third.exit_code == 0, third.output
    # Each run recorded once in the thread, by whichever turn found it finished (a turn's own
    # output shows only what that turn added).
    from fusion_graph.cli.report import stored_route_logs

    log = stored_route_logs(tmp_path / "t.sqlite", "t1")["t1"]
    memory = [(r["turn"], r["memory"]["outcome"]) for r in log if r["kind"] == "memory"]
    assert sorted(memory) == [(0, "stored"), (1, "stored")]


def test_ctrl_c_while_memory_jobs_run_still_says_how_to_continue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def interrupted_wait(limit: float) -> bool:
        raise KeyboardInterrupt  # Ctrl-C while "waiting for memory jobs"

    use_models(monkeypatch, (scripted("cloudfake", ["Noted."]), scripted("localfake", [GOOD])))
    monkeypatch.setattr(cli_run, "wait_for_memory_jobs", interrupted_wait)
    args = [
        "run",
        "My list is in notes.txt",
        "--workspace",
        str(tmp_path),
        "--db",
        str(tmp_path / "t.sqlite"),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 130
    assert "Noted." in result.stdout  # the answer came first
    found = re.search(
        r"interrupted: thread (\w+) saved in \S+; continue it with --thread (\w+)", result.stderr
    )
    assert found is not None and found[1] == found[2], result.stderr


def test_ctrl_c_during_a_step_still_says_how_to_continue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "notes.txt").write_text("milk\n")
    plan = ai_calls(call("read_file", {"path": "notes.txt"}, "r1"))
    use_models(monkeypatch, (scripted("cloudfake", [plan]), Interrupting(messages=iter([]))))
    off = '{"sub_runners": "off"}'
    args = ["run", "read", "--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite"), "--context", off]
    result = runner.invoke(app, [*args, "--thread", "t2", "--new-thread", "--json"])
    assert result.exit_code == 130
    assert "continue it with --thread t2" in result.stderr and result.stdout == ""


def test_ctrl_c_before_the_thread_exists_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        raise KeyboardInterrupt  # while the servers are checked

    monkeypatch.setattr(cli_run, "MODELS", models)
    result = runner.invoke(
        app, ["run", "hi", "--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite")]
    )
    assert result.exit_code == 130
    assert "interrupted before thread" in result.stderr and "--thread" not in result.stderr
