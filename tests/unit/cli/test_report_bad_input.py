"""``report`` under bad input: a Postgres that never answers, a ``--since`` past any date or of 100 KB.

Each ends with one line on stderr and exit code 2, through the command as an operator runs it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fusion_graph.cli import stores
from fusion_graph.cli.app import app

runner = CliRunner()
PASSWORD = "pg-pass-never-printed-42"


@pytest.fixture
def silent_database() -> Iterator[int]:
    """A loopback port whose server accepts every connection and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(listener.getsockname()[1])
    stop.set()
    thread.join()
    for sock in held:
        sock.close()
    listener.close()


def one_error_line(stderr: str) -> str:
    """The error's one line (rich may wrap it at the runner's width: joined back)."""
    text = " ".join(stderr.split())
    assert text.startswith("error:"), stderr
    assert "Traceback" not in stderr
    return text


def test_a_database_that_accepts_and_never_answers_ends_within_the_connect_timeout(
    silent_database: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    monkeypatch.setattr(stores, "POSTGRES_CONNECT_TIMEOUT_S", 2)  # libpq's least
    url = f"postgresql://fusion:{PASSWORD}@127.0.0.1:{silent_database}/threads"
    result = runner.invoke(app, ["report", "--postgres", url])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr)
    assert f"127.0.0.1:{silent_database}/threads" in line and "did not answer" in line
    assert PASSWORD not in result.output and "fusion:" not in result.output


def test_the_connect_timeout_is_the_operators_when_the_url_sets_one() -> None:
    url = f"postgresql://u:{PASSWORD}@db.example:6543/x"
    assert "connect_timeout=10" in stores.postgres_conninfo(url)
    assert stores.postgres_conninfo(url + "?connect_timeout=3") == url + "?connect_timeout=3"
    assert stores.postgres_where(url) == "db.example:6543/x"


@pytest.mark.parametrize("span", ["99999999999d", "36501d", "9999999999999999999999999999999h"])
def test_a_span_past_any_date_is_one_line_and_exit_2(tmp_path: Path, span: str) -> None:
    db = tmp_path / "t.sqlite"
    db.touch()
    result = runner.invoke(app, ["report", "--db", str(db), "--since", span])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr)
    assert "OverflowError" not in result.output and "more than 36500 days" in line


def test_a_huge_since_is_not_echoed_whole(tmp_path: Path) -> None:
    db = tmp_path / "t.sqlite"
    db.touch()
    huge = "x" * 100_000
    result = runner.invoke(app, ["report", "--db", str(db), "--since", huge])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr)
    assert "(100000 characters)" in line and len(result.stderr) < 400


def test_a_span_within_the_bound_still_reads(tmp_path: Path) -> None:
    from fusion_graph.cli.report import since_time

    assert since_time("36500d").year >= 1
    assert since_time("1.5h") < since_time("30m")
