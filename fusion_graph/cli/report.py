"""``fusion-graph report``: cost, savings and routing of the threads stored in a SQLite checkpoint file."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fusion_graph.cli.common import (
    PLAN_NOTE,
    CloudShare,
    build_context,
    build_settings,
    fail,
    run_prices,
    stderr_console,
    stdout_console,
    storage,
)
from fusion_graph.cli.run import DEFAULT_DB
from fusion_graph.records import kept_local_by_budget

if TYPE_CHECKING:
    from rich.table import Table

    from fusion_graph.providers.pricing import TokenPrices
    from fusion_graph.records import RouteRecord

#: Characters of a thread's first user message shown by the report.
FIRST_MESSAGE_CHARS = 40


@dataclass(frozen=True)
class StoredThread:
    """What the report reads of one stored thread.

    Attributes:
        route_log: The ``route_log`` of its latest checkpoint.
        started_at: ``ts`` of its first checkpoint (ISO 8601, UTC), ``None`` if unreadable.
        first_message: Its first user message, whitespace collapsed, at most
            ``FIRST_MESSAGE_CHARS`` characters.
    """

    route_log: list[RouteRecord]
    started_at: str | None
    first_message: str | None


def _first_checkpoints(connection: sqlite3.Connection, thread: str | None) -> dict[str, str]:
    """Each thread's first checkpoint id, oldest thread first (ids are time-ordered UUIDs)."""
    found = connection.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'checkpoints'"
    ).fetchone()
    if found is None:
        return {}
    where, args = ("AND thread_id = ?", (thread,)) if thread is not None else ("", ())
    rows = connection.execute(
        "SELECT thread_id, MIN(checkpoint_id) AS first FROM checkpoints "
        f"WHERE checkpoint_ns = '' {where} GROUP BY thread_id ORDER BY first",
        args,
    ).fetchall()
    return {str(thread_id): str(first) for thread_id, first in rows}


