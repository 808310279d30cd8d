"""Prompt estimates per leg: anchors on a server's report (the estimator itself is in test_tokens.py)."""

from __future__ import annotations

from langchain_core.messages import AIMessage

from fusion_graph.sizing.turn import (
    Estimate,
    anchor_holds,
    approximate_tokens,
    fingerprint,
    leg_estimate,
    new_anchor,
    prompt_estimate,
    relative_error,
)
from tests.unit.sizing.test_tokens import history, read_file


def test_without_an_anchor_the_whole_prompt_is_estimated() -> None:
    messages, key = history(), fingerprint("sys", [read_file])
    estimate = leg_estimate(messages, system_prompt="sys", tools=[read_file], anchor=None, key=key)
    assert estimate == Estimate(prompt_estimate("sys", messages, [read_file]), "approximate")


def test_an_anchor_adds_only_what_was_appended_since_the_report() -> None:
    messages, key = history(), fingerprint("sys", [read_file])
    anchor = new_anchor(prompt_tokens=700, messages=messages[:1], key=key, provider="local:x")
    assert anchor is not None and anchor["messages"] == 1 and anchor["last_id"] == "u1"
    estimate = leg_estimate(messages, system_prompt="sys", tools=[read_file], anchor=anchor, key=key)
    assert estimate == Estimate(700 + approximate_tokens(messages[1:]), "anchored")


def test_an_anchor_is_void_when_the_prefix_or_the_extras_changed() -> None:
    messages, key = history(), fingerprint("sys", [read_file])
    anchor = new_anchor(prompt_tokens=700, messages=messages[:2], key=key, provider="local:x")
    assert anchor is not None
    assert anchor_holds(anchor, messages, key)
    assert not anchor_holds(anchor, messages, fingerprint("another system prompt", [read_file]))
    assert not anchor_holds(anchor, messages, fingerprint("sys", []))
    assert not anchor_holds(anchor, messages[:1], key), "a history shorter than the report"
    rewritten = [messages[0], AIMessage("other", id="a2"), messages[2]]
    assert not anchor_holds(anchor, rewritten, key), "another message where the report ended"
    assert leg_estimate(rewritten, system_prompt="sys", tools=[read_file], anchor=anchor, key=key).basis == (
        "approximate"
    )


def test_no_report_leaves_no_anchor() -> None:
    assert new_anchor(prompt_tokens=None, messages=history(), key="k", provider="p") is None
    assert new_anchor(prompt_tokens=0, messages=history(), key="k", provider="p") is None
    assert new_anchor(prompt_tokens=10, messages=[], key="k", provider="p") is None


def test_relative_error() -> None:
    assert relative_error(110, 100) == 0.1
    assert relative_error(90, 100) == -0.1
    assert relative_error(90, None) is None
