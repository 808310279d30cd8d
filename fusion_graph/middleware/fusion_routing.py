"""``FusionRoutingMiddleware``: per-step fusion routing for a ``create_agent`` agent, on the graph's core.

Each model call of the agent is one step, decided and carried out as the graph
does it: the same signals, score, hysteresis and plan rule (``sizing.turn.next_route``),
the same budget guard and order (``nodes.step.order_step``), the same fit rule
and provider call (``providers.chain.ask``: the thread's llama-server slot and
box, fallover along the provider chain, pricing at the provider that
answered), the same ``route_log`` records in the agent's state and the same
``fusion_route`` custom stream events. The attempt goes out through the agent's
own model call (``request.override``): the agent binds the tools, and the
middleware inside this one still run.

Bad input is held as the graph holds it: a run context that is not one
(a string, a number, a list, a field out of range, a ``workspace_root`` outside
the operator's or reached through a symlink) is refused before any model is
asked (``abefore_agent``); a tool that fails is answered with an error tool
message (``awrap_tool_call``), and a call whose arguments did not parse with the
graph's malformed-call message (``aafter_model``), so no tool call of the
thread is ever left without a result (which OpenAI refuses on the next request).

What the graph does that a middleware cannot (a model call is all it sees):
repairing a malformed tool call on the same leg (the middleware answers it and
the next call is routed as any step), trimming a tool batch
and the loop detector's notice (the notice term stays 0), memory sub-runners,
re-writing a local reply on cloud, shadow checks, compacting a history no
window holds (pair it with ``SummarizationMiddleware``), and a resumable stall
when every provider is down (the call raises ``ChainExhausted``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any

from langchain.agents.middleware.types import (
    AgentMiddleware,
    AgentState,
    ExtendedModelResponse,
    ModelRequest,
    ModelResponse,
    ToolCallRequest,
    hook_config,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.channels import DeltaChannel
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp
from langgraph.prebuilt.tool_node import TOOL_CALL_ERROR_TEMPLATE
from langgraph.runtime import Runtime
from langgraph.types import Command
from typing_extensions import NotRequired  # noqa: UP035 - the TypedDict of state, as in fusion_graph.state

from fusion_graph import prompts
from fusion_graph.context import FusionContext, context_defaults, ensure_context, thread_id_of
from fusion_graph.errors import ChainExhausted, ContextError
from fusion_graph.nodes.step import Sizer, decide_step, over_budget, routing_update
from fusion_graph.nodes.tools import malformed_call_message, unique_call_ids
from fusion_graph.providers.chain import Ask, ProviderChain, ask
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.redact import scrub_content
from fusion_graph.routing.records import RouteRecord, add_totals, joined, records_totals
from fusion_graph.routing.score import Leg
from fusion_graph.settings import FusionSettings
from fusion_graph.sizing.turn import TokenCounter, approximate_tokens, turn_start
from fusion_graph.state import LOG_SNAPSHOT_EVERY, PromptAnchor, State, StepTally, append_records
from fusion_graph.tools.files import check_run_root

#: Run contexts that are no run's settings, whatever the agent's ``context_schema``: refused, not
#: replaced by the middleware's ``context=`` (a caller who sent one meant something else).
NOT_A_CONTEXT = (str, bytes, bytearray, int, float, complex, list, tuple, set, frozenset)


class FusionRoutingState(AgentState[Any]):
    """What the middleware keeps in the agent's state: the graph's route log and what routing reads."""

    route_log: NotRequired[
        Annotated[list[RouteRecord], DeltaChannel(append_records, snapshot_frequency=LOG_SNAPSHOT_EVERY)]
    ]
    totals: NotRequired[Annotated[dict[str, Any], add_totals]]
    leg: NotRequired[Leg]
    provider: NotRequired[str | None]
    latch: NotRequired[int | None]
    anchors: NotRequired[dict[str, PromptAnchor]]
    step_tally: NotRequired[StepTally]


@dataclasses.dataclass(frozen=True)
class MalformedReplies:
    """The answers owed to the model's last answer for its calls whose arguments did not parse."""

    answer: AIMessage
    """The model's answer, with an id on every call (``unique_call_ids``)."""
    renamed: bool
    """Whether ``answer`` differs from the one in the state (a call had no id, or a repeated one)."""
    replies: list[ToolMessage]
    """An error result for each such call not answered yet."""


def unanswered_malformed_calls(messages: Sequence[BaseMessage]) -> MalformedReplies | None:
    """What the model's last answer is owed for its calls that did not parse; ``None``: nothing.

    A call without an id could never be answered, and OpenAI refuses a history
    holding it: such a call gets one first, as the graph gives it.
    """
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, AIMessage):
            break
        if not isinstance(message, ToolMessage):
            return None
    else:
        return None
    if not message.invalid_tool_calls:
        return None
    answered = {m.tool_call_id for m in messages[index + 1 :] if isinstance(m, ToolMessage)}
    answer = unique_call_ids(message)
    replies = [
        ToolMessage(
            content=malformed_call_message(bad),
            tool_call_id=bad["id"] or "",
            name=bad.get("name") or "",
            status="error",
        )
        for bad in answer.invalid_tool_calls
        if bad["id"] not in answered
    ]
    return MalformedReplies(answer, answer is not message, replies) if replies else None


