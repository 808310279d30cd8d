"""The one provider call: ``ask`` runs an inference through the chain and records it.

Every inference comes through here: the steps (plan, continuation steps,
repairs), the re-synthesis of a reply, the memory jobs, MCP samples and
shadow checks (every ``routing.records.StepKind``). So
every call is made and recorded the same way:

- a local link gets the request's ``Placement`` (the slot as ``id_slot`` +
  ``cache_prompt``, its headers), decided per link actually called by the
  graph's one ``Placer``, never from whichever provider is "active";
- every attempt is bounded: ``timeout_s`` (``asyncio.timeout``, so injected
  models too), a completion budget sent as ``max_tokens``, and the links the
  fit rule allows (``Bounds``); a response the model cannot parse is a
  malformed answer (a health failure, so the chain falls over), never an
  uncaught exception;
- one ``route_log`` entry (who answered, which attempts failed before, what
  it cost at the answering provider's prices), also for a call no provider
  answered (``routing.records.make_record``);
- a slot's priming request (``prime_slot``, before a memory job) is built by
  the same request builder on the same placement, and is never recorded;
- where a ``writer`` is given, two custom stream events
  (``stream_mode="custom"``: the decision before the call, the outcome after),
  and leg/score tags and metadata on the model run (LangGraph Studio and
  LangSmith traces show them).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_openai.chat_models.base import BaseChatOpenAI
from pydantic import ValidationError

from fusion_graph.errors import ChainExhausted, MalformedAnswer
from fusion_graph.providers.chain import ChainOutcome, ProviderChain
from fusion_graph.providers.links import ChainLink
from fusion_graph.providers.placement import NOWHERE, Placement, Placer
from fusion_graph.providers.pricing import price
from fusion_graph.routing.records import (
    Attempt,
    RouteRecord,
    StepKind,
    in_all_cloud_baseline,
    make_record,
)
from fusion_graph.routing.score import RouteDecision, StepSignals
from fusion_graph.sizing.estimate import Estimate
from fusion_graph.telemetry import switch as telemetry

ROUTE_EVENT = "fusion_route"

#: Sends a custom stream event (``runtime.stream_writer``).
Writer = Callable[[dict[str, Any]], None]

#: Runs the model call of one attempt on a link at its placement (memory jobs prime their slot first).
Around = Callable[[ChainLink, Placement, Callable[[], Awaitable[Any]]], Awaitable[Any]]
#: Sends one attempt another way than ``model.ainvoke``: the link's chat model (tools not bound) and
#: the attempt's arguments (budget, slot body, headers); a ``create_agent`` middleware sends it through
#: the agent's own model call so the agent binds the tools and its inner middleware run.
Sender = Callable[[BaseChatModel, Mapping[str, Any]], Awaitable[AIMessage]]


@dataclass(frozen=True)
class Bounds:
    """What bounds each attempt of an inference.

    Attributes:
        allowed: Ids of the links the call may use (the fit rule's, a budget's); ``None``: every link.
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


@dataclass(frozen=True)
class Ask:
    """One inference to make: what it is, where it was sent, and what it sends.

    Attributes:
        kind: What the inference is for (``routing.records.StepKind``).
        turn: Index of the turn.
        step: Index of the inference in its turn (a side inference: the step it sits beside).
        decision: The router's (or the kind's own rule's) decision: the leg it starts on, and why.
        prompt: The whole prompt, system message first.
        thread_id: The conversation (its placement on the local leg).
        tools: Tools bound to the model (their schemas are part of the prompt's prefix).
        signals: The routing signals of a scored step (``None`` otherwise).
        prefer_provider: A provider to start at while healthy (a repair's).
        reflection: Use the reserved reflection slot (memory jobs, samples), not the thread's.
        kwargs: Model-call arguments for any link (``stop``, ``temperature``).
        body: Request-body fields for OpenAI-compatible links only (``response_format``, ``tool_choice``).
        max_tokens: The completion budget where ``Bounds.max_tokens`` does not name the link.
        config: The run's config (callbacks); ``None``: the one of the run this is called in, if any.
        tags: More tags for the model run (e.g. ``nostream``).
        extra: Joins the record's ``extra``.
        send: How each attempt goes out (``None``: the link's model with ``tools`` bound, ``ainvoke``).
    """

    kind: StepKind
    turn: int
    step: int
    decision: RouteDecision
    prompt: Sequence[BaseMessage]
    thread_id: str
    tools: Sequence[BaseTool] = ()
    signals: StepSignals | None = None
    prefer_provider: str | None = None
    reflection: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    body: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    config: RunnableConfig | None = None
    tags: Sequence[str] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    send: Sender | None = None


