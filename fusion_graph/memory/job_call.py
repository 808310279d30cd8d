"""One memory job: a warm, structured inference on llama-server's reflection slot."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.tools import BaseTool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ValidationError

from fusion_graph import prompts
from fusion_graph.memory.jobs import MemoryJob, job_prompt
from fusion_graph.providers.ask import HeadersFor, SlotFor, bound_model, call_headers, served_box
from fusion_graph.providers.chain import ChainLink, ProviderChain
from fusion_graph.providers.records import answered_record, make_record
from fusion_graph.providers.slots import slot_body
from fusion_graph.redact import scrub
from fusion_graph.routing import Leg, RouteDecision
from fusion_graph.state import RouteRecord

logger = logging.getLogger(__name__)

PRIMER_PROMPT = "fusion-graph memory slot: park the previous job in the host prompt cache"


# -- one job: a warm, structured inference on the reflection slot -------------


#: One lock per (event loop, llama-server, slot): priming and the job it primes for stay together.
_SLOT_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _slot_lock(link: ChainLink, slot: int) -> asyncio.Lock:
    locks = _SLOT_LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault((link.as_provider().base_url or link.id, slot), asyncio.Lock())


async def prime_reflection_slot(link: ChainLink, slot: int, headers: dict[str, str] | None = None) -> bool:
    """Make llama-server hold the conversation's prefix for a job on ``slot``; ``True`` if it answered.

    llama-server restores a prompt from its host prompt cache (``--cache-ram``)
    only when the slot it picks would keep less than half of its own content,
    and it copies idle slots into that cache when a task starts
    (``--cache-idle-slots``). This one-token request shares nothing with the
    slot's content (the previous job), so it parks that content in the cache
    and snapshots the idle conversation slots; the job that follows then
    finds its conversation there. Any failure is ignored: the job runs cold.
    ``headers`` (the thread's routing key) send it to the box the job will run on.
    """
    model = link.model
    if not isinstance(model, ChatOpenAI) or model.root_async_client is None:
        return False
    try:
        await model.root_async_client.completions.create(
            model=model.model_name,
            prompt=PRIMER_PROMPT,
            max_tokens=1,
            temperature=0,
            extra_body={"id_slot": slot, "cache_prompt": True},
            extra_headers=headers,
        )
    except Exception as error:  # noqa: BLE001 - priming only saves prefill; the job runs anyway
        logger.debug("priming slot %s of %s failed: %s", slot, link.id, scrub(repr(error)))
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
        reflection_slot: The llama-server slot for jobs on a local link (``None``: not llama-server).
        max_tokens: Completion budget of one answer.
        config: Callbacks and tags of the run (``None`` for detached jobs).
        prime: Prime the reflection slot before a local job (``bench/memory_warm.py`` measures
            what turning it off costs).
        headers: Headers of a job's request to a link (the thread's routing key on a local link).
    """

    chain: ProviderChain
    leg: Leg
    system_prompt: str
    tools: Sequence[BaseTool]
    reflection_slot: SlotFor
    max_tokens: int
    config: RunnableConfig | None = None
    prime: bool = True
    headers: HeadersFor | None = None


def _job_kwargs(
    link: ChainLink, job: MemoryJob, runner: JobRunner, body: dict[str, Any] | None
) -> dict[str, Any]:
    """``_body_kwargs`` and the request's headers."""
    return _body_kwargs(link, job, runner, body) | call_headers(link, runner.headers)


def _body_kwargs(
    link: ChainLink, job: MemoryJob, runner: JobRunner, body: dict[str, Any] | None
) -> dict[str, Any]:
    """Request fields of a job: the schema, no tool calls, the slot.

    ``response_format`` travels in ``extra_body``: as a model argument,
    langchain-openai would parse the answer with the SDK, which refuses
    non-strict tools, and the tools must stay bound for the prefix to match.
    """
    if not isinstance(link.model, ChatOpenAI):
        return {"extra_body": body} if body is not None else {}
    kwargs: dict[str, Any] = {
        "max_tokens": runner.max_tokens,
        "extra_body": {**(body or {}), "response_format": job.response_format()},
    }
    if runner.tools:
        kwargs["tool_choice"] = "none"
    return kwargs


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
    slots: dict[str, int | None] = {}
    primed: dict[str, bool] = {}
    for attempt in range(2):
        reason = f"memory job {job.name} on the {runner.leg} leg (sub_runners={runner.leg})"
        decision = RouteDecision(leg=runner.leg, score=None, threshold=None, reason=reason)
        prime = runner.prime and attempt == 0  # a repair continues the slot's own content

        async def invoke(
            link: ChainLink, prompt: list[BaseMessage] = prompt, prime: bool = prime
        ) -> AIMessage:
            slot = await runner.reflection_slot(link) if link.leg == "local" else None
            body = slot_body(link.leg, slot)
            slots[link.id] = slot if body is not None else None
            model: Runnable[Any, Any] = bound_model(link, runner.tools)
            kwargs = _job_kwargs(link, job, runner, body)
            if kwargs:
                model = model.bind(**kwargs)
            if slot is None or body is None:
                answer = await model.ainvoke(prompt, config=runner.config)
            else:
                async with _slot_lock(link, slot):
                    routed = runner.headers(link) if runner.headers is not None else None
                    primed[link.id] = prime and await prime_reflection_slot(link, slot, routed)
                    answer = await model.ainvoke(prompt, config=runner.config)
            return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)

        try:
            outcome = await runner.chain.call(invoke, preferred_leg=runner.leg, prefer_provider=prefer)
        except Exception as failure:  # noqa: BLE001 - a memory job must never fail the turn
            why = scrub(f"provider error: {type(failure).__name__}: {failure}")
            logger.warning("memory job %s failed: %s", job.name, why)
            return None, records, why
        link, answer = outcome.provider, outcome.answer
        record = answered_record(
            outcome,
            turn=turn,
            step=step,
            kind="memory",
            decision=decision,
            signals=None,
            slot=slots.get(link.id),
            extra={"job": job.name, "repair": attempt > 0, "primed": primed.get(link.id, False)},
        )
        box = served_box(answer)
        if box is not None:
            record["extra"]["box"] = box
        records.append(record)
        try:
            return job.schema.model_validate_json(_json_text(answer)), records, None
        except (ValidationError, ValueError) as invalid:
            error = str(invalid).splitlines()[0] if str(invalid) else type(invalid).__name__
            prompt = [*prompt, answer, HumanMessage(prompts.MEMORY_REPAIR.format(error=error))]
            prefer = link.id  # the repair is judged by the model that made the mistake
    records[-1]["extra"]["dropped"] = f"invalid JSON after one repair: {error}"
    return None, records, f"invalid JSON after one repair: {error}"


def dropped_record(job: MemoryJob, leg: Leg, turn: int, step: int, why: str) -> RouteRecord:
    """The record of a job that produced no answer at all (timeout, every provider down)."""
    decision = RouteDecision(leg=leg, score=None, threshold=None, reason=f"memory job {job.name} dropped")
    return make_record(
        turn=turn,
        step=step,
        kind="memory",
        leg=leg,
        decision=decision,
        signals=None,
        provider=None,
        answer=None,
        extra={"job": job.name, "dropped": scrub(why)},
    )


def _json_text(answer: AIMessage) -> str:
    """The JSON text of an answer (content, minus a Markdown fence some models add)."""
    text = answer.text.strip()
    if text.startswith("```"):
        text = text.strip("`")
        text = text[text.find("\n") + 1 :] if "\n" in text else text
    return text
