"""The per-run context: what a caller may choose for one run, declared in one place.

LangGraph Studio renders these fields (with their defaults and descriptions)
as the assistant's configuration; ``langgraph dev`` and embedding apps pass
them as ``context=``. Under LangGraph server the context comes from API
callers, so it holds only run choices (routing, limits, memory knobs, the
system prompt) and four fields that may only *narrow* the operator's settings
(``cloud_model``, ``workspace_root``, ``turn_cloud_budget_usd``,
``thread_cloud_budget_usd``): endpoints, keys, prices and timeouts are
``FusionSettings``. Unknown keys, operator settings and wrong types are
refused with a message naming the field.

Each default can be set by the operator with ``FUSION_<FIELD_NAME>`` (in the
environment or ``.env``; an empty value means the built-in default, as it does
for the operator settings). Those are read when the graph is built
(``context_defaults``), like the operator settings, not at import: a default
set after the package was imported counts, a bad one is refused there naming
its variable, and the schema the built graph serves to Studio carries the
defaults in force.

A run's context overrides them field by field, whether it is a mapping or a
``FusionContext``: an object remembers which fields its caller set (keywords
or assignments), and ``ensure_context`` fills the others from the defaults,
so ``FusionContext(mode="local")`` and ``{"mode": "local"}`` run alike.

The rest is how code outside a node finds the run it serves: the thread's id
in a run's config (``thread_id_of``), whether memory jobs can run for it
(``memory_on``: a store attached, ``sub_runners`` not ``off``), and the sampling
scope (``SamplingScope``, ``sampling_scope``, ``current_scope``): the tool call an
MCP sampling request arrives during, found through a ``ContextVar`` so its
records join that thread's ``route_log``. They sit beside the context, which
all their readers (the nodes, the middleware, MCP sampling, the memory jobs)
import anyway, so finding the run loads no other module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass as std_dataclass
from dataclasses import field, fields
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs, ErrorDetails

from fusion_graph import prompts
from fusion_graph.errors import ContextError
from fusion_graph.routing.records import RouteRecord
from fusion_graph.routing.rule import check_score_quantiles
from fusion_graph.routing.score import (
    DEFAULT_CLOUD_SHARE,
    DEFAULT_HYSTERESIS,
    TROUBLE_WEIGHTS,
    Mode,
    check_trouble_weights,
)
from fusion_graph.settings import ENV_PREFIX, OPERATOR_FIELDS, between, closest_name, dotenv_entries

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig
    from langgraph.runtime import Runtime

#: Marks a field as a model name so LangGraph Studio renders a model picker (in the served schema).
LLM_PICKER = Field(json_schema_extra={"__template_metadata__": {"kind": "llm"}})


def _score_table(value: Any) -> Any:
    """A ``score_quantiles`` table, checked (JSON text from the environment is decoded first)."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return None if value is None else check_score_quantiles(value)


