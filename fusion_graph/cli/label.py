"""``fusion-graph label``: ask the operator's local model every recorded step, and write whether it agreed.

For calibration on what the local model actually gets wrong (``calibrate --labels``).
The asking is ``replay.labelling``'s (the graph's own ``ask`` on the local leg);
this module reads the options, resumes an existing ``--out`` file and shows
progress. It imports the graph's modules only when the command runs.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import ProgressColumn, TextColumn
from rich.text import Text

from fusion_graph.cli.common import (
    build_context,
    build_settings,
    fail,
    progress,
    stderr_console,
    stdout_console,
)
from fusion_graph.cli.tables import add_number_columns, compact_table
from fusion_graph.cli.trace_options import ContextOpt, JsonOpt, TracesArg, load_traces

if TYPE_CHECKING:
    from rich.progress import Task

    from fusion_graph.context import FusionContext
    from fusion_graph.replay.labelling import LabelTally
    from fusion_graph.replay.labels import LabelKey, StepToLabel, ToolSource
    from fusion_graph.replay.traces import RecordedTrajectory
    from fusion_graph.routing.score import Leg
    from fusion_graph.settings import FusionSettings

#: The completion budget of each question (``replay.labelling.DEFAULT_MAX_TOKENS``; a test keeps them equal).
DEFAULT_MAX_TOKENS = 512
#: Exit status after Ctrl-C (128 + SIGINT), as a shell reports it.
INTERRUPTED = 130


class RateColumn(ProgressColumn):
    """Steps labelled this run per second since the bar started (``-`` before the first).

    Not rich's ``task.speed``: that spans only the time between its samples, so
    two answers a moment apart after a long one read as a hundred steps a
    second. Steps a resumed run found done (the task's ``resumed`` field) are
    not counted.
    """

    def render(self, task: Task) -> Text:
        """This run's steps over its elapsed time."""
        done = task.completed - float(task.fields.get("resumed", 0))
        elapsed = task.elapsed
        if not done or not elapsed:
            return Text("-", style="progress.data.speed")
        rate = done / elapsed
        shown = f"{rate:.2f} steps/s" if rate >= 0.1 else f"{elapsed / done:.0f} s/step"
        return Text(shown, style="progress.data.speed")


@dataclass
class Written:
    """Steps written to ``--out`` this run, counted outside ``_label``: said after Ctrl-C or a failure."""

    steps: int = 0


def trim_partial_line(path: Path) -> None:
    """Cut a last line left unfinished (a run killed while writing it), so the next line starts clean.

    Only the last byte is read when the file ends its line (the usual case): the
    file is read whole once, to parse it, not twice.
    """
    with path.open("rb+") as handle:
        if handle.seek(0, os.SEEK_END) == 0:
            return
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) == b"\n":
            return
        handle.seek(0)
        handle.truncate(handle.read().rfind(b"\n") + 1)


def done_keys(out: Path, retry_errors: bool) -> tuple[set[LabelKey], int]:
    """The steps ``out`` labels (``retry_errors``: not those without an answer), and how many agree."""
    from fusion_graph.errors import TraceError
    from fusion_graph.replay.labels import read_label_lines

    if not out.is_file():
        return set(), 0
    trim_partial_line(out)
    try:
        lines = read_label_lines(out)
    except TraceError as error:
        raise fail(f"{error}; --out must be a labels file written by `fusion-graph label`") from error
    kept = [line for line in lines if not (retry_errors and line["agrees"] is None)]
    keys = {(str(line["trace"]), int(line["line"]), int(line["position"])) for line in kept}
    return keys, sum(line["agrees"] is True for line in kept)


def _steps(
    trajectories: Sequence[RecordedTrajectory],
    context: FusionContext,
    tools: ToolSource,
    window: int | None,
) -> list[list[StepToLabel]]:
    from fusion_graph.replay.labels import steps_to_label, trajectory_tools

    return [
        steps_to_label(t, context, tools=trajectory_tools(t, tools), local_window=window)
        for t in trajectories
    ]


async def _label(
    trajectories: Sequence[RecordedTrajectory],
    context: FusionContext,
    settings: FusionSettings,
    out: Path,
    options: dict[str, Any],
    done: set[LabelKey],
    agreed: int,
    written: Written,
) -> tuple[LabelTally, int, int, int | None, int]:
    """Label every step not in ``done``: the tally, the steps, those to do, the window, the concurrency."""
    from fusion_graph.context import FusionContext
    from fusion_graph.providers.resolver import ProviderResolver
    from fusion_graph.replay.labelling import label_all

    resolver = ProviderResolver(settings=settings)
    try:
        local: tuple[Leg, ...] = ("local",)  # never the cloud, even where the operator allows fallover
        chain = (await resolver.chain(FusionContext(mode="local"))).only(local)
        link = chain.links[0]
        window = await resolver.window(link)
        concurrency = options["concurrency"]
        if concurrency is None:
            pool = await resolver.slot_pool(link)
            concurrency = pool.conversation_slots if pool is not None else 1
        steps = _steps(trajectories, context, options["tools"], window)
        total = sum(len(items) for items in steps)
        todo = [[item for item in items if item.key not in done] for items in steps]
        waiting = sum(map(len, todo))
        columns = (TextColumn("agree {task.fields[agree]}"), RateColumn())
        agree = agreed
        with progress(columns=columns) as display, out.open("a", encoding="utf-8") as handle:
            resumed = total - waiting
            task = display.add_task("labelling", total=total, completed=resumed, agree=agree, resumed=resumed)

            def write(line: dict[str, Any]) -> None:
                nonlocal agree
                handle.write(json.dumps(line) + "\n")
                handle.flush()
                written.steps += 1
                agree += line["agrees"] is True
                display.update(task, advance=1, agree=agree)

            tally = await label_all(
                todo,
                chain=chain,
                placer=resolver.placement,
                write=write,
                max_tokens=options["max_tokens"],
                timeout_s=settings.request_timeout,
                window=window,
                concurrency=concurrency,
                limit=options["limit"],
            )
        return tally, total, waiting, window, concurrency
    finally:
        await resolver.aclose()


