"""Recorded agent trajectories: where they are, how they load, and the prices their steps are read at.

A trace file is JSONL, one conversation per line:
``{"id", "messages": [OpenAI chat messages], "reward"?, "tools"?, ...}``, where
``tools`` are the tool schemas the agent had (OpenAI's ``{"type": "function",
"function": {...}}``, or the function objects alone). Every assistant
message is one step. ``replayed`` routes them with the graph's own routing,
``summary`` adds the replays up. A small synthetic sample ships with the
package (``SAMPLE_TRACES``), so the ``replay`` and ``calibrate`` commands run
on a fresh install.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_core.messages import BaseMessage, convert_to_messages

from fusion_graph.errors import TraceError
from fusion_graph.providers.pricing import TokenPrices, default_pricing, unit_prices
from fusion_graph.settings import FusionSettings

#: The environment variable naming the traces directory (the CLI's default, the notebooks').
TRACES_ENV = "FUSION_TRACES_DIR"
#: Synthetic trajectories shipped with the package (written for it, no third-party data), for a first run.
SAMPLE_TRACES = Path(__file__).resolve().parent / "sample_traces"
#: How messages name ``SAMPLE_TRACES``: its place in the package, the same on every install.
SAMPLE_NAME = "fusion_graph/replay/sample_traces"
#: What to do about traces that are not there, for every message that says so.
WHERE_TRACES_ARE = (
    f"point {TRACES_ENV} at a directory of OpenAI-format JSONL traces, or unset it for the bundled "
    f"sample ({SAMPLE_NAME}: the default of `fusion-graph replay`, `calibrate` and the notebooks)"
)


def repository_root(start: Path | None = None) -> Path | None:
    """The fusion-graph checkout holding ``start`` (default: the working directory), or ``None``.

    The first of ``start`` and its parents that holds both ``pyproject.toml`` and
    the ``fusion_graph`` package; failing that, the checkout this package was
    imported from (an editable install), if it is one.
    """
    here = (start or Path.cwd()).resolve()
    package = Path(__file__).resolve().parents[2]
    for candidate in (here, *here.parents, package):
        if (candidate / "pyproject.toml").is_file() and (candidate / "fusion_graph").is_dir():
            return candidate
    return None


def given_traces(environ: Mapping[str, str] | None = None) -> Path | None:
    """``$FUSION_TRACES_DIR`` as a path (``~`` expanded), or ``None`` when it is unset or blank."""
    given = (os.environ if environ is None else environ).get(TRACES_ENV, "").strip()
    return Path(given).expanduser() if given else None


def default_traces(environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """The traces the CLI reads when it is given none, and a note that says which they are.

    ``$FUSION_TRACES_DIR`` when set (a relative one is read from the working
    directory), else the bundled sample (``SAMPLE_TRACES``). The directory is not
    checked here: ``trace_files`` says what is missing.
    """
    given = given_traces(environ)
    if given is not None:
        return given, f"{given} (from {TRACES_ENV})"
    return SAMPLE_TRACES, f"the bundled sample ({SAMPLE_NAME}); pass paths or set {TRACES_ENV} for others"


def notebook_traces(
    environ: Mapping[str, str] | None = None, *, start: Path | None = None
) -> tuple[Path, str]:
    """The traces a notebook replays, and a note that says which: the CLI's default, checked.

    A notebook's kernel starts in ``notebooks/`` (Jupyter's rule), not where
    the command was typed, so a relative ``FUSION_TRACES_DIR`` is read from the
    repository root (the checkout holding ``start``, default the working
    directory) rather than from the kernel's directory; outside a checkout,
    from the working directory. Unset, the bundled sample: a clone runs every
    notebook as it is.

    Raises:
        FileNotFoundError: ``FUSION_TRACES_DIR`` names a directory without
            ``*.jsonl`` files; the message names the variable, the path it was
            read as and what to do instead.
    """
    given = given_traces(environ)
    if given is None:
        return default_traces(environ)
    root = repository_root(start) if not given.is_absolute() else None
    path = ((root / given) if root is not None else given).resolve()
    read_as = f"read from the repository root {root}" if root is not None else "read as given"
    if not path.is_dir() or not any(path.glob("*.jsonl")):
        raise FileNotFoundError(
            f"the traces in {TRACES_ENV} are missing: no *.jsonl files in {path} ({TRACES_ENV}={given}, "
            f"{read_as}). To read others, {WHERE_TRACES_ARE}."
        )
    return path, f"{path} (from {TRACES_ENV}, {read_as})"


@dataclass(frozen=True)
class RecordedTrajectory:
    """One recorded conversation."""

    file: str
    """Stem of its trace file; trajectories of one file form a family."""
    line: int
    id: str
    reward: float | None
    """Task outcome when the source records one (tau-bench: 1 success, 0 failure)."""
    messages: tuple[BaseMessage, ...]
    tools: tuple[dict[str, Any], ...] = ()
    """The tool schemas the record gives (OpenAI format, ``{"type": "function", ...}``); ``()``: none."""


def trace_files(paths: Iterable[Path]) -> list[Path]:
    """Expand directories to their ``*.jsonl`` files (sorted); files are taken as given.

    Raises:
        TraceError: A path does not exist, or no trace file was found.
    """
    paths = list(paths)
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(sorted(path.glob("*.jsonl")))
        elif path.is_file():
            found.append(path)
        else:
            flag = str(path).lower() in ("true", "false", "yes", "no", "1", "0")
            hint = " (flags such as --json take no value)" if flag else ""
            raise TraceError(f"trace path not found: {path}{hint}; {WHERE_TRACES_ARE}")
    if not found:
        raise TraceError(f"no *.jsonl trace files in {', '.join(map(str, paths))}")
    return found


@dataclass(frozen=True)
class TraceRecord:
    """One JSONL trace record as stored: OpenAI chat messages, unconverted."""

    file: str
    line: int
    id: str | None
    """The record's own ``id`` (``None`` when it has none)."""
    reward: float | None
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    """The record's ``tools`` as OpenAI tool schemas (``tool_schemas``); ``()``: it has none."""


