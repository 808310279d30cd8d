"""Trouble signals: is the turn going wrong? Error severity, no progress and progress events (pure).

The seed's four terms (``score.score_step``) say how far along and how heavy
a step is; these say whether the agent is stuck. Each is a pure function of the
turn's messages (after the user's message), so the ``route`` node, replay,
calibration and the plot measure them alike: ``sizing.turn.next_route`` measures
them when ``FusionContext.trouble_signals`` is on, and ``score.score_step``
weighs them (``score.TROUBLE_WEIGHTS``). ``turn_trouble`` folds a whole turn;
a route step instead extends the previous step's ``TurnFold`` (``fold_turn``)
over its new messages, so its cost does not grow with the turn.

- **Error severity** (0-1). Every tool result of the turn is classed
  (``result_kind``): an *error* is a ``ToolMessage`` with ``status="error"``
  (a tool that raised, or a call the batch rules refused) or a result whose text
  matches ``ERROR_PATTERNS``. Errors are counted by batch (the results of one AI
  message): each error of the latest batch weighs ``ERROR_UNIT`` and each batch
  further back halves it (``ERROR_DECAY``), so one fresh error is 0.5, errors on
  two steps in a row 0.75, two in one batch 1.0, and an error followed by a
  success 0.25. The sum is clipped to 1.
- **No progress** (0-1): the share of the last ``NO_PROGRESS_WINDOW`` tool calls
  of the turn whose name and canonical arguments (``score.call_key``) were already
  requested earlier in the turn. Counting inputs already seen, not runs of
  identical calls, catches cycles of any length: ``A B A B`` is 0.5 after two
  laps, and an 8-step cycle fills the window with repeats after its second lap.
- **Progress event** (``progress``): the latest batch holds a passing test run
  (``PASS_PATTERNS``, with no error pattern in the same result), a successful
  result while an earlier error of the turn was still unanswered by a success,
  or a successful call with an input new to the turn right after a batch of
  repeats. It releases the escalation latch (``rule.latch_rule``).

The patterns are few on purpose: a false "error" costs a cloud step, a missed
one only leaves the seed's score to decide.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import Literal

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage

from fusion_graph.routing.score import call_key

ResultKind = Literal["ok", "error", "pass"]
"""A tool result: an error, a passing test run, or any other (successful) result."""

#: Weight of one error result of the latest batch in the error severity (so one fresh error is 0.5).
ERROR_UNIT = 0.5
#: How much an error's weight keeps per batch of age (each batch back halves it).
ERROR_DECAY = 0.5
#: Tool calls the no-progress share looks back over: two laps of a 4-step cycle, or most of the
#: second lap of an 8-step one.
NO_PROGRESS_WINDOW = 8

#: Text that makes a tool result an error (besides ``status="error"``), each with what it catches.
ERROR_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # "Error: flight not available" (tau-bench tools), "ERROR: ..." (shells), LangChain's
    # "Error: ValueError(...) Please fix your mistakes." for a tool that raised.
    ("error prefix", re.compile(r"\A\s*(?:error|exception)\b", re.IGNORECASE)),
    # A Python traceback anywhere in the output.
    ("traceback", re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)),
    # A line that starts with an exception: "SyntaxError: invalid syntax", "json.JSONDecodeError: ...".
    ("exception line", re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): ", re.MULTILINE)),
    # A Python syntax error reported inside a line, as linters and edit guards print it:
    # "- E999 IndentationError: unexpected indent", "x.py:3:1: E999 SyntaxError: invalid syntax".
    ("syntax error", re.compile(r"(?:^|\s)(?:Syntax|Indentation|Tab)Error: ", re.MULTILINE)),
    # A non-zero exit: "exit code 2", "Exit status: 1", "exited with code 1", "non-zero exit status 1".
    (
        "non-zero exit",
        re.compile(r"\b(?:exit(?:ed with)?\s+(?:code|status)|non-zero exit status)\s*[:=]?\s*[1-9]", re.I),
    ),
    # Failing tests: pytest's "1 failed", "FAILED tests/...", unittest's "FAILED (failures=1)".
    ("failing tests", re.compile(r"\b\d+ failed\b|^FAILED\b", re.MULTILINE)),
)

#: Text of a passing test run (a progress event when no error pattern matches the same result).
PASS_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # pytest's "== 12 passed in 0.31s ==", jest's "Tests: 12 passed, 12 total".
    ("passed count", re.compile(r"\b\d+ passed\b")),
    # unittest: "Ran 12 tests in 0.004s" then "OK".
    ("unittest OK", re.compile(r"^Ran \d+ tests? in [\d.]+s\s+OK\b", re.MULTILINE)),
    # go test: "ok  example.com/pkg  0.012s", or "PASS" on its own line.
    ("go ok", re.compile(r"^(?:ok\s+\S+\s+[\d.]+s\b|PASS$)", re.MULTILINE)),
)


@lru_cache(maxsize=1024)
def text_kind(text: str) -> ResultKind:
    """How a result's text reads: ``error`` (``ERROR_PATTERNS``), ``pass`` (``PASS_PATTERNS``), or ``ok``.

    Remembered by text: a turn's results are classed once, not at every step.
    """
    if any(pattern.search(text) for _, pattern in ERROR_PATTERNS):
        return "error"
    if any(pattern.search(text) for _, pattern in PASS_PATTERNS):
        return "pass"
    return "ok"


def result_kind(message: ToolMessage) -> ResultKind:
    """A tool result's kind: ``status="error"`` is an error whatever it says, else ``text_kind``."""
    if message.status == "error":
        return "error"
    return text_kind(message.text)


