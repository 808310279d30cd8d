"""Low-level file I/O for the workspace tools: no symlinks, no hard links, atomic writes.

A path is split lexically (``..`` may not climb above the root), then walked
one component at a time with ``openat``-style calls (``dir_fd=``) and
``O_NOFOLLOW``, starting from a descriptor of the workspace root. Every check
runs on the opened descriptor (``os.fstat``), so nothing can be swapped in
between a check and its use: a symlink anywhere in the path is refused, even
one that points inside the workspace. The operator's root itself may be a
symlink; it is configuration, not model input. A run's narrower root (its
context's ``workspace_root``) is input, so it is walked from the operator's root
like any path (``WorkspaceRoot``). An edit holds an exclusive ``flock`` of the
file's directory from before it opens the file until its rename landed, so
edits of one file (from any thread, run or process using these tools) run one
after the other, each on the file the previous one wrote. POSIX only
(``dir_fd``, ``O_NOFOLLOW``, ``flock``).
"""

from __future__ import annotations

import codecs
import fcntl
import heapq
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from langchain_core.tools import ToolException

from fusion_graph.errors import ContextError, FusionError
from fusion_graph.settings import lexical_parts, workspace_subpath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# NOTE: O_NONBLOCK so that opening a FIFO returns at once; fstat then refuses it.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
TEMP_PREFIX = ".fusion-edit-"
_BOM = codecs.BOM_UTF8


class WorkspaceError(FusionError, ToolException):
    """A path or edit the workspace tools refuse; the message says why (``fusion_graph.errors``)."""


@dataclass(frozen=True)
class WorkspaceRoot:
    """Where the tools start: the operator's root, and the run's directories below it.

    ``base`` is opened by name (operator configuration, may be a symlink);
    ``sub`` (a run's ``workspace_root``) is walked from it without following symlinks.
    """

    base: Path
    sub: tuple[str, ...] = ()


def as_root(root: Path | WorkspaceRoot) -> WorkspaceRoot:
    """``root`` as a ``WorkspaceRoot`` (a plain path is an operator's root)."""
    return root if isinstance(root, WorkspaceRoot) else WorkspaceRoot(Path(root))


@dataclass(frozen=True)
class OpenFile:
    """A regular, singly linked workspace file opened for reading, and the directory holding it."""

    dir_fd: int
    name: str
    file: BinaryIO
    stat: os.stat_result


@dataclass(frozen=True)
class Line:
    """One line of a file: its first bytes, its full size and whether ``head`` is all of it."""

    head: bytes
    size: int
    complete: bool


def split_relative(path: str) -> list[str]:
    """The components of ``path`` below the root, with ``.`` and ``..`` applied lexically."""
    if not path or not path.strip():
        raise WorkspaceError("path is empty; give a path relative to the workspace root")
    if "\0" in path:
        raise WorkspaceError(f"path {path!r} contains a NUL character; give a plain relative path")
    if path.startswith("/"):
        raise WorkspaceError(f"absolute path {path!r} refused: give a path relative to the workspace root")
    parts = lexical_parts(path)
    if parts is None:
        raise WorkspaceError(f"path {path!r} leaves the workspace and was refused")
    return parts


def _open_root(root: Path) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise WorkspaceError(
            f"workspace root {str(root)!r} cannot be opened ({err.strerror}); "
            "set workspace_root to an existing directory"
        ) from None


def _refusal(err: OSError, dir_fd: int, name: str, shown: str, wanted: str) -> WorkspaceError:
    """Turn a failed open of ``name`` into an error that says what to do instead."""
    # The lstat only words the message; the refusal itself came from the open.
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return WorkspaceError(
            f"{shown!r} is a symlink; the workspace tools refuse symlinks because they can lead "
            "outside the workspace: use the path of the real file"
        )
    if mode is not None and wanted == "file" and not stat.S_ISREG(mode):
        return WorkspaceError(f"{shown!r} is not a regular file; only regular files can be read or edited")
    if isinstance(err, FileNotFoundError | NotADirectoryError):
        return WorkspaceError(f"{shown!r} is not a {wanted} in the workspace")
    if isinstance(err, PermissionError):
        return WorkspaceError(f"{shown!r}: permission denied; check its permissions or pick another path")
    return WorkspaceError(f"{shown!r} cannot be opened: {err.strerror}")