def first_user_message(messages: Sequence[Any], limit: int = FIRST_MESSAGE_CHARS) -> str | None:
    """The first human message's text, whitespace collapsed, cut to ``limit`` characters with ``…``."""
    first = next((m for m in messages if getattr(m, "type", None) == "human"), None)
    if first is None:
        return None
    text = " ".join(str(getattr(first, "text", "") or first.content).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def stored_threads(db: Path, thread: str | None = None) -> dict[str, StoredThread]:
    """Each stored thread's route log, start time and first user message, oldest thread first.

    Raises:
        typer.Exit: The file does not exist, or ``thread`` is not in it.
    """
    from langgraph.checkpoint.sqlite import SqliteSaver

    if not db.is_file():
        raise fail(f"no checkpoint database at {db} (fusion-graph run writes {DEFAULT_DB} by default)")
    threads: dict[str, StoredThread] = {}
    with closing(sqlite3.connect(str(db), check_same_thread=False)) as connection:
        firsts = _first_checkpoints(connection, thread)
        if thread is not None and thread not in firsts:
            raise fail(f"thread {thread!r} is not in {db}")
        saver = SqliteSaver(connection)
        for thread_id, first_id in firsts.items():
            config: Any = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
            latest = saver.get_tuple(config)
            first = saver.get_tuple({"configurable": {**config["configurable"], "checkpoint_id": first_id}})
            values = latest.checkpoint["channel_values"] if latest is not None else {}
            threads[thread_id] = StoredThread(
                route_log=list(values.get("route_log", [])),
                started_at=first.checkpoint.get("ts") if first is not None else None,
                first_message=first_user_message(values.get("messages", [])),
            )
    return threads


def stored_route_logs(db: Path, thread: str | None = None) -> dict[str, list[RouteRecord]]:
    """Each stored thread's ``route_log`` from its latest checkpoint, oldest thread first."""
    return {tid: stored.route_log for tid, stored in stored_threads(db, thread).items()}


def all_cloud_cost(records: Sequence[RouteRecord], cloud: TokenPrices | None) -> float | None:
    """What the same tokens (same cache hits) would have cost at the cloud prices; ``None``: unknown price.

    Cloud inferences keep their recorded cost when they have one.
    """
    from fusion_graph.providers.pricing import answering_leg

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


def savings(cost: float, all_cloud: float | None) -> tuple[float | None, float | None]:
    """``(all_cloud - cost, that as a fraction of all_cloud)``; ``None`` where unknown."""
    if all_cloud is None:
        return None, None
    saved = all_cloud - cost
    return saved, (round(saved / all_cloud, 4) if all_cloud > 0 else None)


def budget_summary(records: Sequence[RouteRecord]) -> dict[str, Any]:
    """Cloud spend of a thread's records against the budget rule's terms.

    ``cloud_spend_usd`` sums the cost of the inferences the cloud leg answered
    (what the budgets count), ``max_turn_cloud_usd`` the largest of a turn;
    ``budget_local_steps`` counts steps a budget kept local; ``synthesis_done`` /
    ``synthesis_skipped`` the re-syntheses of local replies made and not made.
    """
    by_turn: dict[int, float] = {}
    for record in records:
        if record["leg"] == "cloud" and record["cost_usd"]:
            by_turn[record["turn"]] = by_turn.get(record["turn"], 0.0) + record["cost_usd"]
    synthesis = [r for r in records if r["kind"] == "synthesis"]
    skipped = sum("skipped" in (r.get("extra") or {}) for r in synthesis)
    return {
        "cloud_spend_usd": sum(by_turn.values()),
        "max_turn_cloud_usd": max(by_turn.values(), default=0.0),
        "budget_local_steps": sum(kept_local_by_budget(r) for r in records),
        "synthesis_done": len(synthesis) - skipped,
        "synthesis_skipped": skipped,
    }


def thread_summary(records: Sequence[RouteRecord], cloud: TokenPrices | None) -> dict[str, Any]:
    """Routing, cost and savings of one thread's records (both cloud shares: see ``CloudShare``)."""
    from fusion_graph.providers.pricing import chain_totals

    totals = chain_totals(records)
    share = CloudShare.of(records)
    legs = [r["routed_leg"] for r in records if r["kind"] not in ("memory", "synthesis", "sampling")]
    all_cloud = all_cloud_cost(records, cloud)
    saved, fraction = savings(totals.total.cost_usd, all_cloud)
    return {
        "turns": len({r["turn"] for r in records}),
        "inferences": totals.total.inferences,
        "cloud_inferences": totals.cloud.inferences,
        "local_inferences": totals.local.inferences,
        "steps": share.steps,
        "plans": share.plans,
        "cloud_fraction": share.fraction,
        "continuation_steps": share.continuation_steps,
        "continuation_cloud_fraction": share.continuation_fraction,
        "switches": sum(a != b for a, b in pairwise(legs)),
        "fallovers": sum(r["leg"] != r["routed_leg"] for r in records),
        "prompt_tokens": totals.total.prompt_tokens,
        "cached_tokens": totals.total.cached_tokens,
        "completion_tokens": totals.total.completion_tokens,
        "cost_usd": totals.total.cost_usd,
        "unpriced": totals.total.unpriced,
        "all_cloud_cost_usd": all_cloud,
        "savings_usd": saved,
        "savings_fraction": fraction,
        **budget_summary(records),
    }


def totals_summary(
    logs: Sequence[Sequence[RouteRecord]], rows: Sequence[dict[str, Any]], cloud: TokenPrices | None
) -> dict[str, Any]:
    """All threads together: their records summarised at once, turns and switches added up per thread."""
    total = thread_summary([record for log in logs for record in log], cloud)
    for name in ("turns", "switches"):
        total[name] = sum(row[name] for row in rows)
    total["max_turn_cloud_usd"] = max((row["max_turn_cloud_usd"] for row in rows), default=0.0)
    return {"threads": len(rows), **total}


def price_hint(cloud_model: str, cloud: TokenPrices | None, unpriced: int) -> str | None:
    """How to price what the report could not, naming the settings; ``None`` when every price is known."""
    if cloud is not None and not unpriced:
        return None
    what = (
        f"the cloud model {cloud_model!r} has no known price (all-cloud and savings are unknown)"
        if cloud is None
        else f"{unpriced} inference(s) have no cost (their provider's price is unknown)"
    )
    return (
        f"{what}: set FUSION_PRICE_OVERRIDES='{{\"{cloud_model}\": [input, output, cached_input]}}' "
        "(USD per million tokens, by model name or provider id), or FUSION_CLOUD_PRICE_LIKE=openai "
        "for a gateway that bills like a catalogue provider"
    )


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.6f}"


def _saved(row: dict[str, Any]) -> str:
    if row["savings_usd"] is None:
        return "unknown"
    fraction = row["savings_fraction"]
    return _money(row["savings_usd"]) + (f"\n{fraction:.0%}" if fraction is not None else "")


def _started(ts: str | None) -> str:
    if not ts:
        return "-"
    try:
        return datetime.fromisoformat(ts).astimezone().strftime("%Y-%m-%d\n%H:%M")
    except ValueError:
        return ts


