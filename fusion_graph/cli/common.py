"""Shared pieces of the ``fusion-graph`` CLI: the context option, trace loading, progress bars.

Progress and diagnostics go to stderr, so ``--json`` output on stdout stays clean.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.redact import scrub
from fusion_graph.replay.traces import (
    RecordedTrajectory,
    StepPrices,
    TraceError,
    load_trajectories,
    step_prices,
)
from fusion_graph.settings import ContextError, FusionSettings


def stderr_console() -> Console:
    """A console on stderr (progress, notes and errors)."""
    return Console(stderr=True)


def stdout_console() -> Console:
    """A console on stdout; 120 columns wide when stdout is not a terminal (pipes, files, tests)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def fail(message: str) -> typer.Exit:
    """Print ``message`` as an error on stderr; the caller raises the returned ``Exit(2)``."""
    stderr_console().print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def _storage_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, sqlite3.Error]
    with contextlib.suppress(ImportError):
        import psycopg

        errors.append(psycopg.Error)
    return tuple(errors)


@contextlib.contextmanager
def storage(where: str) -> Iterator[None]:
    """Turn a checkpoint store that cannot be opened or read into one line on stderr and exit 2."""
    try:
        yield
    except _storage_errors() as error:
        detail = scrub(f"{type(error).__name__}: {error}".splitlines()[0])
        raise fail(
            f"{where} cannot be used ({detail}); give a writable SQLite file with --db, or a "
            "postgresql://user:password@host:port/db URL with --postgres"
        ) from None


def context_dict(raw: str | None) -> dict[str, Any]:
    """The ``--context`` option: a JSON object of ``FusionContext`` fields, or a path to one."""
    if not raw:
        return {}
    text = raw
    if not raw.lstrip().startswith("{"):
        path = Path(raw)
        if not path.is_file():
            raise fail(f"--context is neither a JSON object nor a file: {raw!r}")
        text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise fail(f"--context is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise fail("--context must be a JSON object of FusionContext fields")
    return data


def build_context(raw: str | None, **overrides: Any) -> FusionContext:
    """``FusionContext`` from ``--context`` plus explicit options (``None`` options are ignored)."""
    data = context_dict(raw)
    data.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return ensure_context(data)
    except ContextError as error:
        raise fail(str(error)) from error


def build_settings(**overrides: Any) -> FusionSettings:
    """The operator's settings: ``FUSION_*`` variables (and ``.env``), plus explicit options."""
    try:
        return FusionSettings(**{key: value for key, value in overrides.items() if value is not None})
    except ValidationError as error:
        raise fail(f"invalid FUSION_* settings: {error}") from error


def run_prices(context: FusionContext, settings: FusionSettings) -> StepPrices:
    """Prices of replayed steps: the operator's, at the run's cloud model when it narrows it."""
    try:
        return step_prices(settings.narrow(cloud_model=context.cloud_model))
    except (ContextError, ValueError) as error:
        raise fail(str(error)) from error


def load_or_fail(paths: Sequence[Path]) -> list[RecordedTrajectory]:
    """The trajectories under ``paths``, or a clear error naming what is missing."""
    try:
        trajectories = load_trajectories(paths)
    except TraceError as error:
        raise fail(str(error)) from error
    if not trajectories:
        raise fail(f"no trajectories in {', '.join(map(str, paths))}")
    return trajectories


@contextmanager
def progress(console: Console | None = None) -> Iterator[Progress]:
    """A rich progress display on stderr; it hides itself when stderr is not a terminal."""
    console = console or stderr_console()
    display = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with display:
        yield display
