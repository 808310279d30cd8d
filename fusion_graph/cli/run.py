"""``fusion-graph run``: one turn against the configured servers, with a live table of its steps.

The table is fed by the graph's ``fusion_route`` custom stream events: a
``decision`` event before each inference (the row appears, marked running)
and an ``outcome`` event after it (who answered, tokens, cost). An event
without a ``phase`` is an outcome.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph.state import CompiledStateGraph
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from fusion_graph.cli.common import build_context, build_settings, fail, stdout_console, storage
from fusion_graph.context import FusionContext
from fusion_graph.nodes.inference import InvalidInput
from fusion_graph.providers.chain import ChainExhausted, ProviderRequestError
from fusion_graph.providers.llama_server import (
    START_HINT,
    LlamaServerUnavailable,
    NotLlamaServer,
    fetch_total_slots,
)
from fusion_graph.providers.models import ProviderConfigError
from fusion_graph.providers.pricing import chain_totals
from fusion_graph.redact import scrub
from fusion_graph.settings import ContextError, FusionSettings
from fusion_graph.state import InputState, RouteRecord, State

ROUTE_EVENT = "fusion_route"  # the executor's event name (kept literal: no import of the node layer)
DEFAULT_DB = Path(".fusion-graph") / "threads.sqlite"

#: ``(cloud, local)`` models of a run, or ``None`` to let the graph build them from the settings.
ModelFactory = Callable[
    [FusionContext, FusionSettings], Awaitable[tuple[BaseChatModel, BaseChatModel] | None]
]


# -- fail fast ------------------------------------------------------------------------


def needs_local(context: FusionContext) -> bool:
    """Whether a run can call llama-server."""
    return context.mode == "local" or (context.mode == "fusion" and context.cloud_share < 100)


def check_cloud_key(settings: FusionSettings) -> None:
    """Raise a CLI error naming the variable to set when the cloud key is missing.

    The graph's default chain builds both legs whatever the mode, so the key is needed even
    for a run that would only use llama-server.
    """
    if settings.api_key() is None:
        raise fail(
            f"the cloud leg needs an API key: export {settings.cloud_api_key_env}=... "
            "(FUSION_CLOUD_API_KEY_ENV names the variable; FUSION_CLOUD_API_KEY holds the key itself)"
        )


async def check_local_server(
    context: FusionContext, settings: FusionSettings, *, timeout: float = 3.0
) -> None:
    """Raise a CLI error naming the URL, the variable and how to start llama-server when it is down."""
    if not needs_local(context):
        return
    try:
        await fetch_total_slots(settings.local_base_url, timeout=timeout)
    except LlamaServerUnavailable as error:
        raise fail(
            f"llama-server is not reachable at {settings.local_base_url}: point FUSION_LOCAL_BASE_URL "
            f"at its /v1 URL, or {START_HINT}.\n  ({error})"
        ) from error
    except NotLlamaServer:
        pass  # another OpenAI-compatible server: it runs, without slot affinity


async def default_models(
    context: FusionContext, settings: FusionSettings
) -> tuple[BaseChatModel, BaseChatModel] | None:
    """Check the configured endpoints (fail fast); the graph then builds its models from the settings."""
    check_cloud_key(settings)
    await check_local_server(context, settings)
    return None


#: The model factory ``run`` uses; embedding code and tests may swap in their own (e.g. scripted models).
MODELS: ModelFactory = default_models


# -- the live table -------------------------------------------------------------------


@dataclass
class StepRow:
    """One inference as the events describe it so far."""

    turn: int
    step: int
    kind: str
    routed_leg: str
    leg: str | None = None
    score: int | None = None
    threshold: float | None = None
    reason: str = ""
    provider: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None
    done: bool = False


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _cost(value: float | None) -> str:
    return "-" if value is None else f"${value:.6f}"


@dataclass
class StepTable:
    """The rows of a turn, updated from ``fusion_route`` events."""

    rows: dict[tuple[int, int, str], StepRow] = field(default_factory=dict)

    def apply(self, event: Mapping[str, Any]) -> None:
        """Add or complete a row; events of other kinds are ignored."""
        if event.get("event") != ROUTE_EVENT:
            return
        key = (int(event.get("turn", 0)), int(event.get("step", 0)), str(event.get("kind", "step")))
        row = self.rows.get(key)
        if row is None:
            routed = str(event.get("routed_leg") or event.get("leg") or "?")
            row = self.rows[key] = StepRow(*key, routed_leg=routed)
        row.score = event.get("score", row.score)
        row.threshold = event.get("threshold", row.threshold)
        row.reason = str(event.get("reason") or row.reason)
        if event.get("phase", "outcome") == "outcome":
            row.done = True
            row.leg = event.get("leg")
            row.provider = event.get("provider")
            row.prompt_tokens = event.get("prompt_tokens")
            row.cached_tokens = event.get("cached_tokens")
            row.completion_tokens = event.get("completion_tokens")
            row.cost_usd = event.get("cost_usd")

    def render(self) -> Table:
        """The live table: step, leg, score vs threshold, reason, provider, tokens, cost."""
        table = Table(title="steps", expand=False)
        for name in ("turn", "step", "kind", "leg", "score / T", "reason", "provider", "prompt", "cached"):
            table.add_column(name, overflow="fold")
        table.add_column("cost", justify="right")
        for row in self.rows.values():
            leg = row.leg or row.routed_leg
            shown_leg = f"[{'magenta' if leg == 'cloud' else 'cyan'}]{leg}[/]"
            if row.leg is not None and row.leg != row.routed_leg:
                shown_leg += f" (routed {row.routed_leg})"
            if not row.done:
                shown_leg += " …"
            versus = (
                _num(row.score) if row.threshold is None else f"{_num(row.score)} / {_num(row.threshold)}"
            )
            table.add_row(
                str(row.turn),
                str(row.step),
                row.kind,
                shown_leg,
                versus,
                row.reason,
                row.provider or ("running" if not row.done else "-"),
                _num(row.prompt_tokens),
                _num(row.cached_tokens),
                _cost(row.cost_usd),
            )
        return table


def leg_summary(records: list[RouteRecord]) -> Table:
    """Per answering leg: inferences, tokens and cost (``pricing.chain_totals``)."""
    totals = chain_totals(records)
    table = Table(title="per leg")
    for name in ("leg", "inferences", "prompt", "cached", "completion", "cost"):
        table.add_column(name, justify="right" if name != "leg" else "left")
    for name, leg in (("local", totals.local), ("cloud", totals.cloud), ("total", totals.total)):
        cost = _cost(leg.cost_usd) + (f" (+{leg.unpriced} unpriced)" if leg.unpriced else "")
        table.add_row(
            name,
            str(leg.inferences),
            str(leg.prompt_tokens),
            str(leg.cached_tokens),
            str(leg.completion_tokens),
            cost,
        )
    return table


# -- running a turn -------------------------------------------------------------------


async def run_turn(
    graph: CompiledStateGraph[State, FusionContext, InputState, State],
    task: str,
    *,
    config: RunnableConfig,
    context: FusionContext,
    console: Console,
) -> dict[str, Any]:
    """Run one turn, showing a live step table on ``console``; return the final state values."""
    steps = StepTable()
    values: dict[str, Any] = {}
    with Live(steps.render(), console=console, refresh_per_second=8) as live:
        async for mode, chunk in graph.astream(
            {"messages": [HumanMessage(task)]}, config, context=context, stream_mode=["custom", "values"]
        ):
            if mode == "custom" and isinstance(chunk, Mapping):
                steps.apply(chunk)
                live.update(steps.render())
            elif mode == "values" and isinstance(chunk, dict):
                values = chunk
    console.print()
    turn = values.get("turn", 0)
    records = [r for r in values.get("route_log", []) if r["turn"] == turn]
    answer = next((m for m in reversed(values.get("messages", [])) if isinstance(m, AIMessage)), None)
    console.print(Group("[bold]answer[/]", answer.text if answer is not None else "(no answer)"))
    console.print(leg_summary(records))
    return values


@asynccontextmanager
async def open_saver(db: Path, postgres: str | None) -> AsyncIterator[BaseCheckpointSaver[str]]:
    """The thread checkpointer: SQLite at ``db`` by default, Postgres with ``--postgres``."""
    if postgres:
        if not postgres.startswith(("postgres://", "postgresql://")):
            raise fail(f"--postgres {scrub(postgres)!r} is not a postgresql://user:password@host:port/db URL")
        try:
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
        except ImportError as error:
            raise fail(
                "--postgres needs langgraph-checkpoint-postgres: pip install "
                "'langgraph-checkpoint-postgres' 'psycopg[binary]'"
            ) from error
        manager = cast(
            AbstractAsyncContextManager[BaseCheckpointSaver[str]],
            AsyncPostgresSaver.from_conn_string(postgres),
        )
        async with manager as saver:
            await saver.setup()  # type: ignore[attr-defined]
            yield saver
        return
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    db.parent.mkdir(parents=True, exist_ok=True)
    async with AsyncSqliteSaver.from_conn_string(str(db)) as sqlite:
        yield sqlite


@dataclass(frozen=True)
class RunRequest:
    """One ``fusion-graph run``: the task, where it runs and where its thread persists."""

    task: str
    context: FusionContext
    settings: FusionSettings
    thread: str
    db: Path
    postgres: str | None


async def _run(request: RunRequest, console: Console) -> None:

    context, settings, db, postgres, thread = (
        request.context,
        request.settings,
        request.db,
        request.postgres,
        request.thread,
    )
    models = await MODELS(context, settings)
    with storage("--postgres" if postgres else f"--db {db}"):
        await _turn(request, models, console)
    where = "Postgres" if postgres else str(db)
    console.print(f"thread [bold]{thread}[/] saved in {where}; continue it with --thread {thread}")


async def _turn(request: RunRequest, models: Any, console: Console) -> None:
    from fusion_graph.graph import build_graph

    context, settings, thread = request.context, request.settings, request.thread
    async with open_saver(request.db, request.postgres) as saver:
        if models is None:
            graph = build_graph(checkpointer=saver, settings=settings)
        else:
            graph = build_graph(
                cloud_model=models[0], local_model=models[1], checkpointer=saver, settings=settings
            )
        config: RunnableConfig = {"configurable": {"thread_id": thread}}
        try:
            await run_turn(graph, request.task, config=config, context=context, console=console)
        except (ProviderConfigError, ContextError, LlamaServerUnavailable, InvalidInput) as error:
            raise fail(str(error)) from None
        except (ChainExhausted, ProviderRequestError) as error:
            raise fail(f"{error}\n(the thread is saved: continue it with --thread {thread})") from None


def run(
    task: Annotated[str, typer.Argument(help="What to do, in words (the turn's user message).")],
    workspace: Annotated[
        Path, typer.Option(help="Directory the file tools may read and edit (workspace_root).")
    ] = Path("."),
    thread: Annotated[str | None, typer.Option(help="Thread id to continue; default: a new thread.")] = None,
    db: Annotated[Path, typer.Option(help="SQLite file the threads persist in.")] = DEFAULT_DB,
    postgres: Annotated[
        str | None, typer.Option(help="Postgres URL to persist threads in instead of SQLite.")
    ] = None,
    context: Annotated[
        str | None, typer.Option(help="FusionContext fields as a JSON object (or a JSON file).")
    ] = None,
) -> None:
    """Run one turn with the workspace tools against the configured cloud and llama-server.

    Endpoints, keys and prices are the operator's FUSION_* settings (cloud key
    from the variable named by FUSION_CLOUD_API_KEY_ENV, default OPENAI_API_KEY;
    llama-server at FUSION_LOCAL_BASE_URL). A missing key or an unreachable
    llama-server fails at once. --context holds run choices (cloud_share, a
    calibrated score_quantiles table, limits).
    """
    if not workspace.is_dir():
        raise fail(f"--workspace {workspace} is not a directory")
    request = RunRequest(
        task=task,
        context=build_context(context),
        settings=build_settings(workspace_root=str(workspace.resolve())),
        thread=thread or uuid.uuid4().hex[:12],
        db=db,
        postgres=postgres,
    )
    asyncio.run(_run(request, stdout_console()))
