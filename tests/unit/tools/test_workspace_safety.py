"""What a hostile run or a crash cannot do to the workspace: secret files, a swapped run root, lost edits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool

from fusion_graph import ContextError, FusionContext, FusionSettings, build_graph
from fusion_graph.nodes.tools import next_wave, touched_file
from fusion_graph.settings import workspace_subpath
from fusion_graph.tools.files import WorkspaceError, WorkspaceRoot
from fusion_graph.tools.workspace import _list, _read, _replace, make_workspace_tools
from tests.plugins.fakes import ai_calls, call, scripted, user_input


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_text("alpha\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "a.txt").write_text("OUTSIDE\n")
    return root


def tools_of(root: Path, settings: FusionSettings | None = None) -> dict[str, BaseTool]:
    return {t.name: t for t in make_workspace_tools(root=root, settings=settings)}


# --------------------------------------------------------------------------- secret files


@pytest.mark.parametrize("path", [".env", ".env.local", "sub/.env", "deploy.pem", "id_rsa", ".git/config"])
async def test_secret_files_are_refused_by_default(ws: Path, path: str) -> None:
    target = ws / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("OPENAI_API_KEY=sk-live-secret\n")
    tools = tools_of(ws, FusionSettings())
    for name, args in (
        ("read_file", {"path": path}),
        ("replace_in_file", {"path": path, "old": "a", "new": "b"}),
    ):
        with pytest.raises(WorkspaceError, match="secret-file pattern"):
            await tools[name].ainvoke(args)
    assert target.read_text() == "OPENAI_API_KEY=sk-live-secret\n"


async def test_the_operator_can_clear_or_extend_the_secret_list(ws: Path) -> None:
    (ws / ".env").write_text("X=1\n")
    (ws / "notes.secret").write_text("hidden\n")
    cleared = tools_of(ws, FusionSettings(secret_files=()))
    assert "X=1" in await cleared["read_file"].ainvoke({"path": ".env"})
    extended = tools_of(ws, FusionSettings(secret_files=("*.secret",)))
    with pytest.raises(WorkspaceError, match=r"'\*\.secret'"):
        await extended["read_file"].ainvoke({"path": "notes.secret"})


async def test_a_key_in_a_tool_result_never_reaches_state(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusion_graph.redact import register_secret

    key = "sk-operator-" + "k3y" * 8
    register_secret(key)
    (ws / "config.txt").write_text(f"token = {key}\n")
    model = scripted("any", [ai_calls(call("read_file", {"path": "config.txt"}, "r1")), "done"])
    graph = build_graph(cloud_model=model, local_model=model, settings=FusionSettings(workspace_root=str(ws)))
    out = await graph.ainvoke(user_input("read it"), context=FusionContext(mode="local", sub_runners="off"))
    [result] = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert key not in str(result.content) and "[REDACTED]" in str(result.content)
    assert all(key not in str(m.content) for m in out["messages"])


# --------------------------------------------------------------------------- the run's root


def test_a_run_root_is_resolved_lexically_and_never_above_the_operators() -> None:
    assert workspace_subpath("/srv/ws", "project/src") == ("project", "src")
    assert workspace_subpath("/srv/ws", "/srv/ws/project/./x/..") == ("project",)
    assert workspace_subpath(".", "project") == ("project",)
    for hostile in ("../x", "/etc", "/srv/wsx", "a/../../b"):
        with pytest.raises(ContextError, match="lies outside the operator's workspace"):
            workspace_subpath("/srv/ws", hostile)


def test_a_symlinked_run_root_is_refused_naming_the_field(ws: Path, tmp_path: Path) -> None:
    (ws / "link").symlink_to(tmp_path / "outside")
    root = WorkspaceRoot(ws, ("link",))
    runs: list[Callable[[], str]] = [lambda: _read(root, "a.txt", 1, None), lambda: _list(root, ".")]
    for run in runs:
        with pytest.raises(
            WorkspaceError, match="the run's workspace_root cannot be used: 'link' is a symlink"
        ):
            run()
    with pytest.raises(WorkspaceError, match="workspace_root"):
        _replace(root, "a.txt", "OUTSIDE", "pwned", 1)
    assert (tmp_path / "outside" / "a.txt").read_text() == "OUTSIDE\n"


def test_a_run_root_swapped_for_a_symlink_mid_race_never_reaches_outside(ws: Path, tmp_path: Path) -> None:
    root = WorkspaceRoot(ws, ("sub",))
    stop = threading.Event()

    def swap() -> None:
        real, parked = ws / "sub", ws / "parked"
        while not stop.is_set():
            real.rename(parked)
            real.symlink_to(tmp_path / "outside")
            real.unlink()
            parked.rename(real)
            time.sleep(0.0002)  # the real directory stays in place a moment: some reads go through

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen: list[str] = []
    try:
        for _ in range(1000):
            with contextlib.suppress(WorkspaceError):
                seen.append(_read(root, "a.txt", 1, None))
    finally:
        stop.set()
        swapper.join()
    assert seen, "some reads went through the real directory"
    assert not any("OUTSIDE" in text for text in seen)


async def test_a_relative_run_root_works_with_a_relative_operator_root(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ws.parent)
    model = scripted("any", [ai_calls(call("read_file", {"path": "a.txt"}, "r1")), "done"])
    graph = build_graph(cloud_model=model, local_model=model, settings=FusionSettings(workspace_root="ws"))
    context = FusionContext(mode="local", sub_runners="off", workspace_root="sub")
    out = await graph.ainvoke(user_input("read"), context=context)
    [result] = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert "alpha" in str(result.content)


# --------------------------------------------------------------------------- edits never lost


def test_aliases_of_one_file_run_in_batch_order() -> None:
    spellings = ["a", "./a", ".//a", "sub/../a", "a/"]
    calls: list[Any] = [
        {"name": "replace_in_file", "args": {"path": p}, "id": str(i), "type": "tool_call"}
        for i, p in enumerate(spellings)
    ]
    assert {touched_file(c) for c in calls} == {"a"}
    assert [c["id"] for c in next_wave(calls)] == ["0"], "one call on the file at a time"


async def test_64_concurrent_edits_of_one_file_all_land(ws: Path) -> None:
    target = ws / "counter.txt"
    target.write_text("".join(f"line {i}: todo\n" for i in range(64)))
    tools = tools_of(ws)
    results = await asyncio.gather(
        *(
            tools["replace_in_file"].ainvoke(
                {"path": "counter.txt", "old": f"line {i}: todo", "new": f"line {i}: done"}
            )
            for i in range(64)
        )
    )
    assert all(r == "replaced 1 occurrence(s) in counter.txt" for r in results)
    assert target.read_text() == "".join(f"line {i}: done\n" for i in range(64))


async def test_an_edit_run_again_after_a_crash_reports_it_is_applied(ws: Path) -> None:
    tools = tools_of(ws)
    args = {"path": "sub/a.txt", "old": "alpha", "new": "alpha beta"}
    assert await tools["replace_in_file"].ainvoke(args) == "replaced 1 occurrence(s) in sub/a.txt"
    again = await tools["replace_in_file"].ainvoke(args)  # LangGraph may run a finished call once more
    assert again.startswith("already applied")
    assert (ws / "sub" / "a.txt").read_text() == "alpha beta\n"


async def test_a_negative_count_is_refused(ws: Path) -> None:
    with pytest.raises(WorkspaceError, match="count must be 0"):
        await tools_of(ws)["replace_in_file"].ainvoke(
            {"path": "sub/a.txt", "old": "alpha", "new": "b", "count": -1}
        )
    assert (ws / "sub" / "a.txt").read_text() == "alpha\n"
    assert os.listdir(ws / "sub") == ["a.txt"]


@pytest.mark.parametrize("mode", ["ainvoke", "messages"])
async def test_a_run_root_reached_through_a_symlink_is_refused_before_a_model_is_asked(
    tmp_path: Path, mode: str
) -> None:
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.memory import InMemorySaver

    from fusion_graph import build_graph
    from fusion_graph.context import FusionContext
    from fusion_graph.errors import ContextError
    from fusion_graph.settings import FusionSettings
    from tests.plugins.fakes import scripted, user_input

    operator = tmp_path / "operator"
    outside = tmp_path / "outside"
    operator.mkdir()
    outside.mkdir()
    (operator / "team").symlink_to(outside, target_is_directory=True)
    cloud, local = scripted("c", ["never"]), scripted("l", ["never"])
    graph = build_graph(
        cloud_model=cloud,
        local_model=local,
        checkpointer=InMemorySaver(),
        settings=FusionSettings(workspace_root=str(operator)),
    )
    config: RunnableConfig = {"configurable": {"thread_id": f"symlinked-{mode}"}}
    context = FusionContext(workspace_root="team", sub_runners="off")
    with pytest.raises(ContextError, match="symlink"):
        if mode == "ainvoke":
            await graph.ainvoke(user_input("list it"), config, context=context)
        else:
            async for _ in graph.astream(
                user_input("list it"), config, context=context, stream_mode="messages"
            ):
                pass
    assert not (await graph.aget_state(config)).values  # nothing was written
    (operator / "real").mkdir()  # a real directory inside is accepted
    real = FusionContext(workspace_root="real", sub_runners="off")
    out = await graph.ainvoke(user_input("hi"), config, context=real)
    assert out["messages"][-1].content in ("never",)
