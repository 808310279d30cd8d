"""A step of the agent loop, in the order it happens: measure, rule, budget, fit, place, ask, record.

One module a maintainer reads to follow a step from the tool batch that ends
one inference to the record of the next:

- **measure** (``Sizer.measure``): each link's window and the prompt on each
  leg, anchored on the leg's last server report;
- **rule** (``decide_step``): the score and the band, latch and pace of
  ``routing.rule.decide_leg``, over the signals of ``sizing.turn.next_route``;
- **budget** (``order_step``): the cloud budget's guard (``routing.rule.BudgetCheck``),
  and the shadow check's pick; the result is one ``StepOrder``;
- the order reaches its executor the LangGraph way: the edge after ``tools``
  (``RouteNode.after_tools``), or the ``route`` node that joins a batch of
  several calls, returns ``Send(leg, order.plain())``. The ``local`` and
  ``cloud`` nodes take that payload as their input and read the state through
  ``internals.node_state``; a run resumed from a checkpoint finds the same
  payload in the pending ``Send``, and a stalled step keeps it in
  ``state["stall"]`` for ``nodes.ends.unavailable`` to send again. The plan
  and a repair decide in their own nodes. Nothing decides a step twice;
- **fit** (``Sizer.prepare`` and ``Sizer.bounds``): links whose window cannot
  hold the step are skipped, the history compacted when none can;
- **place** and **ask** (``providers.chain.ask``): the one provider call,
  placed on a llama-server slot for a local link, with the chain's fallover;
- **record**: the answer's tool batch is checked (``nodes.tools.check_batch``)
  and written with the step's record in one update; the answering leg's report
  becomes its anchor for the next estimate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import httpx
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage, convert_to_openai_messages
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.graph import END
from langgraph.runtime import Runtime
from langgraph.store.base import BaseStore
from langgraph.types import Command, Send

from fusion_graph import prompts
from fusion_graph.context import FusionContext, ensure_context, memory_on, thread_id_of
from fusion_graph.errors import ChainExhausted, ContextError, StateError
from fusion_graph.inputs import check_new_turn
from fusion_graph.internals import node_state
from fusion_graph.memory.background import inference_running
from fusion_graph.memory.store import namespace_of, shadows_namespace
from fusion_graph.nodes.memory import Recall, TurnStart
from fusion_graph.nodes.shadow import ShadowChecks, picked, recorded_elsewhere
from fusion_graph.nodes.synthesis import wants_synthesis
from fusion_graph.nodes.tools import check_batch, sends
from fusion_graph.providers.chain import ROUTE_EVENT, Ask, Bounds, ProviderChain, ask
from fusion_graph.providers.llama_server import count_prompt_tokens
from fusion_graph.providers.models import Provider
from fusion_graph.providers.pricing import step_price
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.routing.records import (
    RecordParts,
    RouteRecord,
    SizingRecord,
    StepKind,
    add_totals,
    joined,
    make_record,
    records_totals,
)
from fusion_graph.routing.rule import (
    UNLIMITED,
    BudgetCheck,
    FitPlan,
    LinkRoom,
    StepPrice,
    check_budget,
    completion_budget,
    conversation_budget,
    expected_completion,
    plan_fit,
)
from fusion_graph.routing.score import (
    Leg,
    RouteDecision,
    StepScore,
    StepSignals,
    TroubleScore,
    TroubleSignals,
)
from fusion_graph.sizing.compaction import Compaction, compact
from fusion_graph.sizing.turn import (
    Estimate,
    TokenCounter,
    build_prompt,
    fingerprint,
    last_batch,
    leg_estimate,
    new_anchor,
    next_route,
    next_step,
    pending_calls,
    step_tally,
    tool_schemas,
    turn_number,
    wants_tools,
)
from fusion_graph.state import Answered, PromptAnchor, State

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSizes:
    """What the graph knows about a step's size before the call.

    Attributes:
        windows: Each link's window by provider id (``None``: unknown).
        estimates: The prompt on each leg of the chain.
        budget: The score's context budget (``routing.rule.conversation_budget``).
        score_leg: The leg whose estimate the score uses (local when the chain has one).
        key: The fingerprint of the system prompt and tools (``sizing.turn.fingerprint``).
    """

    windows: dict[str, int | None]
    estimates: dict[str, Estimate]
    budget: int
    score_leg: Leg
    key: str

    @property
    def score_tokens(self) -> int:
        """The prompt estimate the score uses."""
        return self.estimates[self.score_leg].tokens

    def rooms(self, chain: ProviderChain) -> list[LinkRoom]:
        """Every link of ``chain`` as the fit rule sees it."""
        return [
            LinkRoom(link.id, link.leg, self.windows.get(link.id), self.estimates[link.leg].tokens)
            for link in chain.links
        ]


@dataclass(frozen=True)
class Prepared:
    """A step ready to send: the history (compacted if it had to be), its sizes and fit plan.

    ``compaction`` is the one this preparation made; ``compactions`` every one of the step.
    """

    messages: list[BaseMessage]
    sizes: StepSizes
    plan: FitPlan
    compaction: Compaction | None = None
    compactions: list[Compaction] = field(default_factory=list)

    def decided(self, decision: RouteDecision) -> RouteDecision:
        """The router's decision, its reason extended by what the fit rule did."""
        reason = self.plan.reason
        return (
            decision
            if reason is None
            else dataclasses.replace(decision, reason=f"{decision.reason}; {reason}")
        )

    def parts(self) -> RecordParts:
        """The record's ``sizing`` from the fit rule: the rule's reason and the step's compactions."""
        sizing = SizingRecord()
        if self.plan.reason is not None:
            sizing["fit"] = self.plan.reason
        if self.compactions:
            sizing["compaction"] = {
                "cleared_tool_outputs": sum(c.cleared for c in self.compactions),
                "removed_messages": sum(c.removed for c in self.compactions),
                "freed_tokens": sum(c.freed for c in self.compactions),
                "need_tokens": max(c.need for c in self.compactions),
                "times": len(self.compactions),
            }
        return {"sizing": sizing} if sizing else {}

    def anchors(
        self, previous: Mapping[str, PromptAnchor], leg: str, reported: int | None, provider: str
    ) -> dict[str, PromptAnchor]:
        """The thread's anchors once ``leg`` answered this step and reported ``reported`` prompt tokens.

        A compaction voids every earlier anchor. A leg whose prompt llama-server
        counted for this step is anchored on that count even if another leg answered,
        so the next estimate there does not ask the server again.
        """
        anchors = {} if self.compactions else dict(previous)
        key = self.sizes.key
        for other, estimate in self.sizes.estimates.items():
            if other != leg and estimate.basis == "server":
                counted = new_anchor(
                    prompt_tokens=estimate.tokens, messages=self.messages, key=key, provider=""
                )
                if counted is not None:
                    anchors[other] = counted
        anchor = new_anchor(prompt_tokens=reported, messages=self.messages, key=key, provider=provider)
        if anchor is not None:
            anchors[leg] = anchor
        return anchors

    @property
    def changes(self) -> list[BaseMessage]:
        """The state updates of every compaction of the step, in order."""
        return [change for compaction in self.compactions for change in compaction.changes]


