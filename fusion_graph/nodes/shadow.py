"""Shadow checks: the cloud leg asked beside a share of local steps, to see whether it would act alike.

With ``shadow_share`` set, a local step picked by a stable hash of (thread,
turn, step) also sends its prompt to the cloud leg, at the same time as the
local call and without waiting for it: the local answer is used as always.
When both have answered, a ``kind="shadow"`` record (priced, counted in the
cloud budget) says whether the two take the same action (the same tool calls
with equal arguments, or both a reply), what the cloud would have done and
what it cost. A shadow still running when its step is recorded is folded into
the thread's ``route_log`` by a later step of the thread in this process; with a
store, the moment it finishes its record is also written there
(``memory.store.shadows_namespace``), so the thread's next turn records it in
whichever worker runs it. Each record carries its key (thread, turn, step):
whichever fold comes first records it, the other finds it in ``route_log``.
Over the cloud budget, no shadow call is made.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import BaseTool
from langgraph.constants import TAG_NOSTREAM
from langgraph.store.base import BaseStore

from fusion_graph.providers.chain import Ask, Asked, Bounds, ProviderChain, ask
from fusion_graph.providers.placement import Placer
from fusion_graph.redact import scrub
from fusion_graph.routing.records import RouteRecord, action, same_action, upgraded
from fusion_graph.routing.rule import BudgetCheck
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.telemetry import switch as telemetry

logger = logging.getLogger(__name__)


def picked(thread_id: str, turn: int, step: int, share: float) -> bool:
    """Whether this step is one of the ``share`` checked: a stable hash, the same in every process."""
    if share <= 0:
        return False
    # surrogatepass: a lone surrogate in a thread id hashes (the same bytes as before for any other id)
    text = f"fusion-shadow\0{thread_id}\0{turn}\0{step}"
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


@dataclass
class _Pending:
    """A shadow call in flight: what it shadows, its task, and where its record goes when it finishes."""

    thread_id: str
    turn: int
    step: int
    score: int | None
    local: AIMessage | None
    task: asyncio.Task[Asked]
    store: BaseStore | None = None
    namespace: tuple[str, ...] = ()
    record: RouteRecord | None = None
    finished: bool = False

    @property
    def key(self) -> str:
        """The shadow check's key, the same in every process: thread, turn, step."""
        return f"{self.thread_id}:{self.turn}:{self.step}"

    def finish(self) -> RouteRecord | None:
        """Its record, made once both answers are in (``None``: dropped); written to the store then."""
        if not self.finished and self.task.done() and self.local is not None:
            self.finished = True
            self.record = _record(self)
            if self.record is not None and self.store is not None:
                _keep(self.store, self.namespace, self.key, self.thread_id, self.record)
        return self.record


def shadow_key(record: RouteRecord) -> str | None:
    """The key of a shadow check's record (``None``: not one)."""
    shadow = upgraded(record).get("shadow") if record["kind"] == "shadow" else None
    return shadow.get("key") if shadow is not None else None


#: Store writes in flight (held so they are not collected before they finish).
_WRITES: set[asyncio.Future[None]] = set()


def _keep(
    store: BaseStore, namespace: tuple[str, ...], key: str, thread_id: str, record: RouteRecord
) -> None:
    """Write a finished shadow's record to the store, never failing the caller (logged)."""

    async def write() -> None:
        try:
            await store.aput(namespace, key, {"thread_id": thread_id, "record": record}, index=False)
        except Exception as error:  # noqa: BLE001 - a lost write only loses what a crash would have
            logger.warning("shadow check %s was not written to the store: %s", key, scrub(repr(error)))

    future = asyncio.ensure_future(write())
    _WRITES.add(future)
    future.add_done_callback(_WRITES.discard)


async def written() -> None:
    """Wait for the shadow records being written to the store (a shutdown, a test)."""
    while _WRITES:
        await asyncio.gather(*list(_WRITES), return_exceptions=True)


async def recorded_elsewhere(
    store: BaseStore,
    namespace: tuple[str, ...],
    thread_id: str,
    route_log: Sequence[RouteRecord],
    adding: Sequence[RouteRecord] = (),
) -> list[RouteRecord]:
    """The thread's finished shadow records neither its ``route_log`` nor ``adding`` holds.

    Read when a turn starts, so a shadow check that finished after its turn, in
    this worker or another, is recorded (and paid for) once. Entries the
    checkpointed ``route_log`` holds leave the store; ``adding`` (the update
    about to be written) keeps its entries until a later turn sees them recorded.
    """
    try:
        items = await store.asearch(namespace, filter={"thread_id": thread_id}, limit=1000)
    except Exception as error:  # noqa: BLE001 - the turn goes on; the records wait for the next one
        logger.warning("finished shadow checks could not be read: %s", scrub(repr(error)))
        return []
    have = {key for key in (shadow_key(r) for r in route_log) if key is not None}
    coming = {key for key in (shadow_key(r) for r in adding) if key is not None}
    missing = []
    for item in items:
        if item.key in coming:
            continue
        if item.key in have:
            try:
                await store.adelete(namespace, item.key)  # recorded: nothing left to hand over
            except Exception as error:  # noqa: BLE001
                logger.debug("shadow check %s stays in the store: %s", item.key, scrub(repr(error)))
        else:
            missing.append(upgraded(item.value["record"]))
    return sorted(missing, key=lambda r: (r["turn"], r["step"]))


