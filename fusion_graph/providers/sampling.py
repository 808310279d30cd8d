"""MCP sampling through the provider chain: an MCP server's ``sampling/createMessage``, routed and recorded.

An MCP server may ask its client to run a completion for it (*sampling*). Left
to the ``mcp`` SDK's default, that request is refused; pointed at one chat model,
it would bypass the graph's routing, health and prices. ``sampling_callback``
builds the ``ClientSession(sampling_callback=...)`` that answers it through the
graph's own ``ProviderChain``:

- the leg: llama-server's reserved reflection slot by default (the slot memory
  jobs use, so a sampled completion never evicts a conversation's cached
  prefix); cloud when the request's ``modelPreferences`` put intelligence above
  both cost and speed; the run's ``mode`` and ``cloud_share`` win (``sampling_leg``);
- fallover and health as for any inference (``ProviderChain.call``), every
  attempt bounded by the operator's ``request_timeout``;
- a ``RouteRecord`` of ``kind="sampling"`` priced at the provider that answered,
  kept on ``SamplingCallback.records`` and, when the request arrives during a
  tool call of a graph run, collected for that thread's ``route_log`` and
  ``totals`` (the ``tools`` node opens a ``sampling_scope`` around each call).

The scope travels in a ``ContextVar`` (``fusion_graph.context.current_scope``).
``MultiServerMCPClient.get_tools()`` without a session opens a fresh MCP
session *inside* each tool call, so the session's receive task (which runs this
callback) inherits the tool call's context and finds the scope. A long-lived
session opened outside the run has its own context: its records are on
``SamplingCallback.records`` only.

``mcp`` is an optional dependency (``pip install 'fusion-graph[mcp]'``): this
module imports without it, and only building or calling a callback needs it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langgraph.constants import TAG_NOSTREAM

from fusion_graph.context import FusionContext, SamplingScope, current_scope, ensure_context
from fusion_graph.errors import ProviderRequestError, UsageError
from fusion_graph.providers.chain import Ask, Bounds, ProviderChain, ask
from fusion_graph.providers.pricing import step_price
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.redact import scrub
from fusion_graph.routing.records import RecordParts, RouteRecord, joined, make_record
from fusion_graph.routing.rule import UNLIMITED, BudgetCheck, check_budget, expected_completion
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.sizing.turn import approximate_tokens

if TYPE_CHECKING:
    from mcp.client.session import ClientSession
    from mcp.shared.context import RequestContext
    from mcp.types import (
        CreateMessageRequestParams,
        CreateMessageResult,
        ErrorData,
        ModelPreferences,
        SamplingMessage,
    )

logger = logging.getLogger(__name__)

#: What to install when ``mcp`` is missing.
MCP_EXTRA_HINT = "MCP sampling needs the mcp SDK: pip install 'fusion-graph[mcp]'"
#: The thread id of sampling requests that arrive outside a graph run.
OUTSIDE_THREAD = "mcp-sampling"
#: How many records a callback keeps by default (the oldest go first).
DEFAULT_MAX_RECORDS = 1000


# -- which leg --------------------------------------------------------------------------------


def _priority(value: float | None) -> float:
    return float(value) if value is not None else 0.0


def sampling_leg(preferences: ModelPreferences | None, context: FusionContext) -> tuple[Leg, str]:
    """The leg a sampling request starts on, and why (pure: no I/O).

    ``mode="local"``/``"cloud"`` decide alone, and ``cloud_share == 0`` never
    uses cloud. Otherwise cloud only when ``intelligencePriority`` is strictly
    greater than both ``costPriority`` and ``speedPriority`` (missing ones count
    as 0); the default is local (the reflection
    slot). Model ``hints`` are not read: the chain's providers are fixed.
    """
    if context.mode != "fusion":
        return context.mode, f"mode={context.mode}: {context.mode}"
    if context.cloud_share == 0:
        return "local", "cloud_share=0 never uses cloud: local"
    if preferences is None:
        return "local", "no modelPreferences: local"
    intelligence = _priority(preferences.intelligencePriority)
    cost, speed = _priority(preferences.costPriority), _priority(preferences.speedPriority)
    numbers = f"intelligence {intelligence:g} {{}} cost {cost:g}, speed {speed:g}"
    if intelligence > cost and intelligence > speed:
        return "cloud", f"modelPreferences {numbers.format('>')}: cloud"
    return "local", f"modelPreferences {numbers.format('not >')}: local"


# -- the request as chat messages, the answer as an MCP result -------------------------------


def _block_text(block: Any) -> str:
    """One sampling content block as text: text as is, anything else as a note naming what it was.

    Images and audio become such a note (their MIME type), not a multimodal block: a text-only
    local model would refuse the whole request over one image.
    """
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind in ("image", "audio"):
        return f"[{kind} ({block.mimeType}) omitted: this client samples text only]"
    if kind == "tool_use":
        return f"[tool call {block.name}: {block.input}]"
    if kind == "tool_result":
        inner = "\n".join(_block_text(part) for part in block.content)
        return f"[tool result: {inner}]"
    return f"[{kind or type(block).__name__} content omitted]"


def _message(message: SamplingMessage) -> BaseMessage:
    text = "\n\n".join(_block_text(block) for block in message.content_as_list)
    return AIMessage(content=text) if message.role == "assistant" else HumanMessage(content=text)


def sampling_prompt(params: CreateMessageRequestParams) -> list[BaseMessage]:
    """The chat messages of a request: its ``systemPrompt`` first, then its messages in order.

    The run's own system prompt is not added: the server wrote the whole prompt.
    """
    prompt: list[BaseMessage] = [SystemMessage(content=params.systemPrompt)] if params.systemPrompt else []
    return [*prompt, *(_message(message) for message in params.messages)]


def sampling_kwargs(params: CreateMessageRequestParams, context: FusionContext) -> dict[str, Any]:
    """The model-call arguments of a request: ``max_tokens``, ``stop`` and ``temperature`` when given.

    ``maxTokens`` is capped at the run's ``max_completion_tokens``: a server
    cannot ask for a longer completion than the run's own steps may make.
    """
    kwargs: dict[str, Any] = {"max_tokens": min(params.maxTokens, context.max_completion_tokens)}
    if params.stopSequences:
        kwargs["stop"] = list(params.stopSequences)
    if params.temperature is not None:
        kwargs["temperature"] = params.temperature
    return kwargs


#: ``finish_reason`` / ``stop_reason`` values that mean the completion budget ran out.
_LENGTH = frozenset({"length", "max_tokens"})
#: Values that mean a stop sequence ended it (Anthropic's, llama-server's native ``stop_type``).
_STOP_SEQUENCE = frozenset({"stop_sequence", "word"})


def stop_reason(answer: AIMessage, stop: Sequence[str] | None) -> str:
    """The MCP ``stopReason`` of an answer: ``maxTokens``, ``stopSequence`` or ``endTurn``.

    ``stopSequence`` only when stop sequences were sent and the provider says one
    matched (``stop_sequence``/``stopping_word``); OpenAI-style ``stop`` cannot
    tell a stop sequence from the end of the turn, so it is ``endTurn``.
    """
    meta: Mapping[str, Any] = answer.response_metadata
    reasons = {meta.get(key) for key in ("finish_reason", "stop_reason", "stop_type")}
    if reasons & _LENGTH:
        return "maxTokens"
    if stop and (reasons & _STOP_SEQUENCE or meta.get("stop_sequence") or meta.get("stopping_word")):
        return "stopSequence"
    return "endTurn"


def require_mcp() -> None:
    """Raise an ``ImportError`` naming the extra to install when the ``mcp`` SDK is missing."""
    try:
        import mcp.types  # noqa: F401 - only whether it imports
    except ImportError as error:
        raise ImportError(MCP_EXTRA_HINT) from error


def _run_context() -> Any:
    """The graph run's context when this runs inside one (``None`` outside)."""
    try:
        from langgraph.runtime import get_runtime

        return get_runtime().context
    except Exception:  # noqa: BLE001 - outside a run there is no runtime; any failure means "none"
        return None