def overflowed(exhausted: ChainExhausted) -> bool:
    """Whether a call no provider answered hit a context window on the way."""
    return any(attempt.kind == "context_overflow" for attempt in exhausted.attempts)


#: Appended tokens past which llama-server counts the local prompt itself (``/tokenize``): the
#: estimator is a few percent off on most text but up to a quarter low on digit-heavy code, and
#: context pressure, the score's largest term, rests on this number.
SERVER_COUNT_OVER = 512


class Sizer:
    """Measures steps for one graph: its resolver, tools and token estimator."""

    def __init__(
        self, resolver: ProviderResolver, tools: Sequence[BaseTool], count_tokens: TokenCounter
    ) -> None:
        """Keep what measuring needs."""
        self.resolver, self.tools, self.count_tokens = resolver, list(tools), count_tokens
        self._keys: dict[str, str] = {}

    def key(self, system_prompt: str) -> str:
        """The fingerprint of what a request carries besides the history."""
        if system_prompt not in self._keys:
            if len(self._keys) > 64:
                self._keys.clear()
            self._keys[system_prompt] = fingerprint(system_prompt, self.tools)
        return self._keys[system_prompt]

    async def _server_count(
        self, link: Provider, system_prompt: str, messages: Sequence[BaseMessage]
    ) -> int | None:
        """llama-server's own count of this prompt, or ``None`` when it is not llama-server or fails."""
        if await self.resolver.server_props(link) is None:
            return None
        url = self.resolver.count_url(link)  # behind a gateway: a box, which counts alike
        if url is None:
            return None
        try:
            return await count_prompt_tokens(
                url,
                convert_to_openai_messages(build_prompt(system_prompt, messages)),
                tool_schemas(self.tools),
                timeout=min(self.resolver.settings.request_timeout, 10.0),
            )
        except (httpx.HTTPError, ValueError, KeyError) as error:
            logger.warning("llama-server did not count the prompt (%r); estimating it", error)
            return None

    async def measure(
        self,
        chain: ProviderChain,
        messages: Sequence[BaseMessage],
        anchors: Mapping[str, PromptAnchor],
        context: FusionContext,
    ) -> StepSizes:
        """Windows, per-leg estimates and the context budget of the step about to run on ``messages``.

        Raises:
            ContextError: An explicit ``conversation_max_tokens`` is larger than the local window holds.
        """
        # mode=cloud never routes to local: its server is not asked (it may not even run).
        links = chain.links
        asked = [link for link in links if not (context.mode == "cloud" and link.leg == "local")]
        windows = {link.id: await self.resolver.window(link) for link in asked}
        key = self.key(context.system_prompt)
        estimates: dict[str, Estimate] = {}
        unanchored: Estimate | None = None  # the same for every leg without an anchor
        for link in links:
            if link.leg in estimates:
                continue
            anchor = anchors.get(link.leg)
            if anchor is None and unanchored is not None:
                estimate = unanchored
            else:
                estimate = leg_estimate(
                    messages,
                    system_prompt=context.system_prompt,
                    tools=self.tools,
                    anchor=anchor,
                    key=key,
                    count_tokens=self.count_tokens,
                )
                if anchor is None:
                    unanchored = estimate
            unsure = estimate.basis == "approximate" or estimate.appended > SERVER_COUNT_OVER
            if unsure and link.leg == "local" and context.mode != "cloud":
                counted = await self._server_count(link, context.system_prompt, messages)
                if counted is not None:
                    estimate = Estimate(counted, "server")
            estimates[link.leg] = estimate
        legs = [link.leg for link in links]
        score_leg: Leg = "local" if "local" in legs else (legs[0] if legs else "local")
        local = next((link for link in links if link.leg == "local"), None)
        local_window = windows.get(local.id) if local is not None else None
        try:
            budget = conversation_budget(
                context.conversation_max_tokens, local_window, context.max_completion_tokens
            )
        except ValueError as error:
            raise ContextError(str(error)) from None
        if score_leg not in estimates:
            estimates[score_leg] = Estimate(0, "approximate")
        return StepSizes(windows, estimates, budget, score_leg, key)

    def budget_of(self, link: Provider, sizes: StepSizes, context: FusionContext) -> int:
        """The completion budget sent to ``link`` (``max_tokens``): at most half its window."""
        budget = completion_budget(context.max_completion_tokens, sizes.windows.get(link.id))
        return budget if link.max_tokens is None else min(budget, link.max_tokens)

    def cloud_price(
        self,
        chain: ProviderChain,
        sizes: StepSizes,
        anchors: Mapping[str, PromptAnchor],
    ) -> StepPrice | None:
        """The step's price on the chain's first cloud link (``None``: no cloud link or estimate).

        Its estimated prompt, with the prompt its cloud provider last reported for
        this thread counted as cached input (the thread's cloud prefix is warm), at
        most the estimate; and the link's price of one completion token.
        """
        link = chain.first_cloud
        estimate = sizes.estimates.get("cloud")
        if link is None or estimate is None:
            return None
        anchor = anchors.get("cloud")
        cached = min(anchor["prompt_tokens"], estimate.tokens) if anchor is not None else 0
        return step_price(link.pricing, estimate.tokens, cached)

    def check_budget(
        self,
        chain: ProviderChain,
        sizes: StepSizes,
        anchors: Mapping[str, PromptAnchor],
        route_log: Sequence[RouteRecord],
        turn: int,
        context: FusionContext,
    ) -> BudgetCheck:
        """The budget guard (``routing.rule.check_budget``) for this step, priced by ``cloud_price``.

        The step is priced at what the thread's inferences write (``expected_completion``),
        and a cloud call's completion is capped at what the budget can still pay.
        """
        budget = self.resolver.cloud_budget(context)
        if not budget.limited:
            return UNLIMITED
        link = chain.first_cloud
        step = self.cloud_price(chain, sizes, anchors)
        if link is None or step is None:
            return check_budget(budget, route_log, turn, StepPrice(None, None), expected=1, ceiling=1)
        ceiling = self.budget_of(link, sizes, context)
        expected = expected_completion(route_log, ceiling=ceiling)
        return check_budget(budget, route_log, turn, step, expected=expected, ceiling=ceiling)

    async def check_jobs_budget(
        self,
        messages: Sequence[BaseMessage],
        anchors: Mapping[str, PromptAnchor],
        route_log: Sequence[RouteRecord],
        turn: int,
        context: FusionContext,
        *,
        jobs: int,
    ) -> BudgetCheck:
        """The budget guard for a run of ``jobs`` memory jobs on cloud: the same rule as a step's.

        Each job sends the conversation (priced as a step's prompt) and writes up
        to ``memory_max_tokens``; the run is priced whole, so the guard moves all
        of its jobs or none.
        """
        budget = self.resolver.cloud_budget(context)
        if not budget.limited:
            return UNLIMITED
        chain = await self.resolver.chain(context)
        sizes = await self.measure(chain, messages, anchors, context)
        step = self.cloud_price(chain, sizes, anchors)
        if step is None or step.prompt_usd is None:
            return check_budget(budget, route_log, turn, StepPrice(None, None), expected=1, ceiling=1)
        run = StepPrice(step.prompt_usd * jobs, step.token_usd)
        written = context.memory_max_tokens * jobs
        return check_budget(budget, route_log, turn, run, expected=written, ceiling=written)

    def bounds(
        self, chain: ProviderChain, prepared: Prepared, context: FusionContext, check: BudgetCheck = UNLIMITED
    ) -> Bounds:
        """What bounds each attempt of the prepared step: links, windows, budgets, time.

        A cloud link's completion budget is capped by the cloud budget's ``check``;
        over the budget no cloud link is allowed (no fallover to cloud past it), so
        ``allowed`` is empty when only a cloud window could hold the step.
        """
        sizes = prepared.sizes
        allowed = frozenset(prepared.plan.allowed)
        if check.over is not None:
            allowed = frozenset(x for x in allowed if chain.leg_of(x) != "cloud")
        max_tokens = {link.id: self.budget_of(link, sizes, context) for link in chain.links}
        if check.max_tokens is not None:
            for link in chain.links:
                if link.leg == "cloud":
                    max_tokens[link.id] = min(max_tokens[link.id], check.max_tokens)
        return Bounds(
            allowed=allowed,
            windows=sizes.windows,
            estimates=sizes.estimates,
            max_tokens=max_tokens,
            timeout_s=self.resolver.settings.request_timeout,
        )

    async def after_overflow(
        self,
        chain: ProviderChain,
        routed: Leg,
        prepared: Prepared,
        exhausted: ChainExhausted,
        context: FusionContext,
    ) -> Prepared:
        """The step compacted further after every link that could hold it overflowed anyway.

        Frees what the largest overflowed server reported beyond its window; without
        a report, a quarter of the estimate (which was evidently low).
        """
        need = 0
        for attempt in exhausted.attempts:
            if attempt.kind != "context_overflow":
                continue
            window = prepared.sizes.windows.get(attempt.provider) or 0
            estimate = prepared.sizes.estimates[attempt.leg].tokens
            size = attempt.prompt_tokens or int(estimate * 1.25)
            budget = completion_budget(context.max_completion_tokens, window or None)
            need = max(need, size + budget - window if window else estimate // 4)
        again = await self.prepare(chain, routed, prepared.messages, {}, context, need=max(need, 1))
        return dataclasses.replace(again, compactions=[*prepared.compactions, *again.compactions])

    async def prepare(
        self,
        chain: ProviderChain,
        routed: Leg,
        messages: Sequence[BaseMessage],
        anchors: Mapping[str, PromptAnchor],
        context: FusionContext,
        *,
        sizes: StepSizes | None = None,
        need: int = 0,
    ) -> Prepared:
        """Apply the fit rule to a step routed to ``routed``; compact the history when nothing fits.

        ``need``: tokens to free regardless (a retry after every window overflowed).
        """
        history = list(messages)
        if sizes is None:
            sizes = await self.measure(chain, history, anchors, context)
        plan = plan_fit(routed, sizes.rooms(chain), context.max_completion_tokens)
        need = max(need, plan.compact)
        if not need:
            return Prepared(history, sizes, plan)
        done: list[Compaction] = []
        compaction = compact(history, need=need, count_tokens=self.count_tokens)
        done.append(compaction)
        history = compaction.messages
        sizes = await self.measure(chain, history, {}, context)
        compacted = plan_fit(routed, sizes.rooms(chain), context.max_completion_tokens)
        reason = plan.reason or f"every window overflowed: {need:,} tokens to free"
        tail = "; fits after compaction" if compacted.allowed else "; still too large after compaction"
        # Still too large: try the largest window anyway and let its server decide.
        allowed = compacted.allowed or ((plan.target,) if plan.target else ())
        merged = FitPlan(compacted.leg, allowed, reason + tail, compact=need, target=plan.target)
        return Prepared(history, sizes, merged, compaction, done)


#: Every node ``route`` can send the turn to.
Destination = Literal["tools", "local", "cloud", "repair", "step_limit", "give_up", "memory", "__end__"]


#: Where the edge after a tool task can send the turn: a complete batch as ``route`` would, else to it.
AFTER_TOOLS: tuple[str, ...] = ("route", *(name for name in get_args(Destination) if name != "tools"))


def returned_directly(state: State, tools: dict[str, BaseTool]) -> bool:
    """Whether every call the batch ran is a ``return_direct`` tool (the turn ends on its result)."""
    batch = last_batch(state["messages"])
    if batch is None or not batch.tool_calls:
        return False
    if not any(call["name"] in tools and tools[call["name"]].return_direct for call in batch.tool_calls):
        return False  # what ran cannot all be return_direct: no need to look for the results
    ran = {m.tool_call_id for m in state["messages"] if isinstance(m, ToolMessage) and m.status != "error"}
    names = [call["name"] for call in batch.tool_calls if call["id"] in ran]
    return bool(names) and all(name in tools and tools[name].return_direct for name in names)


#: A step's order as its ``Send`` carries it (``StepOrder.plain``): the executor node's input. Not a
#: schema class, so LangGraph still gives the node the graph's state to read (``internals.node_state``).
SentOrder = Mapping[str, Any]


@dataclass(frozen=True)
class StepOrder:
    """One inference, decided once: the leg it starts on and why, its sizes, what the budget allows.

    The executor carries it out without deciding again; what only the call can
    tell (a provider down, a window the server says overflowed) is the chain's
    fallover and the fit rule's compaction, not a second decision.

    Attributes:
        node: The node that runs it (where a resume retries it).
        kind: ``plan``, ``step`` or ``repair``.
        step: Step index in the turn.
        turn: Turn index in the thread.
        decision: The routing decision, after the budget guard (the leg it starts on, and why).
        signals: The signals it was scored on (``None`` for a repair: never re-scored).
        sizes: Windows and estimates it was measured with.
        check: What the cloud budget allows it (binds its fallover too).
        shadow: Whether the cloud leg is asked beside it (``FusionContext.shadow_share``).
        prefer_provider: A provider to start with while healthy (a repair's).
    """

    node: str
    kind: StepKind
    step: int
    turn: int
    decision: RouteDecision
    signals: StepSignals | None
    sizes: StepSizes
    check: BudgetCheck
    shadow: bool = False
    prefer_provider: str | None = None

    def plain(self) -> dict[str, Any]:
        """The order as its ``Send`` carries it: plain data, so a checkpoint holds no fusion class."""
        plain: dict[str, Any] = _plain(self)
        return plain

    @classmethod
    def of(cls, plain: Mapping[str, Any]) -> StepOrder:
        """The order ``plain`` (``StepOrder.plain``) describes, rebuilt."""
        order = _built(plain) if isinstance(plain, Mapping) else plain
        if not isinstance(order, cls):
            raise StateError(f"a step runs on the order its routing sent it, not on {type(order).__name__}")
        return order


#: Where a plain value names the class it was made from.
KIND_KEY = "__kind__"


#: Values a plain form keeps as they are (no call per leaf: an order has some forty).
_LEAVES: frozenset[type] = frozenset({str, int, float, bool, type(None)})
#: Each dataclass's fields its constructor takes, by class (``dataclasses.fields`` builds a tuple a call).
_FIELDS: dict[type, tuple[str, ...]] = {}


def _plain(value: Any) -> Any:
    """``value`` with every dataclass in it as a dict of its fields plus ``KIND_KEY``."""
    kind = type(value)
    names = _FIELDS.get(kind)
    if names is None:
        if isinstance(value, dict):
            return {key: item if type(item) in _LEAVES else _plain(item) for key, item in value.items()}
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            return value
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(value) if f.init)
    own = value.__dict__  # an order's parts are plain dataclasses: their fields are their __dict__
    plain: dict[str, Any] = {KIND_KEY: kind.__name__}
    for name in names:
        item = own[name]
        plain[name] = item if type(item) in _LEAVES else _plain(item)
    return plain


