"""``fusion-graph report``: cost and routing of the threads stored in a SQLite checkpoint file."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from contextlib import closing
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any

import typer
from langgraph.checkpoint.sqlite import SqliteSaver
from rich.table import Table

from fusion_graph.cli.common import build_context, build_settings, fail, run_prices, stdout_console, storage
from fusion_graph.cli.run import DEFAULT_DB
from fusion_graph.providers.pricing import TokenPrices, answering_leg, chain_totals
from fusion_graph.state import RouteRecord


def stored_route_logs(db: Path, thread: str | None = None) -> dict[str, list[RouteRecord]]:
    """Each stored thread's ``route_log`` from its latest checkpoint, in order of first appearance.

    Raises:
        typer.Exit: The file does not exist, or ``thread`` is not in it.
    """
    if not db.is_file():
        raise fail(f"no checkpoint database at {db} (fusion-graph run writes {DEFAULT_DB} by default)")
    logs: dict[str, list[RouteRecord]] = {}
    with closing(sqlite3.connect(str(db), check_same_thread=False)) as connection:
        saver = SqliteSaver(connection)
        if thread is None:
            ids = list(dict.fromkeys(c.config["configurable"]["thread_id"] for c in saver.list(None)))
        else:
            ids = [thread]
        for thread_id in ids:
            latest = saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
            if latest is None:
                raise fail(f"thread {thread_id!r} is not in {db}")
            logs[thread_id] = list(latest.checkpoint["channel_values"].get("route_log", []))
    return logs


def all_cloud_cost(records: Sequence[RouteRecord], cloud: TokenPrices | None) -> float | None:
    """What the same tokens (same cache hits) would have cost at the cloud prices; ``None``: unknown price.

    Cloud inferences keep their recorded cost when they have one.
    """
    if cloud is None:
        return None
    total = 0.0
    for record in records:
        if answering_leg(record) == "cloud" and record["cost_usd"] is not None:
            total += record["cost_usd"]
            continue
        prompt, completion = record["prompt_tokens"], record["completion_tokens"]
        if prompt is None or completion is None:
            continue  # unreported: counted as such by chain_totals
        cached = min(record["cached_tokens"] or 0, prompt)
        total += cloud.cost(prompt, cached, completion)
    return total


def thread_summary(records: Sequence[RouteRecord], cloud: TokenPrices | None) -> dict[str, Any]:
    """Routing and cost of one thread's records."""
    totals = chain_totals(records)
    continuation = [r for r in records if r["kind"] == "step"]
    legs = [r["routed_leg"] for r in records if r["kind"] != "memory"]
    return {
        "turns": len({r["turn"] for r in records}),
        "inferences": totals.total.inferences,
        "cloud_inferences": totals.cloud.inferences,
        "local_inferences": totals.local.inferences,
        "continuation_steps": len(continuation),
        "continuation_cloud_fraction": (
            round(sum(r["routed_leg"] == "cloud" for r in continuation) / len(continuation), 4)
            if continuation
            else 0.0
        ),
        "switches": sum(a != b for a, b in pairwise(legs)),
        "fallovers": sum(r["leg"] != r["routed_leg"] for r in records),
        "prompt_tokens": totals.total.prompt_tokens,
        "cached_tokens": totals.total.cached_tokens,
        "completion_tokens": totals.total.completion_tokens,
        "cost_usd": totals.total.cost_usd,
        "unpriced": totals.total.unpriced,
        "all_cloud_cost_usd": all_cloud_cost(records, cloud),
    }


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.6f}"


def report(
    db: Annotated[
        Path, typer.Option(help="SQLite checkpoint file (what `fusion-graph run` wrote).")
    ] = DEFAULT_DB,
    thread: Annotated[str | None, typer.Option(help="Only this thread.")] = None,
    context: Annotated[
        str | None,
        typer.Option(help="Run context JSON; its cloud_model (if any) prices the all-cloud comparison."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Cost and routing summary of stored threads, against what the same tokens would cost all-cloud.

    The all-cloud figure prices every inference's reported tokens (cached ones
    as cached) at the cloud model's prices (FUSION_CLOUD_MODEL, or the context's
    cloud_model; FUSION_PRICE_OVERRIDES or the genai-prices catalogue); cloud
    inferences keep their recorded cost.
    """
    prices = run_prices(build_context(context), build_settings()).cloud
    if not db.is_file():
        raise fail(
            f"no checkpoint database at {db}: `fusion-graph run` writes it (or pass --db with its file)"
        )
    with storage(f"--db {db}"):
        logs = stored_route_logs(db, thread)
    threads = {tid: thread_summary(log, prices) for tid, log in logs.items()}
    if as_json:
        typer.echo(json.dumps({"db": str(db), "threads": threads}, indent=2))
        return
    table = Table(title=f"threads in {db}")
    columns = (
        "thread",
        "turns",
        "inferences",
        "cloud",
        "local",
        "cont. cloud",
        "switches",
        "cost",
        "all-cloud",
    )
    for name in columns:
        table.add_column(name, justify="left" if name == "thread" else "right")
    for tid, row in threads.items():
        table.add_row(
            tid,
            str(row["turns"]),
            str(row["inferences"]),
            str(row["cloud_inferences"]),
            str(row["local_inferences"]),
            f"{row['continuation_cloud_fraction']:.2f}",
            str(row["switches"]),
            _money(row["cost_usd"]) + (f" (+{row['unpriced']} unpriced)" if row["unpriced"] else ""),
            _money(row["all_cloud_cost_usd"]),
        )
    stdout_console().print(table)
