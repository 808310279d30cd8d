"""Nodes that end a turn without a model reply, or hold it when no provider answers."""

from __future__ import annotations

from typing import Any, Literal, cast

from langchain_core.messages import AIMessage
from langgraph.config import get_config
from langgraph.runtime import Runtime
from langgraph.types import Command, Send

from fusion_graph import prompts
from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.errors import ChainExhausted, StateError
from fusion_graph.internals import is_resuming
from fusion_graph.routing.records import Attempt
from fusion_graph.state import State


async def step_limit(state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
    """End the turn at ``max_steps`` with a message saying so."""
    context = ensure_context(runtime.context)
    return {"messages": [AIMessage(prompts.STEP_LIMIT.format(max_steps=context.max_steps))]}


async def give_up(state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
    """End the turn after ``max_repair_attempts`` failed repairs, with a clear message."""
    text = prompts.REPAIR_EXHAUSTED.format(
        attempts=state.get("repair_attempts", 0), error=state.get("repair_error") or "unknown"
    )
    return {"messages": [AIMessage(text)], "repair_error": None}


#: Where ``unavailable`` can send a resumed turn: the executor whose inference failed.
RetryDestination = Literal["plan", "local", "cloud", "repair"]


async def unavailable(state: State, runtime: Runtime[FusionContext]) -> Command[RetryDestination]:
    """Every provider failed an inference: raise ``ChainExhausted``; on resume, retry it.

    The failed attempts are already in ``route_log`` (the executor wrote them
    before coming here), so the checkpoint holds everything; resume the thread
    with ``ainvoke(None, config)`` once a provider is back.
    """
    stall = state.get("stall")
    if stall is None:
        raise StateError("unavailable runs only after an inference no provider answered")
    if is_resuming(get_config()):
        node = cast(RetryDestination, stall["node"])
        order = stall.get("order")  # a continuation step's: carried out as it was decided
        return Command(update={"stall": None}, goto=node if order is None else Send(node, order))
    log = state.get("route_log", [])
    attempts = [Attempt(**a) for a in log[-1]["attempts"]] if log else []
    raise ChainExhausted(stall["message"], attempts, stall["retry_in_s"])
