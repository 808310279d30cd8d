"""What a memory job may not store: echoes of its own prompt, and memories already kept.

A weak model (a small local one, a CPU box) often answers a memory job with
its instruction read back as a "fact" ("do not call tools and do not continue
the task"). Stored, that line is recalled into every later thread of the user,
so every thread pays for it and the model reads its own instruction as
something the user said. Each run stores another copy. So every item is
screened before it is written, by one rule, and each one left out is recorded
with why (``rejected`` in its record's ``memory``, kept in its job log entry):

- **Normalised text.** Unicode NFKC, case-folded, every run of characters that
  are not letters or digits made one space, trimmed. Two items with the same
  normalised text are the same memory.
- **No words**: an item whose normalised text is empty (only punctuation).
- **Echo**: the item's normalised words occur, in order and contiguous, inside
  a prompt text fusion-graph itself wrote into the job's request (the job's
  instructions, the steps' system prompt); or the item has at least
  ``ECHO_MIN_WORDS`` words and more than ``ECHO_SHARE`` of its word pairs
  (two consecutive words) are word pairs of one of those texts. The
  conversation itself is never an echo source: a fact the user stated is the
  point of a memory.
- **Duplicate**: the same normalised text as a memory already stored in the
  namespace (that assistant and user; not counting what an earlier attempt of
  this same run wrote, which this attempt replaces), or as an earlier item of
  the same answer.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from langgraph.store.base import BaseStore

from fusion_graph.memory.jobs import JobTicket, MemoryJob
from fusion_graph.memory.store import search_all
from fusion_graph.routing.records import Rejected

#: Fewest words an item needs before a partial (word pair) overlap can make it an echo.
ECHO_MIN_WORDS = 3
#: Share of an item's word pairs found in one prompt text above which it is an echo ("mostly overlaps"):
#: an instruction reworded here and there keeps most of its pairs; a fact shares a few (``the user``).
ECHO_SHARE = 0.5

_NOT_WORD = re.compile(r"[\W_]+")


def normalise(text: str) -> str:
    """The text two items are compared by: NFKC, case-folded, words separated by one space."""
    return " ".join(_NOT_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).split())


def _pairs(words: Sequence[str]) -> set[tuple[str, str]]:
    return {(words[i], words[i + 1]) for i in range(len(words) - 1)}


def echo_of(text: str, sources: Mapping[str, str]) -> str | None:
    """The name of the prompt text ``text`` echoes (see the module's rule), or ``None``.

    Args:
        text: An item's text, as answered.
        sources: The prompt texts the job sent that are not conversation, by name
            (``the job's instructions``, ``the system prompt``).
    """
    words = normalise(text).split()
    if not words:
        return None
    for name, source in sources.items():
        said = normalise(source)
        if not said:
            continue
        if f" {' '.join(words)} " in f" {said} ":
            return name
        if len(words) >= ECHO_MIN_WORDS:
            mine = _pairs(words)
            if len(mine & _pairs(said.split())) > ECHO_SHARE * len(mine):
                return name
    return None


def screen_items(
    items: Sequence[dict[str, Any]], *, sources: Mapping[str, str], stored: Mapping[str, str]
) -> tuple[list[dict[str, Any]], list[Rejected]]:
    """Split a job's items into those to store and those left out, with why (the module's rule).

    Args:
        items: The items of a validated answer (``MemoryJob.items``), in order.
        sources: The prompt texts an item must not echo, by name (``echo_of``).
        stored: The namespace's memories already stored: normalised text to store key.

    Returns:
        The items to store, in order, and one ``Rejected`` per item left out.
    """
    kept: list[dict[str, Any]] = []
    rejected: list[Rejected] = []
    seen: set[str] = set()
    for item in items:
        text = str(item.get("text", ""))
        norm = normalise(text)
        echoed = echo_of(text, sources)
        if not norm:
            why = "no words"
        elif echoed is not None:
            why = f"echo of {echoed}"
        elif norm in stored:
            why = f"already stored as {stored[norm]}"
        elif norm in seen:
            why = "repeated in this answer"
        else:
            seen.add(norm)
            kept.append(item)
            continue
        rejected.append(Rejected(kind=str(item.get("kind", "")), text=text, why=why))
    return kept, rejected


async def stored_texts(store: BaseStore, job: MemoryJob, ticket: JobTicket) -> dict[str, str]:
    """The namespace's stored memories, normalised text to key, less what this run itself wrote.

    Items an earlier attempt of the same run (same thread, turn, step and job)
    wrote are left out: this attempt overwrites them, so they must not count as
    duplicates of its own answer. Reads every memory of the namespace (one
    assistant and user), page by page.
    """
    run = ticket.run
    mine = (run["thread_id"], run["turn"], run["step"], job.name)
    texts: dict[str, str] = {}
    for found in await search_all(store, ticket.namespace, {}):
        value = found.value
        if (value.get("thread_id"), value.get("turn"), value.get("step"), value.get("job")) == mine:
            continue
        norm = normalise(str(value.get("text", "")))
        if norm:
            texts.setdefault(norm, found.key)
    return texts
