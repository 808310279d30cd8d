"""A long-lived thread: what a step writes and takes on turn 200 against turn 1.

One thread runs ``--turns`` turns (default 200) of the same shape: the user's
message, the plan on the cloud model, one tool call on the local one, the reply
(instant scripted models, so only the graph's own work and the checkpointer's
show). After each turn the checkpointer's tables are summed: bytes stored
(checkpoint rows, their blobs and writes), and the bytes and checkpoints the
turn added, so a step's bytes are the turn's added bytes over its checkpoints,
and a step's time the turn's wall time over the same count; the turn's time until
its first task starts is LangGraph loading the thread, and the rest over the
checkpoints is a step's own time.

Graphs: fusion (``build_graph``), LangChain's ``create_agent`` with its default
state, and ``create_agent`` with ``messages`` a delta channel (the same reducer
fusion uses, ``fusion_graph.state.add_message_batches``). Checkpointers: SQLite
(a file) and Postgres (a throwaway cluster, skipped with a message when no
Postgres binaries are found).

The table (stderr) gives per graph and checkpointer: bytes a step writes on
turn 1 and on the last turns (the median step, and the mean over the last
``SNAPSHOT_WINDOW`` turns, which carries the whole-history snapshots a delta
channel writes every ``fusion_graph.state.SNAPSHOT_EVERY`` updates), bytes
stored, and the median time of a step on turns 2-11 against the last 10. The
JSON (stdout, ``--out``) holds every turn's figures.

    python -m bench.long_thread                            # 200 turns, SQLite and Postgres
    python -m bench.long_thread --turns 50 --savers sqlite --out long_thread.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from langchain.agents import AgentState, create_agent
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.channels import DeltaChannel
from langgraph.checkpoint.base import BaseCheckpointSaver
from rich.console import Console
from rich.table import Table

from bench.overhead import echo, replayed, script
from fusion_graph import FusionContext, build_graph
from fusion_graph.state import SNAPSHOT_EVERY, add_message_batches

Saver = Literal["sqlite", "postgres"]
GraphName = Literal["fusion", "create_agent", "create_agent-delta"]
SAVERS: tuple[Saver, ...] = ("sqlite", "postgres")
GRAPHS: tuple[GraphName, ...] = ("fusion", "create_agent", "create_agent-delta")
TURNS = 200
#: Turns whose mean step bytes carry the snapshots a delta channel writes now and then.
SNAPSHOT_WINDOW = 25
#: The targets (checked, not asserted): at the last turn against the first.
BYTES_TARGET = 2.0
TIME_TARGET = 1.2


class DeltaAgentState(AgentState[Any]):
    """``create_agent``'s state with ``messages`` a delta channel."""

    messages: Annotated[
        list[AnyMessage], DeltaChannel(add_message_batches, snapshot_frequency=SNAPSHOT_EVERY)
    ]


@dataclass(frozen=True)
class TurnFigures:
    """One turn of the thread: what it added to the checkpointer and how long it took."""

    turn: int
    checkpoints: int
    bytes_added: int
    bytes_stored: int
    seconds: float
    load_seconds: float
    """Until the turn's first task started: LangGraph loading the thread from the checkpointer."""

    @property
    def step_bytes(self) -> float:
        return self.bytes_added / max(self.checkpoints, 1)

    @property
    def step_ms(self) -> float:
        """The turn's time over its checkpoints, the load included."""
        return 1000 * self.seconds / max(self.checkpoints, 1)

    @property
    def own_step_ms(self) -> float:
        """The turn's time after the load, over its checkpoints: the steps themselves."""
        return 1000 * (self.seconds - self.load_seconds) / max(self.checkpoints, 1)


#: ``(checkpoints, bytes)`` the checkpointer holds now.
Meter = Callable[[], tuple[int, int]]


def sqlite_meter(path: Path) -> Meter:
    def measure() -> tuple[int, int]:
        with sqlite3.connect(path) as db:
            rows, stored = db.execute(
                "SELECT count(*), coalesce(sum(length(checkpoint) + length(metadata)), 0) FROM checkpoints"
            ).fetchone()
            written = db.execute("SELECT coalesce(sum(length(value)), 0) FROM writes").fetchone()[0]
        return int(rows), int(stored) + int(written)

    return measure