def _run_thread() -> str | None:
    try:
        from langgraph.config import get_config

        thread = get_config().get("configurable", {}).get("thread_id")
    except Exception:  # noqa: BLE001 - outside a run there is no config
        return None
    return str(thread) if thread else None


class SamplingCallback:
    """An MCP ``sampling_callback`` answering through a ``ProviderResolver``'s chain.

    Matches ``mcp.client.session.SamplingFnT``. ``records`` keeps the record of
    every request it answered (or failed), newest last, at most ``max_records``:
    the only place the records of a long-lived session (opened outside a run) go.
    """

    def __init__(
        self,
        resolver: ProviderResolver,
        *,
        context: FusionContext | dict[str, Any] | None = None,
        max_records: int = DEFAULT_MAX_RECORDS,
    ) -> None:
        """Answer through ``resolver``; ``context`` applies outside a graph run (validated now)."""
        self.resolver = resolver
        self.context = ensure_context(context)
        self.records: deque[RouteRecord] = deque(maxlen=max_records)

    async def __call__(
        self, context: RequestContext[ClientSession, Any], params: CreateMessageRequestParams
    ) -> CreateMessageResult | ErrorData:
        """Answer one ``sampling/createMessage``; a failure is an ``ErrorData`` (scrubbed), never raised.

        ``context`` is the SDK's request context (named as ``SamplingFnT`` names it); it is not read.
        """
        from mcp import types  # present: checked when the callback was built

        scope = current_scope()
        try:
            return await self._sample(params, self._context(scope), scope)
        except Exception as error:  # noqa: BLE001 - the server gets an error result, the session lives on
            message = scrub(f"sampling failed: {type(error).__name__}: {error}")
            logger.warning("%s", message)
            return types.ErrorData(code=types.INTERNAL_ERROR, message=message)

    def _context(self, scope: SamplingScope | None) -> FusionContext:
        if scope is not None and scope.context is not None:
            return scope.context
        run = _run_context()
        return ensure_context(run) if run is not None else self.context

    async def _sample(
        self, params: CreateMessageRequestParams, context: FusionContext, scope: SamplingScope | None
    ) -> CreateMessageResult | ErrorData:
        from mcp import types

        leg, reason = sampling_leg(params.modelPreferences, context)
        decision = RouteDecision(leg=leg, score=None, threshold=None, reason=reason)
        chain = await self.resolver.chain(context)
        prompt = sampling_prompt(params)
        kwargs = sampling_kwargs(params, context)
        thread = scope.thread_id if scope is not None else (_run_thread() or OUTSIDE_THREAD)
        turn, step = (scope.turn, scope.step) if scope is not None else (0, 0)
        parts = RecordParts(
            sampling={
                "thread_id": thread,
                "in_run": scope is not None,
                "requested_max_tokens": params.maxTokens,
            },
            sizing={"max_tokens": kwargs["max_tokens"]},
        )
        check = self._check_budget(chain, prompt, kwargs["max_tokens"], context, scope)
        if check.over is not None:  # cloud only within the run's budget: not as the start, not as a fallover
            decision = check.guard(decision)
            parts["budget"] = {"over": check.over}
            local_only: tuple[Leg, ...] = ("local",)
            chain = chain.only(local_only)
        call = Ask(
            kind="sampling",
            turn=turn,
            step=step,
            decision=decision,
            prompt=prompt,
            thread_id=thread,
            reflection=True,  # the memory jobs' slot: a sample never evicts a conversation's cache
            kwargs=kwargs,
            tags=(TAG_NOSTREAM,),  # not a step of the run: kept out of its messages stream
            parts=parts,
        )
        timeout_s = self.resolver.settings.request_timeout
        try:
            asked = await ask(
                call, chain=chain, placer=self.resolver.placement, bounds=Bounds(timeout_s=timeout_s)
            )
            failure: Exception | None = asked.exhausted
        except ProviderRequestError as refused:  # its text is already scrubbed
            asked, failure = None, refused
        if asked is None or asked.answer is None:
            assert failure is not None
            failed = scrub(f"{type(failure).__name__}: {failure}")
            record = make_record(
                turn=turn,
                step=step,
                kind="sampling",
                decision=decision,
                attempts=getattr(failure, "attempts", ()),
                **joined(parts, {"outcome": {"status": "failed", "error": failed[:500]}}),
            )
            self._keep(record, scope)
            message = f"no provider answered the sampling request: {failed}"
            return types.ErrorData(code=types.INTERNAL_ERROR, message=message)
        answer, record = asked.answer, asked.record
        reason_of_stop = stop_reason(answer, kwargs.get("stop"))
        record.setdefault("outcome", {})["stop_reason"] = reason_of_stop
        self._keep(record, scope)
        return types.CreateMessageResult(
            role="assistant",
            content=types.TextContent(type="text", text=answer.text),
            model=str(record["provider"]),
            stopReason=reason_of_stop,
        )

    def _check_budget(
        self,
        chain: ProviderChain,
        prompt: Sequence[BaseMessage],
        max_tokens: int,
        context: FusionContext,
        scope: SamplingScope | None,
    ) -> BudgetCheck:
        """The budget guard for this request under the run's cloud budget.

        Priced like a step: the prompt's estimate and what the thread's inferences write, at the
        first cloud link's prices, against the thread's spend (its route log and the
        samples of this tool call). Outside a run, nothing has been spent.
        """
        budget = self.resolver.cloud_budget(context)
        cloud = chain.first_cloud
        if not budget.limited or cloud is None:
            return UNLIMITED
        # Nothing of a sampled prompt is in the thread's cloud cache: no cached input to credit.
        step = step_price(cloud.pricing, approximate_tokens(list(prompt)))
        log = [*scope.route_log, *scope.records] if scope is not None else []
        expected = expected_completion(log, ceiling=max_tokens)
        turn = scope.turn if scope is not None else 0
        return check_budget(budget, log, turn, step, expected=expected, ceiling=max_tokens)

    def _keep(self, record: RouteRecord, scope: SamplingScope | None) -> None:
        self.records.append(record)
        if scope is not None:
            scope.records.append(record)