def _built(value: Mapping[str, Any]) -> Any:
    """``value`` (a ``_plain`` form) with each dict that names a class of an order built as that class.

    A form with exactly its class's fields (what ``_plain`` wrote) is set on a new
    instance directly, as ``copy.copy`` does: the parts hold no checks of their own.
    Any other form goes through the constructor, which fills defaults and refuses
    unknown fields.
    """
    fields = {
        key: _built(item) if type(item) is dict else item for key, item in value.items() if key != KIND_KEY
    }
    kind = value.get(KIND_KEY)
    if kind is None:
        return fields
    part = ORDER_PARTS[kind]
    if fields.keys() == _PART_FIELDS[kind]:
        built: Any = object.__new__(part)
        built.__dict__.update(fields)
        return built
    return part(**fields)


#: The classes an order is made of, by name (``_built`` makes each again from its plain form).
ORDER_PARTS: dict[str, type] = {
    part.__name__: part
    for part in (
        StepOrder,
        RouteDecision,
        StepScore,
        TroubleScore,
        StepSignals,
        TroubleSignals,
        StepSizes,
        Estimate,
        BudgetCheck,
    )
}
#: The fields of each class of an order, by name (its parts have no ``__post_init__``: a test holds it).
_PART_FIELDS: dict[str, frozenset[str]] = {
    name: frozenset(f.name for f in dataclasses.fields(part)) for name, part in ORDER_PARTS.items()
}