class ShadowChecks:
    """The shadow calls of one graph, by thread, until their records are folded into ``route_log``."""

    def __init__(self) -> None:
        """No shadow in flight."""
        #: Shadow calls not yet folded, by thread (a step with none here skips ``fold``).
        self.pending: dict[str, list[_Pending]] = {}

    def start(
        self,
        *,
        thread_id: str,
        turn: int,
        step: int,
        score: int | None,
        prompt: Sequence[BaseMessage],
        tools: Sequence[BaseTool],
        chain: ProviderChain,
        placer: Placer,
        check: BudgetCheck,
        timeout_s: float | None,
        max_tokens: int,
        store: BaseStore | None = None,
        namespace: tuple[str, ...] = (),
    ) -> bool:
        """Send the shadow call beside the step (not awaited); ``False`` when there is no cloud or budget.

        ``store``: where its record goes the moment it finishes (under ``namespace``).
        """
        cloud_legs: tuple[Leg, ...] = ("cloud",)
        cloud = chain.only(cloud_legs)
        if not cloud.links or check.over is not None:
            return False
        decision = RouteDecision("cloud", None, None, f"shadow check of local step {step} (shadow_share)")
        cap = min(max_tokens, check.max_tokens) if check.max_tokens is not None else max_tokens
        call = Ask(
            kind="shadow",
            turn=turn,
            step=step,
            decision=decision,
            prompt=prompt,
            thread_id=thread_id,
            tools=tools,
            tags=(TAG_NOSTREAM,),  # not the run's answer: kept out of its messages stream
        )
        bounds = Bounds(max_tokens={link.id: cap for link in cloud.links}, timeout_s=timeout_s)
        task = asyncio.ensure_future(ask(call, chain=cloud, placer=placer, bounds=bounds))
        item = _Pending(thread_id, turn, step, score, None, task, store, namespace)
        task.add_done_callback(lambda _: item.finish())
        self.pending.setdefault(thread_id, []).append(item)
        return True

    def answered(self, thread_id: str, turn: int, step: int, local: AIMessage | None) -> None:
        """The local answer of the step a shadow runs beside (``None``: the step did not answer locally).

        Without a local answer there is nothing to compare: the shadow is
        cancelled and forgotten (cancelling a finished task would keep it).
        """
        pending = self.pending.get(thread_id, [])
        for item in pending:
            if (item.turn, item.step) == (turn, step) and item.local is None:
                if local is None:
                    item.task.cancel()
                item.local = local
                item.finish()
        if local is None:
            pending[:] = [item for item in pending if (item.turn, item.step) != (turn, step)]

    def fold(self, thread_id: str, route_log: Sequence[RouteRecord] = ()) -> list[RouteRecord]:
        """The records of the thread's shadows that have finished (never waits for one).

        One that ``route_log`` already holds (a turn in another worker recorded it
        from the store) is not returned again.
        """
        pending = self.pending.get(thread_id)
        if not pending:
            return []
        recorded: set[str] | None = None
        records, left = [], []
        for item in pending:
            if item.task.cancelled():
                continue  # its step did not answer locally: nothing to compare
            if not item.task.done() or item.local is None:
                left.append(item)  # the shadow, or its step's own answer, is still on its way
                continue
            record = item.finish()
            if record is None:
                continue
            if recorded is None:
                recorded = {key for key in (shadow_key(r) for r in route_log) if key is not None}
            if item.key not in recorded:
                records.append(record)
        if left:
            self.pending[thread_id] = left
        else:
            self.pending.pop(thread_id, None)
        return records


def _record(item: _Pending) -> RouteRecord | None:
    """The shadow's record: whether the cloud acted as the local leg did, what it did and its cost."""
    try:
        asked = item.task.result()
    except Exception as error:  # noqa: BLE001 - a shadow never fails the turn; it is logged and dropped
        logger.warning("shadow check of step %d failed: %s", item.step, scrub(str(error)))
        return None
    record = asked.record
    assert item.local is not None
    answer = asked.answer
    record["shadow"] = {
        "key": item.key,
        "of_step": item.step,
        "score": item.score,
        "local_action": action(item.local),
        "agrees": same_action(item.local, answer) if answer is not None else None,
        "cloud_action": action(answer) if answer is not None else None,
        "cost_usd": record["cost_usd"] if answer is not None else None,
    }
    telemetry.shadow_checked(record)
    return record
