"""``fusion-graph report``: cost, savings and routing of stored threads (a SQLite file, or a Postgres).

With ``--postgres`` it reads every thread of a LangGraph server (or of
``fusion-graph run --postgres``) from the checkpoints in that database,
optionally one assistant's and those active since a time.

Cost, all-cloud cost and savings count the same inferences: those with a price,
when they ran or now (``cli.prices``); the rest are counted apart. Both tables
read at 80 columns with every number whole (``cli.tables``).
"""

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

from fusion_graph.cli.agreement import agreement, agreement_table
from fusion_graph.cli.common import (
    PLAN_NOTE,
    CloudShare,
    build_context,
    build_settings,
    fail,
    stderr_console,
    stdout_console,
    storage,
)
from fusion_graph.cli.prices import PricedCosts, cloud_prices, price_note, priced_costs
from fusion_graph.cli.stores import (
    DEFAULT_DB,
    is_postgres_url,
    postgres_conninfo,
    postgres_where,
    unreachable,
)
from fusion_graph.cli.tables import add_number_columns, compact_table
from fusion_graph.routing.records import is_step, kept_local_by_budget, upgraded

if TYPE_CHECKING:
    from rich.table import Table

    from fusion_graph.providers.pricing import TokenPrices
    from fusion_graph.routing.records import RouteRecord

#: Characters of a thread's first user message shown by the report.
FIRST_MESSAGE_CHARS = 40
#: Seconds one query of ``report --postgres`` may run (Postgres's ``statement_timeout``).
POSTGRES_STATEMENT_TIMEOUT_S = 120
#: Characters of a bad option value echoed in its error (the rest is counted, not printed).
ECHO_CHARS = 60
#: The longest span ``--since`` takes (``36500d``, about a century): a longer one is a typo.
MAX_SINCE_DAYS = 36_500


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

    from fusion_graph.state import state_reader

    if not db.is_file():
        raise fail(f"no checkpoint database at {db} (fusion-graph run writes {DEFAULT_DB} by default)")
    threads: dict[str, StoredThread] = {}
    with closing(sqlite3.connect(str(db), check_same_thread=False)) as connection:
        firsts = _first_checkpoints(connection, thread)
        if thread is not None and thread not in firsts:
            raise fail(f"thread {thread!r} is not in {db}")
        saver = SqliteSaver(connection)
        reader = state_reader(saver)
        for thread_id, first_id in firsts.items():
            config: Any = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
            first = saver.get_tuple({"configurable": {**config["configurable"], "checkpoint_id": first_id}})
            values = reader.get_state(config).values
            threads[thread_id] = StoredThread(
                route_log=[upgraded(record) for record in values.get("route_log", [])],
                started_at=first.checkpoint.get("ts") if first is not None else None,
                first_message=first_user_message(values.get("messages", [])),
            )
    return threads


