"""The fusion agent graph: plan on cloud, route each step by score, one task per tool call.

Diagram::

    START -> plan -> tools (one Send per call) -> local | cloud -> tools -> ...  (a one-call batch)
                     tools -> route -> local | cloud                  (the tasks of a larger batch join)
                     tools | route -> repair (same leg) | step_limit | give_up | memory | END
                                      route -> tools (the next wave of a batch)
    plan | local | cloud | repair -> route          (a batch with nothing to run)
    plan | local | cloud | repair -> memory -> END  (a reply; memory is the side branch)
    plan | local | cloud | repair -> synthesis -> memory | END  (a local reply re-written on cloud)
    plan | local | cloud | repair -> unavailable    (every provider down: raise; resume retries)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from langchain_core.language_models import BaseChatModel
from langchain_core.tools import BaseTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.store.base import BaseStore

from fusion_graph.context import FusionContext, context_defaults
from fusion_graph.errors import UsageError
from fusion_graph.internals import untraced_edge
from fusion_graph.memory import DEFAULT_JOBS, MemoryJob
from fusion_graph.memory.runs import MemoryRuns
from fusion_graph.nodes import (
    AFTER_TOOLS,
    InferenceNodes,
    MemoryNodes,
    RouteNode,
    SynthesisNode,
    after_model,
    after_synthesis,
    give_up,
    memory_on,
    step_limit,
    unavailable,
)
from fusion_graph.nodes.step import Sizer
from fusion_graph.nodes.tools import tools_node
from fusion_graph.providers.chain import ProviderChain
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.run_queue import FusionGraph, serialised
from fusion_graph.settings import FusionSettings
from fusion_graph.sizing.turn import TokenCounter, approximate_tokens
from fusion_graph.state import InputState, State, check_thread_ttl
from fusion_graph.tools.workspace import make_workspace_tools

GRAPH_NAME = "fusion"


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
    settings: FusionSettings | None = None,
) -> FusionGraph:
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
        settings: The operator's settings (endpoints, keys, workspace, prices,
            timeouts); ``None`` reads ``FUSION_*`` variables (and ``.env``) now.
            The run context's ``FUSION_<FIELD>`` defaults are read now too.

    Returns:
        The compiled graph; runs on one ``thread_id`` in this process queue behind each other.

    Raises:
        ContextError: A run-context default in the environment is invalid (named).
        UsageError: A LangGraph server set to prune threads with ``keep_latest`` (``check_thread_ttl``).
    """
    run_defaults = context_defaults()  # FUSION_<FIELD> run defaults, read now as the settings are
    check_thread_ttl(os.environ)
    if resolver is None:
        resolver = ProviderResolver(cloud=cloud_model, local=local_model, chain=chain, settings=settings)
    elif cloud_model is not None or local_model is not None or chain is not None or settings is not None:
        raise UsageError("pass either a resolver or cloud_model/local_model/chain/settings, not both")
    tool_list = list(make_workspace_tools(settings=resolver.settings) if tools is None else tools)
    memory_runs = MemoryRuns(resolver=resolver, jobs=memory_jobs, tools=tool_list)
    sizer = Sizer(resolver, tool_list, count_tokens)
    memory = MemoryNodes(memory_runs, graph_name=GRAPH_NAME, sizer=sizer)
    route = RouteNode(count_tokens, {t.name: t for t in tool_list}, memory_on, sizer)
    inference = InferenceNodes(
        resolver=resolver,
        tools=tool_list,
        count_tokens=count_tokens,
        recall=memory.recall,
        sizer=sizer,
        graph_name=GRAPH_NAME,
    )

    builder = StateGraph(State, context_schema=FusionContext, input_schema=InputState)
    builder.add_node("plan", inference.plan)
    # A step's order (its Send payload) is these nodes' input; they read the state themselves.
    builder.add_node("local", inference.local, input_schema=State)
    builder.add_node("cloud", inference.cloud, input_schema=State)
    builder.add_node("repair", inference.repair)
    # A Send payload (a list of one tool call), not the state, is this node's input.
    builder.add_node("tools", tools_node(tool_list))
    builder.add_node("route", route)
    builder.add_node("step_limit", step_limit)
    builder.add_node("give_up", give_up)
    builder.add_node("unavailable", unavailable)
    builder.add_node("memory", memory.memory)
    builder.add_node("synthesis", SynthesisNode(sizer, tool_list))

    builder.add_edge(START, "plan")
    for executor in ("plan", "local", "cloud", "repair"):
        builder.add_conditional_edges(
            executor,
            untraced_edge(after_model),
            ["tools", "route", "synthesis", "memory", "unavailable", END],
        )
    # A one-call batch is routed by the edge; the tasks of a larger one join at route, which decides once.
    builder.add_conditional_edges("tools", untraced_edge(route.after_tools), list(AFTER_TOOLS))
    builder.add_conditional_edges("synthesis", untraced_edge(after_synthesis), ["memory", END])
    builder.add_edge("step_limit", END)
    builder.add_edge("give_up", END)
    builder.add_edge("memory", END)
    compiled = builder.compile(checkpointer=checkpointer, store=store, name=GRAPH_NAME)
    return serialised(compiled, memory_runs, run_defaults)


#: The default graph for ``langgraph dev`` / LangGraph server (which bring their own checkpointer).
graph = build_graph()
