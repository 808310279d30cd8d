"""What ``--workers`` measures and reports: where each step ran, collisions, moves, the check and the table.

``bench.kv.workers`` replays the grid and records a ``PlacedStep`` per step;
``summarize_workers`` turns a variant's steps into its leaf (the gateway leaf plus
slot collisions and thread moves), ``evaluate_checks`` judges the shared variants
and the ``format_*`` functions print them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.kv.gateway import EXCESS_DETAIL, GatewayStep, summarize_gateway
from bench.kv.report import VERDICT_WORDS
from bench.kv.results import StepRecord, over_minimum

#: The expectation checked (not asserted): shared placement processes at most this many times the minimum.
SHARED_OVER_MINIMUM = 1.02


# -- counting ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacedStep:
    """One step's cost, and where it ran (``worker``, ``box`` and ``slot`` are ``None`` for a cloud step).

    ``finished`` is the wall-clock time the worker got the answer: one slot serves
    one request at a time, so on a (box, slot) it orders the requests as the
    server ran them.
    """

    record: StepRecord
    thread: str
    position: int
    run: int | None = None
    worker: int | None = None
    box: int | None = None
    slot: int | None = None
    finished: float = 0.0
    notes: Mapping[str, Any] = field(default_factory=dict)

    @property
    def local(self) -> bool:
        """Whether it was sent to a box."""
        return self.box is not None


def slot_collisions(steps: Iterable[PlacedStep]) -> int:
    """Local requests on a (box, slot) whose previous request there came from another thread."""
    last: dict[tuple[int | None, int | None], str] = {}
    collisions = 0
    for step in sorted((s for s in steps if s.local), key=lambda s: s.finished):
        where = (step.box, step.slot)
        if where in last and last[where] != step.thread:
            collisions += 1
        last[where] = step.thread
    return collisions


def thread_moves(steps: Iterable[PlacedStep]) -> int:
    """A thread's consecutive local requests on different (box, slot), over all threads."""
    last: dict[str, tuple[int | None, int | None]] = {}
    moves = 0
    for step in sorted((s for s in steps if s.local), key=lambda s: (s.thread, s.position)):
        where = (step.box, step.slot)
        if step.thread in last and last[step.thread] != where:
            moves += 1
        last[step.thread] = where
    return moves


def summarize_workers(steps: Sequence[PlacedStep], boxes: int) -> dict[str, Any]:
    """The gateway leaf (tokens, ``processed_over_minimum``, per box) plus collisions, moves and notes."""
    leaf = summarize_gateway([GatewayStep(s.record, s.thread, s.position, s.box) for s in steps], boxes)
    local = [s for s in steps if s.local]
    leaf["slot_collisions"] = slot_collisions(steps)
    leaf["thread_moves"] = thread_moves(steps)
    leaf["guest_requests"] = sum(1 for s in local if s.notes.get("guest"))
    leaf["fallback_requests"] = sum(
        1 for s in local if str(s.notes.get("lease", "")).startswith("in-process:")
    )
    leaf["excess_detail"] = [
        {
            "thread": s.thread,
            "position": s.position,
            "run": s.run,
            "worker": s.worker,
            "box": s.box,
            "slot": s.slot,
            "prompt_n": s.record.prompt_n,
            "cache_n": s.record.cache_n,
            "minimum": s.record.minimum,
        }
        for s in local
        if s.record.prompt_n > s.record.minimum
    ][:EXCESS_DETAIL]
    return leaf


# -- the report --------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkersCheck:
    """The expectation on one shared variant: at most ``SHARED_OVER_MINIMUM`` × the minimum."""

    variant: str
    holds: bool | None
    detail: str


def evaluate_checks(variants: Mapping[str, Mapping[str, Any]]) -> list[WorkersCheck]:
    """Every shared variant processes at most ``SHARED_OVER_MINIMUM`` × the minimum."""
    return [
        WorkersCheck(name, *over_minimum(leaf, SHARED_OVER_MINIMUM, "expected"))
        for name, leaf in variants.items()
        if leaf.get("placement") == "shared"
    ]


def _int(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def format_workers_table(variants: Mapping[str, Mapping[str, Any]]) -> str:
    """The Markdown table: one row per variant."""
    header = (
        "| placement | workers | boxes × `-np` | slots | local steps | processed | minimum | "
        "processed / minimum | slot collisions | thread moves | threads per box | seconds |"
    )
    lines = [header, "| " + " | ".join(["---"] * 12) + " |"]
    for leaf in variants.values():
        ratio = leaf.get("processed_over_minimum")
        cells = [
            str(leaf.get("placement")),
            str(leaf.get("workers")),
            f"{leaf.get('box_count')} × {leaf.get('box_slots')}",
            str(leaf.get("slots")),
            _int(leaf.get("local_steps")),
            _int(leaf.get("processed_tokens")),
            _int(leaf.get("minimum_tokens")),
            f"{ratio:.3f}" if isinstance(ratio, float | int) else "-",
            _int(leaf.get("slot_collisions")),
            _int(leaf.get("thread_moves")),
            " / ".join(map(str, leaf.get("threads_per_box", []))),
            f"{leaf.get('wall_s', 0):.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_checks(checks: Sequence[WorkersCheck]) -> str:
    """One line per shared variant."""
    return "\n".join(f"  {c.variant}: {VERDICT_WORDS[c.holds]:<5}  {c.detail}" for c in checks)
