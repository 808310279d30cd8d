"""Shared pieces of the ``fusion-graph`` CLI: the context option, trace loading, progress bars.

Progress and diagnostics go to stderr, so ``--json`` output on stdout stays clean.

The CLI imports lazily: this module and the command modules import only typer,
rich and the standard library at import time, so ``fusion-graph --help`` does not
load LangGraph, LangChain or the provider SDKs; each command imports what it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from fusion_graph.redact import scrub, scrub_known
from fusion_graph.routing.records import is_step, unanswered

if TYPE_CHECKING:
    from fusion_graph.context import FusionContext
    from fusion_graph.replay.traces import RecordedTrajectory, StepPrices
    from fusion_graph.routing.records import RouteRecord
    from fusion_graph.settings import FusionSettings


def wrap_words(text: Text, width: int) -> Text:
    """``text`` with each line broken between words to fit ``width``; a longer word stays whole.

    Rich's own wrapping folds a word longer than the width (a path, a URL) into
    pieces; this keeps it on a line of its own, as ``textwrap`` does with
    ``break_long_words=False``, so it can still be copied whole.
    """
    lines: list[Text] = []
    for line in text.split("\n", allow_blank=True):
        plain, breaks, start = line.plain, [], 0
        for word in re.finditer(r"\S+\s*", plain):
            if word.start() > start and len(plain[start : word.end()].rstrip()) > width:
                breaks.append(word.start())
                start = word.start()
        for part in line.divide(breaks):
            part.rstrip()
            lines.append(part)
    return Text("\n").join(lines)


class CliConsole(Console):
    """A rich console whose sentences wrap between words at a terminal, never inside one.

    The CLI prints its notes, errors and sentences with ``soft_wrap=True`` so
    that off a terminal (a pipe, a file, a test) each stays one line to search.
    At a terminal that left the wrapping to the terminal, which cuts a line at
    its last column, inside a word (``withi`` / ``n``, ``--th`` / ``read ID``).
    There such text is wrapped here instead, at spaces only (``wrap_words``).
    """

    def print(self, *objects: Any, **options: Any) -> None:
        """``Console.print``; at a terminal, soft-wrapped text is wrapped at spaces first."""
        texts = bool(objects) and all(isinstance(item, str | Text) for item in objects)
        if texts and options.get("soft_wrap") and self.is_terminal:
            parts = [
                self.render_str(
                    item,
                    markup=options.get("markup"),
                    highlight=options.get("highlight"),
                    emoji=options.get("emoji"),
                )
                if isinstance(item, str)
                else item
                for item in objects
            ]
            joined = Text(str(options.pop("sep", " "))).join(parts)
            objects = (wrap_words(joined, options.get("width") or self.width),)
        super().print(*objects, **options)


def stderr_console() -> Console:
    """A console on stderr (progress, notes and errors)."""
    return CliConsole(stderr=True)


def stdout_console() -> Console:
    """A console on stdout, as wide as the terminal; off one (pipes, files), ``COLUMNS`` or 80.

    Every table is laid out to read at 80 columns (``tables``), so output sent
    to a file reads like the terminal's.
    """
    return CliConsole()


def fail(message: str) -> typer.Exit:
    """Print ``message`` as an error on stderr; the caller raises the returned ``Exit(2)``.

    Registered secrets are replaced first (a key put where a variable's name
    belongs is registered by ``checks.key_variable``).
    """
    from rich.markup import escape

    text = escape(scrub_known(message))
    stderr_console().print(f"[bold red]error:[/] {text}", highlight=False, soft_wrap=True)
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
    from fusion_graph.redact import scrub

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
    from fusion_graph.context import ensure_context
    from fusion_graph.errors import ContextError

    data = context_dict(raw)
    data.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return ensure_context(data)
    except ContextError as error:
        raise fail(str(error)) from error


def build_settings(**overrides: Any) -> FusionSettings:
    """The operator's settings: ``FUSION_*`` variables (and ``.env``), plus explicit options."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from fusion_graph.settings import FusionSettings

    try:
        return FusionSettings(**{key: value for key, value in overrides.items() if value is not None})
    except ValidationError as error:
        problems = [
            (str(e["loc"][0]) if e["loc"] else "", e["msg"].removeprefix("Value error, "))
            for e in error.errors()
        ]
        raise fail("; ".join(setting_problem(name, why, overrides) for name, why in problems)) from None
    except SettingsError as error:
        found = re.search(r'field "(\w+)"', str(error))
        name = found.group(1) if found else ""
        raise fail(
            setting_problem(
                name, "not valid JSON (write it as JSON, as docs/configuration.md shows)", overrides
            )
        ) from None


