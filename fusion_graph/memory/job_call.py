"""One memory job: a warm, structured inference on llama-server's reflection slot."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from pydantic import BaseModel, ValidationError

from fusion_graph import prompts
from fusion_graph.memory.jobs import MemoryJob, job_prompt
from fusion_graph.providers.chain import Ask, Bounds, ProviderChain, ask, prime_slot
from fusion_graph.providers.models import Provider, speaks_openai
from fusion_graph.providers.placement import Placement, Placer
from fusion_graph.redact import scrub
from fusion_graph.routing.records import RouteRecord, make_record
from fusion_graph.routing.score import Leg, RouteDecision

logger = logging.getLogger(__name__)

PRIMER_PROMPT = "fusion-graph memory slot: park the previous job in the host prompt cache"


# -- one job: a warm, structured inference on the reflection slot -------------


#: One lock per (event loop, llama-server, slot): priming and the job it primes for stay together.
_SLOT_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _slot_lock(link: Provider, slot: int) -> asyncio.Lock:
    locks = _SLOT_LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault((link.base_url or link.id, slot), asyncio.Lock())


async def prime_reflection_slot(link: Provider, placement: Placement, timeout_s: float | None) -> bool:
    """Make llama-server hold the conversation's prefix for a job on the slot; ``True`` if it answered.

    llama-server restores a prompt from its host prompt cache (``--cache-ram``)
    only when the slot it picks would keep less than half of its own content,
    and it copies idle slots into that cache when a task starts
    (``--cache-idle-slots``). This one-token request shares nothing with the
    slot's content (the previous job), so it parks that content in the cache
    and snapshots the idle conversation slots; the job that follows then
    finds its conversation there. It goes out as ``ask`` builds every request
    (``chain.prime_slot``: the placement's slot, ``cache_prompt`` and headers, so
    the same box). Only OpenAI-compatible servers are primed (an injected model
    has no slots to park). Any failure is ignored: the job runs cold.
    """
    if not speaks_openai(placement.model or link.model):
        return False
    try:
        await prime_slot(link, placement, PRIMER_PROMPT, timeout_s)
    except Exception as error:  # noqa: BLE001 - priming only saves prefill; the job runs anyway
        logger.debug("priming slot %s of %s failed: %s", placement.slot, link.id, scrub(repr(error)))
        return False
    return True


@dataclass(frozen=True)
class JobRunner:
    """How a thread's memory jobs are called.

    Attributes:
        chain: The provider chain (fallover, health, prices) the jobs go through.
        leg: The ``sub_runners`` leg the jobs start on.
        system_prompt: The steps' system prompt (the prefix must match theirs).
        tools: The tools the steps bind (their schemas are part of the prefix).
        placer: Where local requests go (the reflection slot, on the thread's box).
        thread_id: The thread the jobs are about.
        max_tokens: Completion budget of one answer.
        timeout_s: Seconds one attempt may take (``request_timeout``).
        config: Callbacks and tags of the run (``None`` for detached jobs).
        prime: Prime the reflection slot before a local job (``bench/memory_warm.py`` measures
            what turning it off costs).
        over_budget: Why the cloud budget moved the jobs off cloud (said in their records); no
            attempt may then fall over to a cloud link.
    """

    chain: ProviderChain
    leg: Leg
    system_prompt: str
    tools: Sequence[BaseTool]
    placer: Placer
    thread_id: str
    max_tokens: int
    timeout_s: float | None = None
    config: RunnableConfig | None = None
    prime: bool = True
    over_budget: str | None = None


def _job_body(job: MemoryJob, runner: JobRunner) -> dict[str, Any]:
    """Request fields of a job on an OpenAI-compatible link: the schema, and no tool calls.

    ``response_format`` travels in the body: as a model argument, langchain-openai
    would parse the answer with the SDK, which refuses non-strict tools, and the
    tools must stay bound for the prefix to match.
    """
    body: dict[str, Any] = {"response_format": job.response_format()}
    if runner.tools:
        body["tool_choice"] = "none"
    return body


async def run_job(
    job: MemoryJob, messages: Sequence[BaseMessage], runner: JobRunner, *, turn: int, step: int
) -> tuple[BaseModel | None, list[RouteRecord], str | None]:
    """Ask for the job's JSON about ``messages`` (one repair on the same provider); never raises.

    Returns:
        The validated result (or ``None``), one record per inference, and why it was dropped.
    """
    prompt = job_prompt(runner.system_prompt, messages, job)
    records: list[RouteRecord] = []
    prefer: str | None = None
    error = ""
    allowed = None
    if runner.over_budget is not None:
        allowed = frozenset(link.id for link in runner.chain.links if link.leg != "cloud")
    bounds = Bounds(allowed=allowed, timeout_s=runner.timeout_s)
    if allowed is not None and not allowed:
        why = f"{runner.over_budget}, and no local provider can run it instead"
        return None, [dropped_record(job, "cloud", turn, step, why)], why
    for attempt in range(2):
        if runner.over_budget is None:
            reason = f"memory job {job.name} on the {runner.leg} leg (sub_runners={runner.leg})"
        else:
            reason = f"memory job {job.name}: sub_runners=cloud; {runner.over_budget}: local"
        decision = RouteDecision(
            leg=runner.leg, score=None, threshold=None, reason=reason, budget=runner.over_budget
        )
        primed: dict[str, bool] = {}
        prime = runner.prime and attempt == 0  # a repair continues the slot's own content

        async def on_slot(
            link: Provider,
            placement: Placement,
            call: Callable[[], Awaitable[Any]],
            prime: bool = prime,
            primed: dict[str, bool] = primed,
        ) -> Any:
            if placement.body(link.leg) is None or placement.slot is None:
                return await call()
            # Priming and the job it primes for stay together (other processes' wait in ``ask``).
            async with _slot_lock(link, placement.slot):
                primed[link.id] = prime and await prime_reflection_slot(link, placement, runner.timeout_s)
                return await call()

        call = Ask(
            kind="memory",
            turn=turn,
            step=step,
            decision=decision,
            prompt=prompt,
            thread_id=runner.thread_id,
            tools=runner.tools,
            prefer_provider=prefer,
            reflection=True,
            body=_job_body(job, runner),
            max_tokens=runner.max_tokens,
            config=runner.config,
            parts={"memory": {"job": job.name, "repair": attempt > 0}},
        )
        failure: BaseException | None = None
        try:
            asked = await ask(call, chain=runner.chain, placer=runner.placer, bounds=bounds, around=on_slot)
        except Exception as refused:  # noqa: BLE001 - a memory job must never fail the turn
            failure = refused
        else:
            failure = asked.exhausted if asked.answer is None else None
        if failure is not None or asked.answer is None:
            why = scrub(f"provider error: {type(failure).__name__}: {failure}")
            logger.warning("memory job %s failed: %s", job.name, why)
            return None, records, why
        answer, record = asked.answer, asked.record
        record.setdefault("memory", {})["primed"] = primed.get(str(record["provider"]), False)
        records.append(record)
        try:
            return job.schema.model_validate_json(_json_text(answer)), records, None
        except (ValidationError, ValueError) as invalid:
            error = str(invalid).splitlines()[0] if str(invalid) else type(invalid).__name__
            prompt = [*prompt, answer, HumanMessage(prompts.MEMORY_REPAIR.format(error=error))]
            prefer = record["provider"]  # the repair is judged by the model that made the mistake
    records[-1].setdefault("memory", {})["dropped"] = f"invalid JSON after one repair: {error}"
    return None, records, f"invalid JSON after one repair: {error}"


def dropped_record(job: MemoryJob, leg: Leg, turn: int, step: int, why: str) -> RouteRecord:
    """The record of a job that produced no answer at all (timeout, every provider down)."""
    decision = RouteDecision(leg=leg, score=None, threshold=None, reason=f"memory job {job.name} dropped")
    return make_record(
        turn=turn,
        step=step,
        kind="memory",
        decision=decision,
        memory={"job": job.name, "dropped": scrub(why)},
    )


def _json_text(answer: AIMessage) -> str:
    """The JSON text of an answer (content, minus a Markdown fence some models add)."""
    text = answer.text.strip()
    if text.startswith("```"):
        text = text.strip("`")
        text = text[text.find("\n") + 1 :] if "\n" in text else text
    return text
