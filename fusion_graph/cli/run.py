"""``fusion-graph run``: one turn against the configured servers, with a live table of its steps.

``run_task`` is the command without the terminal: it opens the thread's
checkpoints and the memory store, runs one turn, waits for its memory jobs
(at most as long as the answer took: ``cli.memory_wait``) and returns a
``RunResult``. The command first refuses bad input without loading LangGraph
(``--db``, ``--postgres``, ``--thread``: ``stores.check_target``), then makes the
fail-fast checks (cloud key, also read from ``./.env``, and llama-server:
``cli.checks``), and shows the live view (``cli.live``) or prints ``--json``.
Interrupted (Ctrl-C) once the thread exists, it still says how to continue it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import typer

from fusion_graph.cli.checks import (
    KEY_IN_NAME,
    KEY_IN_NAME_FIX,
    check_cloud_key,
    check_local_server,
    default_models,
    dotenv_names,
    key_variable,
    needs_local,
    unknown_line,
    unknown_variables,
)
from fusion_graph.cli.common import (
    CloudShare,
    build_context,
    build_settings,
    fail,
    stderr_console,
    stdout_console,
    storage,
)
from fusion_graph.cli.live import StepTable
from fusion_graph.cli.memory_wait import LEFT_PENDING, WaitTicker, memory_wait_limit, wait_for_memory_jobs
from fusion_graph.cli.stores import DEFAULT_DB, check_target, no_thread, thread_saved
from fusion_graph.errors import RunError

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from fusion_graph.context import FusionContext
    from fusion_graph.routing.records import RouteRecord
    from fusion_graph.settings import FusionSettings

__all__ = [  # the checks and the live table are part of `run` (re-exported)
    "DEFAULT_DB",
    "MODELS",
    "RunResult",
    "StepTable",
    "check_cloud_key",
    "check_local_server",
    "default_models",
    "needs_local",
    "run",
    "run_task",
]


#: ``(cloud, local)`` models of a run, or ``None`` to let the graph build them from the settings.
ModelFactory: TypeAlias = (
    "Callable[[FusionContext, FusionSettings], Awaitable[tuple[BaseChatModel, BaseChatModel] | None]]"
)


#: The model factory ``run`` uses: ``checks.default_models`` checks the key and llama-server and
#: lets the graph build its models; embedding code and tests may swap in their own (scripted models).
MODELS: ModelFactory = default_models


# -- one turn -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """What one ``run_task`` turn did.

    Attributes:
        answer: The text of the turn's last AI message (``None``: there is none).
        thread_id: The thread the turn ran on (continue it with ``--thread``).
        route_log: The records this run added to the thread's ``route_log``: its
            inferences, and memory jobs of earlier turns folded in at its plan.
        totals: ``pricing.chain_totals`` of ``route_log`` as plain data:
            ``local``, ``cloud`` and ``total`` legs and ``by_provider``.
        cloud_share: ``CloudShare.as_dict`` of ``route_log``.
        turn: Index of the turn in its thread.
        truncated: The answer stopped at ``max_tokens`` (``finish_reason == "length"``).
        answer_s: Seconds from the start of the run to its answer (it bounds the memory wait).
        memory_pending: Memory jobs were still running when the wait ended: they stay pending,
            and the thread's next turn runs them.
    """

    answer: str | None
    thread_id: str
    route_log: list[RouteRecord]
    totals: dict[str, Any]
    cloud_share: dict[str, Any]
    turn: int
    truncated: bool
    answer_s: float = 0.0
    memory_pending: bool = False

    def as_json(self) -> str:
        """The result as one JSON object (what ``run --json`` prints)."""
        return json.dumps(asdict(self), default=str)

    @classmethod
    def of(
        cls, values: dict[str, Any], thread: str, records: list[RouteRecord], *, answer_s: float = 0.0
    ) -> RunResult:
        """The result of a turn from the thread's state (``values``) and the records it added."""
        from langchain_core.messages import AIMessage

        answer = next((m for m in reversed(values.get("messages", [])) if isinstance(m, AIMessage)), None)
        return cls(
            answer=answer.text if answer is not None else None,
            thread_id=thread,
            route_log=records,
            totals=totals_of(records),
            cloud_share=CloudShare.of(records).as_dict(),
            turn=int(values.get("turn", 0)),
            truncated=answer is not None and answer.response_metadata.get("finish_reason") == "length",
            answer_s=answer_s,
        )


