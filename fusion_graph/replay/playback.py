"""Play a recorded conversation live through the real graph: scripted models and tools that answer from it.

``replay.history`` routes a recording without running anything; this module
lets the graph itself run it (``fusion-graph demo``), so routing, the fit rule,
tool dispatch, records and pricing all happen as in production, with no key,
no server and no GPU:

- ``RecordedScript`` splits the conversation into turns (one per user message)
  and hands out, in order, the assistant messages recorded for the running turn.
- ``RecordedChatModel`` answers every inference with the next recorded
  assistant message, on whichever leg the graph routed the step: the route is
  the graph's, the words are the recording's. It reports the tokens the prompt
  and the answer hold (the graph's own estimate), so each leg is priced.
- ``PrefillLlamaServer`` sends each local prompt to a real llama-server with
  ``max_tokens=1`` (prefill only, in the slot the graph placed it in) and then
  answers with the recording: the prompt and cached token counts are the
  server's own, so the prefix cache at work is real.
- ``recorded_tools`` builds one tool per tool name of the recording that
  returns the recorded output of each call, by call id, in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import ConfigDict, Field

from fusion_graph.errors import TraceError
from fusion_graph.providers.llama_server import ChatLlamaServer, timings_of
from fusion_graph.replay.history import split_system
from fusion_graph.replay.traces import RecordedTrajectory
from fusion_graph.sizing.turn import approximate_tokens, tool_tokens

#: What a model says when the graph asks for more answers than the recorded turn has (a repair, or a
#: step past the recording): a plain reply, so the turn ends instead of the run failing.
END_OF_RECORDING = "(the recording has no more answers for this turn)"


@dataclass
class RecordedTurn:
    """One user message and what the recording answered to it."""

    user: HumanMessage
    answers: list[AIMessage]
    """The assistant messages of the turn, in order: the steps the graph is expected to ask for."""


@dataclass
class RecordedScript:
    """The recorded answers of a conversation, handed out turn by turn to whichever leg asks.

    Both legs share one script, so a step gets the same recorded answer whether
    the graph routes it to cloud or to local.

    Attributes:
        turns: The conversation's turns, in order.
        system: The recorded system prompt (``""``: none), the run's ``system_prompt``.
        outputs: The recorded tool outputs by call id, in order (an id may recur across turns).
        pending: The answers of the running turn not asked for yet.
    """

    turns: list[RecordedTurn]
    system: str
    outputs: dict[str, deque[Any]]
    pending: deque[AIMessage] = field(default_factory=deque)

    @classmethod
    def of(cls, trajectory: RecordedTrajectory) -> RecordedScript:
        """Split ``trajectory`` into turns at each user message.

        Raises:
            TraceError: The conversation has no user message or none of its
                assistant messages follows one (nothing to play).
        """
        system, body = split_system(trajectory.messages)
        turns: list[RecordedTurn] = []
        outputs: dict[str, deque[Any]] = {}
        for message in body:
            if isinstance(message, HumanMessage):
                turns.append(RecordedTurn(message, []))
            elif isinstance(message, AIMessage) and turns:
                turns[-1].answers.append(message)
            elif isinstance(message, ToolMessage):
                outputs.setdefault(message.tool_call_id, deque()).append(message.content)
        if not any(turn.answers for turn in turns):
            raise TraceError(
                f"conversation {trajectory.id} has no assistant message after a user message: nothing to play"
            )
        return cls(turns=turns, system=system, outputs=outputs)

    def start(self, turn: RecordedTurn) -> None:
        """Make ``turn``'s answers the next ones (what an earlier turn left unasked is dropped)."""
        self.pending = deque(turn.answers)

    def next_answer(self) -> AIMessage:
        """The next recorded answer of the running turn, or a closing reply when it has none left."""
        if self.pending:
            return self.pending.popleft()
        return AIMessage(END_OF_RECORDING)

    def tool_output(self, call_id: str | None) -> Any:
        """The recorded output of call ``call_id`` (the next one, when the id recurs)."""
        queue = self.outputs.get(call_id or "")
        if not queue:
            return f"(no recorded output for call {call_id})"
        return queue.popleft() if len(queue) > 1 else queue[0]

    def tool_names(self) -> list[str]:
        """The names of the tools the recorded answers call, in first-use order."""
        names = (call["name"] for turn in self.turns for answer in turn.answers for call in answer.tool_calls)
        return list(dict.fromkeys(names))


def recorded_usage(prompt: int, completion: int, cached: int | None = None) -> UsageMetadata:
    """Usage in LangChain's shape, which the graph's records read (``routing.records.usage_numbers``)."""
    usage = UsageMetadata(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion)
    if cached is not None:
        usage["input_token_details"] = InputTokenDetails(cache_read=cached)
    return usage


