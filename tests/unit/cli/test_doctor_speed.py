"""``fusion-graph doctor --live``: llama-server's measured tokens/s against ``request_timeout``.

The local server is a loopback fake answering as llama-server does: ``/props``, and a chat
completion carrying ``timings.predicted_per_second``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from fusion_graph.cli.doctor.speed import PROBE_TOKENS, speed_verdict
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.unit.cli.test_doctor import in_tmp, invoke, rows

__all__ = ["in_tmp"]  # the autouse fixture: each test in an empty directory, no key set

BUDGET_512 = json.dumps({"mode": "local", "max_completion_tokens": 512})


def llama_answer(per_second: float) -> bytes:
    """A llama-server chat completion with its timings."""
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "local",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "one two"},
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 12,
                "completion_tokens": PROBE_TOKENS,
                "total_tokens": 12 + PROBE_TOKENS,
            },
            "timings": {
                "predicted_n": PROBE_TOKENS,
                "predicted_per_second": per_second,
                "prompt_per_second": 90.0,
            },
        }
    ).encode()


@pytest.fixture
def llama(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeOpenAI, list[float]]]:
    """A fake llama-server of 2 slots; the speed it reports is the list's first value."""
    speed = [31.0]
    release = threading.Event()

    def answer(body: dict[str, Any]) -> Reply:
        if "ignore_eos" not in body:  # /apply-template and anything else
            return Reply()
        if speed[0] <= 0:  # still generating when the probe gives up
            return Reply(hold=release)
        return Reply(raw=llama_answer(speed[0]))

    with FakeOpenAI(answer) as fake:
        fake.props = {
            "total_slots": 2,
            "model_alias": "local",
            "default_generation_settings": {"n_ctx": 8192},
        }
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", fake.base_url)
        monkeypatch.setenv("FUSION_REQUEST_TIMEOUT", "120")
        try:
            yield fake, speed
        finally:
            release.set()


def probes(fake: FakeOpenAI) -> list[dict[str, Any]]:
    return [body for body in fake.requests if "ignore_eos" in body]


def test_a_fast_server_fits_the_budget(llama: tuple[FakeOpenAI, list[float]]) -> None:
    fake, _ = llama
    row = rows(invoke("--live", "--json", "--context", BUDGET_512))["generation speed"]
    assert row["status"] == "ok", row
    assert "31.0 tokens/s" in row["detail"] and "max_completion_tokens 512" in row["detail"]
    [probe] = probes(fake)
    assert (probe["max_tokens"], probe["ignore_eos"], probe["id_slot"]) == (PROBE_TOKENS, True, 1)


def test_a_slow_cpu_server_warns_with_the_three_fixes(llama: tuple[FakeOpenAI, list[float]]) -> None:
    _, speed = llama
    speed[0] = 2.3  # llama-server's default threads on a busy 2-core box
    row = rows(invoke("--live", "--json", "--context", BUDGET_512))["generation speed"]
    assert row["status"] == "warn", row
    assert "2.3 tokens/s" in row["detail"] and "request_timeout 120 s" in row["detail"]
    # 2.3 tokens/s x 80% of 120 s = 220 tokens fit; 512 tokens take 223 s, so 280 s with the headroom.
    assert "lower max_completion_tokens to 220" in row["fix"]
    assert "raise FUSION_REQUEST_TIMEOUT to 280" in row["fix"]
    assert "-t 1" in row["fix"]


def test_a_probe_past_the_timeout_still_warns_a_budget_that_cannot_fit(
    llama: tuple[FakeOpenAI, list[float]],
) -> None:
    _, speed = llama
    speed[0] = 0  # never answers within --timeout
    big = json.dumps({"mode": "local", "max_completion_tokens": 4096})
    row = rows(invoke("--live", "--json", "--timeout", "0.5", "--context", big))["generation speed"]
    assert row["status"] == "warn" and "under 32.0 tokens/s" in row["detail"], row


def test_a_probe_past_the_timeout_cannot_tell_whether_a_small_budget_fits(
    llama: tuple[FakeOpenAI, list[float]],
) -> None:
    _, speed = llama
    speed[0] = 0
    row = rows(invoke("--live", "--json", "--timeout", "0.5", "--context", BUDGET_512))["generation speed"]
    assert row["status"] == "info" and "larger --timeout" in row["fix"], row


def test_a_slot_still_generating_is_not_probed(llama: tuple[FakeOpenAI, list[float]]) -> None:
    """Naming a slot that generates corrupts that generation: doctor leaves a busy slot alone."""
    fake, speed = llama
    speed[0] = 0  # the first probe is still generating on the slot when doctor gives up on it
    rows(invoke("--live", "--json", "--timeout", "0.5", "--context", BUDGET_512))
    row = rows(invoke("--live", "--json", "--timeout", "0.5", "--context", BUDGET_512))["generation speed"]
    assert row["status"] == "info" and "generating now" in row["detail"], row
    assert len(probes(fake)) == 1  # no second probe was sent beside the first


def test_without_live_nothing_is_generated(llama: tuple[FakeOpenAI, list[float]]) -> None:
    fake, _ = llama
    assert "generation speed" not in rows(invoke("--json", "--context", BUDGET_512))
    assert probes(fake) == []


def test_a_server_without_timings_is_not_measured(llama: tuple[FakeOpenAI, list[float]]) -> None:
    fake, _ = llama
    fake.script(lambda body: Reply(content="ok"))
    row = rows(invoke("--live", "--json", "--context", BUDGET_512))["generation speed"]
    assert row["status"] == "info" and "timings.predicted_per_second" in row["detail"], row


def test_the_verdict_leaves_headroom_for_the_prompt() -> None:
    assert speed_verdict(10.0, 900, 120.0).status == "ok"  # 90 s of the 96 s allowed
    assert speed_verdict(10.0, 1000, 120.0).status == "warn"  # 100 s: past 80% of 120 s