def check_run_root(operator_root: str, requested: str) -> None:
    """Refuse a run's ``workspace_root`` that cannot be walked to without a symlink, before the run starts.

    The tools refuse such a root whenever they open it; a run checked here is
    refused before any model is asked (``ContextError``), not at its first tool call.
    Blocking (it opens directories): callers on an event loop run it in a thread.
    """
    root = WorkspaceRoot(Path(operator_root), workspace_subpath(operator_root, requested))
    try:
        os.close(_walk(root, []))
    except WorkspaceError as error:
        raise ContextError(str(error)) from None


def _walk(root: Path | WorkspaceRoot, parts: list[str]) -> int:
    """A descriptor of the directory ``parts`` under ``root``; the caller closes it."""
    root = as_root(root)
    fd = _open_root(root.base)
    try:
        for i, name in enumerate(root.sub):
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as err:
                refused = _refusal(err, fd, name, "/".join(root.sub[: i + 1]), "directory")
                raise WorkspaceError(
                    f"the run's workspace_root cannot be used: {refused}; set workspace_root to a "
                    "real directory inside the operator's workspace"
                ) from None
            fd, parent = child, fd
            os.close(parent)
        for i, name in enumerate(parts):
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as err:
                raise _refusal(err, fd, name, "/".join(parts[: i + 1]), "directory") from None
            fd, parent = child, fd
            os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def open_dir(root: Path | WorkspaceRoot, path: str) -> Iterator[int]:
    """A descriptor of directory ``path`` inside ``root``, reached without following symlinks."""
    fd = _walk(root, split_relative(path))
    try:
        yield fd
    finally:
        os.close(fd)


def _check_regular(st: os.stat_result, path: str, for_edit: bool) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise WorkspaceError(f"{path!r} is not a file in the workspace (it is a directory; use list_dir)")
    if not stat.S_ISREG(st.st_mode):
        raise WorkspaceError(
            f"{path!r} is not a regular file (a FIFO, socket or device); "
            "only regular files can be read or edited"
        )
    if st.st_nlink > 1:
        raise WorkspaceError(
            f"{path!r} has {st.st_nlink} hard links and was refused: another link may lie outside "
            "the workspace; work on a copy with a single link"
        )
    if for_edit and not st.st_mode & 0o222:
        raise WorkspaceError(f"{path!r} is read-only (no write permission bits); chmod it first to edit it")


@contextmanager
def open_file(root: Path | WorkspaceRoot, path: str, for_edit: bool = False) -> Iterator[OpenFile]:
    """Open regular file ``path`` inside ``root`` for reading, refusing links and special files.

    With ``for_edit`` the file is opened read-write too, though only read: the
    edit lands by rename, which would otherwise ignore the file's own permissions.
    It also holds the directory's edit lock while the file is open.
    """
    parts = split_relative(path)
    if not parts:
        raise WorkspaceError(f"{path!r} is not a file in the workspace (it is the workspace root)")
    dir_fd = _walk(root, parts[:-1])
    try:
        if for_edit:  # released when dir_fd is closed, after the edit's rename
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
        try:
            access = os.O_RDWR if for_edit else os.O_RDONLY
            fd = os.open(parts[-1], _FILE_FLAGS | access, dir_fd=dir_fd)
        except OSError as err:
            raise _refusal(err, dir_fd, parts[-1], path, "file") from None
        try:
            st = os.fstat(fd)
            _check_regular(st, path, for_edit)
            file = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        with file:
            yield OpenFile(dir_fd=dir_fd, name=parts[-1], file=file, stat=st)
    finally:
        os.close(dir_fd)