def setting_problem(field: str, why: str, overrides: Mapping[str, Any]) -> str:
    """One setting's problem on one line: the variable, where its value came from, and what is wrong."""
    from dotenv import dotenv_values

    from fusion_graph.settings import ENV_PREFIX

    variable = ENV_PREFIX + field.upper()
    if field in overrides and overrides[field] is not None:
        where = "a command-line option"
    elif variable in os.environ:
        where = "the environment"
    elif os.path.isfile(".env") and variable in dotenv_values(".env"):
        where = "./.env"
    else:
        where = "its default"
    return f"{variable} (from {where}): {scrub(why)}"


def run_prices(context: FusionContext, settings: FusionSettings) -> StepPrices:
    """Prices of replayed steps: the operator's, at the run's cloud model when it narrows it."""
    from fusion_graph.errors import ContextError
    from fusion_graph.replay.traces import step_prices

    try:
        return step_prices(settings.narrow(cloud_model=context.cloud_model))
    except (ContextError, ValueError) as error:
        raise fail(str(error)) from error


def load_or_fail(paths: Sequence[Path]) -> list[RecordedTrajectory]:
    """The trajectories under ``paths``, or a clear error naming what is missing."""
    from fusion_graph.errors import TraceError
    from fusion_graph.replay.traces import load_trajectories

    try:
        trajectories = load_trajectories(paths)
    except TraceError as error:
        raise fail(str(error)) from error
    if not trajectories:
        raise fail(f"no trajectories in {', '.join(map(str, paths))}")
    return trajectories


@contextmanager
def progress(console: Console | None = None, *, columns: Sequence[ProgressColumn] = ()) -> Iterator[Progress]:
    """A rich progress display on stderr; it hides itself when stderr is not a terminal.

    ``columns`` go between the count and the elapsed time (``label`` adds its agreement and rate).
    """
    console = console or stderr_console()
    display = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *columns,
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with display:
        yield display


#: Said wherever a cloud share is shown: why the share of all steps exceeds the dial's.
PLAN_NOTE = "plans (one per turn) run on cloud whenever cloud_share > 0"


@dataclass(frozen=True)
class CloudShare:
    """Where the router sent a thread's (or turn's) inferences, over all steps and continuation steps.

    Steps are plans, continuation steps and repairs (memory jobs are not steps, nor
    is an inference no provider answered: it is tried again, and counts then);
    continuation steps are the ``kind="step"`` ones, the share the dial
    (``cloud_share``) sets. Each turn's plan runs on cloud whenever
    ``cloud_share > 0``, so the share of all steps is the higher one.

    Attributes:
        steps: Plans, continuation steps and repairs.
        cloud_steps: Those the router sent to cloud.
        continuation_steps: Continuation steps (``kind="step"``).
        cloud_continuation_steps: Those the router sent to cloud.
        plans: Plans (one per turn).
        cloud_plans: Plans sent to cloud.
    """

    steps: int = 0
    cloud_steps: int = 0
    continuation_steps: int = 0
    cloud_continuation_steps: int = 0
    plans: int = 0
    cloud_plans: int = 0

    @classmethod
    def of(cls, records: Sequence[RouteRecord]) -> CloudShare:
        """The share of ``records`` (``route_log`` entries), by the leg the router chose."""
        # A step no provider answered is retried (resumed, or the turn run again): it counts then.
        steps = [r for r in records if is_step(r) and not unanswered(r)]
        continuation = [r for r in steps if r["kind"] == "step"]
        plans = [r for r in steps if r["kind"] == "plan"]
        return cls(
            steps=len(steps),
            cloud_steps=sum(r["routed_leg"] == "cloud" for r in steps),
            continuation_steps=len(continuation),
            cloud_continuation_steps=sum(r["routed_leg"] == "cloud" for r in continuation),
            plans=len(plans),
            cloud_plans=sum(r["routed_leg"] == "cloud" for r in plans),
        )

    def __add__(self, other: CloudShare) -> CloudShare:
        return CloudShare(*(getattr(self, name) + getattr(other, name) for name in self.__dataclass_fields__))

    @property
    def fraction(self) -> float:
        """Share of all steps on cloud (0 without steps)."""
        return round(self.cloud_steps / self.steps, 4) if self.steps else 0.0

    @property
    def continuation_fraction(self) -> float:
        """Share of continuation steps on cloud (0 without any)."""
        return (
            round(self.cloud_continuation_steps / self.continuation_steps, 4)
            if self.continuation_steps
            else 0.0
        )

    def as_dict(self) -> dict[str, Any]:
        """The counts and both fractions, for ``--json``."""
        return {
            **{name: getattr(self, name) for name in self.__dataclass_fields__},
            "cloud_fraction": self.fraction,
            "continuation_cloud_fraction": self.continuation_fraction,
        }

    def line(self) -> str:
        """Both shares side by side, and why they differ (two lines)."""
        return (
            f"routed to cloud: {self.cloud_steps} of {self.steps} steps ({self.fraction:.0%}) | "
            f"{self.cloud_continuation_steps} of {self.continuation_steps} continuation steps "
            f"({self.continuation_fraction:.0%})\n{PLAN_NOTE}; cloud_share sets the continuation share"
        )
