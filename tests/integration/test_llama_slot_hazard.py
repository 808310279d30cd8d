"""The llama-server behaviour the slot turns exist for, shown on the real server.

A request whose ``id_slot`` names a slot that is generating, with the host prompt
cache on (``--cache-ram``) and ``--slot-prompt-similarity`` above 0, makes
llama-server save and load a cached prompt into that busy slot before it defers
the request: the running generation leaves what it gives alone. The same
requests naming no slot leave it untouched (llama-server never puts an unnamed
request on a busy slot). ``coordination.slot_turns`` keeps fusion from ever
sending the first kind.

If a llama.cpp version stops corrupting, the first test fails: the rule may
then be relaxed (and this test turned around), not silently kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusion_graph_testing import LlamaServer
from fusion_graph_testing.answers import TOP, Exchange, divergent

pytestmark = pytest.mark.llama

#: Tokens the running generation makes: long enough to be mid-way when the others arrive.
RUNNING_TOKENS = 800
#: A prompt the host cache holds (put there before the running generation starts).
CACHED = "bravo charlie delta " * 30
RUNNING = {"prompt": "alpha " * 40, "n_predict": RUNNING_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def hazard_server(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> Iterator[LlamaServer]:
    """Two slots, the host prompt cache on, llama-server's default similarity threshold."""
    with LlamaServer(
        tiny_model,
        binary=llama_server_bin,
        n_slots=2,
        ctx_size=2 * 4096,
        extra_args=["--cache-ram", "256", "-sps", "0.1"],
        log_path=tmp_path / "hazard.log",
    ) as server:
        yield server


async def generating(client: httpx.AsyncClient, slots: str, task: asyncio.Task[Any]) -> None:
    """Until slot 0 is generating (a few ms on any machine; bounded), while ``task`` still runs."""
    for _ in range(3000):
        slot = (await client.get(slots)).json()[0]
        decoded = (slot.get("next_token") or [{}])[0].get("n_decoded", 0)
        if slot["is_processing"] and decoded > 8:
            break
        await asyncio.sleep(0.005)
    assert not task.done(), "the running generation ended before the other requests were sent"


async def generation_beside(server: LlamaServer, others: dict[str, Any]) -> tuple[str, str]:
    """The running generation on slot 0 alone, then again with three requests ``others`` arriving mid-way."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
        running = {**RUNNING, "id_slot": 0, "cache_prompt": False}
        alone = (await client.post("/completion", json=running)).json()["content"]
        # Slot 1 holds CACHED, then another prompt: CACHED is now in the host cache.
        for prompt in (CACHED, "echo foxtrot " * 30):
            await client.post("/completion", json={"prompt": prompt, "n_predict": 1, "id_slot": 1})
        task = asyncio.create_task(client.post("/completion", json=running))
        await generating(client, "/slots", task)
        extra = [
            asyncio.create_task(
                client.post("/completion", json={"prompt": f"{CACHED} golf {i}", "n_predict": 1, **others})
            )
            for i in range(3)
        ]
        beside = (await task).json()["content"]
        await asyncio.gather(*extra)
    return alone, beside


async def test_a_request_naming_a_busy_slot_corrupts_the_generation_running_there(
    hazard_server: LlamaServer,
) -> None:
    alone, beside = await generation_beside(hazard_server, {"id_slot": 0, "cache_prompt": True})
    assert beside != alone, (
        "llama-server no longer corrupts a generation when a request names its busy slot: "
        "the slot turns of coordination.slot_turns may be relaxed (see docs/design.md)"
    )


async def test_requests_naming_no_slot_leave_the_running_generation_alone(hazard_server: LlamaServer) -> None:
    alone, beside = await generation_beside(hazard_server, {"cache_prompt": True})
    assert beside == alone


async def test_the_answers_check_calls_the_corrupted_generation_divergent(hazard_server: LlamaServer) -> None:
    """``fusion_graph_testing.answers`` (what the crowd checks judge by) tells corruption from a near-tie.

    The same hazard through the chat endpoint with the tokens' logprobs: the
    generation that met requests naming its busy slot is judged divergent from the
    same request run alone, by the margin rule the crowd tests and benchmark use.
    """
    body = {
        "messages": [{"role": "user", "content": RUNNING["prompt"]}],
        "max_tokens": RUNNING_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": TOP,
    }
    async with httpx.AsyncClient(base_url=hazard_server.openai_base_url, timeout=300) as client:
        for prompt in (CACHED, "echo foxtrot " * 30):  # CACHED into the host cache, as above
            await client.post("/completions", json={"prompt": prompt, "max_tokens": 1, "id_slot": 1})
        running = {**body, "id_slot": 0, "cache_prompt": False}
        task = asyncio.create_task(client.post("/chat/completions", json=running))
        await generating(client, f"{hazard_server.base_url}/slots", task)
        others = [
            client.post(
                "/completions",
                json={"prompt": f"{CACHED} golf {i}", "max_tokens": 1, "id_slot": 0, "cache_prompt": True},
            )
            for i in range(3)
        ]
        await asyncio.gather(*others)
        beside = (await task).json()
        found = await divergent(client, [Exchange(running, beside)])
    assert len(found) == 1, f"the corrupted generation was judged a tie: {found}"