def _trouble_table(value: Any) -> Any:
    """``trouble_weights``, checked (JSON text from the environment is decoded first; empty: ``None``)."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"trouble_weights must be an object of term weights, got {value!r}")
    return check_trouble_weights(value)


def _blank_is_none(value: Any) -> Any:
    """Empty text (an empty ``FUSION_*`` variable) leaves an optional field unset."""
    return None if isinstance(value, str) and not value.strip() else value


#: Built-in defaults (before the operator's ``FUSION_*`` defaults), by environment key, for docs and tests.
DEFAULTS: dict[str, Any] = {}


def _field(name: str, default: Any, description: str) -> Any:
    DEFAULTS[name] = default
    return Field(default=default, description=description, validate_default=True)


@dataclass(kw_only=True, config={"validate_assignment": True, "extra": "forbid"})
class FusionContext:
    """Configuration of one fusion-graph run (LangGraph ``context_schema``)."""

    mode: Annotated[Mode, Field(description="cloud | local | fusion")] = _field(
        "mode",
        "fusion",
        "Routing mode: 'cloud' runs every step on the cloud model, 'local' every step on "
        "llama-server, 'fusion' routes each step by its complexity score.",
    )
    cloud_share: Annotated[int, *between(0, 100)] = _field(
        "cloud_share",
        DEFAULT_CLOUD_SHARE,
        "The dial, 0-100. A continuation step goes cloud when its score >= 100 - cloud_share "
        "(with hysteresis). 0 never uses cloud; any value > 0 runs the plan step on cloud.",
    )
    hysteresis: Annotated[int, *between(0, 50)] = _field(
        "hysteresis",
        DEFAULT_HYSTERESIS,
        "Dead band (points) around the threshold so local runs last long enough for "
        "llama-server's prefix KV cache to pay off; narrowed near the ends so neither bar "
        "passes halfway to 0 or 100.",
    )
    score_quantiles: Annotated[tuple[float, ...] | None, BeforeValidator(_score_table)] = _field(
        "score_quantiles",
        None,
        "Calibrated dial from `fusion-graph calibrate`: 101 non-decreasing score bars (0-100); "
        "entry 100 - cloud_share is the threshold, compared with the step's exact points, so "
        "cloud_share becomes the share of continuation steps on cloud. Empty: T = 100 - cloud_share.",
    )
    pace_slack: Annotated[float | None, *between(0.5, 100), BeforeValidator(_blank_is_none)] = _field(
        "pace_slack",
        None,
        "Paced dial: keep each thread's cloud continuation steps within this many steps of "
        "cloud_share percent of its continuation steps (read from its route log); the score "
        "with hysteresis picks inside that slack. 0.5 holds the share to the nearest step; "
        "wider leaves the score more say. Empty: no pacing.",
    )
    trouble_signals: bool = _field(
        "trouble_signals",
        False,
        f"Trouble signals: add {TROUBLE_WEIGHTS['error_severity']} × error severity (the turn's tool "
        "errors, recent and repeated ones weighing most) and "
        f"{TROUBLE_WEIGHTS['no_progress']} × no progress (the share of recent calls already made in "
        "the turn) to the score (clipped to 100), and keep a turn that trouble escalated on cloud "
        "until a progress event (a success after errors, a passing test run). Off: the four-term score.",
    )
    trouble_weights: Annotated[dict[str, int] | None, BeforeValidator(_trouble_table)] = _field(
        "trouble_weights",
        None,
        "Points of the two trouble terms when trouble_signals is on, as an object (error_severity, "
        f"no_progress; a term left out keeps its default, {TROUBLE_WEIGHTS['error_severity']} and "
        f"{TROUBLE_WEIGHTS['no_progress']}; 0 turns it off); `fusion-graph calibrate --labels "
        "--trouble-signals` picks them. Empty: the defaults.",
    )
    max_steps: Annotated[int, *between(1, 1000)] = _field(
        "max_steps", 25, "Inferences allowed per turn (plan, steps and repairs) before it ends."
    )
    conversation_max_tokens: Annotated[int | None, *between(256, 10_000_000)] = _field(
        "conversation_max_tokens",
        None,
        "Context budget of a conversation; prompt tokens / this is the context-pressure term. "
        "Empty: the local window less the completion budget (pressure 1 = the step no longer fits "
        "llama-server's slot); an explicit value may not exceed that.",
    )
    max_completion_tokens: Annotated[int, *between(16, 1_000_000)] = _field(
        "max_completion_tokens",
        4096,
        "Completion budget of every inference on either leg (sent as max_tokens; a model's own "
        "lower max_tokens wins). A link reserves it, at most half its window, when checking "
        "that a step fits.",
    )
    max_tool_output_tokens: Annotated[int, *between(100, 10_000_000)] = _field(
        "max_tool_output_tokens",
        8000,
        "Longest tool result kept whole; a longer one keeps its head and tail with a marker "
        "saying how much was cut, and raises the transient notice of the next step.",
    )
    max_tool_calls_per_step: Annotated[int, *between(1, 128)] = _field(
        "max_tool_calls_per_step",
        8,
        "Longest tool batch executed per step; extra calls are not run (a transient notice).",
    )
    loop_repeat_limit: Annotated[int, *between(2, 100)] = _field(
        "loop_repeat_limit",
        3,
        "The same tool call (name + arguments) this many times in one turn trips the loop "
        "detector (a transient notice plus a corrective message).",
    )
    max_repair_attempts: Annotated[int, *between(0, 10)] = _field(
        "max_repair_attempts",
        2,
        "Retries of a malformed tool call, on the leg that made it, before the turn ends.",
    )
    sub_runners: Literal["local", "cloud", "off"] = _field(
        "sub_runners",
        "local",
        "Leg of memory sub-runner jobs: 'local' (default; llama-server's reserved slot, its "
        "prompt restored from the host prompt cache), 'cloud', or 'off'.",
    )
    memory_mode: Literal["inline", "background"] = _field(
        "memory_mode",
        "background",
        "'background' (default): the memory node logs each run as pending in the store and "
        "detaches it; ainvoke returns without waiting, jobs every K steps never delay the next "
        "step, a run no process finished is picked up at the thread's next turn (or by "
        "fusion_graph.memory.sweep), and its records reach route_log by the next turn. 'inline': "
        "jobs run inside the memory node after the reply is written and streamed (checkpointed, "
        "resumable); ainvoke returns after them.",
    )
    memory_every_k_steps: Annotated[int, *between(0, 1000)] = _field(
        "memory_every_k_steps",
        0,
        "Also run memory jobs every K steps of a long turn, beside the next step, which never "
        "waits for them in background mode (0: only after the reply).",
    )
    memory_recall_limit: Annotated[int, *between(0, 50)] = _field(
        "memory_recall_limit",
        5,
        "Stored memories given to the plan step of a turn (most relevant, then newest).",
    )
    memory_max_tokens: Annotated[int, *between(16, 8192)] = _field(
        "memory_max_tokens", 512, "Completion budget of one memory job answer."
    )
    system_prompt: str = _field(
        "system_prompt", prompts.SYSTEM_PROMPT, "System prompt of every step in the turn."
    )
    turn_cloud_budget_usd: Annotated[
        float | None, *between(0, 1_000_000), BeforeValidator(_blank_is_none)
    ] = _field(
        "run_turn_cloud_budget_usd",
        None,
        "USD this run's turn may spend on cloud: a step whose estimated cloud cost would pass it "
        "runs local (the reason says so). May only lower the operator's FUSION_TURN_CLOUD_BUDGET_USD. "
        "Empty: the operator's.",
    )
    thread_cloud_budget_usd: Annotated[
        float | None, *between(0, 1_000_000), BeforeValidator(_blank_is_none)
    ] = _field(
        "run_thread_cloud_budget_usd",
        None,
        "USD the thread may spend on cloud over all its turns; once spent, plans run local too. May "
        "only lower the operator's FUSION_THREAD_CLOUD_BUDGET_USD. Empty: the operator's.",
    )
    shadow_share: Annotated[float, *between(0, 1)] = _field(
        "shadow_share",
        0.0,
        "Share (0-1) of local steps the cloud leg is also asked, beside the step and never delaying "
        "it (the local answer is used as always), within the cloud budget; a 'shadow' record says "
        "whether both took the same action, so `fusion-graph report` shows agreement by score band.",
    )
    resynthesize: Literal["off", "local_replies"] = _field(
        "resynthesize",
        "off",
        "'local_replies': when a turn ends on a reply the local leg wrote, one more cloud call writes "
        "the final reply from the same conversation (the local draft is kept in route_log; skipped, "
        "keeping the local reply, when over budget or cloud is down). 'off': the local reply stands.",
    )

    cloud_model: Annotated[str | None, LLM_PICKER] = _field(
        "run_cloud_model",
        None,
        "Cloud model for this run, one of the operator's allowed models (FUSION_CLOUD_MODEL and "
        "FUSION_CLOUD_MODELS); empty uses the operator's cloud_model.",
    )
    workspace_root: str | None = _field(
        "run_workspace_root",
        None,
        "Directory inside the operator's workspace to confine this run's file tools to; empty "
        "uses the operator's workspace_root.",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_operator_settings(cls, data: Any) -> Any:
        given = data.kwargs if isinstance(data, ArgsKwargs) else data
        if isinstance(given, dict):
            operator = sorted((set(given) & OPERATOR_FIELDS) - RUN_FIELDS)
            if operator:
                raise ValueError(
                    f"{operator[0]} is an operator setting, not part of a run's context: set "
                    f"{ENV_PREFIX}{operator[0].upper()} where the graph runs, or pass "
                    "build_graph(settings=FusionSettings(...))"
                )
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _note_given(cls, data: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        """Remember which fields the caller set, so the unset ones can take the operator's defaults.

        A dataclass cannot tell an explicit ``4096`` from its default, and
        ``ensure_context`` must fill only what the caller left out (as it does
        for a mapping). Keywords count when the object is built, a field when it
        is assigned; an object validated again keeps what it had.
        """
        before = _given(data) if isinstance(data, FusionContext) else frozenset()
        result = handler(data)
        if info.field_name is not None:  # an assignment: that field is now the caller's
            given = before | {info.field_name}
        elif isinstance(data, ArgsKwargs):
            given = frozenset(data.kwargs or ())
        elif isinstance(data, Mapping):
            given = frozenset(str(name) for name in data)
        else:
            given = before
        object.__setattr__(result, _GIVEN, given)
        return result

    @property
    def env_names(self) -> dict[str, str]:
        """Field name -> the environment variable that sets its default."""
        return {name: ENV_PREFIX + env.upper() for name, env in ENV_KEYS.items()}


#: Fields a run's context may set (four of them may only narrow operator settings).
RUN_FIELDS = frozenset(f.name for f in fields(FusionContext))

#: The environment variable suffix of each field's default (the narrowing fields have their own,
#: so they never collide with the operator's FUSION_CLOUD_MODEL, FUSION_WORKSPACE_ROOT or budgets).
_NARROWING = {
    "cloud_model": "run_cloud_model",
    "workspace_root": "run_workspace_root",
    "turn_cloud_budget_usd": "run_turn_cloud_budget_usd",
    "thread_cloud_budget_usd": "run_thread_cloud_budget_usd",
}
ENV_KEYS = {name: _NARROWING.get(name, name) for name in RUN_FIELDS}

#: Where a ``FusionContext`` keeps the names of the fields its caller set (not a field: never in the schema).
_GIVEN = "_fusion_given"


def _given(context: FusionContext) -> frozenset[str]:
    """The fields ``context``'s caller set; all of them when it was built some other way."""
    given = context.__dict__.get(_GIVEN)
    return given if isinstance(given, frozenset) else RUN_FIELDS