def sampling_callback(
    graph_or_resolver: Any,
    *,
    context: FusionContext | dict[str, Any] | None = None,
    max_records: int = DEFAULT_MAX_RECORDS,
) -> SamplingCallback:
    """An MCP ``sampling_callback`` that answers through a graph's provider chain.

    Pass it as ``ClientSession(sampling_callback=...)``, or in a
    ``MultiServerMCPClient`` connection's ``session_kwargs``.

    Args:
        graph_or_resolver: A graph from ``build_graph`` (its resolver is used) or a ``ProviderResolver``.
        context: The run context for requests outside a graph run (inside one, the run's own).
        max_records: How many records ``SamplingCallback.records`` keeps.

    Raises:
        ImportError: ``mcp`` is not installed (``pip install 'fusion-graph[mcp]'``).
        TypeError: ``graph_or_resolver`` is neither.
    """
    require_mcp()
    resolver = graph_or_resolver
    if not isinstance(resolver, ProviderResolver):
        # A FusionGraph (run_queue, a layer above this one): its memory runs hold the resolver.
        resolver = getattr(getattr(graph_or_resolver, "memory_runs", None), "resolver", None)
    if not isinstance(resolver, ProviderResolver):
        raise UsageError(
            "sampling_callback takes a graph from build_graph() or a ProviderResolver, "
            f"got {type(graph_or_resolver).__name__}"
        )
    return SamplingCallback(resolver, context=context, max_records=max_records)
