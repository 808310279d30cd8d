"""Memory jobs: what a job asks for (a bounded schema) and the prompt it sends."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NotRequired

from langchain_core.messages import BaseMessage, HumanMessage
from pydantic import BaseModel, Field

# NOTE: typing_extensions.TypedDict: on Python 3.11 the LangGraph server rejects typing.TypedDict.
from typing_extensions import TypedDict

from fusion_graph import prompts
from fusion_graph.routing.score import Leg
from fusion_graph.sizing.turn import build_prompt

logger = logging.getLogger(__name__)

MEMORY_MESSAGE_NAME = prompts.MEMORY_MESSAGE_NAME


class MemoryItem(BaseModel):
    """One thing worth remembering."""

    kind: Literal["fact", "decision", "task"] = Field(description="fact, decision or open task")
    text: str = Field(min_length=1, max_length=240, description="One self-contained sentence.")


class TurnMemories(BaseModel):
    """What a turn leaves behind (bounded, so a constrained local model always terminates)."""

    items: list[MemoryItem] = Field(default_factory=list, max_length=8)


@dataclass(frozen=True)
class MemoryJob:
    """A structured memory job: a schema with a list field ``items`` of objects to store."""

    name: str
    schema: type[BaseModel]
    instructions: str = prompts.MEMORY_INSTRUCTIONS

    def items(self, result: BaseModel) -> list[dict[str, Any]]:
        """The objects to store from a validated result."""
        raw = result.model_dump(mode="json")
        items = raw.get("items")
        return [dict(item) for item in items] if isinstance(items, list) else [raw]

    def response_format(self) -> dict[str, Any]:
        """OpenAI ``response_format``: llama-server turns it into a grammar."""
        return {
            "type": "json_schema",
            "json_schema": {"name": self.name, "schema": self.schema.model_json_schema()},
        }


DEFAULT_JOBS: tuple[MemoryJob, ...] = (MemoryJob("turn_memories", TurnMemories),)


def job_prompt(system_prompt: str, messages: Sequence[BaseMessage], job: MemoryJob) -> list[BaseMessage]:
    """The conversation exactly as a step sends it (``build_prompt``), then the job's instructions."""
    return [*build_prompt(system_prompt, messages), HumanMessage(job.instructions)]


class TicketFields(TypedDict):
    """What identifies a memory run: the part of its job log entry (``JobEntry``) the ticket writes.

    Attributes:
        thread_id: The thread whose conversation the jobs read.
        turn: Turn of the thread when the run was started.
        step: Last step of that turn the run covers.
        covers: How many of the thread's messages (from the first) the jobs read.
        last_message_id: Id of the last message covered, to check the thread still has it.
        leg: The ``sub_runners`` leg.
        log_id: A random id made when the run is first logged, kept by its re-runs (``None``:
            logged before runs had one). Two apps on one shared-state database may log the
            same thread, turn and step in their own stores; the shared claim is keyed by
            this id too (``JobTicket.claim_key``), so one app's claim never holds back the other's
            run, while every worker of one app reads the same entry, and so the same id.
    """

    thread_id: str
    turn: int
    step: int
    covers: int
    last_message_id: str | None
    leg: Leg
    log_id: NotRequired[str | None]


@dataclass(frozen=True)
class JobTicket:
    """One memory run of a thread: what it covers (``run``, as its job log entry holds it), where it writes.

    ``run`` is the entry's own value, not a copy of its fields: the entry is
    ``run`` plus what the run came to, and a re-run takes ``run`` back from it.

    Attributes:
        namespace: The memories' namespace (the job log is ``jobs_namespace`` of it).
        run: What identifies the run (thread, turn, step, what it covers, its leg).
        attempt: 1 for the first run, then one more per re-run after a crash.
    """

    namespace: tuple[str, ...]
    run: TicketFields
    attempt: int = 1

    @property
    def key(self) -> str:
        """The job log key (also the prefix of the items' keys, so a re-run overwrites them)."""
        return f"{self.run['thread_id']}:{self.run['turn']}:{self.run['step']}"

    @property
    def claim_key(self) -> str:
        """The run's identity in the shared claims table and this process's registry of detached runs.

        The job log key alone names a run within one store; two apps with stores of
        their own (same thread id, same namespace on one database) would share it, and
        one app's finished or live claim would leave the other's run pending forever.
        The entry's ``log_id`` tells them apart; a run logged without one keeps the
        job log key, as its claim was made under it.
        """
        log_id = self.run.get("log_id")
        return f"{self.key}@{log_id}" if log_id else self.key