def echo(value: str, limit: int = ECHO_CHARS) -> str:
    """``value`` quoted for an error, cut to ``limit`` characters (a pasted file is not printed back)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def since_time(value: str, now: datetime | None = None) -> datetime:
    """``--since``: an ISO 8601 time, or a span back from now (``30m``, ``24h``, ``7d``).

    Spans are bounded (``MAX_SINCE_DAYS``): ``99999999999d`` would overflow
    ``datetime`` into a traceback, where the operator needs one line.

    Raises:
        typer.Exit: Neither, or a span longer than ``MAX_SINCE_DAYS`` days.
    """
    import re
    from datetime import UTC, timedelta

    now = now or datetime.now(UTC)
    span = re.fullmatch(r"(\d+(?:\.\d+)?)([mhd])", value.strip())
    if span:
        days = float(span.group(1)) / {"m": 1440, "h": 24, "d": 1}[span.group(2)]
        if days > MAX_SINCE_DAYS:  # inf too: a span of a million digits is read, then refused
            raise fail(
                f"--since {echo(value)} reaches back more than {MAX_SINCE_DAYS} days; give a shorter span"
            )
        return now - timedelta(days=days)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise fail(
            f"--since {echo(value)} is neither an ISO 8601 time nor a span like 24h, 7d or 30m"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def postgres_threads(
    url: str, thread: str | None = None, assistant: str | None = None, since: datetime | None = None
) -> dict[str, StoredThread]:
    """Each thread in a deployment's Postgres checkpoints, oldest first: its route log, start, first message.

    ``assistant``: only threads whose checkpoints a LangGraph server run of that
    assistant (id or graph name) wrote; ``since``: only threads with a checkpoint since then.

    The connect is bounded (``stores.postgres_conninfo``) and so is each query
    (``POSTGRES_STATEMENT_TIMEOUT_S``): a database that does not answer ends the
    report with one line naming its host, never the password.

    Raises:
        typer.Exit: The database cannot be reached, has no checkpoints table, a query ran past
            its timeout, or ``thread`` is not in it.
    """
    import psycopg
    from psycopg.rows import dict_row

    where, args = ["checkpoint_ns = ''"], []
    if thread is not None:
        where.append("thread_id = %s")
        args.append(thread)
    if assistant is not None:
        where.append("(metadata->>'assistant_id' = %s OR metadata->>'graph_id' = %s)")
        args += [assistant, assistant]
    query = (
        "SELECT thread_id, MIN(checkpoint_id) AS first, MAX(checkpoint_id) AS last FROM checkpoints "
        f"WHERE {' AND '.join(where)} GROUP BY thread_id ORDER BY first"
    )
    threads: dict[str, StoredThread] = {}
    try:
        connection = psycopg.connect(
            postgres_conninfo(url), autocommit=True, prepare_threshold=0, row_factory=dict_row
        )
    except psycopg.OperationalError as error:
        raise fail(unreachable(url, error)) from None
    try:
        with connection:
            _read_threads(connection, threads, query, args, thread, since)
    except psycopg.errors.QueryCanceled:
        raise fail(
            f"--postgres: a query on {postgres_where(url)} ran past {POSTGRES_STATEMENT_TIMEOUT_S} s "
            "(statement_timeout); read fewer threads with --since, --assistant or --thread"
        ) from None
    return threads


def _read_threads(
    connection: Any,
    threads: dict[str, StoredThread],
    query: str,
    args: list[Any],
    thread: str | None,
    since: datetime | None,
) -> None:
    """Fill ``threads`` from an open connection (``postgres_threads``), each query under the timeout."""
    from langgraph.checkpoint.postgres import PostgresSaver

    from fusion_graph.state import state_reader

    connection.execute(f"SET statement_timeout = '{POSTGRES_STATEMENT_TIMEOUT_S}s'")
    found = connection.execute("SELECT to_regclass('checkpoints') AS t").fetchone()
    if found is None or found["t"] is None:
        raise fail("the database holds no LangGraph checkpoints (no checkpoints table)")
    rows = connection.execute(query, args).fetchall()
    if thread is not None and not rows:
        raise fail(f"thread {thread!r} is not in the database")
    saver = PostgresSaver(connection)
    reader = state_reader(saver)
    for row in rows:
        config: Any = {"configurable": {"thread_id": str(row["thread_id"]), "checkpoint_ns": ""}}
        latest = reader.get_state({"configurable": {**config["configurable"], "checkpoint_id": row["last"]}})
        if latest.created_at is None:  # gone since the query listed it
            continue
        if since is not None and datetime.fromisoformat(latest.created_at) < since:
            continue
        first = saver.get_tuple({"configurable": {**config["configurable"], "checkpoint_id": row["first"]}})
        values = latest.values
        threads[str(row["thread_id"])] = StoredThread(
            route_log=[upgraded(record) for record in values.get("route_log", [])],
            started_at=first.checkpoint.get("ts") if first is not None else None,
            first_message=first_user_message(values.get("messages", [])),
        )


def stored_route_logs(db: Path, thread: str | None = None) -> dict[str, list[RouteRecord]]:
    """Each stored thread's ``route_log`` from its latest checkpoint, oldest thread first."""
    return {tid: stored.route_log for tid, stored in stored_threads(db, thread).items()}


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
    skipped = sum("skipped" in upgraded(r).get("synthesis", {}) for r in synthesis)
    return {
        "cloud_spend_usd": sum(by_turn.values()),
        "max_turn_cloud_usd": max(by_turn.values(), default=0.0),
        "budget_local_steps": sum(kept_local_by_budget(r) for r in records),
        "synthesis_done": len(synthesis) - skipped,
        "synthesis_skipped": skipped,
    }