def over_budget(order: StepOrder, prepared: Prepared) -> tuple[RouteRecord, AIMessage]:
    """The record and the reply of a step only a cloud window can hold, when the cloud budget refuses it.

    No inference is made: the record says why, the reply tells the user what to do.
    """
    fit = prepared.plan.reason or "the local window cannot hold it"
    why = order.check.over or "over budget"
    record = make_record(
        turn=order.turn,
        step=order.step,
        kind=order.kind,
        decision=prepared.decided(order.decision),
        signals=order.signals,
        outcome={"status": "over_budget"},
        budget={"over": why},
        sizing={"fit": fit},
    )
    return record, AIMessage(prompts.OVER_BUDGET.format(fit=fit, why=why))


async def order_step(
    sizer: Sizer,
    state: State,
    context: FusionContext,
    *,
    node: str,
    kind: StepKind,
    step: int,
    turn: int,
    decision: RouteDecision,
    signals: StepSignals | None,
    thread_id: str,
    sizes: StepSizes | None = None,
    prefer_provider: str | None = None,
    chain: ProviderChain | None = None,
) -> StepOrder:
    """``decision`` as a step's order: measured (unless ``sizes``), guarded by the budget, shadow picked.

    The one budget rule for every step: a cloud step the cloud budget cannot pay
    for runs local, and the check binds the step's fallover. ``chain``: the run's,
    when the caller resolved it already.
    """
    chain = chain or await sizer.resolver.chain(context)
    anchors = state.get("anchors") or {}
    if sizes is None:
        sizes = await sizer.measure(chain, state.get("messages", []), anchors, context)
    check = sizer.check_budget(chain, sizes, anchors, state.get("route_log", []), turn, context)
    decision = check.guard(decision)
    shadow = (
        decision.leg == "local"
        and context.shadow_share > 0
        and picked(thread_id, turn, step, context.shadow_share)
    )
    return StepOrder(node, kind, step, turn, decision, signals, sizes, check, shadow, prefer_provider)