def totals_of(records: list[RouteRecord]) -> dict[str, Any]:
    """``chain_totals`` of ``records`` as plain data."""
    from fusion_graph.providers.pricing import chain_totals

    totals = chain_totals(records)
    return {
        "local": asdict(totals.local),
        "cloud": asdict(totals.cloud),
        "total": asdict(totals.total),
        "by_provider": {name: asdict(leg) for name, leg in totals.by_provider.items()},
    }


def stream_events(mode: str, chunk: Any) -> list[dict[str, Any]]:
    """The live view's events in one ``astream`` chunk (see ``cli.live``)."""
    from langchain_core.messages import AIMessage

    from fusion_graph.cli.live import ANSWER_EVENT, ROUTE_EVENT, TOKENS_EVENT

    if mode == "custom":
        return [dict(chunk)] if isinstance(chunk, Mapping) and chunk.get("event") == ROUTE_EVENT else []
    if mode == "messages":
        meta = chunk[1] if isinstance(chunk, tuple) and len(chunk) == 2 else {}
        if not isinstance(meta, Mapping) or meta.get("fusion_step") is None:
            return []
        return [{"event": TOKENS_EVENT, "step": meta["fusion_step"], "kind": meta.get("fusion_kind")}]
    events = []
    for update in chunk.values() if mode == "updates" and isinstance(chunk, Mapping) else ():
        if not isinstance(update, Mapping):
            continue
        records = [r for r in update.get("route_log") or () if r["kind"] != "memory"]
        answers = [m for m in update.get("messages") or () if isinstance(m, AIMessage)]
        if records and answers:
            record, answer = records[-1], answers[-1]
            events.append(
                {
                    "event": ANSWER_EVENT,
                    "turn": record["turn"],
                    "step": record["step"],
                    "kind": record["kind"],
                    "tools": [call["name"] for call in [*answer.tool_calls, *answer.invalid_tool_calls]],
                    "finish_reason": answer.response_metadata.get("finish_reason"),
                }
            )
    return events


