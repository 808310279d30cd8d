"""Per-call durability: a crash during one tool call never re-runs a call whose result was saved.

What is guaranteed, whatever the machine's speed: a tool call whose result is
in the checkpoint (its task's write) does not run again on resume, because the
graph runs with at least ``durability="sync"`` and so saves the checkpoint that
write belongs to before any tool call of the step starts. A call killed between
returning and its write landing (milliseconds) runs again: resume is at least
once. So the test kills only once A's write is seen in the SQLite file while B
runs, and synchronises on that and on the ledger, never on a sleep.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_child(db: Path, ledger: Path, mode: str, how: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.tool_crash_child", str(db), str(ledger), mode, how],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("FUSION_")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def saved_result(db: Path, result: bytes) -> tuple[bool, bool]:
    """Whether a task's write holding ``result`` is in the SQLite file, and its checkpoint with it.

    A read-only look; ``(False, False)`` while the tables are not made yet or the file is busy.
    """
    if not db.exists():
        return False, False
    query = (
        "SELECT count(*), count(c.checkpoint_id) FROM writes w LEFT JOIN checkpoints c "
        "ON c.thread_id = w.thread_id AND c.checkpoint_ns = w.checkpoint_ns "
        "AND c.checkpoint_id = w.checkpoint_id WHERE instr(w.value, ?) > 0"
    )
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as conn:
            writes, checkpoints = conn.execute(query, (result,)).fetchone()
    except sqlite3.OperationalError:
        return False, False  # the tables are not created yet, or the database is busy
    return bool(writes), bool(writes) and checkpoints == writes


def lines(ledger: Path) -> list[str]:
    return ledger.read_text(encoding="utf-8").splitlines() if ledger.exists() else []


@pytest.mark.parametrize("how", ["ainvoke", "astream"])
def test_sigkill_during_the_second_call_then_resume_runs_only_the_unfinished_call(
    tmp_path: Path, how: str
) -> None:
    db, ledger = tmp_path / "threads.sqlite", tmp_path / "ledger.txt"
    child = run_child(db, ledger, "start", how)
    try:
        # A generous bound on a hang only (a busy machine is slow, never wrong): no step waits on time.
        deadline = time.monotonic() + 240
        # Kill once A's result is in the file on its own, while B hangs (it waits for nothing that comes).
        while True:
            saved = saved_result(db, b"A ok")
            if {"A done", "B start"} <= set(lines(ledger)) and saved[0]:
                break
            assert child.poll() is None, child.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, f"A's result never reached the checkpoint: {lines(ledger)}"
            time.sleep(0.05)
        # The guarantee: the checkpoint A's write belongs to was saved (before A even started).
        assert saved == (True, True)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    before = lines(ledger)  # A and B run side by side: their lines may come in either order
    assert sorted(before) == ["A done", "A start", "B start"]
    assert before.index("A start") < before.index("A done")

    resumed = run_child(db, ledger, "resume", how)
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err.decode()[-2000:]
    # A's side effect happened once; only B ran again.
    assert lines(ledger) == [*before, "B start", "B done", "final all done"]