def iter_lines(file: BinaryIO, cap: int) -> Iterator[Line]:
    r"""The lines of ``file`` (split at ``\n``), keeping at most ``cap`` bytes of each in memory."""
    while head := file.readline(cap):
        size, complete = len(head), True
        if len(head) == cap and not head.endswith(b"\n"):
            while rest := file.readline(cap):
                size += len(rest)
                complete = False
                if rest.endswith(b"\n"):
                    break
        yield Line(head=head, size=size, complete=complete)


def decode_line(line: Line, first: bool) -> tuple[str, bool]:
    r"""The text of ``line`` without its ending (and BOM), and whether its bytes were valid UTF-8.

    Undecodable bytes come back as ``\xNN`` text, never as lone surrogates, so
    the result can always be sent on as JSON.
    """
    raw = line.head
    if first and raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    if line.complete and raw.endswith(b"\n"):
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    # An incremental decoder with final=False drops a character cut in half by the cap.
    try:
        return codecs.getincrementaldecoder("utf-8")("strict").decode(raw, final=line.complete), True
    except UnicodeDecodeError:
        lenient = codecs.getincrementaldecoder("utf-8")("backslashreplace")
        return lenient.decode(raw, final=line.complete), False


def display_name(name: str) -> str:
    r"""``name`` as printable text: bytes that are not UTF-8 as ``\xNN``, control characters escaped."""
    if name.isprintable():
        return name
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def scan_dir(dir_fd: int, limit: int) -> tuple[list[str], int]:
    """Up to ``limit`` entries (directories first, ``/`` and ``@`` marked) and the total count."""
    total = 0

    def entries() -> Iterator[tuple[bool, str, str]]:
        nonlocal total
        with os.scandir(dir_fd) as scan:
            for entry in scan:
                total += 1
                is_dir = entry.is_dir(follow_symlinks=False)
                mark = "/" if is_dir else "@" if entry.is_symlink() else ""
                yield not is_dir, entry.name, display_name(entry.name) + mark

    first = heapq.nsmallest(limit, entries())
    return [shown for _, _, shown in first], total


def read_limited(opened: OpenFile, limit: int, path: str) -> bytes:
    """The whole content of ``opened``, refusing files over ``limit`` bytes."""
    too_big = WorkspaceError(
        f"{path!r} is larger than {limit} bytes; replace_in_file only edits smaller files"
    )
    if opened.stat.st_size > limit:
        raise too_big
    data = opened.file.read(limit + 1)
    if len(data) > limit:
        raise too_big
    return data


def _check_unchanged(opened: OpenFile, path: str) -> None:
    now = os.stat(opened.name, dir_fd=opened.dir_fd, follow_symlinks=False)
    before = opened.stat
    if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != (
        before.st_dev,
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    ):
        raise WorkspaceError(f"{path!r} changed while it was being edited; read it again and retry")


def write_atomic(opened: OpenFile, data: bytes, path: str) -> None:
    """Replace ``opened`` with ``data`` via a synced temp file and a rename, keeping its mode.

    On any failure the original stays as it was and the temp file is removed.
    """
    temp = f"{TEMP_PREFIX}{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(temp, _TEMP_FLAGS, 0o600, dir_fd=opened.dir_fd)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                # Keeping the owner needs privileges; the group often works. chown first: it clears setgid.
                with suppress(OSError):
                    os.fchown(fd, opened.stat.st_uid, opened.stat.st_gid)
                os.fchmod(fd, stat.S_IMODE(opened.stat.st_mode))
                os.fsync(fd)
            _check_unchanged(opened, path)
            os.replace(temp, opened.name, src_dir_fd=opened.dir_fd, dst_dir_fd=opened.dir_fd)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp, dir_fd=opened.dir_fd)
            raise
    except OSError as err:
        raise WorkspaceError(
            f"could not write {path!r} ({err.strerror or err}); the file was left unchanged"
        ) from err
    with suppress(OSError):
        os.fsync(opened.dir_fd)
