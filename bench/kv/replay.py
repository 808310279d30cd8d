"""How each variant sends local steps, and the replay of threads against one server."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.kv.plan import ThreadPlan
from bench.kv.results import StepRecord, step_record
from bench.kv.server import MAX_TOKENS, N_SLOTS
from fusion_graph.context import DEFAULTS
from fusion_graph.providers.placement import slot_body
from fusion_graph.providers.slots import SlotPool


@dataclass(frozen=True)
class Variant:
    """How local requests are sent, and the hysteresis that routes them."""

    name: str
    hysteresis: int
    pinned: bool
    cache_prompt: bool
    description: str

    def body(self, pool: SlotPool | None, thread_id: str) -> dict[str, Any]:
        """Extra request-body fields of a local step of ``thread_id``."""
        if self.pinned:
            assert pool is not None
            fields = slot_body("local", pool.slot_for(thread_id))
            assert fields is not None
            return {**fields, "cache_prompt": self.cache_prompt}
        return {"cache_prompt": self.cache_prompt}


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "fusion",
        DEFAULTS["hysteresis"],
        True,
        True,
        "id_slot from SlotPool(4) + cache_prompt, default hysteresis",
    ),
    Variant("hazard", DEFAULTS["hysteresis"], False, False, "no id_slot, cache_prompt false"),
    Variant("no_hysteresis", 0, True, True, "id_slot + cache_prompt, hysteresis 0"),
    Variant(
        "server_pick",
        DEFAULTS["hysteresis"],
        False,
        True,
        "no id_slot, cache_prompt true: llama-server picks the slot (by prompt similarity)",
    ),
)
#: Replayed unless ``--variants`` says otherwise (``server_pick`` is an opt-in diagnostic).
DEFAULT_VARIANTS = ("fusion", "hazard", "no_hysteresis")


@dataclass
class Replay:
    """State shared by the workers of one variant run."""

    client: httpx.AsyncClient
    variant: Variant
    pool: SlotPool | None
    records: list[StepRecord] = field(default_factory=list)


async def replay_thread(replay: Replay, plan: ThreadPlan, *, release: bool) -> None:
    """Send one thread's steps in order; local ones to llama-server, cloud ones to the counter."""
    trajectory = plan.trajectory
    for step in plan.steps:
        if step.leg == "cloud":
            replay.records.append(step_record(trajectory.file, step))
            continue
        body = {
            "messages": list(trajectory.messages[: step.position]),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            **replay.variant.body(replay.pool, trajectory.thread_id),
        }
        response = await replay.client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"{trajectory.thread_id} step {step.position}: HTTP {response.status_code}: "
                f"{response.text[:500]}"
            )
        replay.records.append(step_record(trajectory.file, step, response.json()["timings"]))
    if release and replay.pool is not None:
        replay.pool.release(trajectory.thread_id)


async def run_variant(
    base_url: str, variant: Variant, plans: Sequence[ThreadPlan], concurrency: int, *, release: bool
) -> list[StepRecord]:
    """Replay every thread, ``concurrency`` threads at a time, each thread's steps in order."""
    pool = SlotPool(N_SLOTS, reserve_reflection=False) if variant.pinned else None
    queue = deque(plans)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        replay = Replay(client, variant, pool)

        async def worker() -> None:
            while queue:
                await replay_thread(replay, queue.popleft(), release=release)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return replay.records