def turn_and_step(messages: Sequence[BaseMessage]) -> tuple[int, int]:
    """The turn (user messages so far, 0-based) and the step about to run (the plan is 0)."""
    start = turn_start(messages)
    turn = sum(1 for m in messages if isinstance(m, HumanMessage) and m.name != prompts.MEMORY_MESSAGE_NAME)
    step = sum(1 for m in messages[start + 1 :] if isinstance(m, AIMessage))
    return max(turn - 1, 0), step


class FusionRoutingMiddleware(AgentMiddleware[FusionRoutingState, Any]):
    """Route each model call of a ``create_agent`` agent to the local or the cloud model, as the graph does.

    ``create_agent(model=..., tools=..., middleware=[FusionRoutingMiddleware(...)])``:
    the agent's ``model`` is replaced on every call by the provider the chain
    answers with. Put it after every middleware that wraps model calls, so they
    see the routed call (any listed after it run per attempt); put tool-only
    middleware such as ``ToolRetryMiddleware`` after it too, so its retries run
    inside the hook that answers a tool's last failure with an error message.
    """

    state_schema = FusionRoutingState

    def __init__(
        self,
        *,
        cloud_model: BaseChatModel | None = None,
        local_model: BaseChatModel | None = None,
        chain: ProviderChain | None = None,
        settings: FusionSettings | None = None,
        context: FusionContext | Mapping[str, Any] | None = None,
        count_tokens: TokenCounter = approximate_tokens,
        resolver: ProviderResolver | None = None,
    ) -> None:
        """The providers and settings, as ``build_graph`` takes them.

        Args:
            cloud_model: Chat model of the cloud leg; ``None`` builds one from the settings.
            local_model: Chat model of the local leg (llama-server); ``None`` builds one.
            chain: A provider chain of your own instead of the two models.
            settings: The operator's settings; ``None`` reads ``FUSION_*`` now.
            context: The run context when the agent's own ``context_schema`` is not
                ``FusionContext`` (a run whose context is a ``FusionContext`` or a mapping
                of its fields uses that, checked as the graph checks it).
            count_tokens: The token estimator of every routing signal.
            resolver: A ``ProviderResolver`` you keep (to close its providers), instead.
        """
        super().__init__()
        if resolver is None:
            resolver = ProviderResolver(cloud=cloud_model, local=local_model, chain=chain, settings=settings)
        self.resolver = resolver
        self.count_tokens = count_tokens
        self.run_defaults = context_defaults()
        self.default_context = ensure_context(
            dict(vars(context)) if isinstance(context, FusionContext) else dict(context or {}),
            self.run_defaults,
        )
        self._sizers: dict[tuple[int, ...], Sizer] = {}

    def _run_context(self, given: Any) -> FusionContext:
        """The run's context if it is fusion's, else the middleware's ``context=``.

        A ``FusionContext`` or a mapping is checked as the graph checks it; any other
        object is the agent's own ``context_schema`` (this middleware's ``context=`` then
        applies); a string, number or sequence is nobody's context and is refused.

        Raises:
            ContextError: The context is not one, or holds a field the graph refuses.
        """
        if isinstance(given, FusionContext | dict):
            return ensure_context(given, self.run_defaults)
        if isinstance(given, Mapping):
            return ensure_context(dict(given), self.run_defaults)
        if isinstance(given, NOT_A_CONTEXT):
            raise ContextError(
                f"the run context must be an object of run settings (FusionContext fields) or the "
                f"agent's own context_schema, got {type(given).__name__}: {given!r:.80}"
            )
        return self.default_context

    def _context(self, given: Any, system_prompt: str) -> FusionContext:
        """The run's context (``_run_context``) with the agent's system prompt."""
        context = self._run_context(given)
        if context.system_prompt != system_prompt:  # estimates count the agent's own system prompt
            context = dataclasses.replace(context, system_prompt=system_prompt)
        return context

    def _sizer(self, tools: Sequence[BaseTool]) -> Sizer:
        key = tuple(id(tool) for tool in tools)
        sizer = self._sizers.get(key)
        if sizer is None:
            sizer = self._sizers[key] = Sizer(self.resolver, list(tools), self.count_tokens)
        return sizer

    async def abefore_agent(self, state: FusionRoutingState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Refuse a run whose context the graph would refuse, before any model is asked.

        Otherwise a bad context is found only by a tool, after a paid model call, and
        the thread keeps the call it could not answer. The same checks as the graph
        makes before its run (``run_queue``): the fields, the operator's bounds (the
        chain), and a ``workspace_root`` that must be reached without a symlink.

        Raises:
            ContextError: The message names what is wrong.
        """
        context = self._run_context(runtime.context)
        await self.resolver.chain(context)
        if context.workspace_root is not None:  # it opens directories: off the event loop
            operator_root = self.resolver.settings.workspace_root
            await asyncio.to_thread(check_run_root, operator_root, context.workspace_root)
        return None

    @hook_config(can_jump_to=["model"])
    async def aafter_model(self, state: FusionRoutingState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Answer each call of the model's answer whose arguments did not parse, and go on.

        ``create_agent`` ends the run on an answer with no valid call, leaving the bad
        one unanswered; the graph tells the model what broke so it can send the call
        again. So does this: an error tool message per bad call, and back to the model
        when no valid call is left to run (valid ones run first, as in the graph).
        """
        found = unanswered_malformed_calls(state["messages"])
        if found is None:
            return None
        renamed = [found.answer] if found.renamed else []  # the same message id: replaced in place
        update: dict[str, Any] = {"messages": [*renamed, *found.replies]}
        if not found.answer.tool_calls:
            update["jump_to"] = "model"
        return update

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        """Run the tool; its failure becomes an error tool message, as the graph's tool node answers it.

        ``create_agent``'s tool node lets a tool's exception end the run, and the
        thread keeps a call with no result, which OpenAI refuses on the next turn.
        Interrupts (``GraphBubbleUp``) still propagate. Middleware listed after this
        one (``ToolRetryMiddleware``) runs inside it, so it retries before this answers.
        """
        try:
            return await handler(request)
        except GraphBubbleUp:
            raise
        except Exception as error:  # noqa: BLE001 - any tool failure is the model's to read, as in the graph
            call = request.tool_call
            return ToolMessage(
                content=scrub_content(TOOL_CALL_ERROR_TEMPLATE.format(error=repr(error))),
                tool_call_id=call["id"] or "",
                name=call["name"],
                status="error",
            )

    async def awrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]],
    ) -> ModelResponse[Any] | AIMessage | ExtendedModelResponse[Any]:
        """Score, route and make the agent's model call through the provider chain, and record it."""
        system_prompt = request.system_message.text if request.system_message is not None else ""
        context = self._context(request.runtime.context, system_prompt)
        messages = request.messages
        state: Mapping[str, Any] = request.state
        turn, step = turn_and_step(messages)
        plan = step == 0
        view: State = {**state, "messages": messages, "step": step - 1, "turn": turn}  # type: ignore[typeddict-item]
        tools = [tool for tool in request.tools if isinstance(tool, BaseTool)]
        sizer = self._sizer(tools)
        chain = await self.resolver.chain(context)
        anchors = dict(state.get("anchors") or {})
        thread_id = thread_id_of(get_config())
        order = await decide_step(
            sizer,
            view,
            context,
            self.count_tokens,
            tools,
            plan=plan,
            turn=turn,
            thread_id=thread_id,
            node="model",
        )
        signals = order.signals
        prepared = await sizer.prepare(
            chain, order.decision.leg, messages, anchors, context, sizes=order.sizes
        )
        bounds = sizer.bounds(chain, prepared, context, order.check)
        if order.check.over is not None and not bounds.allowed:  # only cloud could hold it: over budget
            record, reply = over_budget(order, prepared)
            return ExtendedModelResponse(
                model_response=ModelResponse(result=[reply]), command=Command(update={"route_log": [record]})
            )
        responses: list[ModelResponse[Any]] = []

        async def send(model: BaseChatModel, kwargs: Mapping[str, Any]) -> AIMessage:
            settings = {**request.model_settings, **kwargs}
            response = await handler(request.override(model=model, model_settings=settings))
            responses.append(response)
            answers = [m for m in response.result if isinstance(m, AIMessage)]
            return answers[-1] if answers else AIMessage(content="")

        call = Ask(
            kind=order.kind,
            turn=turn,
            step=step,
            decision=prepared.decided(order.decision),
            prompt=[*([request.system_message] if request.system_message else []), *messages],
            thread_id=thread_id,
            tools=tools,
            signals=signals,
            parts=joined(prepared.parts(), order.check.parts()),
            send=send,
        )
        asked = await ask(
            call,
            chain=chain,
            placer=self.resolver.placement,
            bounds=bounds,
            writer=request.runtime.stream_writer,
        )
        if asked.answer is None or not responses:
            raise asked.exhausted or ChainExhausted("no provider answered", [], None)
        record = asked.record
        provider = record["provider"] or ""
        update: dict[str, Any] = {
            "route_log": [record],
            "totals": records_totals([record]),
            "leg": record["leg"],
            "provider": record["provider"],
            "anchors": prepared.anchors(anchors, record["leg"], record["prompt_tokens"], provider),
        }
        update |= routing_update(state, order.decision, context, [*state.get("route_log", []), record])
        return ExtendedModelResponse(model_response=responses[-1], command=Command(update=update))


__all__ = [
    "FusionRoutingMiddleware",
    "FusionRoutingState",
    "MalformedReplies",
    "turn_and_step",
    "unanswered_malformed_calls",
]