@dataclass(frozen=True)
class TurnTrouble:
    """The trouble signals of the step about to run, measured on its turn's messages."""

    error_severity: float
    """0-1: error results of the turn, the latest batch's weighing most (module docstring)."""
    no_progress: float
    """0-1: the share of the last ``window`` calls already requested earlier in the turn."""
    progress: bool
    """The latest batch is a progress event (``progress_event``)."""
    errors: int = 0
    """Error results in the turn."""
    repeated: int = 0
    """Calls of the window already requested earlier in the turn."""
    window: int = 0
    """Calls in the window (at most ``NO_PROGRESS_WINDOW``)."""


@dataclass
class Batch:
    """One AI message's calls and their results, as the trouble signals read them."""

    keys: list[str] = field(default_factory=list)
    """``call_key`` of each (valid) call, in order."""
    new: list[bool] = field(default_factory=list)
    """For each call: its key was not requested earlier in the turn."""
    ids: list[str | None] = field(default_factory=list)
    """Each call's id, to find its result."""
    results: dict[str, ResultKind] = field(default_factory=dict)
    """The kind of each result, by ``tool_call_id`` (malformed calls' results included)."""

    @property
    def kinds(self) -> list[ResultKind]:
        """The kinds of the batch's results."""
        return list(self.results.values())

    def new_success(self) -> bool:
        """Whether a call with a new input came back without an error."""
        return any(
            fresh and call_id is not None and self.results.get(call_id, "error") != "error"
            for fresh, call_id in zip(self.new, self.ids, strict=True)
        )

    def copy(self) -> Batch:
        """A copy to add results to: a remembered batch is never changed."""
        return Batch(list(self.keys), list(self.new), list(self.ids), dict(self.results))


@dataclass(frozen=True)
class TurnFold:
    """What a turn's messages fold to, so a longer turn folds only its new messages (``fold_turn``).

    Every batch but the last is final (a result lands in the last batch only),
    so their error counts and the unanswered-error flag are carried as totals.
    Never changed once made: ``turn.turn_fold`` remembers folds across steps.
    """

    length: int
    """Messages folded."""
    batches: tuple[Batch, ...]
    seen: frozenset[str]
    """``call_key`` of every call of the turn."""
    errors: tuple[tuple[int, int], ...]
    """``(index, error results)`` of each final batch with errors, in order."""
    final_errors: int
    """Error results of the final batches."""
    unanswered: bool
    """An error of the final batches is still unanswered by a success (``progress_event``)."""


EMPTY_FOLD = TurnFold(0, (), frozenset(), (), 0, False)
"""The fold of no messages."""


def _still_unanswered(unanswered: bool, kinds: Sequence[ResultKind]) -> bool:
    """The unanswered-error flag after a batch with results ``kinds``."""
    return "error" in kinds or (unanswered and all(kind == "error" for kind in kinds))


def fold_turn(messages: Sequence[BaseMessage], known: TurnFold = EMPTY_FOLD) -> TurnFold:
    """``known`` extended over ``messages``, the turn's messages after those it folded.

    ``known`` is left as it was: only its last batch can gain results, and that one is copied.
    """
    batches = list(known.batches)
    seen, errors = known.seen, known.errors
    final_errors, unanswered = known.final_errors, known.unanswered
    adding: set[str] | None = None  # seen plus this fold's keys, made at the first new call
    own_last = False  # batches[-1] is this fold's, not a remembered one
    for message in messages:
        if isinstance(message, AIMessage):
            if batches:  # the last batch is final now
                kinds = batches[-1].kinds
                count = kinds.count("error")
                if count:
                    errors = (*errors, (len(batches) - 1, count))
                final_errors += count
                unanswered = _still_unanswered(unanswered, kinds)
            batch = Batch()
            for call in message.tool_calls:
                if adding is None:
                    adding = set(seen)
                key = call_key(call["name"], call["args"])
                batch.keys.append(key)
                batch.new.append(key not in adding)
                batch.ids.append(call.get("id"))
                adding.add(key)
            batches.append(batch)
            own_last = True
        elif isinstance(message, ToolMessage) and batches:
            if not own_last:
                batches[-1] = batches[-1].copy()
                own_last = True
            batches[-1].results[message.tool_call_id] = result_kind(message)
    return TurnFold(
        known.length + len(messages),
        tuple(batches),
        seen if adding is None else frozenset(adding),
        errors,
        final_errors,
        unanswered,
    )


