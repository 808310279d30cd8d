"""A memory job killed with its process is completed by the next turn in a new process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from langgraph.store.sqlite.aio import AsyncSqliteStore

from fusion_graph.memory.job_log import JobEntry
from tests.unit.memory.test_background import items, log_of

ROOT = Path(__file__).resolve().parents[2]


def run_child(folder: Path, ledger: Path, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.memory_crash_child", str(folder), str(ledger), mode],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("FUSION_")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def lines(ledger: Path) -> list[str]:
    return ledger.read_text(encoding="utf-8").splitlines() if ledger.exists() else []


async def crash_log(folder: Path) -> tuple[list[JobEntry], list[dict[str, Any]]]:
    async with AsyncSqliteStore.from_conn_string(str(folder / "store.sqlite")) as store:
        return await log_of(store, "crash"), await items(store)


async def test_a_job_killed_with_its_process_is_completed_by_the_next_turn_in_a_new_process(
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "ledger.txt"
    child = run_child(tmp_path, ledger, "start")
    try:
        deadline = time.monotonic() + 60
        while not lines(ledger):
            assert child.poll() is None, child.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the child never replied"
            await asyncio.sleep(0.05)
        child.send_signal(signal.SIGKILL)  # right after the reply, its memory job still running
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert lines(ledger) == ["reply all done"]
    entries, stored = await crash_log(tmp_path)
    assert [(e["turn"], e["status"], e["owner"]["pid"]) for e in entries] == [(0, "pending", child.pid)]
    assert stored == []

    resumed = run_child(tmp_path, ledger, "next")
    _, err = await asyncio.to_thread(resumed.communicate, timeout=120)
    assert resumed.returncode == 0, err.decode()[-2000:]
    assert lines(ledger) == ["reply all done", "final second answer"]
    entries, stored = await crash_log(tmp_path)
    # The dead process's job ran again (a second attempt) and stored its memory; so did the new turn's.
    assert [(e["turn"], e["status"], e["attempts"], e["stored"]) for e in entries] == [
        (0, "done", 2, 1),
        (1, "done", 1, 1),
    ]
    # Which of the two jobs asks the scripted model first is not fixed: each stored its own fact.
    assert sorted(i["turn"] for i in stored) == [0, 1]
    assert sorted(i["text"] for i in stored) == [
        "The user formats files with ruff.",
        "The user prefers tabs.",
    ]
