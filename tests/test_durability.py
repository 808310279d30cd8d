"""Per-call durability: a crash during one tool call never re-runs a call that completed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child(db: Path, ledger: Path, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.tool_crash_child", str(db), str(ledger), mode],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("FUSION_")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def lines(ledger: Path) -> list[str]:
    return ledger.read_text(encoding="utf-8").splitlines() if ledger.exists() else []


def test_sigkill_during_the_second_call_then_resume_runs_only_the_unfinished_call(tmp_path: Path) -> None:
    db, ledger = tmp_path / "threads.sqlite", tmp_path / "ledger.txt"
    child = run_child(db, ledger, "start")
    try:
        deadline = time.monotonic() + 60
        while not {"A done", "B start"} <= set(lines(ledger)):
            assert child.poll() is None, child.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, f"the child never reached call B: {lines(ledger)}"
            time.sleep(0.05)
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
