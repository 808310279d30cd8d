"""The live view of ``fusion-graph run``: one compact row per inference, readable at 80 columns.

It is fed by events (plain dicts), so a recorded stream renders the same table:

- ``fusion_route`` (the graph's custom stream): a ``decision`` before each
  inference (the row appears, running), an ``outcome`` after it (who answered,
  failed attempts, tokens, cost, the ``outcome``'s ``latency_s``), and ``compaction``
  notes. An event without a ``phase`` is an outcome.
- ``fusion_answer`` (made by ``run_task`` from the executor's state update):
  the tools the answer called and its ``finish_reason`` (``"length"``: cut at
  ``max_tokens``).
- ``fusion_tokens`` (made by ``run_task`` from ``stream_mode="messages"`` on a
  terminal): streamed chunks of the running inference, for the ticker.

The long routing reason is shown below the table for the last step only (all
steps with ``details``). Each inference is one row, a memory job's repair too,
so the rows and the per-provider counts after the turn agree; memory jobs of
an earlier turn that finished since (folded into this turn) are labelled as
such. The decision event's ``routed_leg`` is where the router sent a step, the
outcome's ``leg`` who answered: the view says "routed" and "answered by".
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from fusion_graph.cli.tables import add_number_columns, compact_table
from fusion_graph.routing.records import upgraded

if TYPE_CHECKING:
    from fusion_graph.routing.records import RouteRecord

ROUTE_EVENT = "fusion_route"  # the executor's event name (kept literal: no import of the node layer)
ANSWER_EVENT = "fusion_answer"
TOKENS_EVENT = "fusion_tokens"
#: Marks an answer cut at ``max_tokens`` in the tools column.
CUT = "(cut)"
CUT_NOTE = (
    f"{CUT}: the answer stopped at max_tokens (finish_reason 'length'); "
    "raise max_completion_tokens in --context"
)
#: Under a table with a fallover: how to read ``cloud 503 → local``.
LEG_NOTE = "leg: routed, then the failed attempt, → the leg that answered"
#: Under this many columns a fallover's leg is ``cloud→local`` and its failed attempt goes below the table.
WIDE = 100
#: Short labels of failed attempts by error class (an HTTP status in the message wins).
_ERROR_LABELS = {
    "rate_limited": "429",
    "timeout": "timeout",
    "connection": "down",
    "server_error": "5xx",
    "misconfigured": "auth",
    "malformed_response": "garbled",
    "context_overflow": "overflow",
}
_STATUS = re.compile(r"\b(?:Error code|status(?: code)?)[:= ]+([1-5]\d\d)\b", re.IGNORECASE)


def attempt_label(attempt: Mapping[str, Any]) -> str:
    """``"503"``, ``"timeout"``...: why one attempt failed, in a word."""
    found = _STATUS.search(str(attempt.get("message") or ""))
    if found:
        return found.group(1)
    kind = str(attempt.get("kind") or "")
    return _ERROR_LABELS.get(kind, kind or "failed")


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
    breakdown: Mapping[str, float] | None = None
    provider: str | None = None
    attempts: list[Mapping[str, Any]] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None
    latency_s: float | None = None
    started: float | None = None
    streamed: int = 0
    tools: list[str] | None = None
    truncated: bool = False
    done: bool = False
    failed: bool = False

    def failed_attempt(self) -> str | None:
        """``cloud 503``: the leg and failure of the first attempt that failed; ``None``: none did."""
        first = self.attempts[0] if self.attempts else None
        return None if first is None else f"{first.get('leg', self.routed_leg)} {attempt_label(first)}"

    def leg_text(self, *, compact: bool = False) -> str:
        """``local``, ``cloud 503 → local``, ``local …`` (running) or ``cloud ✗`` (nobody answered).

        ``compact`` (a narrow terminal): ``cloud→local``, one word that never wraps; the
        failed attempt is then said below the table (``StepTable.notes``).
        """
        if not self.done:
            return f"{self.routed_leg} …"
        failed = self.failed_attempt()
        tried = self.routed_leg if failed is None or compact else failed
        leg = self.leg or self.routed_leg
        if self.failed:
            return f"{tried}{'' if compact else ' '}✗"
        if failed is None and leg == self.routed_leg:
            return leg
        return f"{tried}→{leg}" if compact else f"{tried} → {leg}"


#: Short names of the score's terms (``routing.score.StepScore``), for the line under the table.
TERM_NAMES = {
    "context_pressure": "pressure",
    "turn_depth": "depth",
    "transient_notice": "notice",
    "tail_growth": "tail",
    "error_severity": "errors",
    "no_progress": "no progress",
}


def score_terms(breakdown: Mapping[str, float]) -> str:
    """``terms: pressure 0.9 + depth 3.1 + notice 0 + tail 15``: the points each term added to a score."""
    parts = (
        f"{TERM_NAMES.get(name, name)} {round(float(points), 1):g}" for name, points in breakdown.items()
    )
    return "terms: " + " + ".join(parts)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _tokens(value: int | None) -> str:
    if value is None:
        return "-"
    return str(value) if value < 10_000 else f"{value / 1000:.0f}k"


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 9.95 else f"{value:.0f}s"


def _cost(value: float | None) -> str:
    return "-" if value is None else f"${value:.6f}"


@dataclass
class StepTable:
    """The rows of a run, updated from events; ``render()`` draws them.

    Attributes:
        rows: By ``(turn, step, kind)``, in order of first event.
        details: Show every step's reason below the table, not only the last one's.
        clock: Monotonic seconds, for the running step's elapsed time.
        last: The row of the latest decision or outcome (its reason is shown).
        turn: The latest turn seen; rows of other turns show ``turn.step``.
        terms: Follow each reason shown with the score's terms (``score_terms``): how a score
            came about, for a first look at the dial (``demo``).
    """

    rows: dict[tuple[int, int, str], StepRow] = field(default_factory=dict)
    details: bool = False
    clock: Callable[[], float] = time.monotonic
    last: tuple[int, int, str] | None = None
    turn: int = 0
    terms: bool = False
    spinner: Spinner = field(default_factory=lambda: Spinner("dots"))
    """One spinner for the whole run: its frame follows the time since it was first drawn, so a
    spinner made afresh at each refresh would never turn."""

    def apply(self, event: Mapping[str, Any]) -> None:
        """Add or complete a row; events of other kinds are ignored."""
        name = event.get("event")
        if name == TOKENS_EVENT:
            self._tokens(event)
            return
        if name not in (ROUTE_EVENT, ANSWER_EVENT):
            return
        kind = str(event.get("kind", "step"))
        key = (int(event.get("turn", 0)), int(event.get("step", 0)), kind)
        row = self.rows.get(key)
        if row is not None and row.done and kind == "memory" and name == ROUTE_EVENT:
            # a job's repair (or a second job) at the same turn and step: an inference, a row of its own
            key = (key[0], key[1], f"memory#{sum(k[:2] == key[:2] for k in self.rows) + 1}")
            row = None
        if row is None:
            routed = str(event.get("routed_leg") or event.get("leg") or "?")
            row = self.rows[key] = StepRow(key[0], key[1], kind, routed_leg=routed, started=self.clock())
        if name == ANSWER_EVENT:
            row.tools = [str(tool) for tool in event.get("tools") or ()]
            row.truncated = event.get("finish_reason") == "length"
            return
        if kind != "memory":
            self.turn = max(self.turn, key[0])
        self.last = key
        row.score = event.get("score", row.score)
        row.threshold = event.get("threshold", row.threshold)
        row.reason = str(event.get("reason") or row.reason)
        row.breakdown = event.get("breakdown", row.breakdown)
        if event.get("phase", "outcome") == "outcome":
            self._outcome(row, event)

    def _outcome(self, row: StepRow, event: Mapping[str, Any]) -> None:
        row.done = True
        row.leg = event.get("leg")
        row.provider = event.get("provider")
        row.attempts = list(event.get("attempts") or ())
        row.failed = row.provider is None and bool(row.attempts)
        row.prompt_tokens = event.get("prompt_tokens")
        row.cached_tokens = event.get("cached_tokens")
        row.completion_tokens = event.get("completion_tokens")
        row.cost_usd = event.get("cost_usd")
        latency = (
            upgraded(cast("RouteRecord", event)).get("outcome", {}).get("latency_s")
        )  # a recorded stream
        if latency is None and row.started is not None:
            latency = self.clock() - row.started
        row.latency_s = latency

    def _tokens(self, event: Mapping[str, Any]) -> None:
        key = (int(event.get("turn", self.turn)), int(event.get("step", 0)), str(event.get("kind", "step")))
        row = self.rows.get(key)
        if row is not None and not row.done:
            row.streamed += int(event.get("chunks", 1))

    @property
    def running(self) -> StepRow | None:
        """The inference in flight, if any."""
        return next((row for row in reversed(self.rows.values()) if not row.done), None)

    def _step(self, row: StepRow) -> str:
        return str(row.step) if row.turn == self.turn else f"{row.turn}.{row.step}"

    def _time(self, row: StepRow) -> str:
        if row.done:
            return "-" if row.latency_s is None else _seconds(row.latency_s)
        return _seconds(self.clock() - (row.started or self.clock()))

    def _tools(self, row: StepRow) -> str:
        if not row.done:
            return f"running, {row.streamed} tok" if row.streamed else "running"
        counts = {name: (row.tools or []).count(name) for name in row.tools or ()}
        names = ", ".join(name if n == 1 else f"{name} ×{n}" for name, n in counts.items())
        if row.truncated:
            return f"{CUT} {names}".rstrip()
        return names or "-"

    def table(self, width: int | None = None) -> Table:
        """The compact table: step, kind, leg, score/T, tokens (prompt/cached), time, tools, cost.

        Args:
            width: Columns available; under ``WIDE`` a fallover's leg is ``cloud→local`` (its
                failed attempt is said below the table) so no column wraps but the tools.
        """
        compact = width is not None and width < WIDE
        table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
        table.add_column("step", justify="right", no_wrap=True)
        table.add_column("kind", no_wrap=True)
        table.add_column("leg", no_wrap=True)
        table.add_column("score", justify="right", no_wrap=True)
        table.add_column("tokens", justify="right", no_wrap=True)
        table.add_column("time", justify="right", no_wrap=True)
        table.add_column("tools", overflow="fold", min_width=15)
        table.add_column("cost", justify="right", no_wrap=True)
        for row in self.rows.values():
            leg = row.leg or row.routed_leg
            style = "red" if row.failed else "magenta" if leg == "cloud" else "cyan"
            score = _num(row.score) if row.threshold is None else f"{_num(row.score)}/{_num(row.threshold)}"
            table.add_row(
                self._step(row),
                row.kind,
                Text(row.leg_text(compact=compact), style=style),
                score,
                f"{_tokens(row.prompt_tokens)}/{_tokens(row.cached_tokens)}",
                self._time(row),
                self._tools(row),
                _cost(row.cost_usd),
            )
        return table

    def _folded(self) -> str | None:
        """The legend of memory rows of earlier turns: ``0.2: a memory job of turn 0 ...``."""
        rows = [row for row in self.rows.values() if row.kind == "memory" and row.turn < self.turn]
        labels = list(dict.fromkeys(self._step(row) for row in rows))
        if not labels:
            return None
        turns = ", ".join(str(t) for t in dict.fromkeys(row.turn for row in rows))
        return (
            f"{', '.join(labels)} memory: of turn {turns}, finished after it; folded into this turn "
            "and counted in its totals"
        )

    def notes(self, *, compact: bool = False) -> list[RenderableType]:
        """The reasons (last step, or all with ``details``), the running ticker and the legends.

        ``compact``: the table showed ``cloud→local``, so the failed attempts are listed here.
        """
        lines: list[RenderableType] = []
        shown = list(self.rows.values()) if self.details else [self.rows[self.last]] if self.last else []
        for row in shown:
            kind = "" if row.kind == "step" else f" {row.kind}"
            answered = (
                f" (answered by {row.provider})" if row.provider else " (no answer)" if row.done else ""
            )
            text = f"step {self._step(row)}{kind} routed {row.routed_leg}: {row.reason or '-'}{answered}"
            if self.terms and row.breakdown:
                text += f"\n  {score_terms(row.breakdown)}"
            lines.append(Text(text, style="dim"))
        running = self.running
        if running is not None:
            kind = "" if running.kind == "step" else f" {running.kind}"
            text = f"step {self._step(running)}{kind} routed {running.routed_leg}: {self._time(running)}"
            if running.streamed:
                text += f", {running.streamed} tokens streamed"
            self.spinner.update(text=text)
            lines.append(self.spinner)
        folded = self._folded()
        if folded is not None:
            lines.append(Text(folded, style="dim"))
        fallovers = [row for row in self.rows.values() if row.done and row.attempts]
        if compact and fallovers:
            tried = ", ".join(f"step {self._step(row)} {row.failed_attempt()}" for row in fallovers)
            how = " (leg: routed→answered)" if any(not row.failed for row in fallovers) else ""
            lines.append(Text(f"failed attempts: {tried}{how}", style="dim"))
        elif any(not row.failed for row in fallovers):
            lines.append(Text(LEG_NOTE, style="dim"))
        if any(row.truncated for row in self.rows.values()):
            lines.append(Text(CUT_NOTE, style="yellow"))
        return lines

    def render(self) -> RenderableType:
        """The table and its notes: a renderable drawn afresh at each refresh of a ``Live`` display."""
        return self

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """Draw the current rows at the console's width (the ticker's elapsed time moves); none: nothing."""
        if self.rows:
            yield Group(self.table(options.max_width), *self.notes(compact=options.max_width < WIDE))


# -- after the turn -------------------------------------------------------------------


def counted(records: Sequence[Mapping[str, Any]]) -> str:
    """What a per-provider table counts: ``3 inferences, one per row above (1 plan, 2 memory)``."""
    kinds = Counter(str(r["kind"]) for r in records)
    parts = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    total = len(records)
    return f"{total} inference{'' if total == 1 else 's'}, one per row above" + (
        f" ({parts})" if parts else ""
    )


def provider_summary(totals: Mapping[str, Any], records: Sequence[Mapping[str, Any]] | None = None) -> Table:
    """Per answering provider, then per answering leg and in total: inferences, tokens and cost.

    Args:
        totals: ``RunResult.totals``.
        records: The records counted (``RunResult.route_log``), to say in the title what is counted.
    """
    title = "answered, per provider" + (f": {counted(records)}" if records is not None else "")
    table = compact_table(title)
    table.add_column("provider", overflow="fold")
    add_number_columns(table, "inferences", "prompt", "cached", "completion", "cost")
    rows = [*sorted(totals["by_provider"].items()), ("answered by local", totals["local"])]
    for name, leg in [*rows, ("answered by cloud", totals["cloud"]), ("total", totals["total"])]:
        cost = _cost(leg["cost_usd"]) + (f"\n+{leg['unpriced']} unpriced" if leg["unpriced"] else "")
        table.add_row(
            Text(name, style="bold" if name == "total" else ""),
            str(leg["inferences"]),
            str(leg["prompt_tokens"]),
            str(leg["cached_tokens"]),
            str(leg["completion_tokens"]),
            cost,
        )
    return table


def print_result(console: Console, result: Any) -> None:
    """After the live table: the answer (flagged when cut at max_tokens), costs and cloud shares.

    Args:
        console: Where to print.
        result: A ``cli.run.RunResult``.
    """
    from fusion_graph.cli.common import CloudShare

    console.print()
    console.print(Text("answer", style="bold"))
    console.print(
        result.answer if result.answer is not None else "(no answer)", highlight=False, markup=False
    )
    if result.truncated:
        console.print(Text(f"{CUT} this answer stopped at max_tokens: it may be incomplete", style="yellow"))
    console.print()
    console.print(provider_summary(result.totals, result.route_log))
    console.print(CloudShare.of(result.route_log).line(), highlight=False)