async def decide_step(
    sizer: Sizer,
    state: State,
    context: FusionContext,
    count_tokens: TokenCounter,
    tools: Sequence[BaseTool],
    *,
    plan: bool,
    turn: int,
    thread_id: str,
    node: str | None = None,
) -> StepOrder:
    """The step about to run on ``state``, decided once: measured, routed by the rule, ordered.

    The plan (``plan``: the turn's step 0), a continuation step after a batch, and a
    ``create_agent`` model call (``middleware``) are all decided here; ``node``
    defaults to the leg the order starts on.
    """
    chain = await sizer.resolver.chain(context)
    sizes = await sizer.measure(chain, state["messages"], state.get("anchors") or {}, context)
    decision, signals = next_route(
        state,
        context,
        count_tokens,
        plan=plan,
        prompt_tokens=sizes.score_tokens,
        budget=sizes.budget,
        tools=tools,
    )
    order = await order_step(
        sizer,
        state,
        context,
        node=node or decision.leg,
        kind="plan" if plan else "step",
        step=0 if plan else next_step(state),
        turn=turn,
        decision=decision,
        signals=signals,
        thread_id=thread_id,
        sizes=sizes,
        chain=chain,
    )
    if node is None and order.decision.leg != decision.leg:  # the budget guard moved it local
        order = replace(order, node=order.decision.leg)
    return order


