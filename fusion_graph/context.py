"""The runtime context: every knob of a fusion run, declared in one place.

LangGraph Studio renders these fields (with their descriptions) as the
assistant's configuration; ``langgraph dev`` and embedding apps pass them as
``context=``. Each field falls back to an environment variable
``FUSION_<FIELD_NAME>`` so a deployment can set defaults without code.
Validation is pydantic's: a bad value fails at construction with a message
that names the field and the valid range.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, TypeAdapter
from pydantic.dataclasses import dataclass

from fusion_graph import prompts
from fusion_graph.routing import DEFAULT_CLOUD_SHARE, DEFAULT_HYSTERESIS, Mode

ENV_PREFIX = "FUSION_"

#: Marks a field as a model name so LangGraph Studio renders a model picker.
LLM_PICKER = {"__template_metadata__": {"kind": "llm"}}


def _env(name: str, default: Any) -> Callable[[], Any]:
    """Default factory: ``FUSION_<NAME>`` from the environment, else ``default``.

    The raw string is handed to pydantic, which converts and validates it like
    any other input; structured fields (tables, pairs) are read as JSON.
    """

    def factory() -> Any:
        raw = os.environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            return default
        if isinstance(default, dict | tuple | list):
            try:
                return json.loads(raw)
            except json.JSONDecodeError as error:
                raise ValueError(f"{ENV_PREFIX + name.upper()} must be JSON: {error}") from error
        return raw

    return factory


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # not a number: pydantic's own type error says so


def between(low: float, high: float | None) -> tuple[Any, ...]:
    """Range metadata: a message naming the whole valid range, and bounds Studio shows."""
    span = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"

    def check(value: Any) -> Any:
        number = _number(value)
        if number is not None and (number < low or (high is not None and number > high)):
            raise ValueError(f"must be {span}, got {value!r}")
        return value

    bounds = Field(ge=low, le=high) if high is not None else Field(ge=low)
    return (bounds, BeforeValidator(check))


def positive() -> tuple[Any, ...]:
    """Metadata for a strictly positive number (seconds)."""

    def check(value: Any) -> Any:
        number = _number(value)
        if number is not None and number <= 0:
            raise ValueError(f"must be greater than 0, got {value!r}")
        return value

    return (Field(gt=0), BeforeValidator(check))


#: Built-in defaults (before environment overrides), for docs and tests.
DEFAULTS: dict[str, Any] = {}


def _f(name: str, default: Any, description: str) -> Any:
    DEFAULTS[name] = default
    return Field(default_factory=_env(name, default), description=description, validate_default=True)


@dataclass(kw_only=True, config={"validate_assignment": True})
class FusionContext:
    """Configuration of one fusion-graph run (LangGraph ``context_schema``)."""

    mode: Annotated[Mode, Field(description="cloud | local | fusion")] = _f(
        "mode",
        "fusion",
        "Routing mode: 'cloud' runs every step on the cloud model, 'local' every step on "
        "llama-server, 'fusion' routes each step by its complexity score.",
    )
    cloud_share: Annotated[int, *between(0, 100)] = _f(
        "cloud_share",
        DEFAULT_CLOUD_SHARE,
        "The dial, 0-100. A continuation step goes cloud when its score >= 100 - cloud_share "
        "(with hysteresis). 0 never uses cloud; any value > 0 runs the plan step on cloud.",
    )
    hysteresis: Annotated[int, *between(0, 50)] = _f(
        "hysteresis",
        DEFAULT_HYSTERESIS,
        "Dead band (points) around the threshold so local runs last long enough for "
        "llama-server's prefix KV cache to pay off.",
    )
    max_steps: Annotated[int, *between(1, 1000)] = _f(
        "max_steps", 25, "Inferences allowed per turn (plan, steps and repairs) before it ends."
    )
    conversation_max_tokens: Annotated[int, *between(256, None)] = _f(
        "conversation_max_tokens",
        32768,
        "Context budget of a conversation; prompt tokens / this is the context-pressure term.",
    )
    max_tool_calls_per_step: Annotated[int, *between(1, 128)] = _f(
        "max_tool_calls_per_step",
        8,
        "Longest tool batch executed per step; extra calls are not run (a transient notice).",
    )
    loop_repeat_limit: Annotated[int, *between(2, 100)] = _f(
        "loop_repeat_limit",
        3,
        "The same tool call (name + arguments) this many times in one turn trips the loop "
        "detector (a transient notice plus a corrective message).",
    )
    max_repair_attempts: Annotated[int, *between(0, 10)] = _f(
        "max_repair_attempts",
        2,
        "Retries of a malformed tool call, on the leg that made it, before the turn ends.",
    )
    cloud_model: Annotated[str, LLM_PICKER, Field(min_length=1)] = _f(
        "cloud_model", "gpt-4o-mini", "Cloud chat model name (OpenAI or OpenAI-compatible)."
    )
    cloud_base_url: str | None = _f(
        "cloud_base_url",
        None,
        "Base URL of an OpenAI-compatible cloud API; empty means OpenAI itself.",
    )
    cloud_api_key_env: Annotated[str, Field(min_length=1)] = _f(
        "cloud_api_key_env",
        "OPENAI_API_KEY",
        "Name of the environment variable holding the cloud API key (never the key itself).",
    )
    local_model: Annotated[str, LLM_PICKER, Field(min_length=1)] = _f(
        "local_model", "local", "Model name sent to llama-server (it serves what it loaded)."
    )
    local_base_url: Annotated[str, Field(min_length=1)] = _f(
        "local_base_url",
        "http://127.0.0.1:8080/v1",
        "OpenAI-compatible base URL of llama-server (ends in /v1).",
    )
    local_slots: Annotated[int, *between(0, 1024)] = _f(
        "local_slots",
        0,
        "llama-server slots (its -np). 0 asks the server (GET /props -> total_slots).",
    )
    reserve_reflection_slot: bool = _f(
        "reserve_reflection_slot",
        True,
        "Keep llama-server's last slot for memory sub-runners so they never evict a "
        "conversation's cached prefix.",
    )
    provider_allowed_failures: Annotated[int, *between(0, 100)] = _f(
        "provider_allowed_failures",
        2,
        "Health failures (timeouts, connection errors, 5xx) a provider may have within the "
        "window; one more puts it in cooldown. A 429 cools it down at once.",
    )
    provider_failure_window_s: Annotated[float, *positive()] = _f(
        "provider_failure_window_s", 60.0, "Seconds over which provider failures are counted."
    )
    provider_cooldown_s: Annotated[float, *between(0, None)] = _f(
        "provider_cooldown_s",
        30.0,
        "Seconds a failing provider sits out before a probe; a Retry-After header replaces it.",
    )
    override_provider: str | None = _f(
        "override_provider",
        None,
        "Operator pin: the provider id tried first when the router has no preference "
        "(e.g. 'cloud:gpt-4o-mini'). The routed leg still picks each step's starting link.",
    )
    local_price_per_mtok: Annotated[tuple[float, float], Field()] = _f(
        "local_price_per_mtok",
        (0.0, 0.0),
        "USD per million (input, output) tokens on the local leg, e.g. to count power; default free.",
    )
    price_overrides: dict[str, tuple[float, float, float | None]] = _f(
        "price_overrides",
        {},
        "USD per million (input, output, cached input) tokens by provider id or model name, "
        "for models the price catalogue does not know.",
    )
    sub_runners: Literal["local", "cloud", "off"] = _f(
        "sub_runners",
        "local",
        "Leg of memory sub-runner jobs: 'local' (default; llama-server's reserved slot), 'cloud', or 'off'.",
    )
    memory_mode: Literal["inline", "background"] = _f(
        "memory_mode",
        "inline",
        "'inline': memory jobs run as a graph node after the reply is written and streamed "
        "(checkpointed, resumable). 'background': detached tasks; ainvoke returns at once, "
        "jobs are lost if the process exits first.",
    )
    memory_every_k_steps: Annotated[int, *between(0, 1000)] = _f(
        "memory_every_k_steps",
        0,
        "Also run memory jobs every K steps of a long turn, beside the next step (0: only after the reply).",
    )
    memory_recall_limit: Annotated[int, *between(0, 50)] = _f(
        "memory_recall_limit",
        5,
        "Stored memories given to the plan step of a turn (most relevant, then newest).",
    )
    memory_timeout_s: Annotated[float, *positive()] = _f(
        "memory_timeout_s", 60.0, "Seconds a memory job may take before it is dropped."
    )
    memory_max_tokens: Annotated[int, *between(16, 8192)] = _f(
        "memory_max_tokens", 512, "Completion budget of one memory job answer."
    )
    request_timeout: Annotated[float, *positive()] = _f(
        "request_timeout", 120.0, "Seconds before a model request is abandoned."
    )
    system_prompt: str = _f(
        "system_prompt", prompts.SYSTEM_PROMPT, "System prompt of every step in the turn."
    )
    workspace_root: Annotated[str, Field(min_length=1)] = _f(
        "workspace_root",
        ".",
        "Directory the built-in file tools are confined to; paths outside it are refused.",
    )

    @property
    def env_names(self) -> dict[str, str]:
        """Field name -> the environment variable that sets its default."""
        return {f.name: ENV_PREFIX + f.name.upper() for f in fields(self)}


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
        rows.append((f.name, str(kind), DEFAULTS[f.name], str(schema[f.name].get("description", ""))))
    return rows


def ensure_context(context: FusionContext | dict[str, Any] | None) -> FusionContext:
    """The run's context, with defaults when the caller passed none."""
    if context is None:
        return FusionContext()
    if isinstance(context, dict):
        return FusionContext(**context)
    return context
