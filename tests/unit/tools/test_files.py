"""The workspace tools never damage a file and never reach outside the workspace.

Bytes outside an edit stay as they were (line endings, BOM, non-UTF-8 text,
mode), writes are atomic, links and special files are refused, a symlink
swapped in mid-call is never followed, reads take bounded memory, and every
result can be sent on as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from langchain_core.tools import BaseTool

from fusion_graph.tools.files import TEMP_PREFIX, WorkspaceError, display_name, split_relative
from fusion_graph.tools.workspace import make_workspace_tools

SECRET = b"SECRET outside the workspace: safe\n"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (tmp_path / "outside.txt").write_bytes(SECRET)
    return root


@pytest.fixture
def tools(ws: Path) -> dict[str, BaseTool]:
    return {t.name: t for t in make_workspace_tools(root=ws)}


async def replace(tools: dict[str, BaseTool], path: str, old: str, new: str, count: int = 1) -> str:
    result: str = await tools["replace_in_file"].ainvoke(
        {"path": path, "old": old, "new": new, "count": count}
    )
    return result


# --------------------------------------------------------------------------- bytes outside the edit


async def test_crlf_file_keeps_crlf(tools: dict[str, BaseTool], ws: Path) -> None:
    (ws / "win.txt").write_bytes(b"one\r\ntwo\r\nthree\r\n")
    await replace(tools, "win.txt", "one\ntwo", "1\n2\n2.5")
    await replace(tools, "win.txt", "three", "3")
    assert (ws / "win.txt").read_bytes() == b"1\r\n2\r\n2.5\r\n3\r\n"
    text = await tools["read_file"].ainvoke({"path": "win.txt", "end_line": 2})
    assert text == "     1  1\n     2  2"


async def test_mixed_line_endings_are_left_byte_identical(tools: dict[str, BaseTool], ws: Path) -> None:
    (ws / "mixed.txt").write_bytes(b"a\r\nb\nc\r\n\rd\n")
    await replace(tools, "mixed.txt", "b", "B")
    assert (ws / "mixed.txt").read_bytes() == b"a\r\nB\nc\r\n\rd\n"
    # Multi-line text the model copied without \r still finds the CRLF span, and keeps it.
    await replace(tools, "mixed.txt", "a\nB", "A\nb")
    assert (ws / "mixed.txt").read_bytes() == b"A\r\nb\nc\r\n\rd\n"


async def test_crlf_text_from_the_model_matches_an_lf_file(tools: dict[str, BaseTool], ws: Path) -> None:
    (ws / "unix.txt").write_bytes(b"x\ny\n")
    await replace(tools, "unix.txt", "x\r\ny", "X\r\nY")
    assert (ws / "unix.txt").read_bytes() == b"X\nY\n"


async def test_bom_is_kept_and_hidden_from_the_model(tools: dict[str, BaseTool], ws: Path) -> None:
    (ws / "bom.txt").write_bytes(b"\xef\xbb\xbfhello\r\nworld\r\n")
    assert await tools["read_file"].ainvoke({"path": "bom.txt"}) == "     1  hello\n     2  world"
    await replace(tools, "bom.txt", "hello", "hi")
    assert (ws / "bom.txt").read_bytes() == b"\xef\xbb\xbfhi\r\nworld\r\n"


async def test_latin1_file_is_edited_byte_for_byte(tools: dict[str, BaseTool], ws: Path) -> None:
    target = ws / "latin1.py"
    target.write_bytes(b"caf\xe9 = 1\nx = 2\n")
    assert await replace(tools, "latin1.py", "x = 2", "x = 3") == "replaced 1 occurrence(s) in latin1.py"
    assert target.read_bytes() == b"caf\xe9 = 1\nx = 3\n"
    with pytest.raises(WorkspaceError, match=r"not valid UTF-8 .* only ASCII old and new text"):
        await replace(tools, "latin1.py", "x = 3", "x = 'é'")
    assert target.read_bytes() == b"caf\xe9 = 1\nx = 3\n"
    text = await tools["read_file"].ainvoke({"path": "latin1.py"})
    assert text.splitlines()[0] == "     1  caf\\xe9 = 1"
    assert "not valid UTF-8" in text.splitlines()[-1]
    json.dumps(text, ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("mode", [0o640, 0o755, 0o600])
async def test_file_mode_is_kept(tools: dict[str, BaseTool], ws: Path, mode: int) -> None:
    target = ws / "script.sh"
    target.write_bytes(b"echo hi\n")
    target.chmod(mode)
    await replace(tools, "script.sh", "hi", "there")
    assert target.read_bytes() == b"echo there\n"
    assert stat.S_IMODE(target.stat().st_mode) == mode


async def test_a_read_only_file_is_not_rewritten(tools: dict[str, BaseTool], ws: Path) -> None:
    target = ws / "frozen.txt"
    target.write_bytes(b"keep\n")
    target.chmod(0o444)
    with pytest.raises(WorkspaceError, match=r"'frozen.txt' is read-only .* chmod it first"):
        await replace(tools, "frozen.txt", "keep", "lose")
    assert target.read_bytes() == b"keep\n"
    assert await tools["read_file"].ainvoke({"path": "frozen.txt"}) == "     1  keep"


@pytest.mark.parametrize("step", ["replace", "fsync"])
async def test_a_failed_write_leaves_the_original_and_no_temp_file(
    tools: dict[str, BaseTool], ws: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    target = ws / "keep.txt"
    target.write_bytes(b"original\r\n")
    before = target.stat()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, step, broken)
    with pytest.raises(WorkspaceError, match=r"could not write 'keep.txt' \(I/O error\); the file was left"):
        await replace(tools, "keep.txt", "original", "changed")
    monkeypatch.undo()
    assert target.read_bytes() == b"original\r\n"
    assert (target.stat().st_ino, target.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(os.listdir(ws)) == ["keep.txt"]


async def test_an_unchanged_edit_does_not_rewrite_the_file(tools: dict[str, BaseTool], ws: Path) -> None:
    target = ws / "same.txt"
    target.write_bytes(b"same\n")
    inode = target.stat().st_ino
    assert await replace(tools, "same.txt", "same", "same") == "replaced 1 occurrence(s) in same.txt"
    assert target.stat().st_ino == inode


# --------------------------------------------------------------------------- links and special files


async def test_hard_link_to_an_outside_file_is_refused(
    tools: dict[str, BaseTool], ws: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    os.link(outside, ws / "hl.txt")
    with pytest.raises(WorkspaceError, match=r"'hl.txt' has 2 hard links and was refused"):
        await tools["read_file"].ainvoke({"path": "hl.txt"})
    with pytest.raises(WorkspaceError, match="hard links"):
        await replace(tools, "hl.txt", "safe", "owned")
    assert outside.read_bytes() == SECRET


async def test_fifo_is_refused_without_hanging(tools: dict[str, BaseTool], ws: Path) -> None:
    fifo = ws / "pipe"
    os.mkfifo(fifo)
    try:
        for call in (
            tools["read_file"].ainvoke({"path": "pipe"}),
            replace(tools, "pipe", "a", "b"),
        ):
            with pytest.raises(WorkspaceError, match="'pipe' is not a regular file"):
                await asyncio.wait_for(call, timeout=10)
    finally:
        # If a reader did block, give it a writer so the worker thread can finish.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


async def test_symlink_swapped_in_mid_call_is_never_followed(
    tools: dict[str, BaseTool], ws: Path, tmp_path: Path
) -> None:
    outside_file = tmp_path / "outside.txt"
    outside_dir = tmp_path / "outside_dir"
    outside_dir.mkdir()
    (outside_dir / "f.txt").write_bytes(SECRET)
    (outside_dir / "secret-name.txt").write_bytes(SECRET)
    (ws / "sub").mkdir()
    (ws / "sub" / "f.txt").write_bytes(b"safe\n")
    (ws / "target.txt").write_bytes(b"safe\n")
    watched = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (outside_file, outside_dir / "f.txt")}
    stop = threading.Event()
    swaps = 0
    failures: list[BaseException] = []

    def swapper() -> None:
        nonlocal swaps
        try:
            swap_until_stopped()
        except BaseException as err:
            failures.append(err)

    def swap_until_stopped() -> None:
        nonlocal swaps
        while not stop.is_set():
            os.symlink(outside_file, ws / "t.lnk")
            os.replace(ws / "t.lnk", ws / "target.txt")
            (ws / "t.reg").write_bytes(b"safe\n")
            os.replace(ws / "t.reg", ws / "target.txt")
            os.rename(ws / "sub", ws / "sub.away")
            os.symlink(outside_dir, ws / "sub")
            os.unlink(ws / "sub")
            os.rename(ws / "sub.away", ws / "sub")
            swaps += 1

    calls = [
        ("read_file", {"path": "target.txt"}),
        ("replace_in_file", {"path": "target.txt", "old": "safe", "new": "safe!"}),
        ("read_file", {"path": "sub/f.txt"}),
        ("replace_in_file", {"path": "sub/f.txt", "old": "safe", "new": "safe!"}),
        ("list_dir", {"path": "sub"}),
    ]
    results: list[str] = []
    refused = 0
    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    try:
        for i in range(300 * len(calls)):
            if time.monotonic() > deadline:
                break
            name, args = calls[i % len(calls)]
            try:
                results.append(await tools[name].ainvoke(args))
            except WorkspaceError as err:
                refused += 1
                results.append(str(err))
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive() and not failures
    assert swaps > 0 and refused > 0 and len(results) > refused
    assert not [r for r in results if "SECRET" in r or "secret-name" in r]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in watched} == watched
    assert (outside_dir / "secret-name.txt").read_bytes() == SECRET
    assert not [n for n in os.listdir(ws) + os.listdir(ws / "sub") if n.startswith(TEMP_PREFIX)]


# --------------------------------------------------------------------------- bounded reads


_BIG_READ = textwrap.dedent(
    """
    import asyncio, json, resource, sys
    from pathlib import Path
    from fusion_graph.tools.workspace import make_workspace_tools

    root = Path(sys.argv[1])
    with open(root / "lines.txt", "wb") as f:
        f.write(b"first\\nsecond\\nthird\\n")
        chunk = (b"x" * 1023 + b"\\n") * 1024
        for _ in range(150):
            f.write(chunk)
    with open(root / "sparse.txt", "wb") as f:
        f.write(b"first\\nsecond\\nthird\\n")
        f.seek(150 * 2**20, 1)
        f.write(b"\\nlast\\n")
    (root / "small.txt").write_bytes(b"warm\\n")
    read_file = make_workspace_tools(root=root)[0]

    async def main() -> dict[str, object]:
        await read_file.ainvoke({"path": "small.txt"})
        unit = 1 if sys.platform == "darwin" else 1024
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
        head = await read_file.ainvoke({"path": "lines.txt", "start_line": 1, "end_line": 3})
        capped = await read_file.ainvoke({"path": "lines.txt"})
        wide = await read_file.ainvoke({"path": "sparse.txt", "start_line": 4, "end_line": 4})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
        return {"growth": after - before, "head": head, "capped": len(capped), "wide": wide[-200:]}

    print(json.dumps(asyncio.run(main())))
    """
)


def test_reading_a_few_lines_of_a_huge_file_takes_bounded_memory(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _BIG_READ, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=repo,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert (tmp_path / "lines.txt").stat().st_size > 150 * 2**20
    assert report["head"] == "     1  first\n     2  second\n     3  third"
    assert report["capped"] < 61_000
    assert "line 4 was cut; read on with start_line=5" in report["wide"]
    assert report["growth"] < 20 * 2**20, f"peak RSS grew by {report['growth']} bytes"


# --------------------------------------------------------------------------- names and JSON


async def test_names_that_are_not_utf8_are_shown_escaped(tools: dict[str, BaseTool], ws: Path) -> None:
    with open(os.fsencode(ws) + b"/bad\xff.txt", "wb") as f:
        f.write(b"a\n")
    (ws / "two\nlines.txt").write_bytes(b"")
    listing = await tools["list_dir"].ainvoke({})
    assert listing.splitlines() == ["bad\\xff.txt", "two\\nlines.txt"]
    listing.encode("utf-8")
    json.dumps(listing, ensure_ascii=False).encode("utf-8")
    # A path with a surrogate (the model may send one as a JSON escape) never comes back raw.
    done = await replace(tools, "bad\udcff.txt", "a", "b")
    assert done == "replaced 1 occurrence(s) in bad\\udcff.txt"
    json.dumps(done, ensure_ascii=False).encode("utf-8")
    with pytest.raises(WorkspaceError, match="lone surrogates"):
        await replace(tools, "bad\udcff.txt", "b", "\udcff")


def test_display_name_escapes_only_what_it_must() -> None:
    assert display_name("plain ü.txt") == "plain ü.txt"
    assert display_name(os.fsdecode(b"x\xfe\tz")) == "x\\xfe\\tz"


@pytest.mark.parametrize(
    ("path", "parts"),
    [(".", []), ("a/./b/../c/", ["a", "c"]), ("a//b", ["a", "b"]), ("a/..", [])],
)
def test_split_relative_applies_dots_lexically(path: str, parts: list[str]) -> None:
    assert split_relative(path) == parts


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("..", "leaves the workspace"),
        ("a/../..", "leaves the workspace"),
        ("a\0b", "NUL"),
        ("/a", "absolute"),
    ],
)
def test_split_relative_refuses_escapes(path: str, message: str) -> None:
    with pytest.raises(WorkspaceError, match=message):
        split_relative(path)


async def test_missing_root_names_the_setting(tmp_path: Path) -> None:
    read_file = make_workspace_tools(root=tmp_path / "nope")[0]
    with pytest.raises(WorkspaceError, match="set workspace_root to an existing directory"):
        await read_file.ainvoke({"path": "a.txt"})
