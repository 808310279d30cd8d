"""One inference: build the prompt, call through the provider chain, record the route.

Plan, continuation steps and repairs all come through here, so every call is
recorded the same way: a ``route_log`` entry (who answered, which attempts
failed before, what it cost at the answering provider's prices), two custom
stream events (``stream_mode="custom"``: the decision before the call, the
outcome after it) and leg/score tags and metadata on the model run (visible in
LangGraph Studio and LangSmith traces). An inference no provider answers still
gets its record, with every failed attempt.

Every attempt is bounded: ``request_timeout`` (``asyncio.timeout``, so injected
models too), a completion budget sent as ``max_tokens``, and the fit rule's
links (``Bounds``); a response the model cannot parse is a malformed answer
(a health failure, so the chain falls over), never an uncaught exception.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import merge_configs
from langchain_core.tools import BaseTool
from langchain_openai.chat_models.base import BaseChatOpenAI
from langgraph.config import get_config
from langgraph.runtime import Runtime
from pydantic import ValidationError

from fusion_graph.context import FusionContext
from fusion_graph.providers.chain import Attempt, ChainExhausted, ChainLink, ProviderChain
from fusion_graph.providers.health import MalformedAnswer
from fusion_graph.providers.records import answered_record, make_record
from fusion_graph.providers.slots import slot_body
from fusion_graph.routing import RouteDecision, StepSignals
from fusion_graph.sizing.estimate import Estimate
from fusion_graph.sizing.tokens import build_prompt
from fusion_graph.state import RouteRecord, StepKind

ROUTE_EVENT = "fusion_route"

#: Finds the llama-server slot of this conversation on a link (``None``: not a llama-server).
SlotFor = Callable[[ChainLink], Awaitable[int | None]]

#: Headers a request to a link carries (the thread's routing key on a local link), or ``None``.
HeadersFor = Callable[[ChainLink], dict[str, str] | None]

#: Learns which box behind a gateway served the thread; returns the box it moved from, if any.
ServedBy = Callable[[ChainLink, str], Awaitable[str | None]]


def call_headers(link: ChainLink, headers: HeadersFor | None) -> dict[str, Any]:
    """``extra_headers`` for an OpenAI-compatible link's call (other models take no headers)."""
    wanted = headers(link) if headers is not None else None
    return {"extra_headers": wanted} if wanted and isinstance(link.model, BaseChatOpenAI) else {}


def served_box(answer: Any) -> str | None:
    """The box a gateway named in its answer (``ChatLlamaServer`` keeps it as ``served_by``)."""
    metadata = getattr(answer, "response_metadata", None) or {}
    box = metadata.get("served_by")
    return box if isinstance(box, str) and box else None


def _call_config(kind: StepKind, decision: RouteDecision, step: int, link: ChainLink) -> RunnableConfig:
    score = decision.score.score if decision.score is not None else None
    metadata: dict[str, Any] = {
        "fusion_leg": link.leg,
        "fusion_routed_leg": decision.leg,
        "fusion_kind": kind,
        "fusion_step": step,
        "fusion_score": score,
        "fusion_threshold": decision.threshold,
        "fusion_provider": link.id,
    }
    return {
        "tags": [f"fusion:leg={link.leg}", f"fusion:kind={kind}"],
        "metadata": metadata,
        "run_name": f"{kind}:{link.leg}",
    }


