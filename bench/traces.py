"""Agent traces as replayable threads: each JSONL record is one conversation, replayed as one thread."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fusion_graph.errors import TraceError
from fusion_graph.replay.traces import RecordedTrajectory, load_trajectories, parse_records, trace_files

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["TraceError", "Trajectory", "explained", "load_traces", "trace_files"]

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = REPO_ROOT.parent / "shared" / "data" / "traces"

#: ``--quick``: this many trajectories from each SWE-agent file, ``QUICK_OTHER`` from each other file.
QUICK_SWE = 2
QUICK_OTHER = 3


@dataclass(frozen=True)
class Trajectory:
    """One trace record: one conversation, replayed as one thread."""

    file: str
    line: int
    trace_id: str
    messages: tuple[dict[str, Any], ...]

    @property
    def thread_id(self) -> str:
        """Unique per record (trace ids repeat across records in the SWE-agent file)."""
        return f"{self.file}:{self.line}:{self.trace_id}"

    @property
    def is_swe(self) -> bool:
        """Whether it comes from a SWE-agent trace file (where the targets are judged)."""
        return is_swe_file(self.file)


def is_swe_file(name: str) -> bool:
    """SWE-agent trace files are the ones named ``swe*``."""
    return name.lower().startswith("swe")


def parse_trace_lines(lines: Iterable[str], *, file: str) -> list[Trajectory]:
    """Parse JSONL trace records (``fusion_graph.replay.traces.parse_records``); blank lines are skipped.

    Raises:
        TraceError: A line is not JSON, or lacks a ``messages`` list of role-tagged dicts.
    """
    return [
        Trajectory(file, record.line, record.id or f"line{record.line}", record.messages)
        for record in parse_records(lines, file=file)
    ]


def load_traces(paths: Sequence[Path]) -> list[Trajectory]:
    """Every trajectory of every trace file under ``paths``."""
    trajectories = []
    for path in trace_files(paths):
        with path.open(encoding="utf-8") as handle:
            trajectories.extend(parse_trace_lines(handle, file=path.stem))
    return trajectories


def select_quick(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The ``--quick`` subset: the first ``QUICK_SWE``/``QUICK_OTHER`` trajectories of each file."""
    taken: dict[str, int] = {}
    chosen = []
    for trajectory in trajectories:
        limit = QUICK_SWE if trajectory.is_swe else QUICK_OTHER
        if taken.get(trajectory.file, 0) < limit:
            taken[trajectory.file] = taken.get(trajectory.file, 0) + 1
            chosen.append(trajectory)
    return chosen


def assistant_positions(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices of the assistant messages: one agent step each."""
    return [i for i, message in enumerate(messages) if message.get("role") == "assistant"]


def explained(run: Callable[[], T], traces: Sequence[Path]) -> T | None:
    """``run()``, or ``None`` after printing why a server benchmark could not run (missing traces,
    harness or llama-server build, a failed request)."""
    try:
        return run()
    except TraceError as error:
        missing = not any(p.exists() for p in traces)
        hint = (
            " (pass --traces PATH; the default is ../shared/data/traces beside the repo)" if missing else ""
        )
        print(f"error: {error}{hint}", file=sys.stderr)
    except ImportError as error:
        print(f"error: {error}; install the dev extras (gguf, numpy) to generate the model", file=sys.stderr)
    except RuntimeError as error:  # LlamaServerNotBuilt, LlamaServerError, a failed request
        print(f"error: {error}", file=sys.stderr)
    return None


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """``--traces``, ``--quick`` and ``--out``, as every trace benchmark takes them."""
    parser.add_argument(
        "--traces",
        nargs="+",
        type=Path,
        default=[DEFAULT_TRACES],
        metavar="PATH",
        help=f"trace files or directories of *.jsonl (default: {DEFAULT_TRACES})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a subset: {QUICK_SWE} trajectories per SWE-agent file, {QUICK_OTHER} per other file",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")


def write_results(result: Mapping[str, Any], out: Path | None) -> None:
    """``--out`` of the server benchmarks: ``result`` as indented JSON (folders made), and where it went.

    One writer, so every server benchmark's JSON ends the same way and says so in the same words.
    """
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"JSON written to {out}")


def load_recorded(traces: Sequence[Path], err: Console) -> list[RecordedTrajectory] | None:
    """``load_trajectories(traces)``, or ``None`` after saying on ``err`` why not and where the shared
    traces are expected (the replay-only benchmarks, ``bench.calibration`` and ``bench.trouble``)."""
    try:
        return load_trajectories(traces)
    except TraceError as error:
        err.print(f"[bold red]error:[/] {error}. The shared traces are expected at {DEFAULT_TRACES}.")
        return None


def render_and_write(
    report: T,
    render: Callable[[T, Console], None],
    *,
    width: int,
    out: Path | None,
    err: Console,
) -> None:
    """``render(report)`` on the terminal (``width`` columns when stdout is not one), then ``--out``.

    The replay-only benchmarks' ending: their JSON is written as is (no trailing newline) and the
    line saying where goes to ``err``.
    """
    from rich.console import Console

    console = Console()
    render(report, console if console.is_terminal else Console(width=width))
    if out:
        out.write_text(json.dumps(report, indent=2), encoding="utf-8")
        err.print(f"results written to {out}")