def routing_update(
    state: Mapping[str, Any],
    decision: RouteDecision,
    context: FusionContext,
    route_log: Sequence[RouteRecord],
) -> dict[str, Any]:
    """State a step's decision moves besides the step: the escalation latch and the paced dial's tally.

    The latch (``trouble_signals``) is written only when it moved; the tally of
    ``route_log`` only when the dial is paced, so the next step counts on from it.
    """
    update: dict[str, Any] = {}
    if decision.latch != state.get("latch"):
        update["latch"] = decision.latch
    if context.pace_slack is not None:
        update["step_tally"] = step_tally(route_log, state.get("step_tally"))
    return update


#: Where the turn goes after a batch: a node, the next wave's ``Send``s, or a step's ``Send``
#: (``Send(leg, order.plain())``: its order travels, and is checkpointed, with it).
Routed = Destination | Send | list[Send | Destination]


class RouteNode:
    """The routing rule over the graph's token estimator, tools, sizer and memory switch.

    ``__call__`` is the ``route`` node (a batch's join); ``after_tools`` the edge
    that routes a one-call batch directly; ``decide`` the rule both apply.
    """

    def __init__(
        self,
        count_tokens: TokenCounter,
        tools: dict[str, BaseTool],
        memory_on: Callable[[Runtime[Any]], bool],
        sizer: Sizer,
    ) -> None:
        """Keep what the decision needs."""
        self.count_tokens, self.tools, self.memory_on, self.sizer = count_tokens, tools, memory_on, sizer

    async def decide(self, state: State, runtime: Runtime[FusionContext], thread_id: str) -> Routed:
        """Send the next wave of the batch, end the turn, repair, or route the next step."""
        pending = pending_calls(state["messages"])
        if pending:
            return list(sends(pending))
        if returned_directly(state, self.tools):
            return "memory" if self.memory_on(runtime) else "__end__"
        context = ensure_context(runtime.context)
        step = next_step(state)
        if step >= context.max_steps:
            return "step_limit"
        if state.get("repair_error"):
            if state.get("repair_attempts", 0) >= context.max_repair_attempts:
                return "give_up"
            return "repair"
        tools = list(self.tools.values())
        turn = state.get("turn", 0)
        order = await decide_step(
            self.sizer, state, context, self.count_tokens, tools, plan=False, turn=turn, thread_id=thread_id
        )
        sent = Send(order.decision.leg, order.plain())
        every = context.memory_every_k_steps
        if every and step % every == 0 and self.memory_on(runtime):
            return [sent, "memory"]  # beside the next step
        return sent

    async def __call__(self, state: State, runtime: Runtime[FusionContext]) -> Command[Destination]:
        """The ``route`` node: a joined batch's decision, sent on with its order."""
        return Command(goto=await self.decide(state, runtime, thread_id_of(get_config())))

    async def after_tools(self, state: State, runtime: Runtime[FusionContext], config: RunnableConfig) -> Any:
        """The edge after a tool task: a batch this task completed is routed here, else it joins at ``route``.

        A task sees its own result only, so a batch of several parallel calls (or
        one with a wave still to run) is never complete from here: those join.
        """
        if pending_calls(state["messages"]):
            return "route"
        # An untraced edge: ``get_config`` has no run to read.
        return await self.decide(state, runtime, thread_id_of(config))


#: State fields with reducers: what a node writes there is always new.
_APPENDED = frozenset({"messages", "route_log", "totals"})


def only_changes(state: State, update: dict[str, Any]) -> dict[str, Any]:
    """``update`` without fields that already hold the same value.

    Every written field is saved again in the next checkpoint; skipping
    unchanged ones keeps each step's checkpoint small.
    """
    current: dict[str, Any] = dict(state)
    return {
        key: value
        for key, value in update.items()
        if key in _APPENDED or key not in current or current[key] != value
    }