def _resolved(context: FusionContext) -> FusionContext:
    """``context`` marked as holding every field's value for its run (defaults already applied).

    Nodes call ``ensure_context`` again on what the run carries; a resolved
    context is then taken as it is, and never meets defaults read later.
    """
    object.__setattr__(context, _GIVEN, RUN_FIELDS)
    return context


def _env_value(raw: str, default: Any) -> Any:
    """A ``FUSION_*`` default's text as the field takes it: JSON-decoded, except for text fields."""
    if isinstance(default, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # the field's own check names what it takes


def context_defaults(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The operator's run defaults: every ``FUSION_<FIELD>`` set to a value, checked.

    ``build_graph`` reads them once, as it reads the operator settings; each CLI
    command reads them when it starts. A run's own context overrides them
    field by field. Read from ``environ``, else from the environment over
    ``./.env`` (as ``FusionSettings`` reads its own). An empty value is no
    default: the field keeps its built-in one, as an empty operator setting
    does, so ``.env.example`` uncommented as written runs.

    Raises:
        ContextError: One is invalid; the message names each bad variable, its
            field and what it takes.
    """
    source = {**dotenv_entries(), **os.environ} if environ is None else environ
    given = {
        name: _env_value(raw, DEFAULTS[key])
        for name, key in ENV_KEYS.items()
        if (raw := source.get(ENV_PREFIX + key.upper())) is not None and raw.strip()
    }
    if not given:
        return {}
    try:
        checked = FusionContext(**given)
    except ValidationError as error:
        bad = "; ".join(
            f"{ENV_PREFIX}{ENV_KEYS[str(e['loc'][0])].upper()} ({e['loc'][0]}): "
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in error.errors()
            if e["loc"] and str(e["loc"][0]) in ENV_KEYS
        )
        raise ContextError(
            f"invalid run-context default from the environment or ./.env: {bad or error}"
        ) from None
    return {name: getattr(checked, name) for name in given}


def context_fields() -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, description)`` for each field, for docs that must not drift."""
    rows = []
    schema = TypeAdapter(FusionContext).json_schema()["properties"]
    for f in fields(FusionContext):
        kind = schema[f.name].get("type") or " | ".join(
            str(s.get("type", s.get("const", "?"))) for s in schema[f.name].get("anyOf", [])
        )
        if "enum" in schema[f.name]:
            kind = " | ".join(schema[f.name]["enum"])
        rows.append(
            (f.name, str(kind), DEFAULTS[ENV_KEYS[f.name]], str(schema[f.name].get("description", "")))
        )
    return rows


def ensure_context(context: Any, defaults: Mapping[str, Any] | None = None) -> FusionContext:
    """The run's context, validated, over the operator's run defaults.

    Args:
        context: What the caller passed: ``None``, a mapping of run fields, or a
            ``FusionContext`` (the fields its caller set are kept, the others
            take the defaults, as for a mapping).
        defaults: The operator's run defaults (``context_defaults``); ``None``
            reads them from the environment now.

    Raises:
        ContextError: The context is not a mapping of run fields, names an
            unknown field or an operator setting, or holds a wrong value; or
            a default from the environment is invalid.
    """
    if isinstance(context, FusionContext):
        given = _given(context)
        if given == RUN_FIELDS:  # resolved already (or every field set): the object as it is
            return context
        # A copy over the defaults: the caller's object stays theirs, for another graph's defaults.
        context = {name: getattr(context, name) for name in given}
    base = context_defaults() if defaults is None else defaults
    if context is None:
        return _resolved(FusionContext(**base))
    if not isinstance(context, dict):
        raise ContextError(
            f"the run context must be an object of run settings (FusionContext fields), "
            f"got {type(context).__name__}: {context!r:.80}"
        )
    try:
        return _resolved(FusionContext(**{**base, **context}))
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'context'}: {e['msg'].removeprefix('Value error, ')}"
            + _suggestion(e)
            for e in error.errors()
        )
        raise ContextError(f"invalid run context: {problems}") from None


