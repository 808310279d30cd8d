"""Operator settings: endpoints, keys, the workspace, prices, timeouts and slot counts.

These belong to whoever runs the graph, never to whoever calls it: under
``langgraph dev`` or LangGraph server the run context comes from API callers,
so nothing here can be set per run. A run's context may only *narrow* two of
them (``cloud_model`` to one of ``cloud_models``, ``workspace_root`` to a
directory inside this one; see ``narrow``). Read once at graph build from
``FUSION_*`` environment variables (and a ``.env`` file), or passed as
``build_graph(settings=...)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from fusion_graph.ranges import between, price, seconds

ENV_PREFIX = "FUSION_"

Price = Annotated[float, AfterValidator(price)]


class ContextError(ValueError):
    """A run's context asks for something the operator did not allow; the message names the field."""


class FusionSettings(BaseSettings):
    """What the operator configures once per deployment (``FUSION_<NAME>`` variables)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_file=".env", extra="ignore", frozen=True, validate_default=True
    )

    cloud_model: Annotated[str, Field(min_length=1)] = Field(
        "gpt-4o-mini", description="Cloud chat model name (OpenAI or OpenAI-compatible)."
    )
    cloud_models: tuple[str, ...] = Field(
        (), description="Further cloud models a run's context may pick instead of cloud_model (allow-list)."
    )
    cloud_base_url: str | None = Field(
        None, description="Base URL of an OpenAI-compatible cloud API; empty means OpenAI itself."
    )
    cloud_api_key_env: Annotated[str, Field(min_length=1)] = Field(
        "OPENAI_API_KEY",
        description="Name of the environment variable holding the cloud API key (never the key itself).",
    )
    cloud_api_key: SecretStr | None = Field(
        None, description="The cloud API key itself, when not in the variable named by cloud_api_key_env."
    )
    local_model: Annotated[str, Field(min_length=1)] = Field(
        "local", description="Model name sent to llama-server (it serves what it loaded)."
    )
    local_base_url: Annotated[str, Field(min_length=1)] = Field(
        "http://127.0.0.1:8080/v1", description="OpenAI-compatible base URL of llama-server (ends in /v1)."
    )
    local_slots: Annotated[int, *between(0, 1024)] = Field(
        0, description="llama-server slots (its -np). 0 asks the server (GET /props -> total_slots)."
    )
    reserve_reflection_slot: bool = Field(
        True,
        description="Keep llama-server's last slot for memory sub-runners so they never evict a "
        "conversation's cached prefix.",
    )
    local_window_tokens: Annotated[int, *between(0, 10_000_000)] = Field(
        0,
        description="Tokens one llama-server slot holds (prompt + completion). 0 asks the server "
        "(GET /props -> default_generation_settings.n_ctx, i.e. -c / -np).",
    )
    cloud_window_tokens: Annotated[int, *between(0, 10_000_000)] = Field(
        0,
        description="Tokens the cloud model holds per request. 0 takes max_input_tokens from the "
        "model's langchain-core profile, else 128000.",
    )
    provider_allowed_failures: Annotated[int, *between(0, 100)] = Field(
        2,
        description="Health failures (timeouts, connection errors, 5xx) a provider may have within the "
        "window; one more puts it in cooldown. A 429 cools it down at once.",
    )
    provider_failure_window_s: Annotated[float, *seconds()] = Field(
        60.0, description="Seconds over which provider failures are counted."
    )
    provider_cooldown_s: Annotated[float, *between(0, 3600)] = Field(
        30.0,
        description="Seconds a failing provider sits out before a probe; a Retry-After header replaces it.",
    )
    override_provider: str | None = Field(
        None,
        description="The provider id tried first when the router has no preference "
        "(e.g. 'cloud:gpt-4o-mini'). The routed leg still picks each step's starting link.",
    )
    local_price_per_mtok: tuple[Price, Price] = Field(
        (0.0, 0.0),
        description="USD per million (input, output) tokens on the local leg, e.g. to count power; "
        "default free.",
    )
    price_overrides: dict[str, tuple[Price, Price, Price | None]] = Field(
        default_factory=dict,
        description="USD per million (input, output, cached input) tokens by provider id (any leg) "
        "or cloud model name, for models the price catalogue does not know.",
    )
    cloud_price_like: str | None = Field(
        None,
        description="genai-prices catalogue provider (e.g. 'openai') whose prices the cloud model "
        "bills at, for a cloud_base_url the catalogue does not know (a gateway); empty infers it "
        "from the URL.",
    )
    request_timeout: Annotated[float, *seconds()] = Field(
        120.0, description="Seconds before a model request is abandoned."
    )
    memory_timeout_s: Annotated[float, *seconds()] = Field(
        60.0,
        description="Seconds a memory job may take before it is dropped; a pending background job "
        "is left to its process for 2 x this + 5 s before another process picks it up.",
    )
    workspace_root: Annotated[str, Field(min_length=1)] = Field(
        ".",
        description="Directory the built-in file tools are confined to (a run may narrow it to a "
        "directory inside); paths outside it are refused.",
    )

    def api_key(self) -> SecretStr | None:
        """The cloud key: ``cloud_api_key``, else the variable named by ``cloud_api_key_env``."""
        if self.cloud_api_key is not None and self.cloud_api_key.get_secret_value():
            return self.cloud_api_key
        value = os.environ.get(self.cloud_api_key_env)
        return SecretStr(value) if value else None

    @property
    def allowed_cloud_models(self) -> tuple[str, ...]:
        """``cloud_model`` and the allow-list: what a run's context may pick."""
        return (self.cloud_model, *(m for m in self.cloud_models if m != self.cloud_model))

    def narrow(self, *, cloud_model: str | None = None, workspace_root: str | None = None) -> FusionSettings:
        """These settings as one run may use them: a narrower workspace, an allowed model.

        Raises:
            ContextError: The run asked for a model outside the allow-list or a
                workspace outside the operator's.
        """
        update: dict[str, Any] = {}
        if cloud_model is not None and cloud_model != self.cloud_model:
            if cloud_model not in self.allowed_cloud_models:
                raise ContextError(
                    f"cloud_model {cloud_model!r} is not allowed for this deployment; allowed: "
                    f"{list(self.allowed_cloud_models)} (the operator sets FUSION_CLOUD_MODELS)"
                )
            update["cloud_model"] = cloud_model
        if workspace_root is not None:
            update["workspace_root"] = str(inside_workspace(self.workspace_root, workspace_root))
        return self.model_copy(update=update) if update else self


def inside_workspace(operator_root: str, requested: str) -> Path:
    """``requested`` (absolute, or relative to the operator's root) if it lies inside that root."""
    base = Path(operator_root).resolve()
    target = (base / requested).resolve()
    if target != base and not target.is_relative_to(base):
        raise ContextError(
            f"workspace_root {requested!r} lies outside the operator's workspace; a run may only "
            "narrow it to a directory inside (the operator sets FUSION_WORKSPACE_ROOT)"
        )
    return target


#: Names of the operator settings (refused in a run's context).
OPERATOR_FIELDS = frozenset(FusionSettings.model_fields)


def settings_fields() -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, description)`` for each operator setting, for docs that must not drift."""
    schema = FusionSettings.model_json_schema()["properties"]
    rows = []
    for name, field in FusionSettings.model_fields.items():
        entry = schema[name]
        kind = entry.get("type") or " | ".join(
            str(s.get("type", s.get("const", "?"))) for s in entry.get("anyOf", [])
        )
        default = field.get_default(call_default_factory=True)
        rows.append((name, str(kind), default, field.description or ""))
    return rows