class InferenceNodes:
    """``plan``, ``local``, ``cloud`` and ``repair``, bound to the graph's providers and tools."""

    def __init__(
        self,
        *,
        resolver: ProviderResolver,
        tools: Sequence[BaseTool],
        count_tokens: TokenCounter,
        recall: Recall | None = None,
        sizer: Sizer | None = None,
        graph_name: str = "fusion",
    ) -> None:
        """Keep what every inference needs.

        ``graph_name``: the store namespace's assistant when a run names none (finished shadow checks).
        """
        self.resolver = resolver
        self.graph_name = graph_name
        self.tools = list(tools)
        self.tools_by_name = {tool.name: tool for tool in self.tools}
        self.count_tokens = count_tokens
        self.recall = recall
        self.sizer = sizer or Sizer(resolver, self.tools, count_tokens)
        self.shadows = ShadowChecks()

    async def _infer(
        self, order: StepOrder, state: State, runtime: Runtime[FusionContext]
    ) -> tuple[dict[str, Any], bool]:
        """One inference and its batch check; returns the update and whether it was answered.

        The fit rule picks the links that can hold the step (and compacts the
        history when none can); if every link that could hold it overflowed
        anyway, the history is compacted further and the inference runs once more.
        """
        node, kind, step, turn = order.node, order.kind, order.step, order.turn
        decision, check = order.decision, order.check
        context = ensure_context(runtime.context)
        chain = await self.resolver.chain(context)
        thread_id = thread_id_of(get_config())
        anchors = dict(state.get("anchors") or {})
        messages = state.get("messages", [])
        prepared = await self.sizer.prepare(
            chain, decision.leg, messages, anchors, context, sizes=order.sizes
        )
        shadowed = order.shadow
        if shadowed:  # the cloud leg asked beside the step, never waited for
            shadowed = self._shadow(chain, prepared, check, context, order, thread_id, runtime.store)
        # A memory job of the thread starts after the step in flight (none can run with memory off).
        running = inference_running(thread_id) if memory_on(runtime) else contextlib.nullcontext()
        async with running:
            for retry in (False, True):
                if prepared.compaction is not None:
                    _stream_compaction(runtime, (turn, step, kind), decision.leg, prepared)
                bounds = self.sizer.bounds(chain, prepared, context, check)
                if check.over is not None and not bounds.allowed:  # only cloud could hold it: over budget
                    return _over_budget_end(order, prepared), True
                call = Ask(
                    kind=kind,
                    turn=turn,
                    step=step,
                    decision=prepared.decided(decision),
                    # Every inference of a thread sends the same system prompt, so the prefix is stable.
                    prompt=build_prompt(context.system_prompt, prepared.messages),
                    thread_id=thread_id,
                    tools=self.tools,
                    signals=order.signals,
                    prefer_provider=order.prefer_provider,
                    parts=joined(prepared.parts(), check.parts()),
                )
                asked = await ask(
                    call,
                    chain=chain,
                    placer=self.resolver.placement,
                    bounds=bounds,
                    writer=runtime.stream_writer,
                )
                exhausted = asked.exhausted
                if asked.answer is not None or retry or exhausted is None or not overflowed(exhausted):
                    break
                prepared = await self.sizer.after_overflow(chain, decision.leg, prepared, exhausted, context)
        record, answer = asked.record, asked.answer
        if shadowed:
            self.shadows.answered(thread_id, turn, step, answer if record["leg"] == "local" else None)
        shadows = (
            self.shadows.fold(thread_id, state.get("route_log") or ())
            if thread_id in self.shadows.pending
            else []
        )
        for done in shadows:
            runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **done})
        if answer is None:
            message = str(exhausted) if exhausted is not None else "no provider answered"
            retry_in = exhausted.retry_in_s if exhausted is not None else None
            stalled: dict[str, Any] = {
                "route_log": [record, *shadows],
                "stall": {"node": node, "message": message, "retry_in_s": retry_in},
            }
            if kind == "step":  # a resume sends the same order again (``nodes.ends.unavailable``)
                stalled["stall"]["order"] = order.plain()
            if shadows:  # shadows that finished meanwhile were paid for all the same
                stalled["totals"] = records_totals(shadows)
            return stalled, False
        history = prepared.messages
        batch = check_batch(answer, history=history, tools=self.tools_by_name, context=context)
        anchors = prepared.anchors(anchors, record["leg"], record["prompt_tokens"], record["provider"] or "")
        totals = records_totals([record, *shadows])
        update: dict[str, Any] = {
            "messages": [*prepared.changes, batch.answer, *batch.replies],
            "route_log": [record, *shadows],
            "totals": totals,
            "step": step,
            # The leg that answered: after a fallover the turn continues from there.
            "leg": record["leg"],
            "provider": record["provider"],
            "notice": batch.notice,
            "repair_error": batch.repair_error,
            "stall": None,
            "anchors": anchors,
        }
        if batch.repair_error is None:
            update["repair_attempts"] = 0
        return only_changes(state, update), True

    def _shadow(
        self,
        chain: Any,
        prepared: Prepared,
        check: BudgetCheck,
        context: FusionContext,
        order: StepOrder,
        thread_id: str,
        store: BaseStore | None,
    ) -> bool:
        """Start the shadow check of this local step on the cloud leg; ``False`` when none is made."""
        cloud = chain.first_cloud
        if cloud is None:
            return False
        return self.shadows.start(
            thread_id=thread_id,
            turn=order.turn,
            step=order.step,
            score=order.decision.score.score if order.decision.score is not None else None,
            prompt=build_prompt(context.system_prompt, prepared.messages),
            tools=self.tools,
            chain=chain,
            placer=self.resolver.placement,
            check=check,
            timeout_s=self.resolver.settings.request_timeout,
            max_tokens=self.sizer.budget_of(cloud, prepared.sizes, context),
            store=store,
            namespace=shadows_namespace(namespace_of(get_config(), self.graph_name)),
        )

    async def plan(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Step 0: form the plan and pick the first tool batch (cloud whenever cloud_share > 0).

        Relevant stored memories join the turn as a message right after the user's,
        so every later step shares the prefix. Once the thread's cloud budget is
        spent, plans run local too (the budget guard in ``_infer``).
        """
        check_new_turn(state.get("messages"))
        context = ensure_context(runtime.context)
        start = await self.recall(state, runtime) if self.recall is not None else TurnStart()
        recalled = start.message
        if recalled is not None:
            state = {**state, "messages": [*state["messages"], recalled]}
        turn = turn_number(state.get("turn"), state["messages"])  # a retried turn keeps its number
        thread_id = thread_id_of(get_config())
        order = await decide_step(
            self.sizer,
            state,
            context,
            self.count_tokens,
            self.tools,
            plan=True,
            turn=turn,
            thread_id=thread_id,
        )
        update, answered = await self._infer(order, state, runtime)
        if not answered:
            return update
        if recalled is not None:
            update["messages"] = [recalled, *update["messages"]]
        caught = list(start.records)  # memory jobs that finished since the last turn: in route_log once
        if runtime.store is not None:  # shadow checks that finished after their turn, in any worker
            ns = shadows_namespace(namespace_of(get_config(), self.graph_name))
            thread_id = thread_id_of(get_config())
            log = state.get("route_log") or []
            caught += await recorded_elsewhere(runtime.store, ns, thread_id, log, update["route_log"])
        if caught:
            update["route_log"] = [*caught, *update["route_log"]]
            update["totals"] = add_totals(update.get("totals"), records_totals(caught))
        update |= {"turn": turn}
        if state.get("latch") is not None:  # a new turn starts unlatched (trouble_signals)
            update["latch"] = None
        update.setdefault("repair_attempts", 0)
        return update

    async def _continue(
        self, leg: Leg, plain: Mapping[str, Any], runtime: Runtime[FusionContext]
    ) -> dict[str, Any]:
        """Carry out the order the routing edge sent with this step (its ``Send`` payload).

        The payload is the order, not the state: the state is read as the node
        would see it. A run resumed from a checkpoint finds the same payload in the
        pending ``Send``, so the step is never decided twice.
        """
        order = StepOrder.of(plain)
        if order.decision.leg != leg:
            raise StateError(f"a step ordered on the {order.decision.leg} leg was sent to the {leg} node")
        state: State = node_state(get_config())
        context = ensure_context(runtime.context)
        moved = routing_update(state, order.decision, context, state.get("route_log", []))
        update, _ = await self._infer(order, state, runtime)
        return {**moved, **update}

    async def local(self, state: SentOrder, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the local model (llama-server), on the order sent with it."""
        return await self._continue("local", state, runtime)

    async def cloud(self, state: SentOrder, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the cloud model, on the order sent with it."""
        return await self._continue("cloud", state, runtime)

    async def repair(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Retry a malformed tool call on the leg and provider that made it (never re-scored).

        The provider is preferred while healthy; when it is not, the repair falls
        over like any step. On cloud it is priced against the budget like any step.
        """
        context = ensure_context(runtime.context)
        leg: Leg = state.get("leg", "local")
        attempt = state.get("repair_attempts", 0) + 1
        decision = RouteDecision(
            leg=leg,
            score=None,
            threshold=None,
            reason=f"repair {attempt}/{context.max_repair_attempts} of a malformed tool call: "
            f"kept on the {leg} leg that made it",
        )
        order = await order_step(
            self.sizer,
            state,
            context,
            node="repair",
            kind="repair",
            step=state.get("step", 0) + 1,
            turn=state.get("turn", 0),
            decision=decision,
            signals=None,
            thread_id=thread_id_of(get_config()),
            prefer_provider=state.get("provider"),
        )
        update, answered = await self._infer(order, state, runtime)
        if answered and update.get("repair_error", state.get("repair_error")) is not None:
            update["repair_attempts"] = attempt
        return update


def _over_budget_end(order: StepOrder, prepared: Prepared) -> dict[str, Any]:
    """End the turn with ``over_budget``'s record and reply (the history as prepared)."""
    record, reply = over_budget(order, prepared)
    return {
        "messages": [*prepared.changes, reply],
        "route_log": [record],
        "step": order.step,
        "stall": None,
        "repair_error": None,
    }


def _stream_compaction(
    runtime: Runtime[FusionContext], where: tuple[int, int, StepKind], routed: Leg, prepared: Prepared
) -> None:
    """The ``fusion_route`` event of a compaction, sent before the call it makes possible."""
    compaction = prepared.compaction
    assert compaction is not None
    turn, step, kind = where
    runtime.stream_writer(
        {
            "event": ROUTE_EVENT,
            "phase": "compaction",
            "turn": turn,
            "step": step,
            "kind": kind,
            "routed_leg": routed,
            "reason": prepared.plan.reason,
            **compaction.summary(),
            "freed_tokens": compaction.freed,
            "need_tokens": compaction.need,
        }
    )


async def after_model(state: Answered, runtime: Runtime[FusionContext]) -> str | list[Send]:
    """The edge after an inference: calls to ``tools`` (a task each), a rejected batch to ``route``.

    A stall goes to ``unavailable``; a reply ends the turn (re-written on cloud
    first, when asked, then the memory jobs). Async like every node: LangGraph
    would run a sync edge on a worker thread each step.
    """
    if state.get("stall"):
        return "unavailable"
    messages = state["messages"]
    pending = pending_calls(messages)
    if pending:
        return sends(pending)
    if wants_tools(last_batch(messages)):
        return "route"  # every call of the batch was answered (rejected) before running
    if wants_synthesis(state, ensure_context(runtime.context)):
        return "synthesis"
    return "memory" if memory_on(runtime) else END
