"""One inference on one leg: build the prompt, call the provider, record the route.

Plan, continuation steps and repairs all come through here, so every call is
recorded the same way: a ``route_log`` entry, a custom stream event
(``stream_mode="custom"``) and leg/score tags and metadata on the model run
(visible in LangGraph Studio and LangSmith traces).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import merge_configs
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime

from fusion_graph.context import FusionContext
from fusion_graph.providers import Provider
from fusion_graph.records import make_record
from fusion_graph.routing import RouteDecision, StepSignals
from fusion_graph.signals import build_prompt
from fusion_graph.slots import slot_body
from fusion_graph.state import RouteRecord, StepKind

ROUTE_EVENT = "fusion_route"


def _call_config(kind: StepKind, decision: RouteDecision, step: int, provider: Provider) -> RunnableConfig:
    score = decision.score.score if decision.score is not None else None
    metadata: dict[str, Any] = {
        "fusion_leg": decision.leg,
        "fusion_kind": kind,
        "fusion_step": step,
        "fusion_score": score,
        "fusion_threshold": decision.threshold,
        "fusion_provider": provider.id,
    }
    return {
        "tags": [f"fusion:leg={decision.leg}", f"fusion:kind={kind}"],
        "metadata": metadata,
        "run_name": f"{kind}:{decision.leg}",
    }


async def infer(
    *,
    kind: StepKind,
    step: int,
    turn: int,
    decision: RouteDecision,
    signals: StepSignals | None,
    provider: Provider,
    messages: Sequence[BaseMessage],
    tools: Sequence[BaseTool],
    runtime: Runtime[FusionContext],
    context: FusionContext,
    slot: int | None = None,
) -> tuple[AIMessage, RouteRecord]:
    """Run one inference on ``provider`` and return its answer and route record.

    ``slot`` pins a llama-server slot; it is sent (with ``cache_prompt``) only
    when the step was routed to the local leg.
    """
    # Every inference of a thread sends the same system prompt, so the prefix is stable.
    prompt = build_prompt(context.system_prompt, messages)
    model: Runnable[Any, Any] = provider.model.bind_tools(list(tools)) if tools else provider.model
    body = slot_body(decision.leg, slot)
    if body is not None:
        model = model.bind(extra_body=body)
    config = merge_configs(get_config(), _call_config(kind, decision, step, provider))
    answer = await model.ainvoke(prompt, config=config)
    if not isinstance(answer, AIMessage):
        answer = AIMessage(content=answer.content)
    record = make_record(
        turn=turn,
        step=step,
        kind=kind,
        leg=decision.leg,
        decision=decision,
        signals=signals,
        provider=provider.id,
        answer=answer,
        slot=slot if body is not None else None,
    )
    runtime.stream_writer({"event": ROUTE_EVENT, **record})
    return answer, record
