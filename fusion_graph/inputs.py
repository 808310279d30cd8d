"""What a run must bring: a new user message (within its size), a thread id its savers can hold, whose it is.

Checked before anything is written or sent to a model, by the graph's entry
(``run_queue``) and again by the plan step, so a run refused here leaves the
thread as it was.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    ToolMessage,
    convert_to_messages,
)
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.store.memory import InMemoryStore
from langgraph.types import Command

from fusion_graph.errors import IdentityRefused, InvalidInput, InvalidThreadId

#: A lone surrogate (U+D800 to U+DFFF): Python strings may hold one, UTF-8 cannot.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _in_memory(saver: Any) -> bool:
    """Whether ``saver`` (a checkpointer or store; ``None``: none) keeps a thread id as the string itself."""
    return saver is None or isinstance(saver, InMemorySaver | InMemoryStore)


def _on_postgres(saver: Any) -> bool:
    """Whether ``saver`` keeps its rows in PostgreSQL (its class or a base is from a ``postgres`` module)."""
    return any("postgres" in cls.__module__ for cls in type(saver).__mro__)


def _nul_refused(saver: Any, what: str) -> str | None:
    """Why ``saver`` (the graph's ``what``) cannot take a thread id with a NUL byte; ``None``: it can."""
    if what == "checkpointer":  # SQLite's saver stores and reads it back; PostgreSQL text refuses it
        return "PostgreSQL text cannot hold one" if saver is not None and _on_postgres(saver) else None
    if _in_memory(saver):
        return None
    # The job log finds a thread's memory runs by a filter on the id: PostgreSQL refuses the value,
    # SQLite stores it but its JSON filter stops at the NUL and never finds it (the runs would be lost).
    return (
        "only the in-memory store keeps and finds it (PostgreSQL refuses it, SQLite's filters stop at it, "
        "so a memory job of the thread would be lost)"
    )


def check_thread_id(thread_id: Any, *, checkpointer: Any = None, store: Any = None) -> None:
    """Refuse a thread id that ``checkpointer`` or ``store`` cannot keep, before anything is written.

    LangGraph takes any string, and everything else the graph does with the id
    hashes it (``surrogatepass``), so any id works with the in-memory saver and
    store (2,000 characters too). A lone surrogate is not UTF-8: every other
    saver fails at the run's first write with an encoding error that does not
    say why. A NUL byte: PostgreSQL text refuses it, and a store other than the
    in-memory one cannot find the thread's memory job log by it.

    Raises:
        InvalidThreadId: The id holds what a saver of this graph cannot keep (nothing was written).
    """
    if not isinstance(thread_id, str):
        return  # an int or a UUID: written as its text, which is plain
    shown = ascii(thread_id if len(thread_id) <= 60 else thread_id[:60] + "...")
    surrogate = _SURROGATE.search(thread_id)
    for what, saver in (("checkpointer", checkpointer), ("store", store)):
        if surrogate is not None and not _in_memory(saver):
            raise InvalidThreadId(
                f"thread id {shown} holds a lone surrogate (U+{ord(surrogate.group()):04X}), which is not "
                f"valid Unicode text: the graph's {what} ({type(saver).__name__}) writes thread ids as UTF-8 "
                "and cannot store it; nothing was written. Use an id of valid text (e.g. a UUID)"
            )
        why = _nul_refused(saver, what) if "\0" in thread_id else None
        if why is not None:
            raise InvalidThreadId(
                f"thread id {shown} holds a NUL byte, which the graph's {what} ({type(saver).__name__}) "
                f"cannot take: {why}; nothing was written. Use an id without NUL (e.g. a UUID)"
            )


#: The user a run without an authenticated identity or a ``user_id`` belongs to.
ANONYMOUS = "anonymous"


def authenticated_user(config: RunnableConfig) -> str | None:
    """The identity a LangGraph server's ``Auth`` handler gave the run (``None``: no auth ran).

    The server writes it into ``configurable.langgraph_auth_user_id`` itself (a
    caller cannot set that key), so it is the one identity a run can be trusted with.
    """
    value = (config.get("configurable") or {}).get("langgraph_auth_user_id")
    return str(value) if value else None


def user_of(config: RunnableConfig) -> str:
    """Whose memories a run reads and writes: the authenticated identity, else ``user_id``, else anonymous.

    The one rule for every per-user namespace (memories, the job log, claims).
    Without auth, ``configurable.user_id`` is a label any caller can name, not
    a boundary (docs/deploying.md says so); with auth, a different ``user_id``
    is refused by ``check_identity`` before anything is written.
    """
    return authenticated_user(config) or str((config.get("configurable") or {}).get("user_id") or ANONYMOUS)


def check_identity(config: RunnableConfig | None) -> None:
    """Refuse a run whose ``user_id`` names someone other than its authenticated user.

    Raises:
        IdentityRefused: An authenticated caller named another user (nothing was written).
    """
    if not config:
        return
    authenticated = authenticated_user(config)
    named = (config.get("configurable") or {}).get("user_id")
    if authenticated is not None and named not in (None, "") and str(named) != authenticated:
        raise IdentityRefused(
            "the run's configurable.user_id names another user than the one its credentials "
            "authenticate: memories belong to the authenticated user, so leave user_id out (or set it "
            "to your own identity); nothing was written"
        )


def check_new_turn(messages: Sequence[BaseMessage] | None) -> None:
    """Refuse a turn whose last message is not a user's (no model call is made for it)."""
    if not messages:
        raise InvalidInput(
            "the run has no messages: send at least one user message, e.g. "
            '{"messages": [("user", "...")]}; to continue an interrupted run, invoke with None'
        )
    last = messages[-1]
    if not isinstance(last, HumanMessage):
        raise InvalidInput(
            f"the last message is a {type(last).__name__}, not a user message: a turn starts with a "
            "new user message (to continue an interrupted run, invoke with None or Command(resume=...))"
        )


def check_tool_results(messages: Sequence[BaseMessage]) -> None:
    """Refuse a tool result in the input that answers no tool call made before it in the input.

    A provider would refuse the whole conversation over it at the next step, after
    the thread had been written; here it is refused before anything is.
    """
    called: set[str] = set()
    for message in messages:
        if isinstance(message, AIMessage):
            called |= {str(call["id"]) for call in message.tool_calls if call.get("id")}
        elif isinstance(message, ToolMessage) and message.tool_call_id not in called:
            raise InvalidInput(
                f"the input's tool message {message.tool_call_id!r} answers no tool call: a tool result "
                "follows the assistant message that called it (send the user's message alone to start a turn)"
            )


def input_messages(input: Any) -> list[BaseMessage] | None:
    """The messages a run's input would add to the thread; ``None``: it adds none (a plain resume).

    A dict's ``messages``, or those of a ``Command(update=...)`` (a dict or
    ``(key, value)`` pairs): LangGraph applies either through the thread's
    ``add_messages`` reducer, so both can edit its history.
    """
    raw: Any = None
    if isinstance(input, dict):
        raw = input.get("messages")
    elif isinstance(input, Command):
        update: Any = input.update
        if isinstance(update, dict):
            raw = update.get("messages")
        elif isinstance(update, list | tuple):
            values = [
                pair[1]
                for pair in update
                if isinstance(pair, tuple | list) and len(pair) == 2 and pair[0] == "messages"
            ]
            raw = [m for value in values for m in (value if isinstance(value, list) else [value])] or None
    if raw is None:
        return None
    return convert_to_messages(raw if isinstance(raw, list) else [raw])


def check_history_edits(
    input: Any, existing_ids: Collection[str] | None = None, *, allowed: bool = False
) -> None:
    """Refuse run input that would rewrite the thread's history instead of adding to it.

    ``add_messages`` replaces a message whose id is already in the thread (a
    ``HumanMessage`` carrying an earlier answer's id overwrites that answer) and
    applies ``RemoveMessage`` (``REMOVE_ALL_MESSAGES`` wipes the thread). Under a
    server the run input is untrusted, so both are refused unless the operator
    allows them (``allow_history_edits``). Only the caller's input is checked:
    the graph's own updates (compaction, tool results, memory) never pass here.

    Args:
        input: The run's input (a dict, a ``Command``, ``None``).
        existing_ids: The ids of the thread's messages before the run; ``None``
            skips the id check (the thread was not read yet).
        allowed: The operator's ``allow_history_edits``: nothing is refused.

    Raises:
        InvalidInput: The input removes a message or reuses a thread message's id (nothing was written).
    """
    if allowed:
        return
    messages = input_messages(input) or []
    for message in messages:
        if isinstance(message, RemoveMessage):
            what = "every message of the thread" if message.id == REMOVE_ALL_MESSAGES else repr(message.id)
            raise InvalidInput(
                f"the input removes {what} (a RemoveMessage): run input may only add messages to a "
                "thread, not rewrite its history; nothing was written (the operator may allow it with "
                "FUSION_ALLOW_HISTORY_EDITS=true)"
            )
    if not existing_ids:
        return
    for message in messages:
        if message.id is not None and str(message.id) in existing_ids:
            raise InvalidInput(
                f"the input's {type(message).__name__} has the id {str(message.id)!r} of a message "
                "already in the thread, which it would replace: run input may only add messages to a "
                "thread, not rewrite its history; send it without an id (or with a new one); nothing was "
                "written (the operator may allow it with FUSION_ALLOW_HISTORY_EDITS=true)"
            )


def check_input(
    input: Any,
    max_chars: int | None = None,
    *,
    existing_ids: Collection[str] | None = None,
    allow_history_edits: bool = False,
) -> None:
    """Refuse graph input that carries no new user message, more than ``max_chars`` of text, or edits history.

    ``None`` and ``Command(resume=...)`` resume a thread and pass; a
    ``Command`` that updates ``messages`` is checked for history edits
    (``check_history_edits``, against ``existing_ids`` when given).
    """
    check_history_edits(input, existing_ids, allowed=allow_history_edits)
    if input is None or not isinstance(input, dict):
        return  # resume (None), Command(resume=...), or a type LangGraph itself rejects
    raw: Any = input.get("messages")
    if raw is None:
        check_new_turn([])
    messages = convert_to_messages(raw if isinstance(raw, list) else [raw])
    check_new_turn(messages)
    check_tool_results(messages)
    size = sum(len(str(m.content)) for m in messages)
    if max_chars is not None and size > max_chars:
        raise InvalidInput(
            f"the input is {size:,} characters; this deployment takes at most {max_chars:,} "
            "(the operator sets FUSION_MAX_INPUT_CHARS)"
        )