async def run_task(
    task: str,
    *,
    context: FusionContext | None = None,
    settings: FusionSettings | None = None,
    thread_id: str | None = None,
    new_thread: bool = False,
    db: Path = DEFAULT_DB,
    postgres: str | None = None,
    models: tuple[BaseChatModel, BaseChatModel] | None = None,
    on_event: Callable[[Mapping[str, Any]], None] | None = None,
    stream_tokens: bool = False,
    on_turn_end: Callable[[RunResult], None] | None = None,
    memory_wait_s: float | None = None,
) -> RunResult:
    """Run one turn of ``task`` on a persisted thread, with memory jobs, and return what it did.

    Args:
        task: The turn's user message.
        context: The run context; ``None``: ``FusionContext()`` (``FUSION_*`` defaults).
        settings: The operator's settings; ``None``: ``FusionSettings()`` (its ``api_key()``
            reads the cloud key from ``./.env`` when the environment has none).
        thread_id: The thread to continue; ``None`` starts a new one with a fresh id.
        new_thread: Allow ``thread_id`` to name a thread with no checkpoint yet (starts it).
        db: SQLite checkpoint file; the memory store is ``store_path(db)`` beside it.
        postgres: A ``postgresql://`` URL to keep checkpoints and store in instead.
        models: ``(cloud, local)`` chat models; ``None`` builds them from ``settings``.
        on_event: Called with each ``fusion_route`` event of the graph, each
            ``fusion_answer`` (the tools an answer called, its finish reason) and, with
            ``stream_tokens``, each streamed chunk (``fusion_tokens``): ``cli.live.StepTable.apply``.
        stream_tokens: Also stream the models' tokens (``stream_mode="messages"``; the
            models then answer by streaming).
        on_turn_end: Called with the result when the turn ends, before memory jobs are awaited.
        memory_wait_s: Seconds to wait for the turn's background memory jobs before
            returning; ``None``: as long as the answer took (``memory_wait.memory_wait_limit``).
            A job still running then is finished at the thread's next turn.

    Returns:
        The turn's ``RunResult``.

    Raises:
        RunError: ``thread_id`` has no checkpoint and ``new_thread`` is false, or ``postgres``
            is not usable.
        ProviderConfigError, ContextError, LlamaServerUnavailable, InvalidInput: The graph
            cannot run as configured (nothing is saved).
        ChainExhausted, ProviderRequestError: A model call failed; the thread is saved.
    """
    from langchain_core.messages import HumanMessage

    from fusion_graph.agent import build_graph
    from fusion_graph.cli.stores import has_checkpoint, open_saver, open_store
    from fusion_graph.context import ensure_context
    from fusion_graph.memory.background import detached_now, stop_detached
    from fusion_graph.providers.resolver import ProviderResolver

    started = time.monotonic()
    context = ensure_context(context)
    if settings is None:
        from fusion_graph.settings import FusionSettings

        settings = FusionSettings()
    thread = thread_id or uuid.uuid4().hex[:12]
    config: Any = {"configurable": {"thread_id": thread}}
    modes = ["values"] if on_event is None else ["custom", "updates", "values"]
    if on_event is not None and stream_tokens:
        modes.append("messages")
    cloud, local = models if models is not None else (None, None)
    async with open_saver(db, postgres) as saver, open_store(db, postgres) as store:
        if thread_id is not None and not new_thread and not await has_checkpoint(saver, thread):
            raise no_thread(thread, "--postgres" if postgres else f"--db {db}")
        resolver = ProviderResolver(cloud=cloud, local=local, settings=settings)
        earlier_runs = detached_now()  # an embedding app's own detached runs are not this turn's
        try:
            graph = build_graph(resolver=resolver, checkpointer=saver, store=store)
            before = len((await graph.aget_state(config)).values.get("route_log", []))
            values: dict[str, Any] = {}
            async for mode, chunk in graph.astream(
                {"messages": [HumanMessage(task)]}, config, context=context, stream_mode=modes
            ):
                if mode == "values" and isinstance(chunk, dict):
                    values = chunk
                elif on_event is not None:
                    for event in stream_events(mode, chunk):
                        on_event(event)
            records: list[RouteRecord] = list(values.get("route_log", []))[before:]
            result = RunResult.of(values, thread, records, answer_s=round(time.monotonic() - started, 3))
            if on_turn_end is not None:
                on_turn_end(result)
            # Background memory jobs use the store and the providers: finish them before closing either.
            limit = memory_wait_limit(settings, result.answer_s) if memory_wait_s is None else memory_wait_s
            result = dataclasses.replace(result, memory_pending=await wait_for_memory_jobs(limit))
        finally:
            # What still runs stops before the providers close: it stays pending, never "dropped".
            await stop_detached(keep=earlier_runs)
            await resolver.aclose()
    return result


# -- the command ----------------------------------------------------------------------


async def _run(
    task: str, context: FusionContext, settings: FusionSettings, options: dict[str, Any], as_json: bool
) -> RunResult:
    details = bool(options.pop("details", False))
    models = await MODELS(context, settings)
    if as_json:
        done = await run_task(task, context=context, settings=settings, models=models, **options)
        if done.memory_pending:  # said on stderr: stdout holds the one JSON object
            stderr_console().print(
                f"memory jobs still running: {LEFT_PENDING}", highlight=False, soft_wrap=True
            )
        return done
    from rich.live import Live

    from fusion_graph.cli.live import StepTable, print_result

    console = stdout_console()
    steps = StepTable(details=details)
    notes = stderr_console()
    waiting = notes.status("waiting for memory jobs")
    live = Live(steps.render(), console=console, refresh_per_second=8)
    ticker: list[WaitTicker] = []

    def turn_end(result: RunResult) -> None:
        live.stop()
        print_result(console, result)
        ticker.append(WaitTicker(memory_wait_limit(settings, result.answer_s)))
        waiting.update(ticker[0])
        waiting.start()

    with live:
        try:
            result = await run_task(
                task,
                context=context,
                settings=settings,
                models=models,
                on_event=steps.apply,
                stream_tokens=console.is_terminal,
                on_turn_end=turn_end,
                **options,
            )
        finally:
            waiting.stop()
    outcome = ticker[0].outcome(result.memory_pending) if ticker else None
    if outcome is not None:
        notes.print(outcome, highlight=False, soft_wrap=True)
    return result


def continue_line(name: str, where: str) -> str:
    """How to go on with a thread (printed after each run, and when one is interrupted)."""
    return f"thread {name} saved in {where}; continue it with --thread {name}"


