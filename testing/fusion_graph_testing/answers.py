"""Is an answer given under load the answer the same request gets alone?

For tests and benchmarks of llama-server traffic: each recorded chat request
(``Exchange``: the body sent, the answer with ``logprobs`` and ``top_logprobs``)
is sent again, alone, to a server with no host prompt cache, with
``cache_prompt: false`` and no ``id_slot``, and the two greedy token sequences
are compared. A tiny random model's distributions are flat, so two tokens can
tie and batching noise may pick either: at the first position where the two
answers differ, the difference is *material* only when the token given under
load is not among the alone answer's top tokens there, within a small margin of
the alone answer's own token (``difference``). Where its top 20 all lie within
that margin and the token is not among them, the alone run is asked again for
its top ``WIDE_TOP`` (``divergent``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Exchange:
    """One chat request as sent (``body``) and the server's answer to it (``answer``)."""

    body: dict[str, Any]
    answer: dict[str, Any]


def tokens(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's tokens with their top alternatives (``choices[0].logprobs.content``)."""
    logprobs = (answer.get("choices") or [{}])[0].get("logprobs") or {}
    content = logprobs.get("content")
    return content if isinstance(content, list) else []


#: Alternatives the alone run reports at each position.
TOP = 20
#: Alternatives asked for again where the token given under load is not among the alone run's
#: ``TOP``: a tiny model's top 20 can lie within a fraction of a nat, so a token outside them may
#: still be a tie; this many settle it (llama-server ranks the whole vocabulary for them).
WIDE_TOP = 2000
#: Nats below the alone run's own token within which a token given under load is a tie broken the
#: other way (batching and restored prefixes change the last bits of the logits), not a change.
MARGIN = 0.5


def alone(body: dict[str, Any], top: int = TOP) -> dict[str, Any]:
    """``body`` as sent alone: no slot, no prompt cache; greedy with the top ``top`` kept."""
    sent = {k: v for k, v in body.items() if k not in ("id_slot", "stream", "stream_options")}
    return {**sent, "cache_prompt": False, "temperature": 0, "logprobs": True, "top_logprobs": top}


@dataclass(frozen=True)
class Difference:
    """Where an answer under load leaves the alone run materially (``str``: in words)."""

    index: int
    loaded: str | None
    solo: str | None
    gap: float | None
    """Nats the alone run puts the loaded token below its own; ``None``: not among its alternatives."""
    top: int
    """How many alternatives the alone run reported there."""
    lengths: tuple[int, int] | None = None
    """Token counts under load and alone, when the two agree token for token but one stops sooner."""

    def __str__(self) -> str:
        if self.lengths is not None:
            return f"{self.lengths[0]} tokens under load, {self.lengths[1]} alone"
        gap = f"{self.gap:.3f} nats below" if self.gap is not None else f"not in the top {self.top}"
        return f"token {self.index}: {self.loaded!r} under load, {self.solo!r} alone ({gap})"


def difference(loaded: list[dict[str, Any]], solo: list[dict[str, Any]]) -> Difference | None:
    """Where ``loaded`` leaves ``solo`` materially (see the module docstring); ``None``: it does not.

    At the first position the two differ, the token given under load is a tie broken the other way
    when the alone run ranks it among its top alternatives within ``MARGIN`` nats of its own token; from
    there on the two contexts differ, so nothing after it is compared.
    """
    for index, (got, want) in enumerate(zip(loaded, solo, strict=False)):
        if got.get("token") == want.get("token"):
            continue
        top = {alt.get("token"): alt.get("logprob") for alt in want.get("top_logprobs") or []}
        chosen, theirs = want.get("logprob"), top.get(got.get("token"))
        gap = None
        if isinstance(chosen, float | int) and isinstance(theirs, float | int):
            if chosen - theirs <= MARGIN:
                return None
            gap = float(chosen - theirs)
        return Difference(index, got.get("token"), want.get("token"), gap, len(top))
    if len(loaded) != len(solo):
        return Difference(min(len(loaded), len(solo)), None, None, None, 0, (len(loaded), len(solo)))
    return None


async def divergent(client: httpx.AsyncClient, exchanges: list[Exchange]) -> list[str]:
    """Each exchange whose answer leaves the same request run alone materially, described.

    ``client`` reaches a server with no host prompt cache (``--cache-ram 0``), at its
    OpenAI base URL; the requests are sent one after another.
    """
    found = []
    for number, exchange in enumerate(exchanges):
        response = await client.post("/chat/completions", json=alone(exchange.body))
        response.raise_for_status()
        loaded, solo = tokens(exchange.answer), tokens(response.json())
        if not loaded or not solo:
            found.append(f"request {number}: no logprobs in an answer (ask with logprobs and top_logprobs)")
            continue
        where = difference(loaded, solo)
        if where is not None and where.gap is None and where.top == TOP:  # a flat top 20: ask for more
            response = await client.post("/chat/completions", json=alone(exchange.body, WIDE_TOP))
            response.raise_for_status()
            where = difference(loaded, tokens(response.json()))
        if where is not None:
            slot = exchange.body.get("id_slot")
            found.append(f"request {number} (slot {slot}): {where}")
    return found
