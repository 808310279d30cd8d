"""The fusion agent graph: plan on cloud, route each step by score, validate every batch.

Diagram::

    START -> plan -> tools -> route -> local | cloud -> tools -> ... -> reply
                              route -> repair (same leg) | step_limit | give_up
    reply -> memory (side branch, on the sub_runners leg) -> END
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

from langchain_core.language_models import BaseChatModel
from langchain_core.tools import BaseTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.runtime import Runtime
from langgraph.store.base import BaseStore

from fusion_graph.chain import ProviderChain
from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.memory import DEFAULT_JOBS, MemoryJob
from fusion_graph.nodes import Nodes
from fusion_graph.resolver import ProviderResolver
from fusion_graph.signals import TokenCounter, approximate_tokens
from fusion_graph.state import InputState, State
from fusion_graph.tools import TOOLS
from fusion_graph.turn import continuation_route, last_ai, next_step, wants_tools

GRAPH_NAME = "fusion"


def memory_on(runtime: Runtime[FusionContext]) -> bool:
    """Whether memory jobs can run: a store is attached and ``sub_runners`` is not ``off``."""
    return runtime.store is not None and ensure_context(runtime.context).sub_runners != "off"


def after_model(state: State, runtime: Runtime[FusionContext]) -> Literal["tools", "memory", "__end__"]:
    """Tool calls go to the tool node; a reply ends the turn, via the memory side branch."""
    if wants_tools(last_ai(state["messages"])):
        return "tools"
    return "memory" if memory_on(runtime) else "__end__"


Router = Callable[[State, Runtime[FusionContext]], Awaitable[str | list[str]]]


def make_router(count_tokens: TokenCounter) -> Router:
    """The routing edge after a tool batch: limits and repairs first, then the score."""

    async def route(state: State, runtime: Runtime[FusionContext]) -> str | list[str]:
        context = ensure_context(runtime.context)
        step = next_step(state)
        if step >= context.max_steps:
            return "step_limit"
        if state.get("repair_error"):
            if state.get("repair_attempts", 0) >= context.max_repair_attempts:
                return "give_up"
            return "repair"
        decision, _ = continuation_route(state, context, count_tokens)
        every = context.memory_every_k_steps
        if every and step % every == 0 and memory_on(runtime):
            return [decision.leg, "memory"]  # the side branch runs beside the next step
        return decision.leg

    return route


def build_graph(
    *,
    cloud_model: BaseChatModel | None = None,
    local_model: BaseChatModel | None = None,
    tools: Sequence[BaseTool] | None = None,
    checkpointer: BaseCheckpointSaver[str] | None = None,
    store: BaseStore | None = None,
    count_tokens: TokenCounter = approximate_tokens,
    chain: ProviderChain | None = None,
    resolver: ProviderResolver | None = None,
    memory_jobs: Sequence[MemoryJob] = DEFAULT_JOBS,
) -> CompiledStateGraph[State, FusionContext, InputState, State]:
    """Build and compile the fusion graph.

    Args:
        cloud_model: Chat model of the cloud leg; ``None`` builds a ``ChatOpenAI``
            from the run's context (key from the environment).
        local_model: Chat model of the local leg; ``None`` builds a ``ChatOpenAI``
            pointed at llama-server's ``local_base_url``.
        tools: Tools bound to both legs; ``None`` means the workspace file tools.
        checkpointer: Persistence for threads (leave ``None`` under the LangGraph server).
        store: Long-term store (memories).
        count_tokens: The token estimator used for every routing signal.
        chain: A provider chain of your own (more providers, custom health policy or
            pricing) instead of ``cloud_model``/``local_model``.
        resolver: A ``ProviderResolver`` you keep, to close the graph's providers
            (``await resolver.aclose()``) when your app shuts down; built from the
            arguments above when ``None``.
        memory_jobs: Structured memory jobs run after each reply (needs a store).
    """
    if resolver is None:
        resolver = ProviderResolver(cloud=cloud_model, local=local_model, chain=chain)
    elif cloud_model is not None or local_model is not None or chain is not None:
        raise ValueError("pass either a resolver or cloud_model/local_model/chain, not both")
    nodes = Nodes(
        resolver=resolver,
        tools=TOOLS if tools is None else tools,
        count_tokens=count_tokens,
        memory_jobs=memory_jobs,
        graph_name=GRAPH_NAME,
    )
    builder = StateGraph(State, context_schema=FusionContext, input_schema=InputState)
    builder.add_node("plan", nodes.plan)
    builder.add_node("local", nodes.local)
    builder.add_node("cloud", nodes.cloud)
    builder.add_node("tools", nodes.tools)
    builder.add_node("repair", nodes.repair)
    builder.add_node("step_limit", nodes.step_limit)
    builder.add_node("give_up", nodes.give_up)
    builder.add_node("memory", nodes.memory)

    builder.add_edge(START, "plan")
    for executor in ("plan", "local", "cloud", "repair"):
        builder.add_conditional_edges(executor, after_model, ["tools", "memory", END])
    builder.add_conditional_edges(
        "tools", make_router(count_tokens), ["local", "cloud", "repair", "step_limit", "give_up", "memory"]
    )
    builder.add_edge("step_limit", END)
    builder.add_edge("give_up", END)
    builder.add_edge("memory", END)
    return builder.compile(checkpointer=checkpointer, store=store, name=GRAPH_NAME)


#: The default graph for ``langgraph dev`` / LangGraph server (which bring their own checkpointer).
graph = build_graph()