def postgres_meter(url: str) -> Meter:
    import psycopg

    def measure() -> tuple[int, int]:
        with psycopg.connect(url) as db:
            rows, stored = db.execute(
                "SELECT count(*), coalesce(sum(octet_length(checkpoint::text) "
                "+ octet_length(metadata::text)), 0) FROM checkpoints"
            ).fetchone() or (0, 0)
            blobs = db.execute("SELECT coalesce(sum(octet_length(blob)), 0) FROM checkpoint_blobs").fetchone()
            writes = db.execute(
                "SELECT coalesce(sum(octet_length(blob)), 0) FROM checkpoint_writes"
            ).fetchone()
        return int(rows), int(stored) + int((blobs or [0])[0]) + int((writes or [0])[0])

    return measure


@asynccontextmanager
async def sqlite_saver(folder: Path, name: str) -> AsyncIterator[tuple[BaseCheckpointSaver[Any], Meter]]:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    path = folder / f"{name}.sqlite"
    async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
        await saver.setup()
        yield saver, sqlite_meter(path)


def postgres_saver_factory(cluster: Any) -> Callable[[Path, str], AbstractAsyncContextManager[Any]]:
    @asynccontextmanager
    async def open_saver(folder: Path, name: str) -> AsyncIterator[tuple[BaseCheckpointSaver[Any], Meter]]:
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        url = cluster.create_database(name.replace("-", "_"))
        async with AsyncPostgresSaver.from_conn_string(url) as saver:
            await saver.setup()
            yield saver, postgres_meter(url)

    return open_saver


def build(graph: GraphName, saver: BaseCheckpointSaver[Any]) -> Any:
    """The graph under test: a turn is a plan (or model call) with one tool call, then the reply."""
    answers = script(2)
    if graph == "fusion":
        return build_graph(
            cloud_model=replayed(answers[:1]),
            local_model=replayed(answers[1:]),
            tools=[echo],
            checkpointer=saver,
        )
    schema = DeltaAgentState if graph == "create_agent-delta" else AgentState
    return create_agent(replayed(answers), tools=[echo], checkpointer=saver, state_schema=schema)


async def run_thread(
    graph_name: GraphName, saver: BaseCheckpointSaver[Any], meter: Meter, turns: int
) -> list[TurnFigures]:
    """Every turn of one thread through ``graph_name``, measured."""
    graph = build(graph_name, saver)
    config: Any = {"configurable": {"thread_id": f"long-{graph_name}"}}
    context = FusionContext(max_steps=10, sub_runners="off", loop_repeat_limit=100)
    before = meter()
    figures = []
    for turn in range(1, turns + 1):
        graph_input: Any = {"messages": [HumanMessage(f"turn {turn}: echo the step")]}
        began = time.perf_counter()
        loaded: float | None = None
        out: dict[str, Any] = {}
        extra = {"context": context} if graph_name == "fusion" else {}
        async for mode, chunk in graph.astream(graph_input, config, stream_mode=["tasks", "values"], **extra):
            if mode == "tasks" and loaded is None:
                loaded = time.perf_counter() - began
            elif mode == "values":
                out = chunk
        seconds = time.perf_counter() - began
        if graph_name == "fusion":
            assert len(out["route_log"]) == 2 * turn, "a turn of fusion records its plan and its step"
        assert sum(isinstance(m, AIMessage) for m in out["messages"]) == 2 * turn, (
            "the thread kept every turn"
        )
        after = meter()
        figures.append(
            TurnFigures(turn, after[0] - before[0], after[1] - before[1], after[1], seconds, loaded or 0.0)
        )
        before = after
    return figures


