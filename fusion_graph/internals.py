"""The only place fusion-graph relies on LangGraph behaviour that is not public API.

Each use has a ``# NOTE`` saying why no public part does the job, and
``tests/unit/test_internals.py`` pins it against the installed langgraph, so an
upgrade that changes it fails there instead of silently elsewhere.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from langchain_core.runnables import Runnable, RunnableConfig
from langgraph._internal._constants import CONFIG_KEY_READ_STATE
from langgraph._internal._runnable import RunnableCallable
from langgraph.graph.state import CompiledStateGraph

from fusion_graph.errors import StateError

# NOTE: LangGraph marks a run that continues from a checkpoint (invoke with None,
# or ``Command(resume=...)``) with this configurable key. ``unavailable`` needs it
# to tell a fresh failure (raise, so the caller sees ``ChainExhausted``) from a
# resume (retry the inference): a node that raises cannot write state, and
# ``Runtime.execution_info`` carries no resume flag.
RESUMING_KEY = "__pregel_resuming"


def is_resuming(config: RunnableConfig) -> bool:
    """Whether the running task belongs to a run that resumed the thread from its checkpoint."""
    return bool(config.get("configurable", {}).get(RESUMING_KEY))


Compiled = TypeVar("Compiled", bound=CompiledStateGraph[Any, Any, Any, Any])


def reclass(compiled: CompiledStateGraph[Any, Any, Any, Any], cls: type[Compiled]) -> Compiled:
    """``compiled`` as an instance of ``cls``, a subclass of ``CompiledStateGraph``.

    The object is the one ``StateGraph.compile`` built (same channels, nodes,
    checkpointer); ``cls`` may add methods, and attributes its ``__init__`` takes
    back from ``copy()`` (which passes every instance attribute to ``__init__``).
    """
    # NOTE: ``StateGraph.compile`` has no hook for the class it builds, and the
    # per-thread run queue and input check must wrap ``astream`` itself: they
    # act before the input is written to the checkpoint, where no node can.
    if type(compiled) is not CompiledStateGraph or not issubclass(cls, CompiledStateGraph):
        raise TypeError(f"expected a CompiledStateGraph to re-class as {cls.__name__}")
    compiled.__class__ = cls
    return compiled  # type: ignore[return-value]


def untraced_edge(path: Callable[..., Awaitable[Any]]) -> Runnable[Any, Any]:
    """The async ``path`` of a conditional edge as a runnable that opens no trace run of its own."""
    # NOTE: ``add_conditional_edges`` wraps a plain function as a *traced* runnable: an async one
    # then costs a task and two callback tasks on every step (``bench/overhead.py`` measures it),
    # for a run that says nothing the step's own model run does not (its ``fusion_*`` metadata).
    # LangChain's ``create_agent`` registers its edges as ``RunnableCallable(..., trace=False)``;
    # no public part builds one.
    return RunnableCallable(None, path, trace=False)


def node_state(config: RunnableConfig) -> Any:
    """The graph state a node reached by ``Send`` would get from an edge (channels as of its step).

    Raises:
        StateError: The running task has no state to read (not a task of a graph run).
    """
    # NOTE: a node reached by ``Send`` gets the payload as its input, not the state.
    # LangGraph's own ``ToolNode`` reads the state of such a task through this
    # configurable key (``ToolNode._extract_state``); no public part reads it.
    read = config.get("configurable", {}).get(CONFIG_KEY_READ_STATE)
    if read is None:
        raise StateError("no graph state to read here: a step's order runs only inside a graph run")
    return read()