#: Each link's model with the graph's tools bound (binding converts every schema, once is enough).
_BOUND: weakref.WeakKeyDictionary[ChainLink, tuple[tuple[int, ...], Runnable[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def bound_model(link: ChainLink, tools: Sequence[BaseTool]) -> Runnable[Any, Any]:
    """``link.model`` with ``tools`` bound, built once per link and tool list."""
    key = tuple(id(tool) for tool in tools)
    cached = _BOUND.get(link)
    if cached is not None and cached[0] == key:
        return cached[1]
    model: Runnable[Any, Any] = link.model.bind_tools(list(tools)) if tools else link.model
    _BOUND[link] = (key, model)
    return model


def decision_event(
    *, kind: StepKind, step: int, turn: int, decision: RouteDecision, slot: int | None
) -> dict[str, Any]:
    """The ``fusion_route`` event sent before an inference: where it is going and why."""
    return {
        "event": ROUTE_EVENT,
        "phase": "decision",
        "turn": turn,
        "step": step,
        "kind": kind,
        "routed_leg": decision.leg,
        "score": decision.score.score if decision.score is not None else None,
        "threshold": decision.threshold,
        "reason": decision.reason,
        "slot": slot,
    }


@dataclass(frozen=True)
class Inference:
    """One inference to run: what it is, where the router sent it, and on what.

    Attributes:
        kind: Plan, step or repair.
        step: Index of the inference in its turn.
        turn: Index of the turn.
        decision: The router's (or repair rule's) decision, its reason extended by the fit rule.
        signals: The step's routing signals (``None`` for repairs).
        messages: The history to send (after the system prompt).
        tools: Tools bound to the model.
        context: The run's context.
        prefer_provider: A provider to start at (repairs).
    """

    kind: StepKind
    step: int
    turn: int
    decision: RouteDecision
    signals: StepSignals | None
    messages: Sequence[BaseMessage]
    tools: Sequence[BaseTool]
    context: FusionContext
    prefer_provider: str | None = None


@dataclass(frozen=True)
class Bounds:
    """What bounds each attempt of an inference.

    Attributes:
        allowed: Ids of the links whose window can hold the request (``None``: every link).
        windows: Each link's window by id; after a context overflow, only larger ones are tried.
        estimates: The prompt estimate per leg, recorded next to the server's count.
        max_tokens: The completion budget sent to each link (``max_tokens``), by id.
        timeout_s: Seconds an attempt may take (``request_timeout``), injected models included.
    """

    allowed: frozenset[str] | None = None
    windows: Mapping[str, int | None] = field(default_factory=dict)
    estimates: Mapping[str, Estimate] = field(default_factory=dict)
    max_tokens: Mapping[str, int] = field(default_factory=dict)
    timeout_s: float | None = None


class _Walk:
    """The links an inference may still try: the fit rule's, and after an overflow only larger ones."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.overflowed: int | None = None

    def saw(self, attempt: Attempt) -> None:
        if attempt.kind == "context_overflow":
            window = self.bounds.windows.get(attempt.provider) or 0
            self.overflowed = max(self.overflowed or 0, window)

    def fits(self, link: ChainLink) -> bool:
        if self.bounds.allowed is not None and link.id not in self.bounds.allowed:
            return False
        if self.overflowed is None:
            return True
        window = self.bounds.windows.get(link.id)
        return window is not None and window > self.overflowed


async def _ask(
    model: Runnable[Any, Any],
    prompt: list[BaseMessage],
    config: RunnableConfig,
    link: ChainLink,
    timeout_s: float | None,
    kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """One model call within ``timeout_s``; a response the model cannot parse is a ``MalformedAnswer``.

    ``kwargs`` go to the model's ``ainvoke``, as ``model.bind(**kwargs)`` would send them.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await model.ainvoke(prompt, config=config, **(kwargs or {}))
    except TimeoutError as error:
        raise TimeoutError(f"{link.id} gave no answer within request_timeout={timeout_s:g} s") from error
    except (IndexError, ValidationError) as error:
        raise MalformedAnswer(
            f"{link.id} answered something that is not a chat completion ({type(error).__name__}: {error})"
        ) from error


async def infer(
    call: Inference,
    *,
    chain: ProviderChain,
    find_slot: SlotFor,
    runtime: Runtime[FusionContext],
    bounds: Bounds | None = None,
    extra: dict[str, Any] | None = None,
    headers: HeadersFor | None = None,
    served: ServedBy | None = None,
) -> tuple[AIMessage | None, RouteRecord, ChainExhausted | None]:
    """Run one inference through ``chain``, starting at the routed leg.

    The routed leg is only the preferred starting link: when it fails the
    chain falls over (possibly to the other leg) and the record says so. Slot
    fields are sent only to a local llama-server link, decided per link
    actually called, never from whichever provider is "active". Links outside
    ``bounds.allowed`` are never tried; a context overflow walks on to a link
    with a larger window. ``extra`` joins the record's ``extra``. ``headers``
    go with each call (a local link's routing key); ``served`` learns the box a
    gateway answered from, which the record keeps (``box``, ``box_moved_from``).

    Returns:
        The answer (``None`` when every provider failed), the record, and the
        chain's ``ChainExhausted`` when every provider failed.
    """
    bounds = bounds or Bounds()
    decision = call.decision
    # Every inference of a thread sends the same system prompt, so the prefix is stable.
    prompt = build_prompt(call.context.system_prompt, call.messages)
    slots: dict[str, int | None] = {}
    routed = next((link for link in chain.links if link.leg == decision.leg), None)
    planned_slot = await find_slot(routed) if routed is not None and routed.leg == "local" else None
    runtime.stream_writer(
        decision_event(kind=call.kind, step=call.step, turn=call.turn, decision=decision, slot=planned_slot)
    )

    async def invoke(link: ChainLink) -> AIMessage:
        model = bound_model(link, call.tools)
        slot = await find_slot(link) if link.leg == "local" else None
        body = slot_body(link.leg, slot)
        kwargs: dict[str, Any] = {}
        if body is not None:
            own = getattr(link.model, "extra_body", None)  # a call's extra_body replaces the model's
            kwargs["extra_body"] = {**own, **body} if isinstance(own, dict) else body
        if link.id in bounds.max_tokens:
            kwargs["max_tokens"] = bounds.max_tokens[link.id]
        kwargs |= call_headers(link, headers)
        slots[link.id] = slot if body is not None else None
        config = merge_configs(get_config(), _call_config(call.kind, decision, call.step, link))
        # The call's arguments go with the call: a binding per call would only copy the config again.
        answer = await _ask(model, prompt, config, link, bounds.timeout_s, kwargs)
        return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)

    walk = _Walk(bounds)
    try:
        outcome = await chain.call(
            invoke,
            preferred_leg=decision.leg,
            prefer_provider=call.prefer_provider,
            on_attempt=walk.saw,
            fits=walk.fits,
        )
    except ChainExhausted as exhausted:
        record = make_record(
            turn=call.turn,
            step=call.step,
            kind=call.kind,
            decision=decision,
            signals=call.signals,
            leg=decision.leg,
            provider=None,
            answer=None,
            attempts=[asdict(attempt) for attempt in exhausted.attempts],
            extra={"outcome": "exhausted", "retry_in_s": exhausted.retry_in_s, **(extra or {})},
        )
        runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        return None, record, exhausted
    link = outcome.provider
    sized: dict[str, Any] = {}
    estimate = bounds.estimates.get(link.leg)
    if estimate is not None:
        sized = {"estimated_prompt_tokens": estimate.tokens, "estimate_basis": estimate.basis}
    if link.id in bounds.windows:
        sized["window"] = bounds.windows[link.id]
    if link.id in bounds.max_tokens:
        sized["max_tokens"] = bounds.max_tokens[link.id]
    box = served_box(outcome.answer)
    if box is not None:
        sized["box"] = box
        moved = await served(link, box) if served is not None else None
        if moved is not None:  # the gateway re-placed the thread: this step ran on a cold cache
            sized["box_moved_from"] = moved
    record = answered_record(
        outcome,
        turn=call.turn,
        step=call.step,
        kind=call.kind,
        decision=decision,
        signals=call.signals,
        slot=slots.get(link.id),
        extra={**sized, **(extra or {})},
    )
    runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
    return outcome.answer, record, None