def summary(figures: Sequence[TurnFigures]) -> dict[str, Any]:
    """The table's figures for one thread: first turn against the last ones."""
    last = figures[-10:]
    window = figures[-SNAPSHOT_WINDOW:]
    early = figures[1:11] or figures[:1]
    first_bytes = figures[0].step_bytes
    median_bytes = statistics.median(f.step_bytes for f in last)
    mean_bytes = sum(f.bytes_added for f in window) / max(sum(f.checkpoints for f in window), 1)
    early_ms = statistics.median(f.step_ms for f in early)
    late_ms = statistics.median(f.step_ms for f in last)
    early_own = statistics.median(f.own_step_ms for f in early)
    late_own = statistics.median(f.own_step_ms for f in last)
    early_load = statistics.median(1000 * f.load_seconds for f in early)
    late_load = statistics.median(1000 * f.load_seconds for f in last)
    return {
        "turns": len(figures),
        "step_bytes_turn_1": round(first_bytes),
        "step_bytes_last_median": round(median_bytes),
        "step_bytes_last_mean": round(mean_bytes),
        "bytes_ratio_median": round(median_bytes / first_bytes, 2),
        "bytes_ratio_mean": round(mean_bytes / first_bytes, 2),
        "bytes_stored": figures[-1].bytes_stored,
        "step_ms_early": round(early_ms, 2),
        "step_ms_last": round(late_ms, 2),
        "time_ratio": round(late_ms / early_ms, 2),
        "own_step_ms_early": round(early_own, 2),
        "own_step_ms_last": round(late_own, 2),
        "own_time_ratio": round(late_own / early_own, 2),
        "load_ms_early": round(early_load, 2),
        "load_ms_last": round(late_load, 2),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="long-thread-") as tmp:
        openers: dict[str, Callable[[Path, str], AbstractAsyncContextManager[Any]]] = {}
        cluster = None
        if "sqlite" in args.savers:
            openers["sqlite"] = sqlite_saver
        if "postgres" in args.savers:
            try:
                from fusion_graph_testing.postgres import PostgresCluster, check_os_user, find_bin_dir

                find_bin_dir()
                check_os_user()
                cluster = PostgresCluster(prefix="long-thread-pg-").start()
                openers["postgres"] = postgres_saver_factory(cluster)
            except Exception as error:  # noqa: BLE001 - the bench goes on without Postgres, and says so
                print(f"postgres left out: {error}", file=sys.stderr)
        try:
            for saver_name, opener in openers.items():
                for graph_name in args.graphs:
                    name = f"{graph_name}-{saver_name}"
                    print(f"{name}: {args.turns} turns", file=sys.stderr, flush=True)
                    async with opener(Path(tmp), name) as (saver, meter):
                        figures = await run_thread(graph_name, saver, meter, args.turns)
                    results[name] = {
                        "graph": graph_name,
                        "saver": saver_name,
                        **summary(figures),
                        "per_turn": [asdict(f) for f in figures],
                    }
        finally:
            if cluster is not None:
                cluster.stop()
    return results


def table_of(results: dict[str, Any]) -> Table:
    table = Table(title="One thread, turn 1 against the last turns")
    for column in (
        "graph",
        "saver",
        "B/step turn 1",
        "B/step last (median)",
        "B/step last (mean)",
        "ratio median / mean",
        "stored MB",
        "ms/step turns 2-11",
        "ms/step last 10",
        "time ratio",
        "own ms/step 2-11 / last",
        "own ratio",
        "load ms 2-11 / last",
    ):
        table.add_column(column)
    for leaf in results.values():
        table.add_row(
            leaf["graph"],
            leaf["saver"],
            f"{leaf['step_bytes_turn_1']:,}",
            f"{leaf['step_bytes_last_median']:,}",
            f"{leaf['step_bytes_last_mean']:,}",
            f"{leaf['bytes_ratio_median']} / {leaf['bytes_ratio_mean']}",
            f"{leaf['bytes_stored'] / 1e6:.2f}",
            f"{leaf['step_ms_early']}",
            f"{leaf['step_ms_last']}",
            f"{leaf['time_ratio']}",
            f"{leaf['own_step_ms_early']} / {leaf['own_step_ms_last']}",
            f"{leaf['own_time_ratio']}",
            f"{leaf['load_ms_early']} / {leaf['load_ms_last']}",
        )
    return table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.long_thread", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=TURNS, help=f"turns of the thread (default {TURNS})")
    parser.add_argument(
        "--savers", nargs="+", choices=SAVERS, default=list(SAVERS), help="checkpointers (default: both)"
    )
    parser.add_argument(
        "--graphs", nargs="+", choices=GRAPHS, default=list(GRAPHS), help="graphs (default: all)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.turns < 12:
        parser.error("--turns: at least 12 (turns 2-11 are the early ones)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.perf_counter()
    results = asyncio.run(measure(args))
    payload = {
        "meta": {
            "turns": args.turns,
            "snapshot_every": SNAPSHOT_EVERY,
            "targets": {"bytes_ratio": BYTES_TARGET, "time_ratio": TIME_TARGET},
            "platform": platform.platform(),
            "python": platform.python_version(),
            "wall_s": round(time.perf_counter() - began, 1),
        },
        "results": results,
    }
    Console(stderr=True).print(table_of(results))
    text = json.dumps(payload, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
