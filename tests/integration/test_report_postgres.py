"""``run --postgres`` then ``report --postgres`` on a real PostgreSQL, under the bounded connect and queries.

The bad-input side (a server that never answers, ``--since`` out of range) is in
``tests/unit/cli/test_report_bad_input.py``; here the bounds must not get in the way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langchain_core.language_models import BaseChatModel

from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import scripted
from tests.unit.cli.test_report_bad_input import runner


def test_a_thread_run_into_postgres_is_reported_from_it(
    postgres_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return scripted("cloudfake", ["Noted."]), scripted("localfake", ["{}"])

    monkeypatch.setattr(cli_run, "MODELS", models)
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    off = '{"sub_runners": "off"}'
    ran = runner.invoke(
        app,
        ["run", "hello", "--workspace", str(tmp_path), "--postgres", postgres_db, "--context", off, "--json"],
    )
    assert ran.exit_code == 0, ran.output
    thread = json.loads(ran.stdout)["thread_id"]
    reported = runner.invoke(app, ["report", "--postgres", postgres_db, "--since", "1h", "--json"])
    assert reported.exit_code == 0, reported.output
    assert list(json.loads(reported.stdout)["threads"]) == [thread]
