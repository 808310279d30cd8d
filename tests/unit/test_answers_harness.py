"""How an answer under load is judged against the same request alone (``fusion_graph_testing.answers``)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from fusion_graph_testing.answers import MARGIN, TOP, WIDE_TOP, Exchange, alone, difference, divergent


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


def answer_of(*positions: dict[str, Any]) -> dict[str, Any]:
    return {"choices": [{"logprobs": {"content": list(positions)}}]}


async def judged(wide: dict[str, float]) -> tuple[list[str], list[int]]:
    """``divergent`` over one exchange whose loaded token is outside the alone top 20: asks twice."""
    flat = {f"t{i}": -10.0 - i / 100 for i in range(TOP)}  # a tiny model's top 20: 0.2 nats in all
    asked: list[int] = []

    def serve(request: httpx.Request) -> httpx.Response:
        top = json.loads(request.content)["top_logprobs"]
        asked.append(top)
        alternatives = flat if top == TOP else wide
        return httpx.Response(200, json=answer_of(token("t0", -10.0, alternatives)))

    async with httpx.AsyncClient(transport=httpx.MockTransport(serve), base_url="http://alone") as client:
        found = await divergent(client, [Exchange({"messages": []}, answer_of(token("x", -9.0)))])
    return found, asked


async def test_a_token_outside_a_flat_top_20_is_looked_for_among_more() -> None:
    """The alone run's top 20 lie within 0.2 nats: the token under load is looked for in its top 2,000."""
    tie, asked = await judged({"t0": -10.0, "x": -10.0 - MARGIN / 2})
    assert tie == [] and asked == [TOP, WIDE_TOP]
    far, _ = await judged({"t0": -10.0, "x": -10.0 - 3 * MARGIN})
    assert len(far) == 1 and "nats below" in far[0]
    missing, _ = await judged({"t0": -10.0})
    assert len(missing) == 1 and "not in the top 1" in missing[0]
