"""One inference: build the prompt, call through the provider chain, record the route.

Plan, continuation steps and repairs all come through here, so every call is
recorded the same way: a ``route_log`` entry (who answered, which attempts
failed before, what it cost at the answering provider's prices), two custom
stream events (``stream_mode="custom"``: the decision before the call, the
outcome after it) and leg/score tags and metadata on the model run (visible in
LangGraph Studio and LangSmith traces). An inference no provider answers still
gets its record, with every failed attempt.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import merge_configs
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime

from fusion_graph.chain import ChainExhausted, ChainLink, ProviderChain
from fusion_graph.context import FusionContext
from fusion_graph.records import answered_record, make_record
from fusion_graph.routing import RouteDecision, StepSignals
from fusion_graph.signals import build_prompt
from fusion_graph.slots import slot_body
from fusion_graph.state import RouteRecord, StepKind

ROUTE_EVENT = "fusion_route"

#: Finds the llama-server slot of this conversation on a link (``None``: not a llama-server).
SlotFinder = Callable[[ChainLink], Awaitable[int | None]]


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


async def infer(
    *,
    kind: StepKind,
    step: int,
    turn: int,
    decision: RouteDecision,
    signals: StepSignals | None,
    chain: ProviderChain,
    find_slot: SlotFinder,
    messages: Sequence[BaseMessage],
    tools: Sequence[BaseTool],
    runtime: Runtime[FusionContext],
    context: FusionContext,
    prefer_provider: str | None = None,
) -> tuple[AIMessage | None, RouteRecord, ChainExhausted | None]:
    """Run one inference through ``chain``, starting at the routed leg.

    The routed leg is only the preferred starting link: when it fails the
    chain falls over (possibly to the other leg) and the record says so. Slot
    fields are sent only to a local llama-server link, decided per link
    actually called, never from whichever provider is "active".

    Returns:
        The answer (``None`` when every provider failed), the record, and the
        chain's ``ChainExhausted`` when every provider failed.
    """
    # Every inference of a thread sends the same system prompt, so the prefix is stable.
    prompt = build_prompt(context.system_prompt, messages)
    slots: dict[str, int | None] = {}
    routed = next((link for link in chain.links if link.leg == decision.leg), None)
    planned_slot = await find_slot(routed) if routed is not None and routed.leg == "local" else None
    runtime.stream_writer(
        decision_event(kind=kind, step=step, turn=turn, decision=decision, slot=planned_slot)
    )

    async def invoke(link: ChainLink) -> AIMessage:
        model = bound_model(link, tools)
        slot = await find_slot(link) if link.leg == "local" else None
        body = slot_body(link.leg, slot)
        if body is not None:
            model = model.bind(extra_body=body)
        slots[link.id] = slot if body is not None else None
        config = merge_configs(get_config(), _call_config(kind, decision, step, link))
        answer = await model.ainvoke(prompt, config=config)
        return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)

    try:
        outcome = await chain.call(invoke, preferred_leg=decision.leg, prefer_provider=prefer_provider)
    except ChainExhausted as exhausted:
        record = make_record(
            turn=turn,
            step=step,
            kind=kind,
            leg=decision.leg,
            decision=decision,
            signals=signals,
            provider=None,
            answer=None,
            attempts=[asdict(attempt) for attempt in exhausted.attempts],
            extra={"outcome": "exhausted", "retry_in_s": exhausted.retry_in_s},
        )
        runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        return None, record, exhausted
    record = answered_record(
        outcome,
        turn=turn,
        step=step,
        kind=kind,
        decision=decision,
        signals=signals,
        slot=slots.get(outcome.provider.id),
    )
    runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
    return outcome.answer, record, None
