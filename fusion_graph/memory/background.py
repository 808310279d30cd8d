"""Detached memory runs and the inferences in flight per thread (this process's registries).

A detached run is a task on the loop of the run that started it. Under a
LangGraph server with ``BG_JOB_ISOLATED_LOOPS`` each run has a loop of its
own that stops with the run, so a task left there would freeze until another
run wakes that loop: ``loop_outlives_run`` says when the memory node must see
its jobs through itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from collections.abc import AsyncIterator, Awaitable
from typing import Any

logger = logging.getLogger(__name__)

# -- detached runs, and inferences in flight per thread ------------------------

#: Jobs running detached (``memory_mode="background"``); ``drain`` awaits them.
_PENDING: set[asyncio.Task[Any]] = set()
#: The detached run of each job log key, while it runs in this process.
_RUNNING: dict[str, asyncio.Task[Any]] = {}


def detach(job: Awaitable[Any], key: str | None = None) -> asyncio.Task[Any]:
    """Run ``job`` in the background, keeping a reference (by job log ``key``, if any) until it is done."""
    task = asyncio.ensure_future(job)
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)
    if key is not None:
        _RUNNING[key] = task

        def forget(done: asyncio.Task[Any]) -> None:
            if _RUNNING.get(key) is done:
                del _RUNNING[key]

        task.add_done_callback(forget)
    return task


def detached_now() -> frozenset[asyncio.Task[Any]]:
    """The detached runs of this process now (``stop_detached`` leaves these alone)."""
    return frozenset(_PENDING)


async def stop_detached(keep: frozenset[asyncio.Task[Any]] = frozenset()) -> int:
    """Cancel the detached runs not in ``keep`` and wait until they stopped; how many were running.

    A run stopped this way stays ``pending`` in the job log, so the thread's next
    turn runs it. Stopping it before its providers close matters: closing the
    HTTP client under a running job would fail its request, and the job would be
    recorded (and counted) as a failed attempt, an exhausted inference and a
    dropped job, and logged as done.
    """
    running = [task for task in _PENDING if task not in keep and not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running)
    return len(running)


def runs_in_flight() -> int:
    """Memory runs detached in this process and not finished yet (the metrics' pending jobs)."""
    return sum(1 for task in _PENDING if not task.done())


def loop_outlives_run() -> bool:
    """Whether the event loop a graph run runs on goes on after the run (not a server's isolated loop)."""
    return os.environ.get("BG_JOB_ISOLATED_LOOPS", "").strip().lower() not in {"1", "true", "yes", "on"}


def running_here(key: str) -> bool:
    """Whether the run logged under ``key`` is running in this process."""
    task = _RUNNING.get(key)
    return task is not None and not task.done()


#: Inferences in flight per event loop and thread, so a job can start after the step beside it.
_IN_FLIGHT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, set[asyncio.Future[None]]]] = (
    weakref.WeakKeyDictionary()
)


def _in_flight() -> dict[str, set[asyncio.Future[None]]]:
    return _IN_FLIGHT.setdefault(asyncio.get_running_loop(), {})


@contextlib.asynccontextmanager
async def inference_running(thread_id: str) -> AsyncIterator[None]:
    """Mark an inference of ``thread_id`` as in flight (``steps_settled`` waits for it)."""
    table = _in_flight()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    table.setdefault(thread_id, set()).add(done)
    try:
        yield
    finally:
        done.set_result(None)
        futures = table.get(thread_id, set())
        futures.discard(done)
        if not futures:
            table.pop(thread_id, None)


async def steps_settled(thread_id: str, timeout: float) -> None:
    """Wait (at most ``timeout`` s) for the thread's inferences in flight now.

    A job beside a step (``memory_every_k_steps``) starts once that step is
    answered: llama-server then holds the step's prompt in an idle slot, which
    the job's priming copies into the host prompt cache.
    """
    futures = set(_in_flight().get(thread_id, set()))
    if futures:
        await asyncio.wait(futures, timeout=timeout)


async def wait_detached(timeout: float | None = None) -> None:
    """Wait (at most ``timeout`` s) for the detached runs of this process."""
    if _PENDING:
        await asyncio.wait(list(_PENDING), timeout=timeout)