def interrupted(name: str, db: Path, postgres: str | None) -> typer.Exit:
    """Ctrl-C: once the thread has a checkpoint, say how to continue it; exit code 130."""
    where = "Postgres" if postgres else str(db)
    if thread_saved(db, postgres, name):
        line = f"interrupted: {continue_line(name, where)} (memory jobs not finished run at its next turn)"
    else:
        line = f"interrupted before thread {name} was saved: nothing to continue"
    stderr_console().print(line, highlight=False, soft_wrap=True)
    return typer.Exit(130)


def run(
    task: Annotated[str, typer.Argument(help="What to do, in words (the turn's user message).")],
    workspace: Annotated[
        Path, typer.Option(help="Directory the file tools may read and edit (workspace_root).")
    ] = Path("."),
    thread: Annotated[
        str | None, typer.Option(help="Thread id to continue (it must exist); default: a new thread.")
    ] = None,
    new_thread: Annotated[
        bool, typer.Option("--new-thread", help="Start the --thread id given when it has no checkpoint yet.")
    ] = False,
    db: Annotated[Path, typer.Option(help="SQLite file the threads persist in (memories beside it).")] = (
        DEFAULT_DB
    ),
    postgres: Annotated[
        str | None, typer.Option(help="Postgres URL to persist threads and memories in instead of SQLite.")
    ] = None,
    context: Annotated[
        str | None, typer.Option(help="FusionContext fields as a JSON object (or a JSON file).")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print one JSON object (answer, thread_id, route_log, totals), no table."
        ),
    ] = False,
    details: Annotated[bool, typer.Option("--details", help="Show every step's routing reason.")] = False,
) -> None:
    """Run one turn with the workspace tools against the configured cloud and llama-server.

    Endpoints, keys and prices are the operator's FUSION_* settings (cloud key
    from the variable named by FUSION_CLOUD_API_KEY_ENV, default OPENAI_API_KEY,
    in the environment or ./.env; llama-server at FUSION_LOCAL_BASE_URL). A
    missing key or an unreachable llama-server fails at once. --context holds
    run choices (cloud_share, a calibrated score_quantiles table, limits).
    Memory jobs run after the reply and are awaited at most as long as the answer
    took; those still running are left to the thread's next turn. Ctrl-C after the
    thread is saved still prints how to continue it.
    """
    from fusion_graph.errors import (
        ChainExhausted,
        ContextError,
        InvalidInput,
        LlamaServerUnavailable,
        ProviderConfigError,
        ProviderRequestError,
        ThreadBusy,
    )

    if not workspace.is_dir():
        raise fail(f"--workspace {workspace} is not a directory")
    run_context = build_context(context)
    settings = build_settings(workspace_root=str(workspace.resolve()))
    if key_variable(settings) is None and settings.api_key() is not None:
        stderr_console().print(f"note: {KEY_IN_NAME}: {KEY_IN_NAME_FIX}", highlight=False, soft_wrap=True)
    for unknown, meant in unknown_variables(os.environ, dotenv_names()):
        stderr_console().print(f"note: {unknown_line(unknown, meant)}", highlight=False, soft_wrap=True)
    name = thread or uuid.uuid4().hex[:12]
    options = {"thread_id": name, "new_thread": new_thread or thread is None, "db": db, "postgres": postgres}
    where = "Postgres" if postgres else str(db)
    try:
        with storage("--postgres" if postgres else f"--db {db}"):
            # Before LangGraph loads or a server is asked; a thread begun from the workspace is found there.
            check_target(db, postgres, thread, new_thread, elsewhere=[workspace / DEFAULT_DB])
            result = asyncio.run(_run(task, run_context, settings, {**options, "details": details}, as_json))
    except KeyboardInterrupt:
        raise interrupted(name, db, postgres) from None
    except RunError as error:
        raise fail(str(error)) from None
    except (ProviderConfigError, ContextError, LlamaServerUnavailable, InvalidInput) as error:
        raise fail(str(error)) from None
    except (ChainExhausted, ProviderRequestError) as error:
        raise fail(f"{error}\n(the thread is saved: continue it with --thread {name})") from None
    except ThreadBusy:
        raise fail(
            f"thread {name!r} is running in another process right now (nothing was written): wait "
            f"for that run to end, then run this one again with --thread {name}"
        ) from None
    if as_json:
        typer.echo(result.as_json())
        return
    stdout_console().print(continue_line(name, where), highlight=False, soft_wrap=True)
