"""Built-in workspace tools: reading, listing, replacing, and staying inside the workspace."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool

from fusion_graph.agent import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from fusion_graph.tools.workspace import (
    MAX_LIST_ENTRIES,
    MAX_READ_CHARS,
    TOOLS,
    WorkspaceError,
    _runtime_root,
    make_workspace_tools,
    resolve_in_workspace,
)
from tests.plugins.fakes import ai_calls, call, scripted, user_input


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "notes.txt").write_text("one\ntwo\nthree\nfour\n", encoding="utf-8")
    (root / "src" / "app.py").write_text("x = 1\ny = 1\n", encoding="utf-8")
    (tmp_path / "outside.txt").write_text("secret\n", encoding="utf-8")
    return root


@pytest.fixture
def tools(workspace: Path) -> dict[str, BaseTool]:
    return {t.name: t for t in make_workspace_tools(root=workspace)}


def test_tool_names() -> None:
    assert [t.name for t in TOOLS] == ["read_file", "list_dir", "replace_in_file"]


# --------------------------------------------------------------------------- read


async def test_read_a_line_range(tools: dict[str, BaseTool]) -> None:
    text = await tools["read_file"].ainvoke({"path": "notes.txt", "start_line": 2, "end_line": 3})
    assert text == "     2  two\n     3  three"


async def test_read_whole_file_and_past_the_end(tools: dict[str, BaseTool]) -> None:
    whole = await tools["read_file"].ainvoke({"path": "notes.txt"})
    assert whole.splitlines() == ["     1  one", "     2  two", "     3  three", "     4  four"]
    past = await tools["read_file"].ainvoke({"path": "notes.txt", "start_line": 9})
    assert past == "(no lines in range 9-4; file has 4)"


@pytest.mark.parametrize(("start", "end"), [(0, None), (3, 2)])
async def test_read_rejects_a_bad_line_range(tools: dict[str, BaseTool], start: int, end: int | None) -> None:
    with pytest.raises(WorkspaceError, match="line range"):
        await tools["read_file"].ainvoke({"path": "notes.txt", "start_line": start, "end_line": end})


async def test_read_rejects_directories_and_missing_files(tools: dict[str, BaseTool]) -> None:
    for path in ("src", "missing.txt", ".", "missing/app.py"):
        with pytest.raises(WorkspaceError, match=r"is not a (file|directory) in the workspace"):
            await tools["read_file"].ainvoke({"path": path})
    with pytest.raises(WorkspaceError, match="it is a directory; use list_dir"):
        await tools["read_file"].ainvoke({"path": "src"})


async def test_read_stops_at_the_output_limit_and_says_where_to_go_on(
    tools: dict[str, BaseTool], workspace: Path
) -> None:
    line = "y" * 99
    (workspace / "long.txt").write_text(f"{line}\n" * 2000, encoding="utf-8")
    text = await tools["read_file"].ainvoke({"path": "long.txt"})
    *shown, note = text.splitlines()
    assert len(text) <= MAX_READ_CHARS + 200
    last = len(shown)
    assert shown[-1] == f"{last:>6}  {line}"
    assert f"output limit reached before line {last + 1}; read on with start_line={last + 1}" in note
    assert f"{(2000 - last) * 100} bytes follow" in note
    rest = await tools["read_file"].ainvoke(
        {"path": "long.txt", "start_line": last + 1, "end_line": last + 1}
    )
    assert rest == f"{last + 1:>6}  {line}"


async def test_read_cuts_a_line_longer_than_the_limit(tools: dict[str, BaseTool], workspace: Path) -> None:
    (workspace / "wide.txt").write_text("z" * (3 * MAX_READ_CHARS) + "\nnext\n", encoding="utf-8")
    first, note = (await tools["read_file"].ainvoke({"path": "wide.txt"})).splitlines()
    assert first == f"{1:>6}  " + "z" * (MAX_READ_CHARS - 8)
    assert "line 1 was cut; read on with start_line=2; 5 bytes follow" in note
    assert await tools["read_file"].ainvoke({"path": "wide.txt", "start_line": 2}) == "     2  next"


# --------------------------------------------------------------------------- list


async def test_list_puts_directories_first(tools: dict[str, BaseTool], workspace: Path) -> None:
    (workspace / "a.txt").write_text("", encoding="utf-8")
    (workspace / "zdir").mkdir()
    listing = await tools["list_dir"].ainvoke({})
    assert listing.splitlines() == ["src/", "zdir/", "a.txt", "notes.txt"]
    assert await tools["list_dir"].ainvoke({"path": "src"}) == "app.py"
    assert await tools["list_dir"].ainvoke({"path": "zdir"}) == "(empty directory)"


async def test_list_rejects_files(tools: dict[str, BaseTool]) -> None:
    with pytest.raises(WorkspaceError, match="is not a directory"):
        await tools["list_dir"].ainvoke({"path": "notes.txt"})


async def test_list_is_bounded(tools: dict[str, BaseTool], workspace: Path) -> None:
    many = workspace / "many"
    many.mkdir()
    (many / "zz_dir").mkdir()
    for i in range(MAX_LIST_ENTRIES + 2):
        (many / f"f{i:04}").touch()
    lines = (await tools["list_dir"].ainvoke({"path": "many"})).splitlines()
    assert lines[0] == "zz_dir/"
    assert lines[1:3] == ["f0000", "f0001"]
    assert len(lines) == MAX_LIST_ENTRIES + 1
    assert lines[-1] == "... (3 more; list a subdirectory to narrow it down)"


# --------------------------------------------------------------------------- replace


async def test_replace_unique_text(tools: dict[str, BaseTool], workspace: Path) -> None:
    result = await tools["replace_in_file"].ainvoke({"path": "notes.txt", "old": "two", "new": "2"})
    assert result == "replaced 1 occurrence(s) in notes.txt"
    assert (workspace / "notes.txt").read_text(encoding="utf-8") == "one\n2\nthree\nfour\n"


async def test_replace_count_mismatch_changes_nothing(tools: dict[str, BaseTool], workspace: Path) -> None:
    target = workspace / "src" / "app.py"
    with pytest.raises(WorkspaceError, match=r"occurs 2 times .* but count=1"):
        await tools["replace_in_file"].ainvoke({"path": "src/app.py", "old": "= 1", "new": "= 2"})
    assert target.read_text(encoding="utf-8") == "x = 1\ny = 1\n"


async def test_replace_all_with_count_0(tools: dict[str, BaseTool], workspace: Path) -> None:
    args = {"path": "src/app.py", "old": "= 1", "new": "= 2", "count": 0}
    assert await tools["replace_in_file"].ainvoke(args) == "replaced 2 occurrence(s) in src/app.py"
    assert (workspace / "src" / "app.py").read_text(encoding="utf-8") == "x = 2\ny = 2\n"


async def test_replace_with_matching_count(tools: dict[str, BaseTool], workspace: Path) -> None:
    args = {"path": "src/app.py", "old": "= 1", "new": "= 3", "count": 2}
    assert await tools["replace_in_file"].ainvoke(args) == "replaced 2 occurrence(s) in src/app.py"


@pytest.mark.parametrize(("old", "message"), [("zzz", "not found"), ("", "old text is empty")])
async def test_replace_refuses_missing_or_empty_text(
    tools: dict[str, BaseTool], workspace: Path, old: str, message: str
) -> None:
    with pytest.raises(WorkspaceError, match=message):
        await tools["replace_in_file"].ainvoke({"path": "notes.txt", "old": old, "new": "x"})
    assert (workspace / "notes.txt").read_text(encoding="utf-8") == "one\ntwo\nthree\nfour\n"


# --------------------------------------------------------------------------- confinement


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/etc/passwd", "absolute path"),
        ("../outside.txt", "leaves the workspace"),
        ("src/../../outside.txt", "leaves the workspace"),
        ("", "path is empty"),
        ("   ", "path is empty"),
    ],
)
async def test_paths_outside_the_workspace_are_refused(
    tools: dict[str, BaseTool], path: str, message: str
) -> None:
    with pytest.raises(WorkspaceError, match=message):
        await tools["read_file"].ainvoke({"path": path})
    with pytest.raises(WorkspaceError, match=message):
        await tools["list_dir"].ainvoke({"path": path})
    with pytest.raises(WorkspaceError, match=message):
        await tools["replace_in_file"].ainvoke({"path": path, "old": "secret", "new": "x"})


async def test_symlinks_are_refused_even_inside_the_workspace(
    tools: dict[str, BaseTool], workspace: Path, tmp_path: Path
) -> None:
    (workspace / "link.txt").symlink_to(tmp_path / "outside.txt")
    (workspace / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    (workspace / "alias.py").symlink_to(workspace / "src" / "app.py")
    for path in ("link.txt", "linkdir/outside.txt", "alias.py"):
        with pytest.raises(WorkspaceError, match="is a symlink; the workspace tools refuse symlinks"):
            await tools["read_file"].ainvoke({"path": path})
        with pytest.raises(WorkspaceError, match="is a symlink"):
            await tools["replace_in_file"].ainvoke({"path": path, "old": "secret", "new": "leaked"})
    with pytest.raises(WorkspaceError, match="'linkdir' is a symlink"):
        await tools["list_dir"].ainvoke({"path": "linkdir"})
    assert (tmp_path / "outside.txt").read_text(encoding="utf-8") == "secret\n"
    assert (workspace / "src" / "app.py").read_text(encoding="utf-8") == "x = 1\ny = 1\n"


async def test_list_marks_symlinks_without_following_them(
    tools: dict[str, BaseTool], workspace: Path
) -> None:
    (workspace / "linkdir").symlink_to(workspace / "src", target_is_directory=True)
    assert (await tools["list_dir"].ainvoke({})).splitlines() == ["src/", "linkdir@", "notes.txt"]


def test_resolve_in_workspace(workspace: Path, tmp_path: Path) -> None:
    assert resolve_in_workspace(workspace, ".") == workspace.resolve()
    assert resolve_in_workspace(workspace, "src/../notes.txt") == (workspace / "notes.txt").resolve()
    (workspace / "out").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(WorkspaceError, match="leaves the workspace"):
        resolve_in_workspace(workspace, "out/outside.txt")


# --------------------------------------------------------------------------- the run's workspace root


async def test_tools_without_a_root_outside_a_graph_raise_a_clear_error() -> None:
    for tool in TOOLS:
        with pytest.raises(WorkspaceError, match=r"no workspace root.*make_workspace_tools\(root=\.\.\.\)"):
            await tool.ainvoke({"path": ".", "old": "a", "new": "b"})
    with pytest.raises(WorkspaceError, match="no workspace root"):
        _runtime_root(None)


async def test_tools_without_a_root_use_the_runs_workspace_root(workspace: Path) -> None:
    model = scripted(
        "any",
        [
            ai_calls(
                call("list_dir", {"path": "."}, "l1"),
                call("read_file", {"path": "../outside.txt"}, "r1"),
            ),
            "done",
        ],
    )
    # The operator allows the parent directory; the run narrows it to the workspace.
    settings = FusionSettings(workspace_root=str(workspace.parent))
    graph = build_graph(cloud_model=model, local_model=model, settings=settings)
    out = await graph.ainvoke(
        user_input("look around"), context=FusionContext(mode="local", workspace_root=str(workspace))
    )
    results = {m.tool_call_id: m for m in out["messages"] if isinstance(m, ToolMessage)}
    assert results["l1"].content == "src/\nnotes.txt"
    assert results["r1"].status == "error"
    assert "leaves the workspace" in str(results["r1"].content)
    assert out["messages"][-1].content == "done"
