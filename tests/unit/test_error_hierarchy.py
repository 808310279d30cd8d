"""Every error a caller can meet is a ``FusionError``, and still the built-in error it always was."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel

from fusion_graph import build_graph
from fusion_graph.coordination.shared_base import SharedStateUnavailable
from fusion_graph.errors import (
    Closed,
    FusionError,
    StateError,
    SyncInEventLoop,
    UnknownProvider,
    UsageError,
)
from fusion_graph.providers.chain import ProviderChain
from fusion_graph.providers.slots import SlotPool
from fusion_graph.replay.labelling import LocalUnavailable

PACKAGE = Path(__file__).resolve().parents[2] / "fusion_graph"
BUILT_IN = {"ValueError", "RuntimeError", "TypeError", "KeyError"}
#: Where a bare built-in error is right, and why: each is raised inside a pydantic validator (which
#: turns it into the setting's or field's own error) or in the pure bottom layers, which import
#: nothing of the package (``ContextError`` and the CLI's one-line errors report them).
BARE_ALLOWED = {
    "settings.py": "pydantic validators of FusionSettings and the ranges both use",
    "context.py": "pydantic validators of FusionContext",
    "routing/score.py": "the score's own checks, the bottom layer (below errors.py)",
    "routing/rule.py": "the decision's own checks, the bottom layer (below errors.py)",
    "internals.py": "a check of LangGraph's own class, met only if LangGraph changes",
}


def bare_raises() -> list[str]:
    """``file:line`` of every ``raise ValueError(...)`` (and the like) outside the allowed modules."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in BARE_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Raise):
                continue
            raised = node.exc
            if (
                isinstance(raised, ast.Call)
                and isinstance(raised.func, ast.Name)
                and raised.func.id in BUILT_IN
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {raised.func.id}")
    return found


def test_no_module_raises_a_bare_built_in_error_a_caller_could_meet() -> None:
    assert bare_raises() == []


@pytest.mark.parametrize(
    ("error", "built_in"),
    [
        (UsageError, ValueError),
        (UsageError, TypeError),
        (UnknownProvider, KeyError),
        (Closed, RuntimeError),
        (SyncInEventLoop, RuntimeError),
        (StateError, RuntimeError),
        (LocalUnavailable, RuntimeError),
        (SharedStateUnavailable, RuntimeError),
    ],
)
def test_each_error_is_a_fusion_error_and_its_built_in(
    error: type[Exception], built_in: type[Exception]
) -> None:
    assert issubclass(error, FusionError) and issubclass(error, built_in)


def test_misuse_raises_the_packages_own_errors() -> None:
    with pytest.raises(UsageError, match="pass either a resolver"):
        build_graph(cloud_model=GenericFakeChatModel(messages=iter([])), resolver=object())  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="total_slots"):
        SlotPool(0)
    chain = ProviderChain([])
    with pytest.raises(UnknownProvider, match="no provider 'nope'") as unknown:
        chain.link("nope")
    assert str(unknown.value).startswith("no provider")  # not quoted, as KeyError would


def test_a_sync_call_inside_a_running_loop_is_named() -> None:
    import asyncio

    graph = build_graph(cloud_model=GenericFakeChatModel(messages=iter([])))

    async def inside() -> None:
        with pytest.raises(SyncInEventLoop, match="would block this running event loop"):
            graph.invoke({"messages": [("user", "hi")]})

    asyncio.run(inside())
