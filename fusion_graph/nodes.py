"""The graph's nodes. Each gathers signals, calls the pure core, and records the result.

All nodes are ``async`` and read configuration from ``runtime.context``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime

from fusion_graph import memory, prompts
from fusion_graph.batch import plan_batch
from fusion_graph.chain import ChainLink
from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.executor import ROUTE_EVENT, infer
from fusion_graph.records import totals_of
from fusion_graph.resolver import ProviderResolver
from fusion_graph.routing import Leg, RouteDecision, StepSignals
from fusion_graph.signals import TokenCounter, turn_start
from fusion_graph.state import RouteRecord, State, StepKind, add_totals
from fusion_graph.turn import continuation_route, last_ai, plan_route


async def _run_call(tool: BaseTool, call: ToolCall) -> ToolMessage:
    """Run one validated call; a tool's own failure becomes an error message, not a crash."""
    try:
        result = await tool.ainvoke(call)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the model must see every tool failure
        return ToolMessage(
            content=f"Error: {type(error).__name__}: {error}",
            tool_call_id=call["id"] or "",
            name=call["name"],
            status="error",
        )
    if isinstance(result, ToolMessage):
        return result
    return ToolMessage(content=str(result), tool_call_id=call["id"] or "", name=call["name"])


logger = logging.getLogger(__name__)


def thread_id_of(config: RunnableConfig) -> str:
    """The conversation's id (``configurable.thread_id``); one shared id when absent."""
    return str(config.get("configurable", {}).get("thread_id") or "default")


