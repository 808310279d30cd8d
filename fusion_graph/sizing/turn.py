"""The turn in progress: where it stands in graph state, what its next step's prompt weighs, where it goes.

Pure helpers the nodes, the edges and replay share: read the batch in
progress, gather the next step's routing signals, and hand them to the routing
rule (``fusion_graph.routing.rule``). The signals need the prompt's size, so
the token counts live here too, with the memo that keeps both cheap:

- **Token counts.** One estimator is used everywhere (score, fit checks,
  benchmarks, replay): by default ``approximate_tokens``, a character-class
  estimate of what a BPE tokenizer and a chat template make of each message;
  any ``Callable[[Sequence[BaseMessage]], int]`` (a real tokenizer, say) plugs
  in instead (``TokenCounter``).
- **Anchored estimates.** A character estimate of the whole history drifts with
  the tokenizer, the chat template and the tool schemas. Each leg's server
  reports the exact ``prompt_tokens`` of every request it answers, so the
  estimate for the next request on that leg is that report (a ``PromptAnchor``
  in graph state) plus an estimate of only the messages appended since
  (``leg_estimate``). Without an anchor (a thread's first request on a leg, or
  after compaction), the graph asks llama-server to render and tokenize the
  prompt (``providers.llama_server.count_prompt_tokens``) or, for other servers,
  estimates the whole prompt with its tool schemas (``prompt_estimate``). The
  I/O is the step's ``Sizer`` (``fusion_graph.nodes.step``).
- **The history memo** (``HistoryMemo``). A thread's history grows by
  appending, and each step asks the same questions (token sums, where the turn
  starts, which calls were made) of a list that extends the previous step's.
  The memo keeps the last few histories (by the identity of their first
  message) with what was computed for them, so a step extends a remembered
  value over its new messages instead of folding the whole history again.
  Messages are taken as immutable, as LangGraph treats them: a changed message
  is a new object, so the history no longer matches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from fusion_graph.context import FusionContext
from fusion_graph.prompts import MEMORY_MESSAGE_NAME
from fusion_graph.routing.records import RouteRecord
from fusion_graph.routing.rule import Pace, conversation_budget, decide_leg
from fusion_graph.routing.score import RouteDecision, StepSignals, TroubleSignals, score_step
from fusion_graph.routing.trouble import EMPTY_FOLD, TurnFold, fold_trouble, fold_turn
from fusion_graph.state import PromptAnchor, State, StepTally

V = TypeVar("V")


class HistoryMemo(Generic[V]):
    """The values computed for the last ``limit`` histories seen; thread-safe."""

    def __init__(self, limit: int = 16) -> None:
        """Keep at most ``limit`` histories."""
        self._limit = limit
        self._known: OrderedDict[int, tuple[list[BaseMessage], V]] = OrderedDict()
        self._lock = threading.Lock()

    def find(self, items: list[BaseMessage]) -> tuple[int, V] | None:
        """``(n, value)``: a remembered history agrees with ``items`` on its first ``n`` messages.

        ``n`` is the shorter of the two lengths; the value is what was stored for
        the remembered history (which may be longer than ``items``).
        """
        if not items:
            return None
        with self._lock:
            known = self._known.get(id(items[0]))
            if known is None or known[0][0] is not items[0]:
                return None
            seen, value = known
            shared = min(len(seen), len(items))
            if seen[:shared] != items[:shared]:  # the same (or equal) messages, or not this history
                return None
            self._known.move_to_end(id(items[0]))
            return shared, value

    def store(self, items: Sequence[BaseMessage], value: V) -> None:
        """Remember ``value`` for ``items`` (a copy of the list: the caller's may grow)."""
        if not items:
            return
        with self._lock:
            self._known[id(items[0])] = (list(items), value)
            self._known.move_to_end(id(items[0]))
            if len(self._known) > self._limit:
                self._known.popitem(last=False)


TokenCounter = Callable[[Sequence[BaseMessage]], int]


#: ``response_metadata`` key of a tool result cut to ``max_tool_output_tokens`` (``{"tokens", "cut"}``).
CUT_KEY = "fusion_cut"


#: Tokens per character class, fitted by least squares on every message of the shared traces and
#: on this package's own sources as ``read_file`` shows them, against the Qwen2 and Llama-3 BPE
#: vocabularies (what llama-server counts): per word (a run of ASCII letters), per letter, per
#: digit, per ASCII punctuation mark, per non-ASCII character and per whitespace run (a newline,
#: a tab or two or more spaces: indentation). Code and JSON have more punctuation, digits and
#: indentation per character than prose, which is why a flat 4 characters per token is 15-40 %
#: low on tool output.
TOKENS_PER_WORD = 0.405


TOKENS_PER_LETTER = 0.136


TOKENS_PER_DIGIT = 0.733


TOKENS_PER_PUNCT = 0.671


TOKENS_PER_NON_ASCII = 2.594


TOKENS_PER_SPACE_RUN = 0.956


#: What a chat template adds around each message (``<|im_start|>role\n ... <|im_end|>\n``).
TOKENS_PER_MESSAGE = 5


#: The generation prompt after the last message (``<|im_start|>assistant\n``).
TOKENS_PER_PROMPT = 3


#: A chat template's preamble around bound tool schemas ("# Tools ... <tools></tools> ...").
TOKENS_PER_TOOL_BLOCK = 40


#: Fixed cost of an image block (langchain-core's default: OpenAI's low-resolution cost).
TOKENS_PER_IMAGE = 85


#: Longer texts are estimated on their first and last ``_SAMPLE_CHARS // 2`` characters, scaled.
_SAMPLE_CHARS = 262_144


_WORD = re.compile(r"[A-Za-z]+")


_DIGIT = re.compile(r"[0-9]")


_PUNCT = re.compile(r"[!-/:-@\[-`{-~]")


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


_SPACE_RUN = re.compile(r"\s{2,}|[\t\n\r]")


def text_tokens(text: str) -> float:
    """Estimated tokens of ``text`` alone (no template), from its character classes."""
    if len(text) > _SAMPLE_CHARS:
        half = _SAMPLE_CHARS // 2
        return text_tokens(text[:half] + text[-half:]) * len(text) / _SAMPLE_CHARS
    if not text:  # every class counts 0 (an answer that only calls tools)
        return 0.0
    words = _WORD.findall(text)
    return (
        TOKENS_PER_WORD * len(words)
        + TOKENS_PER_LETTER * sum(map(len, words))
        + TOKENS_PER_DIGIT * len(_DIGIT.findall(text))
        + TOKENS_PER_PUNCT * len(_PUNCT.findall(text))
        + TOKENS_PER_NON_ASCII * (0 if text.isascii() else len(_NON_ASCII.findall(text)))
        + TOKENS_PER_SPACE_RUN * len(_SPACE_RUN.findall(text))
    )


def _content_tokens(content: str | list[str | dict[str, Any]]) -> float:
    if isinstance(content, str):
        return text_tokens(content)
    total = 0.0
    for block in content:
        if isinstance(block, str):
            total += text_tokens(block)
        elif block.get("type") in ("image", "image_url"):
            total += TOKENS_PER_IMAGE
        elif block.get("type") == "text":
            total += text_tokens(str(block.get("text", "")))
        else:
            total += text_tokens(repr(block))
    return total


def message_tokens(message: BaseMessage) -> int:
    """Estimated tokens of one message as a chat template renders it (content, tool calls, framing)."""
    total = _content_tokens(message.content) + TOKENS_PER_MESSAGE
    if isinstance(message, AIMessage) and message.tool_calls:
        calls = [{"name": c["name"], "arguments": json.dumps(c["args"])} for c in message.tool_calls]
        total += text_tokens(json.dumps(calls))
    return int(total + 0.5)


#: Per-message estimates of messages already seen, so a step counts only what is new.
_SEEN: OrderedDict[tuple[str, str, int, int], int] = OrderedDict()


_SEEN_LIMIT = 100_000


def _message_key(message: BaseMessage) -> tuple[str, str, int, int] | None:
    if not message.id:
        return None
    calls = len(message.tool_calls) if isinstance(message, AIMessage) else 0
    return (message.id, message.type, len(message.content), calls)


def _count(message: BaseMessage) -> int:
    """``message_tokens`` of one message, remembered by id (see ``_SEEN``)."""
    key = _message_key(message)
    count = _SEEN.get(key) if key is not None else None
    if count is None:
        count = message_tokens(message)
        if key is not None:
            _SEEN[key] = count
            if len(_SEEN) > _SEEN_LIMIT:
                _SEEN.popitem(last=False)
    return count


#: Lists already summed, by the identity of their first message: the messages and the estimate
#: of each prefix (``sums[i]`` covers the first ``i``). A history that starts with a remembered
#: list (the same message objects, or equal ones) is summed from there, so a step costs its new
#: messages plus one identity comparison of the history (in C), not a walk over it.
_PREFIXES: HistoryMemo[list[int]] = HistoryMemo()


def _running_sums(messages: Sequence[BaseMessage], start: int = 0) -> list[int]:
    sums, total = [], start
    for message in messages:
        total += _count(message)
        sums.append(total)
    return sums


def approximate_tokens(messages: Sequence[BaseMessage]) -> int:
    """The default estimator: ``message_tokens`` summed over ``messages``.

    The estimate adds up message by message, so each message (by id) is
    counted once and remembered, and so is the running sum of a history
    (``_PREFIXES``): a step costs the new messages, not the history. Messages
    are taken as immutable, as LangGraph treats them (a change is a new message).
    """
    if not messages:
        return 0
    items = messages if isinstance(messages, list) else list(messages)
    known = _PREFIXES.find(items)
    if known is not None:
        shared, sums = known  # sums[i]: the first i messages
        if shared == len(items):
            return sums[shared]
        if shared == len(sums) - 1:  # items extends the remembered history
            tail = _running_sums(items[shared:], sums[-1])
            _PREFIXES.store(items, sums + tail)
            return tail[-1]
    sums = [0, *_running_sums(items)]
    _PREFIXES.store(items, sums)
    return sums[-1]


#: Each tool's schema and its canonical JSON, by tool identity (the tool is kept, so its id stays its
#: own): converting a tool costs more than a step's whole estimate, and every graph of an app binds
#: the same tool objects. Read-only: callers only send or serialise them.
_SCHEMAS: dict[int, tuple[object, dict[str, Any], str]] = {}


def _schema(tool: BaseTool | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``tool``'s OpenAI-style schema and that schema as canonical JSON (sorted keys)."""
    if isinstance(tool, dict):  # a plain schema may be changed in place: converted each time
        schema = convert_to_openai_tool(tool)
        return schema, json.dumps(schema, sort_keys=True)
    known = _SCHEMAS.get(id(tool))
    if known is not None and known[0] is tool:
        return known[1], known[2]
    schema = convert_to_openai_tool(tool)
    canonical = json.dumps(schema, sort_keys=True)
    if len(_SCHEMAS) > 256:
        _SCHEMAS.clear()
    _SCHEMAS[id(tool)] = (tool, schema, canonical)
    return schema, canonical


def tool_schemas(tools: Sequence[BaseTool | dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the OpenAI-style schemas a chat template renders (shared: do not change them)."""
    return [_schema(tool)[0] for tool in tools]


@functools.lru_cache(maxsize=64)
def _schema_tokens(rendered: tuple[str, ...]) -> int:
    if not rendered:
        return 0
    return int(TOKENS_PER_TOOL_BLOCK + sum(text_tokens(text) for text in rendered) + 0.5)


#: Tool-schema estimates by tool identity: a graph binds the same tools at every step.
_TOOL_TOKENS: dict[tuple[int, ...], tuple[tuple[object, ...], int]] = {}


def tool_tokens(tools: Sequence[BaseTool | dict[str, Any]]) -> int:
    """Estimated tokens of bound tool schemas in the prompt (schemas plus the template's preamble)."""
    key = tuple(id(tool) for tool in tools)
    cached = _TOOL_TOKENS.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], tools, strict=True)):
        return cached[1]
    count = _schema_tokens(tuple(json.dumps(schema) for schema in tool_schemas(tools)))
    if len(_TOOL_TOKENS) > 256:
        _TOOL_TOKENS.clear()
    _TOOL_TOKENS[key] = (tuple(tools), count)  # the tools are kept, so their ids stay theirs
    return count


def build_prompt(system_prompt: str, messages: Sequence[BaseMessage]) -> list[BaseMessage]:
    """The exact message list a step sends: the system prompt, then the history."""
    if not system_prompt:
        return list(messages)
    return [_system_message(system_prompt), *messages]


@functools.lru_cache(maxsize=64)
def _system_message(system_prompt: str) -> SystemMessage:
    """The system prompt as a message, made once per prompt (every step of a thread sends it)."""
    return SystemMessage(system_prompt)


def prompt_estimate(
    system_prompt: str,
    messages: Sequence[BaseMessage],
    tools: Sequence[BaseTool | dict[str, Any]] = (),
    count_tokens: TokenCounter = approximate_tokens,
) -> int:
    """Estimated tokens of the whole prompt a step sends: system prompt, history, tool schemas.

    With no server report to anchor on, this is the estimate (``leg_estimate``).
    """
    tool_part = tool_tokens(tools) if tools else 0
    if count_tokens is approximate_tokens:
        body = system_tokens(system_prompt) + approximate_tokens(messages) + TOKENS_PER_PROMPT
    else:
        body = count_tokens(build_prompt(system_prompt, messages))
    return body + tool_part


@functools.lru_cache(maxsize=64)
def system_tokens(system_prompt: str) -> int:
    """Estimated tokens of the system prompt as a message (cached: it is the same every step)."""
    return approximate_tokens([SystemMessage(system_prompt)]) if system_prompt else 0


Basis = Literal["anchored", "server", "approximate"]


@dataclass(frozen=True)
class Estimate:
    """A step's prompt on one leg, and what the number rests on.

    ``basis``: ``anchored`` (the leg's last report plus the appended messages),
    ``server`` (llama-server tokenized this very prompt) or ``approximate``.
    """

    tokens: int
    basis: Basis
    appended: int = field(default=0, compare=False)
    """Estimated tokens appended since the anchor (``anchored`` only): what the estimator guessed."""


def fingerprint(system_prompt: str, tools: Sequence[BaseTool | dict[str, Any]]) -> str:
    """What a request carries besides the history: the system prompt and the tool schemas."""
    digest = hashlib.sha256(system_prompt.encode())
    for tool in tools:
        digest.update(_schema(tool)[1].encode())
    return digest.hexdigest()[:16]


def anchor_holds(anchor: PromptAnchor | None, messages: Sequence[BaseMessage], key: str) -> bool:
    """Whether ``anchor`` still describes a prefix of ``messages`` sent with the same extras."""
    if anchor is None or anchor["fingerprint"] != key:
        return False
    count = anchor["messages"]
    if count < 1 or count > len(messages):
        return False
    return messages[count - 1].id == anchor["last_id"]


def leg_estimate(
    messages: Sequence[BaseMessage],
    *,
    system_prompt: str,
    tools: Sequence[BaseTool | dict[str, Any]],
    anchor: PromptAnchor | None,
    key: str,
    count_tokens: TokenCounter = approximate_tokens,
) -> Estimate:
    """The prompt of a step on one leg: anchored when the anchor holds, else approximated."""
    if anchor is not None and anchor_holds(anchor, messages, key):
        appended = messages[anchor["messages"] :]
        added = count_tokens(appended) if appended else 0
        return Estimate(anchor["prompt_tokens"] + added, "anchored", added)
    return Estimate(prompt_estimate(system_prompt, messages, tools, count_tokens), "approximate")


def new_anchor(
    *, prompt_tokens: int | None, messages: Sequence[BaseMessage], key: str, provider: str
) -> PromptAnchor | None:
    """The anchor a server's report leaves (``None`` when it reported nothing to anchor on)."""
    if not prompt_tokens or not messages:
        return None
    return PromptAnchor(
        prompt_tokens=prompt_tokens,
        messages=len(messages),
        last_id=messages[-1].id,
        fingerprint=key,
        provider=provider,
    )


def relative_error(estimate: int, reported: int | None) -> float | None:
    """``(estimate - reported) / reported``, or ``None`` without a report."""
    if not reported:
        return None
    return (estimate - reported) / reported


def _is_turn_start(message: BaseMessage) -> bool:
    return isinstance(message, HumanMessage) and message.name != MEMORY_MESSAGE_NAME


def _scan_start(messages: Sequence[BaseMessage], stop: int = -1) -> int | None:
    """Index of the last turn-start message after ``stop`` (``None``: none there)."""
    for index in range(len(messages) - 1, stop, -1):
        if _is_turn_start(messages[index]):
            return index
    return None


#: Histories whose turn start was found, by the identity of their first message: the messages
#: and the index. A history that extends a remembered one (the same message objects, or equal
#: ones) is searched only past it; a step does not walk its turn back to the user's message.
_STARTS: HistoryMemo[int] = HistoryMemo()


def turn_start(messages: Sequence[BaseMessage]) -> int:
    """Index of this turn's user message: the last ``HumanMessage`` (0 when none).

    The message that carries recalled memories is part of the turn, not its start.
    """
    if not messages:
        return 0
    items = messages if isinstance(messages, list) else list(messages)
    known = _STARTS.find(items)
    if known is not None:
        shared, start = known
        if shared < len(items):  # items extends the remembered history: search only what is new
            later = _scan_start(items, shared - 1)
            start = start if later is None else later
            _STARTS.store(items, start)
            return start
        if start < shared:
            return start
    start = _scan_start(items) or 0
    _STARTS.store(items, start)
    return start


def turn_number(last_turn: int | None, messages: Sequence[BaseMessage]) -> int:
    """The number of the turn a plan starts: the next one, or the last one again when it was cut short.

    A turn cut short after its plan answered (an exception or a kill mid-turn)
    leaves the history ending in its tool calls or their results, not in a
    reply. Continuing the thread retries that turn, so it keeps its number: its
    records share it and ``report`` counts the turn once. A plan no provider
    answered wrote no number (``last_turn`` is still the turn before), so the
    next number is already the retried turn's.

    Args:
        last_turn: ``State.turn``: the number the last answered plan wrote (``None``: no turn yet).
        messages: The history with this turn's new user message at its end.
    """
    if last_turn is None:
        return 0
    start = turn_start(messages)
    before = messages[start - 1] if 0 < start < len(messages) else None
    cut_short = isinstance(before, ToolMessage) or (
        isinstance(before, AIMessage) and bool(before.tool_calls or before.invalid_tool_calls)
    )
    return last_turn if cut_short else last_turn + 1


def last_ai(messages: Sequence[BaseMessage]) -> AIMessage | None:
    """The last message when it is an AI message."""
    if messages and isinstance(messages[-1], AIMessage):
        return messages[-1]
    return None


def _batch_index(messages: Sequence[BaseMessage]) -> int | None:
    """Index of the last AI message after the turn's start, found walking back from the end."""
    for index in range(len(messages) - 1, 0, -1):
        message = messages[index]
        if isinstance(message, AIMessage):
            return index
        if _is_turn_start(message):
            return None
    return None


def last_batch(messages: Sequence[BaseMessage]) -> AIMessage | None:
    """The AI message whose tool batch is in progress: the last AI message of the turn."""
    index = _batch_index(messages)
    return None if index is None else messages[index]  # type: ignore[return-value]


def pending_calls(messages: Sequence[BaseMessage]) -> list[ToolCall]:
    """Calls of the batch in progress that have no tool result yet, in batch order."""
    index = _batch_index(messages)
    if index is None:
        return []
    batch = messages[index]
    assert isinstance(batch, AIMessage)
    answered = {m.tool_call_id for m in messages[index + 1 :] if isinstance(m, ToolMessage)}
    return [call for call in batch.tool_calls if call["id"] not in answered]


def wants_tools(message: AIMessage | None) -> bool:
    """Whether an answer carries tool calls (valid or malformed) that need a tool step."""
    return message is not None and bool(message.tool_calls or message.invalid_tool_calls)


def next_step(state: State) -> int:
    """Index of the inference about to run."""
    return state.get("step", 0) + 1


def step_tally(route_log: Sequence[RouteRecord], known: StepTally | None = None) -> StepTally:
    """How many continuation steps ``route_log`` holds (``kind == "step"``), and how many went to cloud.

    A step counts for cloud by ``routed_leg``: a cloud step that fell over to
    local still used its share, so an outage is not followed by a burst of cloud
    steps. ``known`` is an earlier tally of the same log (``State.step_tally``):
    the log only grows, so only the records after the ones it covers are counted;
    one that covers more records than the log holds is ignored.
    """
    start, steps, cloud = 0, 0, 0
    if known is not None and known["records"] <= len(route_log):
        start, steps, cloud = known["records"], known["steps"], known["cloud"]
    for index in range(start, len(route_log)):
        record = route_log[index]
        if record["kind"] == "step":
            steps += 1
            cloud += record["routed_leg"] == "cloud"
    return StepTally(records=len(route_log), steps=steps, cloud=cloud)


def pace_of(state: State, context: FusionContext) -> Pace | None:
    """The paced dial's tally of the thread, read from its route log (``None`` when not paced).

    It counts the continuation steps the router sent (``kind == "step"``) and
    those it sent to cloud by ``routed_leg`` (``step_tally``), from the tally the
    ``route`` node kept in ``state["step_tally"]`` on. Replay rebuilds the route
    log, so it counts the same records.
    """
    if context.pace_slack is None:
        return None
    tally = step_tally(state.get("route_log", []), state.get("step_tally"))
    return Pace(context.pace_slack, tally["steps"], tally["cloud"])


def output_cut(messages: Sequence[BaseMessage]) -> bool:
    """Whether a tool result of the batch in progress was cut to ``max_tool_output_tokens``."""
    index = _batch_index(messages)
    if index is None:
        return False
    return any(isinstance(m, ToolMessage) and CUT_KEY in m.response_metadata for m in messages[index + 1 :])


def step_signals(
    *,
    system_prompt: str,
    messages: Sequence[BaseMessage],
    step: int,
    max_steps: int,
    conversation_max_tokens: int,
    notice: bool,
    count_tokens: TokenCounter = approximate_tokens,
    tools: Sequence[BaseTool | dict[str, Any]] = (),
    prompt_tokens: int | None = None,
) -> StepSignals:
    """Measure the signals of the step about to run on ``messages``.

    The stable prefix is the system prompt, earlier turns and this turn's user
    message; tool output is every tool message after it. ``prompt_tokens`` is
    the caller's better count of the whole prompt (anchored on a server's
    report); without it the prompt is estimated, tool schemas included.
    """
    start = turn_start(messages)
    tool_output = [m for m in messages[start + 1 :] if isinstance(m, ToolMessage)]
    if count_tokens is approximate_tokens:
        # The default estimate adds up per message: one pass gives all three counts.
        stable_tokens = system_tokens(system_prompt) + approximate_tokens(messages[: start + 1])
        output_tokens = approximate_tokens(tool_output)
    else:
        stable_tokens = count_tokens(build_prompt(system_prompt, messages[: start + 1]))
        output_tokens = count_tokens(tool_output) if tool_output else 0
    if prompt_tokens is None:
        prompt_tokens = prompt_estimate(system_prompt, messages, tools, count_tokens)
    return StepSignals(
        prompt_tokens=prompt_tokens,
        conversation_max_tokens=conversation_max_tokens,
        step=step,
        max_steps=max_steps,
        transient_notice=notice,
        tool_output_tokens=output_tokens,
        stable_prefix_tokens=stable_tokens,
    )


#: Turns already folded for the trouble signals, by the identity of their first message (as
#: ``nodes.tools.prior_call_counts``): a step folds only the messages since the previous one.
_FOLDS: HistoryMemo[TurnFold] = HistoryMemo()


def turn_fold(turn_messages: Sequence[BaseMessage]) -> TurnFold:
    """``trouble.fold_turn`` of a turn's messages, extending a remembered fold of their prefix."""
    items = turn_messages if isinstance(turn_messages, list) else list(turn_messages)
    known = _FOLDS.find(items)
    if known is not None:
        shared, folded = known
        if folded.length == shared:  # items extends (or is) the remembered turn: fold only what is new
            if shared < len(items):
                folded = fold_turn(items[shared:], folded)
                _FOLDS.store(items, folded)
            return folded
    folded = fold_turn(items, EMPTY_FOLD)
    _FOLDS.store(items, folded)
    return folded


def with_trouble(
    signals: StepSignals, messages: Sequence[BaseMessage], latched: int | None
) -> TroubleSignals:
    """``signals`` with the trouble signals of the turn in ``messages`` and the latch the step finds.

    The turn is the messages after its user's (``turn_start``); ``trouble.fold_trouble``
    measures them, folded incrementally (``turn_fold``) so a step costs its new messages.
    """
    trouble = fold_trouble(turn_fold(messages[turn_start(messages) + 1 :]))
    return TroubleSignals(
        **vars(signals),
        error_severity=trouble.error_severity,
        no_progress=trouble.no_progress,
        progress=trouble.progress,
        latched=latched,
    )


def next_route(
    state: State,
    context: FusionContext,
    count_tokens: TokenCounter = approximate_tokens,
    *,
    plan: bool = False,
    prompt_tokens: int | None = None,
    budget: int | None = None,
    tools: Sequence[BaseTool] = (),
) -> tuple[RouteDecision, StepSignals]:
    """Measure, score and route the step about to run on ``state``: the one routing function.

    ``plan``: the turn's step 0 (cloud whenever ``cloud_share > 0`` in fusion; no
    notice, no current leg). Otherwise the next continuation step, whose notice
    term fires for a trimmed batch, the loop detector, or a tool result cut to
    ``max_tool_output_tokens``, and whose current leg (hysteresis) is the last
    step's. The ``route`` node, the plan step and replay call this.

    ``prompt_tokens`` is the graph's estimate of the prompt (anchored on the
    server's report); without it the prompt is estimated, ``tools`` included.
    ``budget`` is the context budget (``routing.rule.conversation_budget``); without it,
    ``conversation_max_tokens`` or the fallback for an unknown window.

    With ``trouble_signals``, a continuation step's signals carry the trouble
    signals (``with_trouble``) and its decision goes through the escalation
    latch in ``state["latch"]`` (``routing.score.Latch``); the decision's ``latch`` is
    what the ``route`` node keeps there for the next step. Plans never carry
    them: the plan starts a turn, with no latch.
    """
    if budget is None:
        budget = conversation_budget(context.conversation_max_tokens, None, context.max_completion_tokens)
    step = 0 if plan else next_step(state)
    signals = step_signals(
        system_prompt=context.system_prompt,
        messages=state["messages"],
        step=step,
        max_steps=context.max_steps,
        conversation_max_tokens=budget,
        notice=False if plan else bool(state.get("notice", False) or output_cut(state["messages"])),
        count_tokens=count_tokens,
        tools=tools,
        prompt_tokens=prompt_tokens,
    )
    latch = None
    if context.trouble_signals and not plan:
        signals = with_trouble(signals, state["messages"], state.get("latch"))
        latch = signals.latch
    decision = decide_leg(
        mode=context.mode,
        step=step,
        current_leg=None if plan else state.get("leg"),
        score=score_step(signals, context.trouble_weights),
        cloud_share=context.cloud_share,
        hysteresis=context.hysteresis,
        score_quantiles=context.score_quantiles,
        pace=pace_of(state, context),
        latch=latch,
        trouble_weights=context.trouble_weights,
    )
    return decision, signals