def turn_batches(turn_messages: Sequence[BaseMessage]) -> list[Batch]:
    """The turn's batches in order: each AI message's calls, and the tool results that follow it."""
    return list(fold_turn(turn_messages).batches)


def no_progress_share(keys: Sequence[str], window: int = NO_PROGRESS_WINDOW) -> tuple[int, int]:
    """``(repeated, calls)``: of the last ``window`` keys, those seen earlier in the turn."""
    recent = list(keys[-window:]) if window > 0 else []
    seen = set(keys[: len(keys) - len(recent)])
    repeated = 0
    for key in recent:
        repeated += key in seen
        seen.add(key)
    return repeated, len(recent)


def _recent_repeats(batches: Sequence[Batch], window: int) -> tuple[int, int]:
    """``no_progress_share`` of the turn's keys, read off ``Batch.new`` from the end (no full pass).

    ``new`` already says whether a key was requested earlier in the turn.
    """
    repeated = calls = 0
    for batch in reversed(batches):
        for fresh in reversed(batch.new):
            if calls >= window:
                return repeated, calls
            calls += 1
            repeated += not fresh
        if calls >= window:
            break
    return repeated, calls


def _severity(aged: Iterable[tuple[int, int]]) -> float:
    """``error_severity`` from ``(age, errors)`` of the batches, youngest first.

    A batch without errors adds exactly 0.0, so leaving it out keeps the sum bit for bit;
    no term is negative, so a total that reached 1 stays clipped to 1.
    """
    total = 0.0
    for age, count in aged:
        total += ERROR_UNIT * ERROR_DECAY**age * count
        if total >= 1.0:
            break
    return min(total, 1.0)


def error_severity(batches: Sequence[Batch]) -> float:
    """0-1: each error ``ERROR_UNIT``, times ``ERROR_DECAY`` per batch of age (the last batch is age 0)."""
    return _severity((age, batch.kinds.count("error")) for age, batch in enumerate(reversed(batches)))


def _progress(latest: Batch, before: Batch | None, unanswered: bool) -> bool:
    """``progress_event`` of ``latest``, given the batch ``before`` it and the unanswered flag up to it."""
    kinds = latest.kinds
    if "pass" in kinds:
        return True
    if unanswered and any(kind != "error" for kind in kinds):
        return True
    looped = before is not None and bool(before.keys) and not any(before.new)
    return looped and latest.new_success()


def progress_event(batches: Sequence[Batch]) -> bool:
    """Whether the last batch is a progress event, the one thing that releases the escalation latch.

    It is one when it holds a passing test run (``PASS_PATTERNS``); when it holds
    a result without an error while an earlier error is unanswered (no later
    batch came back with a success); or when a call with an input new to the
    turn came back without an error right after a batch of repeated calls (the
    loop is broken). Each kind of trouble thus has its way out.
    """
    if not batches:
        return False
    *earlier, latest = batches
    unanswered = False  # an error no later batch has answered with a success yet
    for batch in earlier:
        unanswered = _still_unanswered(unanswered, batch.kinds)
    return _progress(latest, earlier[-1] if earlier else None, unanswered)


def fold_trouble(folded: TurnFold, window: int = NO_PROGRESS_WINDOW) -> TurnTrouble:
    """The trouble signals of a folded turn, from its last batch and carried totals (not every batch)."""
    batches = folded.batches
    if not batches:
        return TurnTrouble(error_severity=0.0, no_progress=0.0, progress=False)
    repeated, calls = _recent_repeats(batches, window) if window > 0 else (0, 0)
    latest = batches[-1]
    latest_errors = latest.kinds.count("error")
    last = len(batches) - 1
    aged = chain(((0, latest_errors),), ((last - index, count) for index, count in reversed(folded.errors)))
    return TurnTrouble(
        error_severity=round(_severity(aged), 4),
        no_progress=round(repeated / calls, 4) if calls else 0.0,
        progress=_progress(latest, batches[-2] if last else None, folded.unanswered),
        errors=folded.final_errors + latest_errors,
        repeated=repeated,
        window=calls,
    )


def turn_trouble(turn_messages: Sequence[BaseMessage], window: int = NO_PROGRESS_WINDOW) -> TurnTrouble:
    """The trouble signals of the step about to run on a turn whose messages (after the user's) are given.

    Folds the whole turn; ``turn.with_trouble`` extends the previous step's fold instead.
    """
    return fold_trouble(fold_turn(turn_messages), window)
