"""The routing node: where the turn goes after a tool batch, decided once.

In order: calls still waiting for their file run next (the next wave of the
batch), then the step limit, then repairs, then the score picks ``local`` or
``cloud``. The score's prompt estimate is measured on the local leg (anchored
on llama-server's last report for this thread) against the local window's
usable part; a cloud step the cloud budget cannot pay for goes local (the
budget guard). The decision is handed to the executor in ``state["route"]``
(with those estimates), so the node that runs the step records exactly the
decision that sent it there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langgraph.runtime import Runtime
from langgraph.types import Command, Send

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.nodes.dispatch import sends
from fusion_graph.providers.measure import Sizer
from fusion_graph.sizing.tokens import TokenCounter
from fusion_graph.state import State
from fusion_graph.turn import last_batch, next_route, next_step, pending_calls, step_tally, to_pending

#: Every node ``route`` can send the turn to.
Destination = Literal["tools", "local", "cloud", "repair", "step_limit", "give_up", "memory", "__end__"]


def returned_directly(state: State, tools: dict[str, BaseTool]) -> bool:
    """Whether every call the batch ran is a ``return_direct`` tool (the turn ends on its result)."""
    batch = last_batch(state["messages"])
    if batch is None or not batch.tool_calls:
        return False
    if not any(call["name"] in tools and tools[call["name"]].return_direct for call in batch.tool_calls):
        return False  # what ran cannot all be return_direct: no need to look for the results
    ran = {m.tool_call_id for m in state["messages"] if isinstance(m, ToolMessage) and m.status != "error"}
    names = [call["name"] for call in batch.tool_calls if call["id"] in ran]
    return bool(names) and all(name in tools and tools[name].return_direct for name in names)


class RouteNode:
    """The ``route`` node over the graph's token estimator, tools, sizer and memory switch."""

    def __init__(
        self,
        count_tokens: TokenCounter,
        tools: dict[str, BaseTool],
        memory_on: Callable[[Runtime[Any]], bool],
        sizer: Sizer,
    ) -> None:
        """Keep what the decision needs."""
        self.count_tokens, self.tools, self.memory_on, self.sizer = count_tokens, tools, memory_on, sizer

    async def __call__(self, state: State, runtime: Runtime[FusionContext]) -> Command[Destination]:
        """Send the next wave of the batch, end the turn, repair, or route the next step."""
        pending = pending_calls(state["messages"])
        if pending:
            goto: list[Send | Destination] = list(sends(pending))
            return Command(goto=goto)
        if returned_directly(state, self.tools):
            return Command(goto="memory" if self.memory_on(runtime) else "__end__")
        context = ensure_context(runtime.context)
        step = next_step(state)
        if step >= context.max_steps:
            return Command(goto="step_limit")
        if state.get("repair_error"):
            if state.get("repair_attempts", 0) >= context.max_repair_attempts:
                return Command(goto="give_up")
            return Command(goto="repair")
        chain = await self.sizer.resolver.chain(context)
        sizes = await self.sizer.measure(chain, state["messages"], state.get("anchors") or {}, context)
        decision, signals = next_route(
            state,
            context,
            self.count_tokens,
            prompt_tokens=sizes.score_tokens,
            budget=sizes.budget,
            tools=list(self.tools.values()),
        )
        if decision.leg == "cloud":  # a step the cloud budget cannot afford runs local
            anchors, log = state.get("anchors") or {}, state.get("route_log", [])
            check = self.sizer.check_budget(chain, sizes, anchors, log, state.get("turn", 0), context)
            decision = check.guard(decision)
        handed = to_pending(step, decision, signals, sizes.estimates, sizes.as_dict())
        update: dict[str, Any] = {"route": handed}
        if decision.latch != state.get("latch"):  # the escalation latch (trouble_signals) moved
            update["latch"] = decision.latch
        if context.pace_slack is not None:  # the paced dial's count so far, so the next step counts on
            update["step_tally"] = step_tally(state.get("route_log", []), state.get("step_tally"))
        every = context.memory_every_k_steps
        if every and step % every == 0 and self.memory_on(runtime):
            return Command(update=update, goto=[decision.leg, "memory"])  # beside the next step
        return Command(update=update, goto=decision.leg)
