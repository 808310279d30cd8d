"""``fusion-graph run`` keeps memories: a SQLite store beside the checkpoints, jobs awaited before exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langchain_core.language_models import BaseChatModel
from langgraph.store.sqlite import SqliteStore

from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.cli.stores import store_path
from fusion_graph.context import FusionContext
from fusion_graph.memory import namespace
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import ScriptedModel, scripted
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
    assert [(r["turn"], r["leg"], r["extra"]["outcome"]) for r in memory] == [(0, "local", "stored")]
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
