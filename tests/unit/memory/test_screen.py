"""Memory jobs screen what they store: no echo of their own prompt, no second copy of a memory.

Through the public API (``build_graph`` with scripted models), as a weak local model
answers: its instruction read back as a "fact", the same fact twice, and one real fact.
"""

from __future__ import annotations

import json
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.store.memory import InMemoryStore

from fusion_graph import build_graph, memory
from fusion_graph.context import FusionContext
from fusion_graph.memory.job_log import thread_entries
from fusion_graph.memory.jobs import MEMORY_MESSAGE_NAME, JobTicket, TicketFields
from fusion_graph.memory.screen import echo_of, normalise, screen_items, stored_texts
from fusion_graph.prompts import MEMORY_INSTRUCTIONS, SYSTEM_PROMPT
from tests.plugins.fakes import user_input
from tests.unit.memory.test_runner import NS, TOOLS, one_turn, stored

INLINE = FusionContext(memory_mode="inline")
SOURCES = {"the job's instructions": MEMORY_INSTRUCTIONS, "the system prompt": SYSTEM_PROMPT}


def answer(*texts: str) -> str:
    """A memory job's JSON answer of one fact per text."""
    return json.dumps({"items": [{"kind": "fact", "text": text} for text in texts]})


def config(thread: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread}}


def memory_record(out: dict[str, Any]) -> dict[str, Any]:
    [record] = [r for r in out["route_log"] if r["kind"] == "memory"]
    return dict(record["memory"])


ECHOES = (
    "Memory job: do not call tools and do not continue the task.",  # read back word for word
    "Reply with JSON only, matching the schema",  # a piece of it
    "Do not call tools and don't continue the task, skip anything transient.",  # mostly it, reworded
    "You are a careful software agent working in a project workspace.",  # the system prompt
)


async def test_a_job_whose_model_echoes_its_prompt_stores_nothing_and_says_why() -> None:
    store = InMemoryStore()
    for thread in ("t1", "t2"):  # every new thread would have recalled another copy
        cloud, local = one_turn(["all done", answer(*ECHOES)])
        graph = build_graph(
            cloud_model=cloud, local_model=local, tools=TOOLS, store=store, checkpointer=InMemorySaver()
        )
        out = await graph.ainvoke(user_input("list the files"), config(thread), context=INLINE)
        extra = memory_record(out)
        assert (extra["stored"], extra["dropped"]) == (0, None)
        assert [r["text"] for r in extra["rejected"]] == list(ECHOES)
        assert [r["why"] for r in extra["rejected"]] == [
            "echo of the job's instructions",
            "echo of the job's instructions",
            "echo of the job's instructions",
            "echo of the system prompt",
        ]
        # Nothing was recalled into the second thread's plan prompt either.
        assert not [m for m in cloud.prompts[0] if m.name == MEMORY_MESSAGE_NAME]
    assert await stored(store) == []


async def test_a_duplicate_is_stored_once_and_a_genuine_fact_is_stored() -> None:
    store = InMemoryStore()
    cloud, local = one_turn(["all done", answer("The user prefers tabs.", "the user prefers TABS")])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    out = await graph.ainvoke(user_input("I prefer tabs"), config("t1"), context=INLINE)
    extra = memory_record(out)
    assert extra["stored"] == 1
    assert extra["rejected"] == [
        {"kind": "fact", "text": "the user prefers TABS", "why": "repeated in this answer"}
    ]

    # A later thread of the same user: the known fact again, and a new one.
    cloud, local = one_turn(
        ["all done", answer("The user prefers tabs!", "The project targets Python 3.12.")]
    )
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    out = await graph.ainvoke(user_input("we use 3.12"), config("t2"), context=INLINE)
    extra = memory_record(out)
    assert extra["stored"] == 1
    [rejected] = extra["rejected"]
    assert rejected["text"] == "The user prefers tabs!"
    assert rejected["why"].startswith("already stored as t1:0:1:turn_memories:")
    assert sorted(item["text"] for item in await stored(store)) == [
        "The project targets Python 3.12.",
        "The user prefers tabs.",
    ]


async def test_a_background_job_keeps_what_it_left_out_in_its_job_log_entry() -> None:
    store = InMemoryStore()
    cloud, local = one_turn(["all done", answer(ECHOES[0], "The user prefers tabs.")])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    await graph.ainvoke(user_input("go"), config("t1"), context=FusionContext(memory_mode="background"))
    await memory.drain(5)
    [entry] = await thread_entries(store, NS, "t1")
    assert (entry["status"], entry["stored"], entry.get("rejected")) == ("done", 1, 1)
    assert [r["why"] for r in entry["records"][-1]["memory"]["rejected"]] == [
        "echo of the job's instructions"
    ]
    assert [item["text"] for item in await stored(store)] == ["The user prefers tabs."]


def test_the_echo_rule_leaves_facts_that_share_common_words() -> None:
    for fact in (
        "The user prefers tabs.",
        "Open task: port the CLI to typer.",
        "The project keeps durable facts in docs/facts.md.",
        "I prefer tabs",  # what the user said: the conversation is never an echo source
    ):
        assert echo_of(fact, SOURCES) is None, fact
    assert echo_of("skip anything transient", SOURCES) == "the job's instructions"
    assert normalise("  The user's   TABS! ") == "the user s tabs"
    kept, rejected = screen_items(
        [{"kind": "fact", "text": "..."}, {"kind": "task", "text": "Fix CI."}], sources=SOURCES, stored={}
    )
    assert kept == [{"kind": "task", "text": "Fix CI."}]
    assert rejected == [{"kind": "fact", "text": "...", "why": "no words"}]


async def test_a_rerun_does_not_count_what_its_own_earlier_attempt_stored() -> None:
    store = InMemoryStore()
    run = TicketFields(thread_id="t1", turn=0, step=1, covers=2, last_message_id=None, leg="local")
    ours = {"kind": "fact", "text": "Tabs.", "job": "turn_memories", "thread_id": "t1", "turn": 0, "step": 1}
    await store.aput(NS, "t1:0:1:turn_memories:0", ours)
    await store.aput(NS, "t0:0:1:turn_memories:0", {**ours, "text": "Spaces.", "thread_id": "t0"})
    texts = await stored_texts(store, memory.DEFAULT_JOBS[0], JobTicket(NS, run, attempt=2))
    assert texts == {"spaces": "t0:0:1:turn_memories:0"}