def thread_summary(
    records: Sequence[RouteRecord],
    cloud: TokenPrices | None,
    cloud_model: str,
    *,
    costs: PricedCosts | None = None,
) -> dict[str, Any]:
    """Routing, cost and savings of one thread's records (both cloud shares: see ``CloudShare``).

    Cost, all-cloud cost and savings are over the inferences with a price
    (``prices.priced_costs``, or ``costs`` when the caller priced the records already);
    ``unpriced`` counts the others, ``repriced`` those priced now from their recorded tokens.
    """
    from fusion_graph.providers.pricing import chain_totals

    totals = chain_totals(records)
    share = CloudShare.of(records)
    legs = [r["routed_leg"] for r in records if is_step(r)]
    if costs is None:
        costs = priced_costs(records, cloud, cloud_model)
    saved, fraction = costs.savings
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
        "cost_usd": costs.cost_usd,
        "priced_inferences": costs.priced,
        "repriced": costs.repriced,
        "unpriced": costs.unpriced,
        "unpriced_providers": list(costs.unpriced_providers),
        "unanswered": costs.unanswered,
        "all_cloud_cost_usd": costs.all_cloud_usd,
        "savings_usd": saved,
        "savings_fraction": fraction,
        **budget_summary(records),
    }


def totals_summary(
    logs: Sequence[Sequence[RouteRecord]],
    rows: Sequence[dict[str, Any]],
    cloud: TokenPrices | None,
    cloud_model: str,
    *,
    costs: PricedCosts | None = None,
) -> dict[str, Any]:
    """All threads together: their records summarised at once, turns and switches added up per thread.

    ``costs``: the priced costs of all the records, when the caller has them (``report``'s price note).
    """
    total = thread_summary([record for log in logs for record in log], cloud, cloud_model, costs=costs)
    for name in ("turns", "switches"):
        total[name] = sum(row[name] for row in rows)
    total["max_turn_cloud_usd"] = max((row["max_turn_cloud_usd"] for row in rows), default=0.0)
    return {"threads": len(rows), **total}


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.6f}"


def _saved(row: dict[str, Any]) -> str:
    if row["savings_usd"] is None:
        return "unknown"
    fraction = row["savings_fraction"]
    return _money(row["savings_usd"]) + (f"\n{fraction:.0%}" if fraction is not None else "")


def _active_since(thread: StoredThread, after: datetime) -> bool:
    """Whether a SQLite thread started at or after ``after`` (its checkpoints' times are not all read)."""
    assert thread.started_at is not None
    started = datetime.fromisoformat(thread.started_at)
    return (started if started.tzinfo is not None else started.replace(tzinfo=after.tzinfo)) >= after


def _started(ts: str | None) -> str | None:
    if not ts:
        return None
    try:
        return datetime.fromisoformat(ts).astimezone().strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return ts


#: Under the report table: what its columns count.
REPORT_CAPTION = (
    "turns/steps: per thread; cloud all/cont.: share of all steps, and of continuation steps, routed "
    "to cloud; "
    f"{PLAN_NOTE}. cost, all-cloud and saved count the inferences with a price"
)