def _suggestion(error: ErrorDetails) -> str:
    """`` (did you mean 'cloud_share'?)`` for an unknown key that misspells a run field, else nothing.

    The same hint an unknown ``FUSION_*`` variable or operator setting gets, so a
    typo in a run's context is as easy to spot as one in the environment.
    """
    if error["type"] != "unexpected_keyword_argument" or not error["loc"]:
        return ""
    meant = closest_name(str(error["loc"][-1]), RUN_FIELDS)
    return f" (did you mean {meant!r}?)" if meant else ""


def thread_id_of(config: RunnableConfig) -> str:
    """The conversation's id (``configurable.thread_id``); one shared id when absent."""
    return str((config.get("configurable") or {}).get("thread_id") or "default")


def memory_on(runtime: Runtime[Any]) -> bool:
    """Whether memory jobs can run: a store is attached and ``sub_runners`` is not ``off``."""
    return runtime.store is not None and ensure_context(runtime.context).sub_runners != "off"


@std_dataclass
class SamplingScope:
    """The tool call a sampling request belongs to, and the records collected for its thread.

    Attributes:
        turn: The run's turn (``State.turn``) when the tool was called.
        step: The inference that asked for the call (``State.step``).
        thread_id: The run's ``configurable.thread_id``.
        context: The run's context (mode, ``cloud_share``, completion budget).
        route_log: The thread's route log when the tool was called (its cloud spend so far).
        records: Records of the sampling requests answered during the call, for ``route_log``.
    """

    turn: int
    step: int
    thread_id: str
    context: FusionContext | None = None
    route_log: Sequence[RouteRecord] = ()
    records: list[RouteRecord] = field(default_factory=list)


_SAMPLING_SCOPE: ContextVar[SamplingScope | None] = ContextVar("fusion_sampling_scope", default=None)


@contextmanager
def sampling_scope(
    *,
    turn: int,
    step: int,
    thread_id: str,
    context: FusionContext | None,
    route_log: Sequence[RouteRecord] = (),
) -> Iterator[SamplingScope]:
    """Collect the sampling records of whatever runs inside (a tool call); yields the scope.

    Tasks started inside (an MCP session's receive loop) inherit the scope; the
    records list is shared, so what they append is read here after the call.
    """
    scope = SamplingScope(turn=turn, step=step, thread_id=thread_id, context=context, route_log=route_log)
    token = _SAMPLING_SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SAMPLING_SCOPE.reset(token)


def current_scope() -> SamplingScope | None:
    """The scope of the tool call running now, if any."""
    return _SAMPLING_SCOPE.get()
