"""What ``replay`` and ``calibrate`` share: the traces argument and its default, and their common options."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fusion_graph.cli.common import load_or_fail, stderr_console

if TYPE_CHECKING:
    from fusion_graph.replay.traces import RecordedTrajectory

TracesArg = Annotated[
    list[Path] | None,
    typer.Argument(
        help="Trace files (JSONL, OpenAI chat messages) or directories of *.jsonl. Default: the "
        "directory in FUSION_TRACES_DIR, else the bundled sample (fusion_graph/replay/sample_traces).",
        show_default=False,
    ),
]
ContextOpt = Annotated[
    str | None,
    typer.Option(help="FusionContext fields as a JSON object (or a JSON file), e.g. a calibrated context."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
TurnBudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--turn-budget",
        help="USD a turn may spend on cloud (the run's turn_cloud_budget_usd): a cloud step that would "
        "pass it runs local, by the graph's rule (priced before the call with max_completion_tokens).",
        min=0,
    ),
]
ThreadBudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--thread-budget",
        help="USD a thread (one trajectory) may spend on cloud (the run's thread_cloud_budget_usd).",
        min=0,
    ),
]

TroubleOpt = Annotated[
    bool | None,
    typer.Option(
        "--trouble-signals/--no-trouble-signals",
        help="Score with the trouble signals and the escalation latch (the run's trouble_signals: tool "
        "errors and repeated calls raise the score; a turn they escalate stays on cloud until a "
        "progress event). Default: --context's, else off.",
        show_default=False,
    ),
]


def load_traces(paths: list[Path] | None) -> list[RecordedTrajectory]:
    """The trajectories under ``paths``; none given: ``replay.traces.default_traces``, said on stderr."""
    from fusion_graph.replay.traces import default_traces

    if not paths:
        path, note = default_traces()
        stderr_console().print(f"traces: {note}", highlight=False, soft_wrap=True)
        paths = [path]
    return load_or_fail(paths)
