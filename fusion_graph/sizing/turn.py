"""The turn in progress: where it stands in graph state, and where its next step goes.

Pure helpers the nodes, the edges and replay share: read the batch in
progress, gather the next step's routing signals, and hand them to the
routing rule (``fusion_graph.routing.rule``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from langchain_core.tools import BaseTool

from fusion_graph.context import FusionContext
from fusion_graph.prompts import MEMORY_MESSAGE_NAME
from fusion_graph.routing.records import RouteRecord
from fusion_graph.routing.rule import Pace, decide_leg
from fusion_graph.routing.score import (
    RouteDecision,
    StepSignals,
    TroubleSignals,
    score_step,
)
from fusion_graph.routing.trouble import EMPTY_FOLD, TurnFold, fold_trouble, fold_turn
from fusion_graph.sizing.fit import conversation_budget
from fusion_graph.sizing.history_memo import HistoryMemo
from fusion_graph.sizing.tokens import (
    CUT_KEY,
    TokenCounter,
    approximate_tokens,
    build_prompt,
    prompt_estimate,
    system_tokens,
)
from fusion_graph.state import State, StepTally


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
#: ``tools.batch.prior_call_counts``): a step folds only the messages since the previous one.
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
    ``budget`` is the context budget (``fit.conversation_budget``); without it,
    ``conversation_max_tokens`` or the fallback for an unknown window.

    With ``trouble_signals``, a continuation step's signals carry the trouble
    signals (``with_trouble``) and its decision goes through the escalation
    latch in ``state["latch"]`` (``routing.Latch``); the decision's ``latch`` is
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
