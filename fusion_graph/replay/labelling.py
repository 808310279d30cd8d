"""Ask the local model each recorded step, through the graph's own ``ask``, and write a label per step.

Every question goes through ``providers.chain`` on the local leg alone, so the
slot a trajectory is pinned to, the completion budget, the request timeout,
fallover and health are the graph's: each trajectory is one thread (its steps
asked in order on one slot, so llama-server reuses the growing prefix) and at
most ``concurrency`` trajectories are asked at a time (one per conversation
slot). Each label is handed to ``write`` as soon as its answer is in, so a run
stopped at any point keeps every finished step; ``fusion-graph label`` appends
them to its ``--out`` file and skips them when it runs again.

A step the local model gives no answer to (its prompt does not fit the window,
the request was refused, it timed out, the answer was malformed) is labelled
``agrees: null`` with the error, scrubbed of secrets. A server that cannot be
reached, or is cooling down after repeated failures, stops the run instead
(``LocalUnavailable``): nothing would be learnt from the steps after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fusion_graph.errors import ChainExhausted, FusionError, ProviderRequestError, UsageError
from fusion_graph.providers.chain import Ask, Bounds, ProviderChain, ask
from fusion_graph.providers.models import Provider
from fusion_graph.providers.placement import Placer
from fusion_graph.redact import scrub
from fusion_graph.replay.labels import StepToLabel, label_line
from fusion_graph.routing.records import same_action
from fusion_graph.routing.rule import LinkRoom, completion_budget, fits
from fusion_graph.routing.score import RouteDecision

#: The completion budget of each question: room for a tool call or a short reply, not an essay.
DEFAULT_MAX_TOKENS = 512
#: Longest error text kept in a label.
ERROR_CHARS = 500
REASON = "offline label: the recorded step asked of the local model"

#: Receives each finished label (a JSONL line's object).
Write = Callable[[dict[str, Any]], None]


class LocalUnavailable(FusionError, RuntimeError):
    """The local server cannot be reached or is cooling down: the run stops, finished labels kept."""


@dataclass
class LabelTally:
    """What a labelling run did: steps asked, labelled agreeing, disagreeing and unanswered."""

    asked: int = 0
    agree: int = 0
    disagree: int = 0
    failed: int = 0

    def count(self, line: dict[str, Any]) -> None:
        """Count one written label."""
        self.asked += 1
        agrees = line["agrees"]
        if agrees is None:
            self.failed += 1
        elif agrees:
            self.agree += 1
        else:
            self.disagree += 1


def _unreachable(exhausted: ChainExhausted) -> bool:
    """No attempt was made (every link cooling down), or every attempt failed to connect."""
    return not exhausted.attempts or all(attempt.kind == "connection" for attempt in exhausted.attempts)


def _error(text: str) -> str:
    return scrub(text)[:ERROR_CHARS]


async def label_step(
    item: StepToLabel,
    *,
    chain: ProviderChain,
    placer: Placer,
    thread_id: str,
    max_tokens: int,
    timeout_s: float | None,
    window: int | None,
) -> dict[str, Any]:
    """Ask the local model one recorded step (temperature 0) and return its label line.

    Raises:
        LocalUnavailable: The local server cannot be reached, or is cooling down.
    """
    links: Sequence[Provider] = chain.links
    room = LinkRoom(links[0].id, "local", window, item.signals.prompt_tokens) if links else None
    if room is not None and not fits(room, max_tokens):
        budget = completion_budget(max_tokens, window)
        error = (
            f"not asked: prompt ~{item.signals.prompt_tokens:,} + {budget:,} > local window {window:,} "
            "(the graph would not send it there either)"
        )
        return label_line(item, None, agrees=None, error=error)
    call = Ask(
        kind="plan" if item.step == 0 else "step",
        turn=item.turn,
        step=item.step,
        decision=RouteDecision("local", item.score, None, REASON),
        prompt=item.prompt,
        thread_id=thread_id,
        tools=item.tools,
        signals=item.signals,
        kwargs={"temperature": 0},
        max_tokens=max_tokens,
    )
    bounds = Bounds(
        windows={link.id: window for link in links},
        max_tokens={link.id: max_tokens for link in links},
        timeout_s=timeout_s,
    )
    try:
        asked = await ask(call, chain=chain, placer=placer, bounds=bounds)
    except ProviderRequestError as error:
        return label_line(
            item, None, agrees=None, error=_error(f"{error.error_type} [{error.kind}]: {error}")
        )
    record = asked.record
    if asked.answer is None:
        exhausted = asked.exhausted
        if exhausted is not None and _unreachable(exhausted):
            raise LocalUnavailable(str(exhausted))
        last = record["attempts"][-1] if record["attempts"] else None
        what = f"{last['error']} [{last['kind']}]: {last['message']}" if last else str(exhausted)
        return label_line(item, None, agrees=None, error=_error(what))
    return label_line(
        item,
        asked.answer,
        agrees=same_action(asked.answer, item.recorded),
        provider=record["provider"],
        completion_tokens=record["completion_tokens"],
        latency_s=record.get("outcome", {}).get("latency_s"),
    )


async def label_all(
    trajectories: Sequence[Sequence[StepToLabel]],
    *,
    chain: ProviderChain,
    placer: Placer,
    write: Write,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout_s: float | None = None,
    window: int | None = None,
    concurrency: int = 1,
    limit: int | None = None,
) -> LabelTally:
    """Label the steps of ``trajectories`` (each in order, ``concurrency`` trajectories at a time).

    ``write`` gets each label as soon as it is known; ``limit`` stops after that
    many steps have been asked (``None``: all). ``chain`` should hold the local
    leg only (``ProviderChain.only``).

    Raises:
        LocalUnavailable: The local server cannot be reached or is cooling down;
            the labels written so far stand.
    """
    if concurrency < 1:
        raise UsageError(f"concurrency must be at least 1, got {concurrency}")
    tally = LabelTally()
    queue: asyncio.Queue[Sequence[StepToLabel]] = asyncio.Queue()
    for steps in trajectories:
        if steps:
            queue.put_nowait(steps)
    started = 0

    async def worker() -> None:
        nonlocal started
        while not queue.empty():
            steps = queue.get_nowait()
            trace, record, _ = steps[0].key
            thread_id = f"label:{trace}:{record}"  # one thread a trajectory: its own slot and cache
            for item in steps:
                if limit is not None and started >= limit:
                    return
                started += 1
                line = await label_step(
                    item,
                    chain=chain,
                    placer=placer,
                    thread_id=thread_id,
                    max_tokens=max_tokens,
                    timeout_s=timeout_s,
                    window=window,
                )
                write(line)
                tally.count(line)
            await placer.release(thread_id)  # its trajectory is done: its slot may go to the next

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, queue.qsize())):
                group.create_task(worker())
    except ExceptionGroup as failed:  # the first worker's error, as if there were one worker
        raise failed.exceptions[0] from None
    return tally
