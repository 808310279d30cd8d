"""``fusion-graph run`` with shared state on a real Postgres: a busy thread is one line, not a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from langchain_core.language_models import BaseChatModel

from fusion_graph.agent import GRAPH_NAME
from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.context import FusionContext
from fusion_graph.coordination.shared_base import lock_key
from fusion_graph.coordination.shared_state import default_namespace
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import scripted
from tests.unit.cli.test_traces import runner


def test_a_thread_running_in_another_process_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, postgres_db: str
) -> None:
    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return scripted("cloudfake", ["never asked"]), scripted("localfake", [])

    monkeypatch.setattr(cli_run, "MODELS", models)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("FUSION_SHARED_STATE", "postgres")
    monkeypatch.setenv("FUSION_SHARED_STATE_URL", postgres_db)
    monkeypatch.delenv("DATABASE_URI", raising=False)
    import psycopg

    # Another process runs thread "busy" of the same app (the same checkpoint file): it holds the
    # thread's run lock, named by where the thread's checkpoints live (run_queue.store_name).
    store = f"sqlite:{os.path.realpath(tmp_path / 't.sqlite')}"
    key = lock_key(f"fusion-thread:{default_namespace()}\0{GRAPH_NAME}:{store}:busy")
    with psycopg.connect(postgres_db, autocommit=True) as other:
        assert other.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)
        args = ["run", "hi", "--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite")]
        result = runner.invoke(
            app, [*args, "--thread", "busy", "--new-thread", "--context", '{"mode": "cloud"}']
        )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "thread 'busy' is running in another process" in lines[0] and "--thread busy" in lines[0]
