"""Windows, budgets and prompt estimates of a step: the I/O around ``fit`` and ``estimate``.

The graph owns one ``Sizer``. For a step it asks the resolver for every
link's window (llama-server's ``/props`` once per server, else the model's
profile or the operator's setting), estimates the prompt on each leg
(anchored on that leg's last report, or tokenized by llama-server on a
thread's first local request), and derives the score's context budget from
the local window. ``prepare`` then applies the fit rule and, when no link can
hold the step, compacts the history.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from langchain_core.messages import BaseMessage, convert_to_openai_messages
from langchain_core.tools import BaseTool

from fusion_graph.context import FusionContext
from fusion_graph.errors import ChainExhausted, ContextError
from fusion_graph.providers.ask import Bounds
from fusion_graph.providers.chain import ProviderChain
from fusion_graph.providers.links import ChainLink
from fusion_graph.providers.llama_server import count_prompt_tokens
from fusion_graph.providers.pricing import step_price
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.routing.budget import UNLIMITED, BudgetCheck, StepPrice, check_budget, expected_completion
from fusion_graph.routing.records import RouteRecord
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.sizing.compaction import Compaction, compact
from fusion_graph.sizing.estimate import Estimate, fingerprint, leg_estimate, new_anchor
from fusion_graph.sizing.fit import FitPlan, LinkRoom, completion_budget, conversation_budget, plan_fit
from fusion_graph.sizing.tokens import TokenCounter, build_prompt, tool_schemas
from fusion_graph.state import PromptAnchor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSizes:
    """What the graph knows about a step's size before the call.

    Attributes:
        windows: Each link's window by provider id (``None``: unknown).
        estimates: The prompt on each leg of the chain.
        budget: The score's context budget (``fit.conversation_budget``).
        score_leg: The leg whose estimate the score uses (local when the chain has one).
        key: The fingerprint of the system prompt and tools (``estimate.fingerprint``).
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

    def extra(self) -> dict[str, Any]:
        """What the record keeps of the fit rule: its reason and the step's compactions."""
        extra: dict[str, Any] = {}
        if self.plan.reason is not None:
            extra["fit"] = self.plan.reason
        if self.compactions:
            extra["compaction"] = {
                "cleared_tool_outputs": sum(c.cleared for c in self.compactions),
                "removed_messages": sum(c.removed for c in self.compactions),
                "freed_tokens": sum(c.freed for c in self.compactions),
                "need_tokens": max(c.need for c in self.compactions),
                "times": len(self.compactions),
            }
        return extra

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
        self, link: ChainLink, system_prompt: str, messages: Sequence[BaseMessage]
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

    def budget_of(self, link: ChainLink, sizes: StepSizes, context: FusionContext) -> int:
        """The completion budget sent to ``link`` (``max_tokens``): at most half its window."""
        budget = completion_budget(context.max_completion_tokens, sizes.windows.get(link.id))
        own = getattr(link.model, "max_tokens", None)
        return min(budget, own) if isinstance(own, int) and own > 0 else budget

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
        """The budget guard (``budget.check_budget``) for this step, priced by ``cloud_price``.

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
