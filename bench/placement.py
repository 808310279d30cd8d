"""What placing a local request costs: this process's slot table against leases shared in Postgres.

Every local step asks the graph's placer where to go (``Placer.place``) and holds
the slot's turn around its request (``Placement.hold``). In one process that is a
dictionary lookup and a lock; with ``shared_state="postgres"`` a thread's first
request claims a lease (a round trip, under an advisory lock), later ones use
this process's copy until half the lease has run, and every request takes the
slot's advisory lock on a connection of its own. This
times both, per request, on a throwaway Postgres cluster (the harness's
``PostgresCluster``; it needs Debian's ``postgresql`` binaries): ``threads``
threads, each placed once (the claim) and then ``steps`` times (its steps).

    python -m bench.placement --out placement.json        # --threads 64 --steps 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusion_graph.coordination.shared_state import SharedState
from fusion_graph.coordination.slot_leases import LocalLeases
from fusion_graph.providers.models import Provider, build_local_model
from fusion_graph.providers.placement import LeasedPlacement, Placer, ServerSlots
from fusion_graph.providers.pricing import FREE, Pricing
from fusion_graph.settings import FusionSettings


async def _no_props(link: Provider) -> Any:
    return None


async def timed(placer: Placer, link: Provider, threads: Sequence[str], steps: int) -> dict[str, float]:
    """Microseconds per ``place`` call: each thread's first (a claim where shared), then its steps.

    ``moved`` counts later placements that named another slot than the thread's first:
    anything but 0 means the figures time the wrong path.
    """
    first: list[float] = []
    later: list[float] = []
    slots: dict[str, int | None] = {}
    moved = 0
    for thread in threads:
        began = time.perf_counter()
        placed = await placer.place(link, thread)
        async with placed.hold():  # the slot's turn, taken and given back around each request
            pass
        first.append(time.perf_counter() - began)
        slots[thread] = placed.slot
    for _ in range(steps):
        for thread in threads:
            began = time.perf_counter()
            placed = await placer.place(link, thread)
            async with placed.hold():
                pass
            later.append(time.perf_counter() - began)
            moved += placed.slot != slots[thread]
    return {
        "first_us_median": round(statistics.median(first) * 1e6, 1),
        "later_us_median": round(statistics.median(later) * 1e6, 1),
        "later_us_p99": round(sorted(later)[int(len(later) * 0.99)] * 1e6, 1),
        "moved": moved,
    }


async def measure(url: str, threads: int, steps: int) -> dict[str, Any]:
    """Both placers over one local link of ``threads + 1`` slots (one per thread, and the reflection slot)."""
    settings = FusionSettings(local_slots=threads + 1, local_base_url="http://127.0.0.1:9/v1")
    link = Provider("local:local", "local", build_local_model(settings), Pricing.flat(FREE))
    names = [f"thread-{i}" for i in range(threads)]
    # As the graph places without shared state: this process's own lease table, by the same rule.
    local = LeasedPlacement(LocalLeases(), ServerSlots(settings, _no_props), boxes=(), box_model=None)
    state = SharedState(url)
    try:
        shared = LeasedPlacement(state, ServerSlots(settings, _no_props), boxes=(), box_model=None)
        await state.leases.box_of("warm-up", "nobody")  # connect and make the tables before timing
        return {
            "threads": threads,
            "steps": steps,
            "in_process": await timed(local, link, names, steps),
            "shared": await timed(shared, link, names, steps),
        }
    finally:
        await state.aclose()


def table(result: dict[str, Any]) -> str:
    """The result as a Markdown table."""
    lines = [
        "| placement | thread's first (median) | later (median) | later (p99) | moved |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in ("in_process", "shared"):
        row = result[name]
        lines.append(
            f"| {name.replace('_', '-')} | {row['first_us_median']:.1f} µs | {row['later_us_median']:.1f} µs "
            f"| {row['later_us_p99']:.1f} µs | {row['moved']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    from fusion_graph_testing.postgres import PostgresCluster

    with PostgresCluster() as cluster:
        url = cluster.create_database("placement")
        result = asyncio.run(measure(url, args.threads, args.steps))
    text = json.dumps(result, indent=2)
    print(text)
    print(table(result), file=sys.stderr)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
