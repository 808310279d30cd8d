"""The wait for a turn's memory jobs after its answer: bounded by the answer's own time, and shown.

Memory jobs run after the reply, detached. ``run`` waits for them so their
memories are stored before the process exits, but never longer than the
answer took (at least ``MIN_MEMORY_WAIT_S``, at most ``memory_timeout_s`` + 5):
a job still running then stays ``pending`` in the store's job log, and the
thread's next turn runs it again (``memory.runs``). The terminal shows the
seconds waited against that bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.text import Text

if TYPE_CHECKING:
    from fusion_graph.settings import FusionSettings

#: The shortest wait, so the job of an answer that came at once still gets to store its memories.
MIN_MEMORY_WAIT_S = 2.0
#: Said when jobs are left running: where they go.
LEFT_PENDING = "left pending: the thread's next turn runs them"


def memory_wait_limit(settings: FusionSettings, answer_s: float) -> float:
    """Seconds to wait for the jobs: as long as the answer took, within the bounds above."""
    return min(settings.memory_timeout_s + 5, max(answer_s, MIN_MEMORY_WAIT_S))


async def wait_for_memory_jobs(limit: float) -> bool:
    """Wait at most ``limit`` seconds for this process's detached memory runs; whether some still run."""
    from fusion_graph.memory import drain

    try:
        await asyncio.wait_for(drain(), timeout=limit)
    except TimeoutError:
        return True
    return False


@dataclass
class WaitTicker:
    """The status line of the wait, drawn afresh at each refresh: seconds waited, and the bound.

    Attributes:
        limit: The bound (``memory_wait_limit``).
        clock: Monotonic seconds.
        started: When the wait began.
    """

    limit: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)

    def __post_init__(self) -> None:
        """Start the clock."""
        self.started = self.started or self.clock()

    @property
    def elapsed(self) -> float:
        """Seconds waited so far."""
        return self.clock() - self.started

    def __rich__(self) -> Text:
        """``waiting for memory jobs: 3s, at most 20s (Ctrl-C: leave them to the next turn)``."""
        return Text(
            f"waiting for memory jobs: {self.elapsed:.0f}s, at most {self.limit:.0f}s "
            "(Ctrl-C: leave them to the next turn)"
        )

    def outcome(self, pending: bool) -> str | None:
        """The line after the wait: jobs left pending, and where they go; ``None`` when they finished."""
        if not pending:
            return None
        waited = f"{self.elapsed:.0f}s (as long as the answer took)"
        return f"memory jobs still running after {waited}: {LEFT_PENDING}"
