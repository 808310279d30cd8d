"""The ``synthesis`` node: cloud re-writes the final reply of a turn that ended on a local reply.

With ``resynthesize="local_replies"``, a turn whose last inference was a local
reply gets one more inference on the cloud leg only (never a fallover to
local): the conversation up to that reply plus an instruction to write the
final reply. Its answer replaces the local draft in the thread (same message
id); the draft stays in the record (``kind="synthesis"``, its ``synthesis``'s ``draft``),
which is priced and counts against the cloud budgets. When the budget does not
allow it, no cloud provider is up, or the answer asks for tools, the local
reply stands and the record says why. The local conversation is not sent to
llama-server again, and the turn's leg is left as it was, so hysteresis and the
local prefix cache are unaffected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.graph import END
from langgraph.runtime import Runtime

from fusion_graph import prompts
from fusion_graph.context import FusionContext, ensure_context, memory_on, thread_id_of
from fusion_graph.errors import ProviderRequestError, StateError
from fusion_graph.providers.chain import ROUTE_EVENT, Ask, Bounds, ask
from fusion_graph.routing.records import SynthesisRecord, make_record, totals_of
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.sizing.turn import build_prompt, last_ai
from fusion_graph.state import Answered, State

if TYPE_CHECKING:
    from fusion_graph.nodes.step import Sizer

#: Name of the instruction message sent with the synthesis call (never stored in the thread).
SYNTHESIS_MESSAGE_NAME = "resynthesize"

REASON = "resynthesize=local_replies: the turn ended on a reply the local leg wrote; cloud writes it"


def wants_synthesis(state: Answered, context: FusionContext) -> bool:
    """Whether a turn that ends here gets its reply re-written on cloud.

    Only a reply the local leg answered, in a run that may use cloud at all.
    """
    if context.resynthesize != "local_replies" or context.mode == "local":
        return False
    if context.mode == "fusion" and context.cloud_share == 0:
        return False
    reply = last_ai(state.get("messages", []))
    return reply is not None and not reply.tool_calls and state.get("leg") == "local"


class SynthesisNode:
    """The ``synthesis`` node over the graph's sizer (its resolver) and tools."""

    def __init__(self, sizer: Sizer, tools: Sequence[BaseTool]) -> None:
        """Keep what the call needs: the tools stay bound, so the cloud prefix matches its steps'."""
        self.sizer, self.tools = sizer, list(tools)

    async def __call__(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Re-write the local reply on cloud, or keep it and record why."""
        context = ensure_context(runtime.context)
        draft = last_ai(state["messages"])
        if draft is None:
            raise StateError("synthesis runs only after a reply")
        turn, step = state.get("turn", 0), state.get("step", 0) + 1
        decision = RouteDecision("cloud", None, None, REASON)
        history = [*state["messages"][:-1], HumanMessage(prompts.RESYNTHESIZE, name=SYNTHESIS_MESSAGE_NAME)]
        chain = await self.sizer.resolver.chain(context)
        legs: tuple[Leg, ...] = ("cloud",)
        cloud = chain.only(legs)  # a re-write on local would only repeat the draft
        anchors, log = state.get("anchors") or {}, state.get("route_log", [])
        # Sized as a cloud-only run: llama-server is not asked to count a prompt it will not see.
        sizes = await self.sizer.measure(chain, history, anchors, dataclasses.replace(context, mode="cloud"))
        kept = SynthesisRecord(draft=draft.text, draft_id=draft.id)
        why = "no cloud provider in this run's chain" if not cloud.links else None
        why = why or self.sizer.check_budget(chain, sizes, anchors, log, turn, context).over
        if why is not None:
            return self._skipped(runtime, turn, step, decision, why, kept)
        call = Ask(
            kind="synthesis",
            turn=turn,
            step=step,
            decision=decision,
            prompt=build_prompt(context.system_prompt, history),
            thread_id=thread_id_of(get_config()),
            tools=self.tools,
            parts={"synthesis": kept},
        )
        bounds = Bounds(
            windows=sizes.windows,
            estimates=sizes.estimates,
            max_tokens={link.id: self.sizer.budget_of(link, sizes, context) for link in cloud.links},
            timeout_s=self.sizer.resolver.settings.request_timeout,
        )
        placer = self.sizer.resolver.placement
        try:
            asked = await ask(call, chain=cloud, placer=placer, bounds=bounds, writer=runtime.stream_writer)
        except ProviderRequestError as refused:
            return self._skipped(runtime, turn, step, decision, f"cloud refused it: {refused}", kept)
        answer, record = asked.answer, asked.record
        if answer is None:
            record["synthesis"] = {
                **kept,
                "skipped": f"cloud is down, the local reply stands: {asked.exhausted}",
            }
            return {"route_log": [record]}
        if answer.tool_calls or answer.invalid_tool_calls or not answer.text.strip():
            record["synthesis"] = {
                **kept,
                "skipped": "the cloud answer was not a reply (tool calls or empty): draft kept",
            }
            return {"route_log": [record], "totals": totals_of(record)}
        reply = AIMessage(
            content=answer.content,
            id=draft.id,  # replaces the draft in the thread (add_messages matches by id)
            response_metadata=answer.response_metadata,
            usage_metadata=answer.usage_metadata,
        )
        return {"messages": [reply], "route_log": [record], "totals": totals_of(record), "step": step}

    @staticmethod
    def _skipped(
        runtime: Runtime[FusionContext],
        turn: int,
        step: int,
        decision: RouteDecision,
        why: str,
        kept: SynthesisRecord,
    ) -> dict[str, Any]:
        """No call made: the record says why, and the local reply stands."""
        record = make_record(
            turn=turn, step=step, kind="synthesis", decision=decision, synthesis={**kept, "skipped": why}
        )
        runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        return {"route_log": [record]}


async def after_synthesis(state: Answered, runtime: Runtime[FusionContext]) -> str:
    """The turn's reply is final: memory jobs (when on), else the end."""
    return "memory" if memory_on(runtime) else END