def _summary(
    out: Path, total: int, waiting: int, tally: LabelTally, window: int | None, slots: int
) -> dict[str, Any]:
    return {
        "out": str(out),
        "steps": total,
        "labelled_before": total - waiting,
        "asked": tally.asked,
        "agree": tally.agree,
        "disagree": tally.disagree,
        "no_answer": tally.failed,
        "left": waiting - tally.asked,
        "local_window": window,
        "concurrency": slots,
    }


def label(
    traces: TracesArg = None,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="JSONL file of labels, one line per step, written as each is done. An existing one "
            "is resumed: the steps it holds are not asked again.",
        ),
    ] = Path("labels.jsonl"),
    context: ContextOpt = None,
    max_tokens: Annotated[
        int,
        typer.Option(help="Completion budget of each question: enough for a tool call.", min=16),
    ] = DEFAULT_MAX_TOKENS,
    concurrency: Annotated[
        int | None,
        typer.Option(
            help="Trajectories asked at a time (each on its own slot). Default: the local server's "
            "conversation slots (GET /props total_slots, less the reserved reflection slot; "
            "FUSION_LOCAL_SLOTS when set), 1 when it reports none.",
            min=1,
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(help="Ask at most this many steps this run (run again for the rest).", min=0),
    ] = None,
    tools: Annotated[
        str,
        typer.Option(
            help="The tools each step is asked with: 'recorded' (the record's own 'tools' schemas, "
            "none when it has none) or 'inferred' (those, else schemas inferred from the calls the "
            "trajectory makes: names, argument names and JSON types)."
        ),
    ] = "recorded",
    retry_errors: Annotated[
        bool,
        typer.Option(help="Ask again the steps --out holds without an answer (agrees: null)."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Ask the local model each recorded step and label whether it takes the recorded action.

    For every assistant message of the traces (a strong model's trajectories),
    the operator's local model (FUSION_LOCAL_*) gets the same prompt (the
    trace's system prompt and the history before it) and tools, at temperature
    0, through the graph's own provider call (slots, timeout, errors). Each
    line says where the step is, its score under the routing rule (--context)
    and its signals, the recorded and the local action, and whether they are
    the same (agrees; null with the error when the local model gave no
    answer). Ctrl-C stops it; the same command resumes where it stopped.
    Calibrate on the result with `fusion-graph calibrate --labels OUT`.
    """
    from fusion_graph.errors import ContextError, ProviderConfigError
    from fusion_graph.replay.labelling import LocalUnavailable
    from fusion_graph.replay.labels import TOOL_SOURCES

    if tools not in TOOL_SOURCES:
        raise fail(f"--tools must be one of {', '.join(TOOL_SOURCES)}, got {tools!r}")
    run_context = build_context(context)
    settings = build_settings()
    trajectories = load_traces(traces)
    done, agreed = done_keys(out, retry_errors)
    options = {"max_tokens": max_tokens, "concurrency": concurrency, "limit": limit, "tools": tools}
    written = Written()
    resume = f"run the same command again to go on ({out} keeps every finished step)"
    try:
        tally, total, waiting, window, slots = asyncio.run(
            _label(trajectories, run_context, settings, out, options, done, agreed, written)
        )
    except KeyboardInterrupt:
        stderr_console().print(
            f"interrupted: {written.steps} step(s) labelled this run; {resume}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(INTERRUPTED) from None
    except LocalUnavailable as error:
        raise fail(
            f"the local model at {settings.local_base_url} stopped answering after {written.steps} step(s) "
            f"this run: {error}. Start llama-server (fusion-graph doctor checks it), then {resume}"
        ) from None
    except (ContextError, ProviderConfigError) as error:
        raise fail(str(error)) from None
    result = _summary(out, total, waiting, tally, window, slots)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = compact_table(f"labels: {out}", f"local window {window or 'unknown'} tokens, {slots} at a time")
    add_number_columns(table, "traces", "steps", "before", "asked", "agree", "disagree", "no\nanswer", "left")
    table.add_row(
        str(len(trajectories)),
        str(total),
        str(result["labelled_before"]),
        str(tally.asked),
        str(tally.agree),
        str(tally.disagree),
        str(tally.failed),
        str(result["left"]),
    )
    stdout_console().print(table)
    if result["left"]:
        stdout_console().print(f"{result['left']} step(s) left: {resume}", highlight=False, soft_wrap=True)
    else:
        stdout_console().print(
            f"calibrate on them: fusion-graph calibrate --labels {out} --target-cloud-fraction F",
            highlight=False,
            soft_wrap=True,
        )
