"""Per-call durability: a crash during one tool call never re-runs a call that completed."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_child(db: Path, ledger: Path, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.tool_crash_child", str(db), str(ledger), mode],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("FUSION_")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def result_saved(db: Path, result: bytes) -> bool:
    """Whether a task's write holding ``result`` is in the SQLite checkpoint (read-only look)."""
    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as conn:
            row = conn.execute("SELECT count(*) FROM writes WHERE instr(value, ?) > 0", (result,)).fetchone()
    except sqlite3.OperationalError:
        return False  # the table is not created yet, or the database is busy
    return bool(row and row[0])


def lines(ledger: Path) -> list[str]:
    return ledger.read_text(encoding="utf-8").splitlines() if ledger.exists() else []


def test_sigkill_during_the_second_call_then_resume_runs_only_the_unfinished_call(tmp_path: Path) -> None:
    db, ledger = tmp_path / "threads.sqlite", tmp_path / "ledger.txt"
    child = run_child(db, ledger, "start")
    try:
        deadline = time.monotonic() + 60
        # Kill once A's result is in the checkpoint on its own, while B is still running.
        while not ({"A done", "B start"} <= set(lines(ledger)) and result_saved(db, b"A ok")):
            assert child.poll() is None, child.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, f"A's result never reached the checkpoint: {lines(ledger)}"
            time.sleep(0.05)
        assert "B done" not in lines(ledger)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert lines(ledger) == ["A start", "A done", "B start"]

    resumed = run_child(db, ledger, "resume")
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err.decode()[-2000:]
    # A's side effect happened once; only B ran again.
    assert lines(ledger) == ["A start", "A done", "B start", "B start", "B done", "final all done"]
