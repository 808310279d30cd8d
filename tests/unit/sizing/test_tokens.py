"""Prompt token estimates: the character-class estimator, message framing and tool schemas."""

from __future__ import annotations

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.tools import tool

from fusion_graph.sizing.turn import (
    TOKENS_PER_MESSAGE,
    TOKENS_PER_PROMPT,
    approximate_tokens,
    message_tokens,
    prompt_estimate,
    text_tokens,
    tool_tokens,
)

CODE = (
    "def handler_7(request, limit=49):\n    return {'status': 202, 'count': len(request['items'][:limit])}\n"
)


PROSE = "The passenger asked to move the flight to the following Tuesday and keep the same seat.\n"


@tool
def read_file(path: str, start_line: int = 1) -> str:
    """Read a file of the workspace, with line numbers."""
    return path


def history() -> list[BaseMessage]:
    return [
        HumanMessage("read a.py", id="u1"),
        AIMessage("", tool_calls=[{"name": "read_file", "args": {"path": "a.py"}, "id": "c1"}], id="a1"),
        ToolMessage(CODE * 20, tool_call_id="c1", id="t1"),
    ]


def test_code_costs_more_tokens_per_character_than_prose() -> None:
    assert text_tokens(CODE) / len(CODE) > 1.3 * text_tokens(PROSE) / len(PROSE)
    # Four characters a token undercounts code (BPE splits its punctuation, digits and indentation).
    assert text_tokens(CODE * 10) > 1.2 * len(CODE * 10) / 4


def test_a_huge_text_is_estimated_from_its_ends_and_scaled() -> None:
    one = CODE * 20_000  # about 2 MB
    assert len(one) > 1_900_000
    assert abs(text_tokens(one) - 20_000 * text_tokens(CODE)) / text_tokens(one) < 0.01


def test_a_message_adds_its_template_framing_and_its_tool_calls() -> None:
    plain = AIMessage("hello")
    calling = AIMessage("hello", tool_calls=[{"name": "read_file", "args": {"path": "a.py"}, "id": "c"}])
    assert message_tokens(plain) == round(text_tokens("hello") + TOKENS_PER_MESSAGE)
    assert message_tokens(calling) > message_tokens(plain) + 5


def test_bound_tool_schemas_are_part_of_the_prompt() -> None:
    messages = history()[:1]
    bare = prompt_estimate("Be brief.", messages)
    assert (
        bare
        == approximate_tokens([HumanMessage("Be brief.")]) + approximate_tokens(messages) + TOKENS_PER_PROMPT
    )
    assert prompt_estimate("Be brief.", messages, [read_file]) == bare + tool_tokens([read_file])
    assert tool_tokens([read_file]) > 40


def test_the_estimator_beats_four_characters_a_token_on_tool_output() -> None:
    # A JSON tool result: digits and punctuation. Qwen2's tokenizer makes 42 tokens of it
    # (llama-server /tokenize); four characters a token says 23.
    result = ToolMessage(
        '{"reservation_id": "ZFA04Y", "flights": [{"flight_number": "HAT170", "date": "2024-05-17"}]}',
        tool_call_id="c",
    )
    ours = message_tokens(result) - TOKENS_PER_MESSAGE
    chars4 = count_tokens_approximately([result], extra_tokens_per_message=0)
    assert abs(ours - 42) <= 4 < abs(chars4 - 42)
