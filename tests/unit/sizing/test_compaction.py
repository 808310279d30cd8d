"""Compaction: LangChain's clear-tool-uses edit first, oldest outputs first, then trimming."""

from __future__ import annotations

from typing import cast

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langgraph.graph.message import Messages, add_messages

from fusion_graph.sizing.compaction import PLACEHOLDER, compact
from fusion_graph.sizing.turn import approximate_tokens, message_tokens


def call(index: int) -> AIMessage:
    return AIMessage(
        "", tool_calls=[{"name": "read", "args": {"n": index}, "id": f"c{index}"}], id=f"a{index}"
    )


def output(index: int, size: int = 400) -> ToolMessage:
    return ToolMessage(f"line {index}: " + "x = [1, 2, 3]\n" * size, tool_call_id=f"c{index}", id=f"t{index}")


def loop(outputs: int) -> list[BaseMessage]:
    messages: list[BaseMessage] = [HumanMessage("go", id="u")]
    for index in range(outputs):
        messages += [call(index), output(index)]
    return messages


def test_the_oldest_tool_output_goes_first_and_only_as_much_as_needed() -> None:
    messages = loop(4)
    need = message_tokens(messages[2]) // 2
    result = compact(messages, need=need, count_tokens=approximate_tokens)
    assert (result.cleared, result.removed) == (1, 0)
    assert result.enough and result.freed >= need
    assert [m.id for m in result.messages] == [m.id for m in messages], "every message keeps its place"
    assert result.messages[2].content == PLACEHOLDER
    assert [m.content for m in result.messages[3:]] == [m.content for m in messages[3:]]
    assert [m.id for m in result.changes] == ["t0"]


def test_the_two_most_recent_outputs_are_kept_while_older_ones_suffice() -> None:
    messages = loop(4)
    need = int(0.8 * (message_tokens(messages[2]) + message_tokens(messages[4])))
    result = compact(messages, need=need, count_tokens=approximate_tokens)
    cleared = [m.id for m in result.messages if m.content == PLACEHOLDER]
    assert cleared == ["t0", "t1"]


def test_recent_outputs_go_too_when_older_ones_are_not_enough() -> None:
    messages = loop(2)
    need = message_tokens(messages[2]) + 100
    result = compact(messages, need=need, count_tokens=approximate_tokens)
    assert [m.id for m in result.messages if m.content == PLACEHOLDER] == ["t0", "t1"]


def test_when_tool_outputs_are_not_enough_the_oldest_messages_are_dropped() -> None:
    chat: list[BaseMessage] = []
    for turn in range(6):
        chat += [
            HumanMessage(f"question {turn} " + "why? " * 200, id=f"u{turn}"),
            AIMessage("answer", id=f"a{turn}"),
        ]
    need = approximate_tokens(chat[:4])
    result = compact(chat, need=need, count_tokens=approximate_tokens)
    assert result.enough and result.removed >= 4
    assert isinstance(result.messages[0], HumanMessage), "the kept history starts at a user message"
    assert result.messages == chat[result.removed :]
    # Applied through the graph's reducer, the changes leave exactly the compacted history.
    merged = cast(list[BaseMessage], add_messages(cast(Messages, chat), cast(Messages, result.changes)))
    assert [m.id for m in merged] == [m.id for m in result.messages]


def test_the_reducer_replaces_cleared_outputs_in_place() -> None:
    messages = loop(3)
    result = compact(messages, need=message_tokens(messages[2]), count_tokens=approximate_tokens)
    merged = cast(
        list[BaseMessage],
        add_messages(cast(Messages, messages), cast(Messages, result.changes)),
    )
    assert [m.content for m in merged] == [m.content for m in result.messages]
    assert merged[2].response_metadata["context_editing"]["cleared"] is True