def recorded_answer(answer: AIMessage, usage: UsageMetadata, metadata: dict[str, Any]) -> AIMessage:
    """A copy of a recorded answer with this call's usage and metadata (the recording stays as it was)."""
    return answer.model_copy(
        update={
            "id": None,
            "usage_metadata": usage,
            "response_metadata": {**answer.response_metadata, **metadata},
        }
    )


class RecordedChatModel(BaseChatModel):
    """A chat model that answers each call with the next recorded answer of its ``RecordedScript``.

    Its usage is the graph's own token estimate of the prompt it was sent (tool
    schemas included) and of the recorded answer, so a step is priced at what it
    would have cost on the leg it ran on. It never streams: each answer is whole.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    script: RecordedScript = Field(exclude=True)
    model_name: str = "recorded"

    @property
    def _llm_type(self) -> str:
        return "recorded"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Keep the tool schemas as a call argument: they count in the prompt, as a server counts them."""
        return self.bind(tools=[convert_to_openai_tool(tool) for tool in tools], **kwargs)

    def _answer(self, messages: list[BaseMessage], tools: Sequence[dict[str, Any]]) -> ChatResult:
        answer = self.script.next_answer()
        prompt = approximate_tokens(messages) + (tool_tokens(list(tools)) if tools else 0)
        usage = recorded_usage(prompt, approximate_tokens([answer]))
        return ChatResult(generations=[ChatGeneration(message=recorded_answer(answer, usage, {}))])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._answer(messages, kwargs.get("tools") or ())

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._answer(messages, kwargs.get("tools") or ())


class PrefillLlamaServer(ChatLlamaServer):
    """llama-server prefills each prompt for real (``max_tokens=1``), then the recording answers.

    The request is the graph's own (its slot as ``id_slot``, ``cache_prompt``,
    the bound tools), so the prompt and cached token counts and ``timings`` the
    server reports are what this conversation would have cost on it. The one
    token written is thrown away, unchecked: the answer is the recording's.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    script: RecordedScript = Field(exclude=True)

    def _create_chat_result(
        self, response: dict[str, Any] | openai.BaseModel, generation_info: dict[str, Any] | None = None
    ) -> ChatResult:
        # Not ChatOpenAICompatible's checks: a one-token answer is often "cut before any content".
        result = ChatOpenAI._create_chat_result(self, response, generation_info)
        timings = timings_of(response)
        for generation in result.generations:
            if timings is not None:
                generation.message.response_metadata["timings"] = timings
        return result

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prefill = await super()._agenerate(
            messages, stop=stop, run_manager=run_manager, **{**kwargs, "max_tokens": 1}
        )
        real = prefill.generations[0].message
        answer = self.script.next_answer()
        reported = getattr(real, "usage_metadata", None) or {}
        details = reported.get("input_token_details") or {}
        prompt = reported.get("input_tokens")
        if prompt is None:
            prompt = approximate_tokens(messages)
        usage = recorded_usage(prompt, approximate_tokens([answer]), details.get("cache_read"))
        metadata = {
            key: real.response_metadata[key]
            for key in ("timings", "model_name")
            if key in real.response_metadata
        }
        return ChatResult(generations=[ChatGeneration(message=recorded_answer(answer, usage, metadata))])


class RecordedTool(BaseTool):
    """A tool of the recording: each call returns what the recording's tool returned to that call id."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    script: RecordedScript = Field(exclude=True)

    def _to_args_and_kwargs(
        self, tool_input: str | dict[str, Any], tool_call_id: str | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # The call id, not the arguments, says which recorded output answers (the arguments are recorded).
        return (), {"call_id": tool_call_id}

    def _run(self, call_id: str | None = None, **_: Any) -> Any:
        return self.script.tool_output(call_id)

    async def _arun(self, call_id: str | None = None, **_: Any) -> Any:
        return self.script.tool_output(call_id)


def recorded_tools(script: RecordedScript, schemas: Sequence[dict[str, Any]] = ()) -> list[BaseTool]:
    """One ``RecordedTool`` per tool the recording calls (and per schema it gives).

    ``schemas`` are the record's own tool schemas (``RecordedTrajectory.tools``):
    their descriptions and parameters are what the model saw, so they are what
    the prompt carries. Their ``required`` lists are dropped: the calls are
    replayed as recorded, and a field a recorded call left out must not send the
    step to repair. A tool without a schema takes any object.
    """
    given = {schema["function"]["name"]: schema["function"] for schema in schemas}
    tools: list[BaseTool] = []
    for name in dict.fromkeys([*given, *script.tool_names()]):
        function = given.get(name, {})
        parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
        parameters.pop("required", None)
        description = function.get("description") or f"The recorded {name} tool."
        tools.append(RecordedTool(name=name, description=description, args_schema=parameters, script=script))
    return tools
