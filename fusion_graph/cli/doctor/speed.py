"""Doctor's ``--live`` speed row: does a full answer at llama-server's measured speed fit ``request_timeout``?

On a CPU box generation is slow, and llama-server's default thread count can
make it far slower than it need be on a busy machine (2.3 tokens/s against 31
with ``-t 1`` on a loaded 2-core box): every step that runs to
``max_completion_tokens`` then ends in a timeout with nothing to show for it.
The row measures the speed the way llama-server reports it (``timings.
predicted_per_second`` of a short completion) and says, before the first run,
whether the budget fits and which of the three fixes to take.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from fusion_graph.cli.doctor.rows import Check, error_text, json_body, transport

if TYPE_CHECKING:
    import httpx

    from fusion_graph.providers.llama_server import ServerProps
    from fusion_graph.settings import FusionSettings

NAME = "generation speed"
#: Tokens the probe generates (``ignore_eos``: a model that stops early would measure nothing).
PROBE_TOKENS = 16
#: Share of ``request_timeout`` a full answer may take; the rest is left for the prompt's prefill.
HEADROOM = 0.8
PROBE_PROMPT = "Count from one to one hundred in words."
THREADS_FIX = (
    "on a CPU box start llama-server with fewer threads (-t 1, or the physical cores minus one on a "
    "busy box) and compare this row's tokens/s"
)


def speed_verdict(per_second: float, budget: int, request_timeout: float, *, measured: bool = True) -> Check:
    """The row for a speed: ``warn`` when ``budget`` tokens at it take more than ``HEADROOM`` of the timeout.

    Args:
        per_second: Generated tokens per second (an upper bound when not ``measured``).
        budget: The run's ``max_completion_tokens``.
        request_timeout: The operator's ``request_timeout`` (``FUSION_REQUEST_TIMEOUT``), seconds.
        measured: ``False`` when the probe timed out and ``per_second`` is only what it could
            at most have been.
    """
    speed = f"{per_second:.1f} tokens/s" if measured else f"under {per_second:.1f} tokens/s"
    need = budget / per_second
    allowed = HEADROOM * request_timeout
    if need <= allowed:
        if not measured:
            return Check(
                NAME,
                "info",
                f"no answer to a {PROBE_TOKENS}-token completion within --timeout: {speed}, too few "
                "to tell whether max_completion_tokens fits request_timeout",
                "rerun with a larger --timeout",
            )
        return Check(
            NAME,
            "ok",
            f"{speed}: max_completion_tokens {budget} takes at most {need:.0f} s of request_timeout "
            f"{request_timeout:g} s",
        )
    fit = max(1, math.floor(per_second * allowed))
    raise_to = 10 * math.ceil(need / HEADROOM / 10)
    takes = "up to" if measured else "over"
    return Check(
        NAME,
        "warn",
        f"{speed}: max_completion_tokens {budget} takes {takes} {need:.0f} s, past {HEADROOM:.0%} of "
        f"request_timeout {request_timeout:g} s: a long answer would time out",
        f"lower max_completion_tokens to {fit} or less (--context '{{\"max_completion_tokens\": {fit}}}'), "
        f"raise FUSION_REQUEST_TIMEOUT to {raise_to}{'' if measured else ' or more'}, or {THREADS_FIX}",
    )


def _per_second(body: object) -> float | None:
    """``timings.predicted_per_second`` of a llama-server answer, when it is a positive number."""
    timings = body.get("timings") if isinstance(body, dict) else None
    speed: Any = timings.get("predicted_per_second") if isinstance(timings, dict) else None
    if isinstance(speed, int | float) and not isinstance(speed, bool) and speed > 0:
        return float(speed)
    return None


def speed_check(
    settings: FusionSettings, props: ServerProps, budget: int, client: httpx.Client, *, timeout: float
) -> Check:
    """``--live``: a ``PROBE_TOKENS``-token chat completion on the last slot, judged by ``speed_verdict``.

    The last slot is the one memory jobs use (the reflection slot), so the probe
    evicts no conversation's cached prefix. A probe that outlasts ``timeout``
    still bounds the speed from above (``PROBE_TOKENS / timeout``), which is
    enough to warn a budget that cannot fit.
    """
    import httpx

    from fusion_graph.providers.llama_server import server_root

    slot = props.total_slots - 1
    # A request naming a slot that is generating corrupts that generation (docs/design.md, one request
    # a slot): doctor is outside the graph's slot turns, so it probes only a slot the server shows idle.
    try:
        states = client.get(server_root(settings.local_base_url) + "/slots", timeout=timeout).json()
    except (httpx.HTTPError, ValueError):
        states = None
    busy = isinstance(states, list) and any(
        isinstance(row, dict) and row.get("id") == slot and row.get("is_processing") for row in states
    )
    if busy:
        return Check(
            NAME,
            "info",
            f"not measured: slot {slot} (memory jobs') is generating now, and a probe naming it could "
            "disturb that generation",
            "rerun doctor --live when the server is idle",
        )
    body = {
        "model": settings.local_model,
        "messages": [{"role": "user", "content": PROBE_PROMPT}],
        "max_tokens": PROBE_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "id_slot": slot,
    }
    url = settings.local_base_url.rstrip("/") + "/chat/completions"
    try:
        response = client.post(url, json=body, timeout=timeout)
    except httpx.TimeoutException:
        return speed_verdict(PROBE_TOKENS / timeout, budget, settings.request_timeout, measured=False)
    except httpx.HTTPError as error:
        return Check(NAME, "info", f"not measured: POST {url} failed ({transport(error)})")
    if response.status_code >= 300:
        return Check(
            NAME,
            "info",
            f"not measured: POST {url} answered HTTP {response.status_code} ({error_text(response)})",
        )
    per_second = _per_second(json_body(response))
    if per_second is None:
        return Check(
            NAME, "info", f"not measured: the answer of POST {url} has no timings.predicted_per_second"
        )
    return speed_verdict(per_second, budget, settings.request_timeout)