def report_table(db: Path, threads: dict[str, dict[str, Any]], total: dict[str, Any]) -> Table:
    """One row per thread (its first message under its id) and a totals row."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"threads in {db}",
        caption=f"cloud all: share of all steps; cloud cont.: of continuation steps;\n{PLAN_NOTE}",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
        title_justify="left",
        caption_justify="left",
    )
    table.add_column("thread", overflow="fold", max_width=24)
    table.add_column("started", no_wrap=True)
    for name in ("turns", "steps", "cloud\nall", "cloud\ncont.", "switches", "cost", "all-cloud", "saved"):
        table.add_column(name, justify="right", no_wrap=True)

    def cells(row: dict[str, Any]) -> list[str]:
        cost = _money(row["cost_usd"]) + (f"\n+{row['unpriced']} unpriced" if row["unpriced"] else "")
        return [
            str(row["turns"]),
            str(row["steps"]),
            f"{row['cloud_fraction']:.2f}",
            f"{row['continuation_cloud_fraction']:.2f}",
            str(row["switches"]),
            cost,
            _money(row["all_cloud_cost_usd"]),
            _saved(row),
        ]

    for index, (tid, row) in enumerate(threads.items()):
        label = Text(tid)
        if row["first_message"]:
            label.append(f"\n{row['first_message']}", style="dim")
        table.add_row(label, _started(row["started_at"]), *cells(row), end_section=index == len(threads) - 1)
    table.add_row(Text(f"total ({total['threads']})", style="bold"), "", *cells(total), style="bold")
    return table


def _against(spent: float, limit: float | None) -> str:
    if limit is None:
        return _money(spent)
    return f"{_money(spent)}\n{spent / limit:.0%} of ${limit:g}" if limit > 0 else f"{_money(spent)}\nof $0"


def budget_table(
    threads: dict[str, dict[str, Any]], total: dict[str, Any], budget: dict[str, float | None]
) -> Table:
    """Per thread and in total: cloud spend against the budgets, steps kept local, re-syntheses.

    The thread's spend is shown against the thread budget, its largest turn's
    against the turn budget.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    limits = ", ".join(
        f"{name} ${budget[key]:g}"
        for name, key in (("turn", "turn_usd"), ("thread", "thread_usd"))
        if budget[key] is not None
    )
    table = Table(
        title="cloud spend against budget ("
        + (f"operator budgets: {limits}" if limits else "no budget set")
        + ")",
        caption="spend: cost of the inferences cloud answered; kept local: steps a budget moved off cloud",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
        title_justify="left",
        caption_justify="left",
    )
    table.add_column("thread", overflow="fold", max_width=24)
    for name in ("cloud spend", "largest turn", "kept local", "synthesis\ndone", "synthesis\nskipped"):
        table.add_column(name, justify="right", no_wrap=True)

    def cells(row: dict[str, Any], thread_limit: float | None) -> list[str]:
        return [
            _against(row["cloud_spend_usd"], thread_limit),
            _against(row["max_turn_cloud_usd"], budget["turn_usd"]),
            str(row["budget_local_steps"]),
            str(row["synthesis_done"]),
            str(row["synthesis_skipped"]),
        ]

    for index, (tid, row) in enumerate(threads.items()):
        table.add_row(Text(tid), *cells(row, budget["thread_usd"]), end_section=index == len(threads) - 1)
    table.add_row(Text(f"total ({total['threads']})", style="bold"), *cells(total, None), style="bold")
    return table


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
    inferences keep their recorded cost. Savings are all-cloud minus cost. Both
    cloud shares are shown: of all steps, and of continuation steps (what
    cloud_share sets; each turn's plan runs on cloud whenever cloud_share > 0).

    A second table shows each thread's cloud spend against the operator's
    budgets (FUSION_TURN_CLOUD_BUDGET_USD, FUSION_THREAD_CLOUD_BUDGET_USD, when
    set): the thread's spend, its largest turn's, the steps a budget kept local
    and the re-syntheses of local replies made and skipped.
    """
    run_context = build_context(context)
    settings = build_settings()
    prices = run_prices(run_context, settings).cloud
    if not db.is_file():
        raise fail(
            f"no checkpoint database at {db}: `fusion-graph run` writes it (or pass --db with its file)"
        )
    with storage(f"--db {db}"):
        stored = stored_threads(db, thread)
    threads = {
        tid: {
            **thread_summary(one.route_log, prices),
            "started_at": one.started_at,
            "first_message": one.first_message,
        }
        for tid, one in stored.items()
    }
    total = totals_summary([one.route_log for one in stored.values()], list(threads.values()), prices)
    hint = price_hint(run_context.cloud_model or settings.cloud_model, prices, total["unpriced"])
    budget = {"turn_usd": settings.turn_cloud_budget_usd, "thread_usd": settings.thread_cloud_budget_usd}
    if as_json:
        output = {
            "db": str(db),
            "threads": threads,
            "totals": total,
            "savings_usd": total["savings_usd"],
            "savings_fraction": total["savings_fraction"],
            "price_hint": hint,
            "cloud_budget": budget,
        }
        typer.echo(json.dumps(output, indent=2))
        return
    stdout_console().print(report_table(db, threads, total))
    stdout_console().print(budget_table(threads, total, budget))
    if hint is not None:
        from rich.text import Text

        stderr_console().print(Text.assemble(("note: ", "yellow"), hint), soft_wrap=True)
