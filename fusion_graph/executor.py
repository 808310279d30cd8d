"""One inference: build the prompt, call through the provider chain, record the route.

Plan, continuation steps and repairs all come through here, so every call is
recorded the same way: a ``route_log`` entry (who answered, which attempts
failed before, what it cost at the answering provider's prices), a custom
stream event (``stream_mode="custom"``) and leg/score tags and metadata on the
model run (visible in LangGraph Studio and LangSmith traces).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import merge_configs
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime

from fusion_graph.chain import ChainLink, ProviderChain
from fusion_graph.context import FusionContext
from fusion_graph.records import answered_record
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
) -> tuple[AIMessage, RouteRecord]:
    """Run one inference through ``chain``, starting at the routed leg; return answer and record.

    The routed leg is only the preferred starting link: when it fails the
    chain falls over (possibly to the other leg) and the record says so. Slot
    fields are sent only to a local llama-server link, decided per link
    actually called, never from whichever provider is "active".
    """
    # Every inference of a thread sends the same system prompt, so the prefix is stable.
    prompt = build_prompt(context.system_prompt, messages)
    slots: dict[str, int | None] = {}

    async def invoke(link: ChainLink) -> AIMessage:
        model: Runnable[Any, Any] = link.model.bind_tools(list(tools)) if tools else link.model
        slot = await find_slot(link) if link.leg == "local" else None
        body = slot_body(link.leg, slot)
        if body is not None:
            model = model.bind(extra_body=body)
        slots[link.id] = slot if body is not None else None
        config = merge_configs(get_config(), _call_config(kind, decision, step, link))
        answer = await model.ainvoke(prompt, config=config)
        return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)

    outcome = await chain.call(invoke, preferred_leg=decision.leg, prefer_provider=prefer_provider)
    record = answered_record(
        outcome,
        turn=turn,
        step=step,
        kind=kind,
        decision=decision,
        signals=signals,
        slot=slots.get(outcome.provider.id),
    )
    runtime.stream_writer({"event": ROUTE_EVENT, **record})
    return outcome.answer, record