class Nodes:
    """Node functions bound to the graph's provider resolver, tools and token estimator."""

    def __init__(
        self,
        *,
        resolver: ProviderResolver,
        tools: Sequence[BaseTool],
        count_tokens: TokenCounter,
        memory_jobs: Sequence[memory.MemoryJob] = memory.DEFAULT_JOBS,
        graph_name: str = "fusion",
    ) -> None:
        """Keep what every node needs."""
        self.resolver = resolver
        self.memory_jobs = tuple(memory_jobs)
        self.graph_name = graph_name
        self.tool_list = list(tools)
        self.tools_by_name = {tool.name: tool for tool in self.tool_list}
        self.count_tokens = count_tokens

    async def _infer(
        self,
        *,
        kind: StepKind,
        step: int,
        decision: RouteDecision,
        signals: StepSignals | None,
        state: State,
        runtime: Runtime[FusionContext],
        context: FusionContext,
        prefer_provider: str | None = None,
    ) -> tuple[AIMessage, dict[str, Any]]:
        """One inference through the chain; returns the answer and the shared state update."""
        chain = await self.resolver.chain(context)
        thread_id = thread_id_of(get_config())

        async def find_slot(link: ChainLink) -> int | None:
            pool = await self.resolver.slot_pool(link, context)
            return pool.slot_for(thread_id) if pool is not None else None

        answer, record = await infer(
            kind=kind,
            step=step,
            turn=state.get("turn", 0) if kind != "plan" else state.get("turn", -1) + 1,
            decision=decision,
            signals=signals,
            chain=chain,
            find_slot=find_slot,
            messages=state["messages"],
            tools=self.tool_list,
            runtime=runtime,
            context=context,
            prefer_provider=prefer_provider,
        )
        update: dict[str, Any] = {
            "messages": [answer],
            "route_log": [record],
            "totals": totals_of(record),
            "step": step,
            # The leg that answered: after a fallover the turn continues from there.
            "leg": record["leg"],
            "provider": record["provider"],
        }
        return answer, update

    async def plan(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Step 0: form the plan and pick the first tool batch (cloud whenever cloud_share > 0).

        Relevant stored memories join the turn as a message right after the user's,
        so every later step shares the prefix.
        """
        context = ensure_context(runtime.context)
        recalled = await self._recall(state, runtime, context)
        if recalled is not None:
            state = {**state, "messages": [*state["messages"], recalled]}
        decision, signals = plan_route(state, context, self.count_tokens)
        _, update = await self._infer(
            kind="plan",
            step=0,
            decision=decision,
            signals=signals,
            state=state,
            runtime=runtime,
            context=context,
        )
        if recalled is not None:
            update["messages"] = [recalled, *update["messages"]]
        update |= {
            "turn": state.get("turn", -1) + 1,
            "notice": False,
            "repair_attempts": 0,
            "repair_error": None,
        }
        return update

    async def _continue(self, leg: Leg, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        context = ensure_context(runtime.context)
        decision, signals = continuation_route(state, context, self.count_tokens)
        if decision.leg != leg:  # the edge and the node read the same state
            raise RuntimeError(f"routing edge chose {leg} but the decision now says {decision.leg}")
        _, update = await self._infer(
            kind="step",
            step=state.get("step", 0) + 1,
            decision=decision,
            signals=signals,
            state=state,
            runtime=runtime,
            context=context,
        )
        return update | {"notice": False}

    async def local(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the local model (llama-server)."""
        return await self._continue("local", state, runtime)

    async def cloud(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the cloud model."""
        return await self._continue("cloud", state, runtime)

    async def repair(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Retry a malformed tool call on the leg and provider that made it (never re-scored).

        The provider is preferred while healthy; when it is not, the repair falls
        over like any step.
        """
        context = ensure_context(runtime.context)
        leg: Leg = state.get("leg", "local")
        attempt = state.get("repair_attempts", 0) + 1
        decision = RouteDecision(
            leg=leg,
            score=None,
            threshold=None,
            reason=f"repair {attempt}/{context.max_repair_attempts} of a malformed tool call: "
            f"kept on the {leg} leg that made it",
        )
        _, update = await self._infer(
            kind="repair",
            step=state.get("step", 0) + 1,
            decision=decision,
            signals=None,
            state=state,
            runtime=runtime,
            context=context,
            prefer_provider=state.get("provider"),
        )
        return update | {"repair_attempts": attempt, "repair_error": None}

    async def _recall(
        self, state: State, runtime: Runtime[FusionContext], context: FusionContext
    ) -> HumanMessage | None:
        if runtime.store is None or context.memory_recall_limit == 0:
            return None
        messages = state["messages"]
        query = messages[turn_start(messages)].text if messages else ""
        try:
            ns = memory.namespace_of(get_config(), self.graph_name)
            items = await memory.recall(runtime.store, ns, query, context.memory_recall_limit)
        except Exception:
            logger.exception("recalling memories failed")
            return None
        return memory.memory_message(items)

    async def memory(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Run the memory jobs on the ``sub_runners`` leg; never fails or holds up the turn.

        ``inline`` mode runs after the reply is in state (and streamed) and records
        ``kind="memory"`` entries in ``route_log``; ``background`` mode detaches the
        jobs and returns at once (their records go to the store beside the memories).
        """
        context = ensure_context(runtime.context)
        store = runtime.store
        if store is None or context.sub_runners == "off" or not self.memory_jobs:
            return {}
        leg: Leg = "cloud" if context.sub_runners == "cloud" else "local"
        config = get_config()
        ns = memory.namespace_of(config, self.graph_name)
        thread_id = thread_id_of(config)
        messages = state["messages"]
        excerpt = memory.transcript(
            messages[turn_start(messages) :], max_chars=2 * context.conversation_max_tokens
        )
        turn, step = state.get("turn", 0), state.get("step", 0)
        chain = await self.resolver.chain(context)

        async def reflection_slot(link: ChainLink) -> int | None:
            pool = await self.resolver.slot_pool(link, context)
            return pool.reflection_slot if pool is not None else None

        async def one(job: memory.MemoryJob, job_config: RunnableConfig | None) -> list[RouteRecord]:
            try:
                result, records, dropped = await asyncio.wait_for(
                    memory.run_job(
                        job,
                        chain=chain,
                        leg=leg,
                        reflection_slot=reflection_slot,
                        excerpt=excerpt,
                        turn=turn,
                        step=step,
                        max_tokens=context.memory_max_tokens,
                        config=job_config,
                    ),
                    timeout=context.memory_timeout_s,
                )
            except TimeoutError:
                result, records, dropped = None, [], f"timed out after {context.memory_timeout_s} s"
            stored: list[dict[str, Any]] = []
            if result is not None:
                try:
                    stored = await memory.store_items(
                        store, ns, job, result, thread_id=thread_id, turn=turn, step=step
                    )
                except Exception as error:  # noqa: BLE001 - never fail the turn over memory
                    dropped = f"store write failed: {type(error).__name__}: {error}"
            if not records or (dropped is not None and not records[-1]["extra"].get("dropped")):
                records.append(memory.dropped_record(job, leg, turn, step, dropped or "no answer"))
            records[-1]["extra"] |= {"stored": len(stored), "dropped": dropped}
            return records

        async def run_all(job_config: RunnableConfig | None) -> list[RouteRecord]:
            results = await asyncio.gather(*(one(job, job_config) for job in self.memory_jobs))
            return [record for records in results for record in records]

        if context.memory_mode == "background":

            async def detached() -> None:
                records = await run_all(None)
                try:
                    for record in records:
                        await store.aput(memory.jobs_namespace(ns), uuid.uuid4().hex, dict(record))
                except Exception:
                    logger.exception("writing memory job records failed")

            memory.detach(detached())
            return {}
        records = await run_all(config)
        for record in records:
            runtime.stream_writer({"event": ROUTE_EVENT, **record})
        totals: dict[str, Any] = {}
        for record in records:
            totals = add_totals(totals, totals_of(record))
        return {"route_log": records, "totals": totals}

    async def tools(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Validate the last answer's tool batch, then run what passed."""
        context = ensure_context(runtime.context)
        messages = state["messages"]
        message = last_ai(messages)
        if message is None:
            raise RuntimeError("the tools node needs an AI message with tool calls last in state")
        batch = plan_batch(
            message,
            tools=self.tools_by_name,
            earlier_in_turn=messages[turn_start(messages) + 1 : -1],
            max_calls=context.max_tool_calls_per_step,
            loop_repeat_limit=context.loop_repeat_limit,
        )
        ran = await asyncio.gather(*(_run_call(self.tools_by_name[c["name"]], c) for c in batch.run))
        replies: dict[str, ToolMessage] = {m.tool_call_id: m for m in ran}
        for rejected in batch.rejected:
            replies[rejected.call_id] = ToolMessage(
                content=rejected.message, tool_call_id=rejected.call_id, name=rejected.name, status="error"
            )
        order = [c["id"] for c in message.tool_calls] + [c.get("id") for c in message.invalid_tool_calls]
        ordered = [replies[i] for i in order if i is not None and i in replies]
        ordered += [m for i, m in replies.items() if i not in order]
        malformed = batch.malformed
        update: dict[str, Any] = {
            "messages": ordered,
            "notice": batch.notice,
            "repair_error": "; ".join(r.message for r in malformed) if malformed else None,
        }
        if not malformed:
            update["repair_attempts"] = 0
        return update

    async def step_limit(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """End the turn at ``max_steps`` with a message saying so."""
        context = ensure_context(runtime.context)
        return {"messages": [AIMessage(prompts.STEP_LIMIT.format(max_steps=context.max_steps))]}

    async def give_up(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """End the turn after ``max_repair_attempts`` failed repairs, with a clear message."""
        text = prompts.REPAIR_EXHAUSTED.format(
            attempts=state.get("repair_attempts", 0), error=state.get("repair_error") or "unknown"
        )
        return {"messages": [AIMessage(text)], "repair_error": None}