def tool_schemas(raw: Any, *, where: str) -> tuple[dict[str, Any], ...]:
    """A record's ``tools`` as OpenAI tool schemas: ``{"type": "function", "function": {"name", ...}}``.

    Function objects given alone (``{"name", "description", "parameters"}``) are wrapped;
    no ``tools`` (``None``) is none.

    Raises:
        TraceError: ``tools`` is not a list of named functions.
    """
    if raw is None:
        return ()
    found = []
    for item in raw if isinstance(raw, list) else [None]:
        function = item.get("function", item) if isinstance(item, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TraceError(
                f"{where}: expected 'tools' to be a list of {{'type': 'function', 'function': ...}}"
            )
        found.append({"type": "function", "function": function})
    return tuple(found)


#: What a trace file holds, for errors about one that does not.
TRACE_FORMAT = 'a trace file is JSONL: one {"id", "messages": [OpenAI chat messages]} conversation a line'


def parse_records(lines: Iterable[str], *, file: str, where: str | None = None) -> list[TraceRecord]:
    """Parse JSONL records ``{"id", "messages": [...], "reward"?}``; blank lines are skipped.

    ``file`` names the family (a file's stem); ``where`` names the file in errors
    (default ``file``), e.g. the path as given.

    Raises:
        TraceError: A line is not JSON or has no list of role-tagged messages.
    """
    name = where or file
    found = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{name}:{number}: not JSON ({error}); {TRACE_FORMAT}") from error
        raw = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(raw, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in raw
        ):
            raise TraceError(
                f"{name}:{number}: expected a 'messages' list of {{'role': ...}} objects; {TRACE_FORMAT}"
            )
        reward = record.get("reward")
        found.append(
            TraceRecord(
                file=file,
                line=number,
                id=str(record["id"]) if record.get("id") else None,
                reward=float(reward) if isinstance(reward, int | float) else None,
                messages=tuple(raw),
                tools=tool_schemas(record.get("tools"), where=f"{name}:{number}"),
            )
        )
    return found


def parse_trajectories(
    lines: Iterable[str], *, file: str, where: str | None = None
) -> list[RecordedTrajectory]:
    """Parse JSONL trace records (``parse_records``) into conversations of LangChain messages.

    Raises:
        TraceError: A line is not a trace record, or its messages cannot be read.
    """
    found = []
    for record in parse_records(lines, file=file, where=where):
        try:
            messages = convert_to_messages(list(record.messages))
        except (ValueError, TypeError, KeyError) as error:
            raise TraceError(f"{where or file}:{record.line}: unreadable messages ({error})") from error
        found.append(
            RecordedTrajectory(
                file=file,
                line=record.line,
                id=record.id or f"{file}:{record.line}",
                reward=record.reward,
                messages=tuple(messages),
                tools=record.tools,
            )
        )
    return found


def load_trajectories(paths: Iterable[Path]) -> list[RecordedTrajectory]:
    """Every trajectory of every trace file under ``paths`` (files or directories)."""
    found = []
    for path in trace_files(paths):
        with path.open(encoding="utf-8") as handle:
            found.extend(parse_trajectories(handle, file=path.stem, where=str(path)))
    return found


def families(trajectories: Iterable[RecordedTrajectory]) -> dict[str, list[RecordedTrajectory]]:
    """Trajectories grouped by trace file, in first-seen order."""
    grouped: dict[str, list[RecordedTrajectory]] = {}
    for trajectory in trajectories:
        grouped.setdefault(trajectory.file, []).append(trajectory)
    return grouped


@dataclass(frozen=True)
class StepPrices:
    """Per-million prices to price replayed steps: cloud (``None``: unknown) and local."""

    cloud: TokenPrices | None
    local: TokenPrices


def step_prices(settings: FusionSettings, cloud_model: str | None = None) -> StepPrices:
    """The cloud model's prices (``price_overrides`` or the catalogue) and the local price.

    Args:
        settings: The operator's settings (prices, cloud endpoint).
        cloud_model: The run's model; ``None`` is the operator's ``cloud_model``.
    """
    model = cloud_model or settings.cloud_model
    overrides = {
        key: TokenPrices(input=value[0], output=value[1], cached_input=value[2])
        for key, value in settings.price_overrides.items()
    }
    pricing = default_pricing(
        provider_id=f"cloud:{model}",
        leg="cloud",
        model_ref=model,
        api_url=settings.cloud_base_url,
        overrides=overrides,
        price_like=settings.cloud_price_like,
    )
    local_in, local_out = settings.local_price_per_mtok
    return StepPrices(unit_prices(pricing), TokenPrices(local_in, local_out, local_in))
