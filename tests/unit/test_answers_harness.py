"""How an answer under load is judged against the same request alone (``fusion_graph_testing.answers``)."""

from __future__ import annotations

from typing import Any

from fusion_graph_testing.answers import MARGIN, alone, difference


def token(text: str, logprob: float, top: dict[str, float] | None = None) -> dict[str, Any]:
    return {
        "token": text,
        "logprob": logprob,
        "top_logprobs": [{"token": t, "logprob": p} for t, p in (top or {}).items()],
    }


def test_the_same_tokens_do_not_differ() -> None:
    answer = [token("a", -1.0), token("b", -1.0)]
    assert difference(answer, answer) is None


def test_a_near_tie_broken_the_other_way_is_no_difference() -> None:
    loaded = [token("a", -1.0), token("x", -2.0)]
    solo = [token("a", -1.0), token("b", -2.0, {"b": -2.0, "x": -2.0 - MARGIN / 2})]
    assert difference(loaded, solo) is None


def test_a_token_far_below_or_outside_the_alone_top_is_a_difference() -> None:
    loaded = [token("x", -1.0)]
    below = [token("b", -1.0, {"b": -1.0, "x": -1.0 - 2 * MARGIN})]
    outside = [token("b", -1.0, {"b": -1.0, "c": -1.1})]
    assert "token 0" in str(difference(loaded, below)) and "nats below" in str(difference(loaded, below))
    assert "not in the top" in str(difference(loaded, outside))
    assert "tokens under load" in str(difference([token("a", -1.0)], [token("a", -1.0), token("b", -1.0)]))


def test_the_alone_request_names_no_slot_and_caches_nothing() -> None:
    sent = alone({"messages": [], "id_slot": 3, "cache_prompt": True, "stream": True, "temperature": 0.7})
    assert "id_slot" not in sent and "stream" not in sent
    assert sent["cache_prompt"] is False and sent["temperature"] == 0 and sent["logprobs"] is True