def report_table(db: Path, threads: dict[str, dict[str, Any]], total: dict[str, Any]) -> Table:
    """One row per thread (its start and first message under its id) and a totals row.

    Six number columns (pairs joined by ``/``) beside one text column that
    wraps: it reads at 80 columns with every number whole.
    """
    from rich.text import Text

    table = compact_table(f"threads in {db}", REPORT_CAPTION)
    table.add_column("thread", overflow="fold", min_width=12)
    add_number_columns(table, "turns/\nsteps", "cloud\nall/cont.", "switches", "cost", "all-cloud", "saved")

    def cells(row: dict[str, Any]) -> list[str]:
        cost = _money(row["cost_usd"])
        cost += f"\n{row['repriced']} repriced" if row["repriced"] else ""
        cost += f"\n+{row['unpriced']} unpriced" if row["unpriced"] else ""
        return [
            f"{row['turns']}/{row['steps']}",
            f"{row['cloud_fraction']:.2f}/{row['continuation_cloud_fraction']:.2f}",
            str(row["switches"]),
            cost,
            _money(row["all_cloud_cost_usd"]),
            _saved(row),
        ]

    for index, (tid, row) in enumerate(threads.items()):
        label = Text(tid)
        for extra in (_started(row["started_at"]), row["first_message"]):
            if extra:
                label.append(f"\n{extra}", style="dim")
        table.add_row(label, *cells(row), end_section=index == len(threads) - 1)
    table.add_row(Text(f"total ({total['threads']})", style="bold"), *cells(total), style="bold")
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
    from rich.text import Text

    limits = ", ".join(
        f"{name} ${budget[key]:g}"
        for name, key in (("turn", "turn_usd"), ("thread", "thread_usd"))
        if budget[key] is not None
    )
    table = compact_table(
        "cloud spend against budget (" + (f"operator budgets: {limits}" if limits else "no budget set") + ")",
        "spend: cost of the inferences cloud answered; kept local: steps a budget moved off cloud",
    )
    table.add_column("thread", overflow="fold", min_width=12)
    add_number_columns(
        table, "cloud spend", "largest turn", "kept local", "synthesis\ndone", "synthesis\nskipped"
    )

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
    postgres: Annotated[
        str | None,
        typer.Option(
            help="A deployment's Postgres instead (postgresql://...): every thread a LangGraph server "
            "or `fusion-graph run --postgres` checkpointed there."
        ),
    ] = None,
    assistant: Annotated[
        str | None, typer.Option(help="With --postgres: only this assistant's threads (id or graph name).")
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Only threads active since then: an ISO 8601 time, or a span back (24h, 7d, 30m)."),
    ] = None,
    margin: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            max=0.999,
            help="Shadow checks: say whether local steps take the cloud's action at least 1 - MARGIN of "
            "the time (95% lower bound), or how many more checks it needs.",
        ),
    ] = None,
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
    inferences keep their recorded cost. Savings are all-cloud minus cost, both
    over the inferences with a price: a cloud inference unpriced when it ran is
    priced now from its tokens when its price is known now; others without a
    price are counted apart. Both cloud shares are shown: of all steps, and of
    continuation steps (what cloud_share sets; each turn's plan runs on cloud
    whenever cloud_share > 0).

    A second table shows each thread's cloud spend against the operator's
    budgets (FUSION_TURN_CLOUD_BUDGET_USD, FUSION_THREAD_CLOUD_BUDGET_USD, when
    set): the thread's spend, its largest turn's, the steps a budget kept local
    and the re-syntheses of local replies made and skipped. With shadow checks
    (``shadow_share``), a third shows how often the cloud took the local step's
    action, by the local steps' score band.
    """
    if assistant is not None and postgres is None:
        raise fail("--assistant reads a LangGraph server's threads: give --postgres with its database URL")
    if postgres is not None and not is_postgres_url(postgres):
        raise fail("--postgres must be a postgresql://user:password@host:port/db URL")
    if postgres is None and not db.is_file():  # before anything is loaded or priced
        raise fail(
            f"no checkpoint database at {db}: `fusion-graph run` writes it (or pass --db with its file)"
        )
    after = since_time(since) if since is not None else None
    run_context = build_context(context)
    settings = build_settings()
    if postgres is not None:
        from fusion_graph.redact import register_url_secrets

        register_url_secrets(postgres)
        with storage("--postgres"):
            stored = postgres_threads(postgres, thread, assistant, after)
    else:
        with storage(f"--db {db}"):
            stored = stored_threads(db, thread)
        if after is not None:
            stored = {
                tid: one
                for tid, one in stored.items()
                if one.route_log and one.started_at is not None and _active_since(one, after)
            }
    prices = cloud_prices(run_context, settings)
    model = run_context.cloud_model or settings.cloud_model
    threads = {
        tid: {
            **thread_summary(one.route_log, prices, model),
            "started_at": one.started_at,
            "first_message": one.first_message,
        }
        for tid, one in stored.items()
    }
    logs = [one.route_log for one in stored.values()]
    costs = priced_costs([r for log in logs for r in log], prices, model)  # once: totals and note
    total = totals_summary(logs, list(threads.values()), prices, model, costs=costs)
    hint = price_note(settings, model, prices, costs)
    budget = {"turn_usd": settings.turn_cloud_budget_usd, "thread_usd": settings.thread_cloud_budget_usd}
    shadow = agreement((record for log in logs for record in log), margin)
    if as_json:
        output = {
            "db": "postgres" if postgres is not None else str(db),
            "threads": threads,
            "totals": total,
            "savings_usd": total["savings_usd"],
            "savings_fraction": total["savings_fraction"],
            "price_hint": hint,
            "cloud_budget": budget,
            "shadow": shadow,
        }
        typer.echo(json.dumps(output, indent=2))
        return
    stdout_console().print(report_table(db if postgres is None else Path("postgres"), threads, total))
    stdout_console().print(budget_table(threads, total, budget))
    if shadow["checked"]:
        stdout_console().print(agreement_table(shadow))
    if hint is not None:
        from rich.text import Text

        stderr_console().print(Text.assemble(("note: ", "yellow"), hint), soft_wrap=True)
