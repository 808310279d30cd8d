"""``fusion-graph report`` (a report of real runs is in test_run.py)."""

from __future__ import annotations

from pathlib import Path

from fusion_graph.cli.app import app
from tests.unit.cli.test_traces import runner


def test_report_of_a_missing_database_says_so(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(tmp_path / "none.sqlite")])
    assert result.exit_code == 2
    assert "no checkpoint database" in result.stderr
    assert not (tmp_path / "none.sqlite").exists()