@dataclass(frozen=True)
class Asked:
    """What an inference came to: the answer (``None``: no provider answered), its record, the failure."""

    answer: AIMessage | None
    record: RouteRecord
    exhausted: ChainExhausted | None = None


#: Each link's model with the graph's tools bound (binding converts every schema, once is enough).
_BOUND: weakref.WeakKeyDictionary[ChainLink, tuple[tuple[int, ...], Runnable[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


#: The same for the models that reach one box directly (a placement's ``model``), by identity.
_BOUND_BOX: dict[int, tuple[BaseChatModel, tuple[int, ...], Runnable[Any, Any]]] = {}


def bound_model(
    link: ChainLink, tools: Sequence[BaseTool], model: BaseChatModel | None = None
) -> Runnable[Any, Any]:
    """``link.model`` (or ``model``, a box's own) with ``tools`` bound, built once per model and tool list."""
    key = tuple(id(tool) for tool in tools)
    if model is not None:
        known = _BOUND_BOX.get(id(model))
        if known is not None and known[0] is model and known[1] == key:
            return known[2]
        bound: Runnable[Any, Any] = model.bind_tools(list(tools)) if tools else model
        _BOUND_BOX[id(model)] = (model, key, bound)
        return bound
    cached = _BOUND.get(link)
    if cached is not None and cached[0] == key:
        return cached[1]
    bound = link.model.bind_tools(list(tools)) if tools else link.model
    _BOUND[link] = (key, bound)
    return bound


def request_kwargs(link: ChainLink, call: Ask, placement: Placement, bounds: Bounds) -> dict[str, Any]:
    """The model-call arguments of one attempt on ``link``: budget, slot, body fields, headers."""
    kwargs: dict[str, Any] = dict(call.kwargs)
    max_tokens = bounds.max_tokens.get(link.id, call.max_tokens)
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    openai = isinstance(link.model, BaseChatOpenAI)
    body = placement.body(link.leg) or {}
    if openai:
        body |= call.body
        if placement.headers:
            kwargs["extra_headers"] = dict(placement.headers)
    if body:
        own = getattr(link.model, "extra_body", None)  # a call's extra_body replaces the model's
        kwargs["extra_body"] = {**own, **body} if isinstance(own, dict) else body
    return kwargs


def call_config(call: Ask, link: ChainLink) -> RunnableConfig:
    """The run's config with this call's tags and metadata (leg, kind, step, score, provider)."""
    decision = call.decision
    score = decision.score.score if decision.score is not None else None
    metadata: dict[str, Any] = {
        "fusion_leg": link.leg,
        "fusion_routed_leg": decision.leg,
        "fusion_kind": call.kind,
        "fusion_step": call.step,
        "fusion_score": score,
        "fusion_threshold": decision.threshold,
        "fusion_provider": link.id,
    }
    # What ``merge_configs`` makes of these three keys, at a sixth of its cost (it runs at every
    # inference): ``ensure_config`` already returns a fresh dict with its own tags list and metadata.
    config = ensure_config(call.config)
    config["tags"] = sorted(
        {*config.get("tags", ()), f"fusion:leg={link.leg}", f"fusion:kind={call.kind}", *call.tags}
    )
    config["metadata"] = {**config.get("metadata", {}), **metadata}
    config["run_name"] = f"{call.kind}:{link.leg}"
    return config


def decision_event(call: Ask, slot: int | None) -> dict[str, Any]:
    """The ``fusion_route`` event sent before an inference: where it is going and why."""
    decision = call.decision
    return {
        "event": ROUTE_EVENT,
        "phase": "decision",
        "turn": call.turn,
        "step": call.step,
        "kind": call.kind,
        "routed_leg": decision.leg,
        "score": decision.score.score if decision.score is not None else None,
        "threshold": decision.threshold,
        "reason": decision.reason,
        "slot": slot,
    }


async def _model_call(
    model: Runnable[Any, Any],
    prompt: Sequence[BaseMessage],
    config: RunnableConfig,
    link: ChainLink,
    timeout_s: float | None,
    kwargs: Mapping[str, Any],
) -> AIMessage:
    """One model call within ``timeout_s``; a response the model cannot parse is a ``MalformedAnswer``.

    ``kwargs`` go to the model's ``ainvoke``, as ``model.bind(**kwargs)`` would send them.
    """
    return await within(model.ainvoke(list(prompt), config=config, **kwargs), link, timeout_s)


def timeout_text(provider: str, timeout_s: float | None, *, local: bool = False) -> str:
    """What a request that outlasted its bound says: the variable that sets it, its value, the fixes.

    The setting's name alone (``request_timeout``) is not what an operator types;
    a slow local model (a CPU box) is the usual cause, so the message names
    ``FUSION_REQUEST_TIMEOUT`` with its current value, and the other fixes.
    """
    if timeout_s is None:
        head = f"{provider} gave no answer within its client's own timeout (no request_timeout bound it)"
        fixes = "raise the model client's timeout, or lower max_completion_tokens"
    else:
        head = f"{provider} gave no answer within request_timeout={timeout_s:g} s"
        fixes = f"raise FUSION_REQUEST_TIMEOUT (now {timeout_s:g}), or lower max_completion_tokens"
    cpu = " (llama-server on CPU: also try fewer threads, -t)" if local else ""
    return f"{head}: {fixes}{cpu}"


async def within(answering: Awaitable[Any], link: ChainLink, timeout_s: float | None) -> AIMessage:
    """``answering`` within ``timeout_s``; a response the model cannot parse is a ``MalformedAnswer``."""
    try:
        async with asyncio.timeout(timeout_s):
            answer = await answering
    except (TimeoutError, openai.APITimeoutError) as error:
        raise TimeoutError(timeout_text(link.id, timeout_s, local=link.leg == "local")) from error
    except (IndexError, ValidationError) as error:
        raise MalformedAnswer(
            f"{link.id} answered something that is not a chat completion ({type(error).__name__}: {error})"
        ) from error
    return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)


#: The decision of a priming request: a slot's housekeeping, not a step (never recorded).
PRIMING = RouteDecision("local", None, None, "prime the reserved slot")


async def prime_slot(link: ChainLink, placement: Placement, text: str, timeout_s: float | None) -> None:
    """A one-token request of ``text`` on ``placement``'s slot, built as every attempt is; unrecorded.

    Kept out of the run's callbacks and streams: it answers nothing the caller asked.

    Raises:
        Exception: Whatever the call raised (the caller decides whether priming matters).
    """
    call = Ask(
        kind="memory",
        turn=0,
        step=0,
        decision=PRIMING,
        prompt=(HumanMessage(text),),
        thread_id="",
        kwargs={"temperature": 0},
        max_tokens=1,
    )
    kwargs = request_kwargs(link, call, placement, Bounds())
    config: RunnableConfig = {"callbacks": [], "tags": ["nostream"], "run_name": "prime:local"}
    await _model_call(placement.model or link.model, call.prompt, config, link, timeout_s, kwargs)


class _Walk:
    """The links an inference may still try: the bounds' own, and after an overflow only larger ones."""

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


async def ask(
    call: Ask,
    *,
    chain: ProviderChain,
    placer: Placer,
    bounds: Bounds | None = None,
    writer: Writer | None = None,
    around: Around | None = None,
) -> Asked:
    """Make ``call`` through ``chain``, starting at its decision's leg, and record it.

    The routed leg is only the preferred starting link: when it fails the
    chain falls over (possibly to the other leg) and the record says so. Links
    outside ``bounds.allowed`` are never tried; a context overflow walks on to
    a link with a larger window. ``writer`` gets the decision and outcome
    events; ``around`` wraps each model call (a memory job's slot priming).

    Raises:
        ProviderRequestError: The request itself was refused (it would fail on any provider).
    """
    bounds = bounds or Bounds()
    decision = call.decision
    placements: dict[str, Placement] = {}
    started_ns = time.time_ns() if telemetry.ACTIVE.on else 0

    async def placed(link: ChainLink) -> Placement:
        if link.leg != "local":
            return NOWHERE
        known = placements.get(link.id)
        if known is None:
            known = placements[link.id] = await placer.place(link, call.thread_id, reflection=call.reflection)
        return known

    if writer is not None:
        routed = next((link for link in chain.links if link.leg == decision.leg), None)
        planned = await placed(routed) if routed is not None else NOWHERE
        writer(decision_event(call, planned.slot))

    sent: dict[str, Placement] = {}

    async def invoke(link: ChainLink) -> AIMessage:
        while True:
            placement = await placed(link)
            try:
                # The slot is named only inside its turn (no other request runs on it meanwhile).
                async with placement.hold() as held:
                    sent[link.id] = held
                    kwargs = request_kwargs(link, call, held, bounds)
                    once = _once(link, held, kwargs)
                    return await (around(link, held, once) if around is not None else once())
            except Exception as error:
                if link.leg == "local" and placer.unreachable(placement, error):
                    placements.pop(link.id, None)  # its box is down: placed again on one that answers
                    continue
                raise

    def _once(link: ChainLink, held: Placement, kwargs: dict[str, Any]) -> Callable[[], Awaitable[AIMessage]]:
        send = call.send

        def once() -> Awaitable[AIMessage]:
            if send is not None:
                return within(send(held.model or link.model, kwargs), link, bounds.timeout_s)
            model = bound_model(link, call.tools, held.model)
            return _model_call(model, call.prompt, call_config(call, link), link, bounds.timeout_s, kwargs)

        return once

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
            attempts=exhausted.attempts,
            extra={"outcome": "exhausted", "retry_in_s": exhausted.retry_in_s, **call.extra},
        )
        if writer is not None:
            writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        if telemetry.ACTIVE.on:
            _report(call, chain, record, None, started_ns)
        return Asked(None, record, exhausted)
    link = outcome.provider
    placement = sent.get(link.id, NOWHERE)
    extra: dict[str, Any] = dict(placement.notes)
    estimate = bounds.estimates.get(link.leg)
    if estimate is not None:
        extra |= {"estimated_prompt_tokens": estimate.tokens, "estimate_basis": estimate.basis}
    if link.id in bounds.windows:
        extra["window"] = bounds.windows[link.id]
    if link.id in bounds.max_tokens:
        extra["max_tokens"] = bounds.max_tokens[link.id]
    record = answered_record(
        outcome,
        turn=call.turn,
        step=call.step,
        kind=call.kind,
        decision=decision,
        signals=call.signals,
        slot=placement.slot if placement.body(link.leg) is not None else None,
        extra={**extra, **call.extra},
    )
    if writer is not None:
        writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
    if telemetry.ACTIVE.on:
        _report(call, chain, record, outcome.answer, started_ns)
    return Asked(outcome.answer, record)


def all_cloud_cost(record: RouteRecord, chain: ProviderChain) -> float | None:
    """What a priced inference would have cost on the chain's first cloud link (its own cost on cloud).

    A local inference is priced from its reported tokens at the cloud link's prices,
    cached tokens credited as the report's all-cloud figure credits them.
    """
    if record["cost_usd"] is None:
        return None
    if not in_all_cloud_baseline(record):
        return 0.0
    if record["leg"] == "cloud":
        return record["cost_usd"]
    cloud, prompt, completion = chain.first_cloud, record["prompt_tokens"], record["completion_tokens"]
    if cloud is None or prompt is None or completion is None:
        return None
    return price(cloud.pricing, prompt, min(record["cached_tokens"] or 0, prompt), completion)


def _report(
    call: Ask, chain: ProviderChain, record: RouteRecord, answer: AIMessage | None, started_ns: int
) -> None:
    """Hand one inference to the telemetry (metrics, a span), when it is on."""
    provider = record["provider"]
    link = chain.link(provider) if provider is not None else None
    if link is None:
        link = next((x for x in chain.links if x.leg == call.decision.leg), None)
    model = str(getattr(link.model, "model_name", None) or link.id) if link is not None else "unknown"
    metadata = answer.response_metadata if answer is not None else {}
    telemetry.inference(
        record,
        all_cloud_usd=all_cloud_cost(record, chain),
        started_ns=started_ns,
        model=model,
        response_model=metadata.get("model_name") or metadata.get("model"),
        thread_id=call.thread_id or None,
    )


def answered_record(
    outcome: ChainOutcome[AIMessage],
    *,
    turn: int,
    step: int,
    kind: StepKind,
    decision: RouteDecision,
    signals: StepSignals | None,
    slot: int | None,
    extra: dict[str, Any] | None = None,
) -> RouteRecord:
    """The record of an inference the chain got an answer for, priced at the answering provider."""
    link = outcome.provider
    record = make_record(
        turn=turn,
        step=step,
        kind=kind,
        leg=link.leg,
        decision=decision,
        signals=signals,
        provider=link.id,
        answer=outcome.answer,
        slot=slot,
        attempts=outcome.attempts,
        extra={"probe": outcome.probe, "latency_s": round(outcome.latency_s, 4), **(extra or {})},
    )
    record["cost_usd"] = price(
        link.pricing, record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]
    )
    return record
