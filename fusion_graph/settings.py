"""Operator settings: endpoints, keys, the workspace, prices, timeouts and slot counts.

These belong to whoever runs the graph, never to whoever calls it: under
``langgraph dev`` or LangGraph server the run context comes from API callers,
so nothing here can be set per run. A run's context may only *narrow* four of
them: ``cloud_model`` to one of ``cloud_models``, ``workspace_root`` to a
directory inside this one (see ``narrow``), and the two cloud budgets to lower
ones (``routing.rule.cloud_budget``). Read once at graph build from
``FUSION_*`` environment variables (and a ``.env`` file), or passed as
``build_graph(settings=...)``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import posixpath
from collections.abc import Iterable
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from fusion_graph.errors import ContextError

ENV_PREFIX = "FUSION_"

# Field metadata shared by operator settings and run context: finite ranges with readable errors.


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # not a number: pydantic's own type error says so


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got the boolean {value!r}")
    return value


def between(low: float, high: float) -> tuple[Any, ...]:
    """Range metadata: a message naming the whole valid range, and bounds Studio shows."""

    def check(value: Any) -> Any:
        _no_bool(value)
        number = _number(value)
        if number is not None and (math.isnan(number) or number < low or number > high):
            raise ValueError(f"must be between {low:g} and {high:g}, got {value!r}")
        return value

    return (Field(ge=low, le=high, allow_inf_nan=False), BeforeValidator(check))


def seconds(high: float = 3600.0) -> tuple[Any, ...]:
    """Metadata for a duration: greater than 0 and at most ``high`` seconds (never infinite)."""

    def check(value: Any) -> Any:
        _no_bool(value)
        number = _number(value)
        if number is not None and not (0 < number <= high):
            raise ValueError(f"must be greater than 0 and at most {high:g} seconds, got {value!r}")
        return value

    return (Field(gt=0, le=high, allow_inf_nan=False), BeforeValidator(check))


#: The largest price (USD per million tokens) accepted: far above any real model, never infinite.
MAX_PRICE = 10_000.0


def price(value: Any) -> Any:
    """A price in USD per million tokens: finite, 0 or more, at most ``MAX_PRICE``."""
    _no_bool(value)
    number = _number(value)
    if number is None or math.isnan(number) or not (0 <= number <= MAX_PRICE):
        raise ValueError(f"prices must be between 0 and {MAX_PRICE:g} USD per million tokens, got {value!r}")
    return number


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely misspells (``None``: none is close).

    One rule for every "did you mean" the package prints: unknown settings,
    unknown ``FUSION_*`` variables and unknown run-context keys.
    """
    return next(iter(difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)), None)


def lexical_parts(path: str) -> list[str] | None:
    """The components of relative ``path`` with ``.`` and ``..`` applied; ``None`` if it climbs above.

    Pure string work (it may run on an event loop): what the names are on disk,
    symlinks included, is for the caller's descriptor walk to find out.
    """
    parts: list[str] = []
    for name in path.split("/"):
        if name in ("", "."):
            continue
        if name != "..":
            parts.append(name)
        elif parts:
            parts.pop()
        else:
            return None
    return parts


def dotenv_value(name: str, path: str = ".env") -> str | None:
    """``name``'s non-empty value in the dotenv file at ``path`` (``None``: no file, unset or empty)."""
    if not os.path.isfile(path):
        return None
    from dotenv import dotenv_values  # python-dotenv: what pydantic-settings reads .env with

    value = dotenv_values(path).get(name)
    return value or None


def dotenv_entries(path: str = ".env") -> dict[str, str]:
    """The variables the dotenv file at ``path`` sets to a value (none without the file).

    The run context's ``FUSION_*`` defaults are read from here under the
    environment, as ``FusionSettings`` reads its own, so one ``.env`` configures both.
    """
    if not os.path.isfile(path):
        return {}
    from dotenv import dotenv_values

    return {name: value for name, value in dotenv_values(path).items() if value is not None}


Price = Annotated[float, AfterValidator(price)]


#: Secret files the built-in tools refuse by default: dotenv files, private keys, git internals.
DEFAULT_SECRET_FILES: tuple[str, ...] = (
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "id_rsa",
    "id_dsa",
    "id_ecdsa",
    "id_ed25519",
    ".netrc",
    ".pgpass",
    ".git/",
)


class FusionSettings(BaseSettings):
    """What the operator configures once per deployment (``FUSION_<NAME>`` variables)."""

    # env_ignore_empty: an empty FUSION_* value (as .env.example writes the optional ones) means the
    # field's default, from the environment and .env alike; a setting is turned off by a value.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_ignore_empty=True,
        extra="ignore",
        frozen=True,
        validate_default=True,
    )

    cloud_model: Annotated[str, Field(min_length=1)] = Field(
        "gpt-4o-mini", description="Cloud chat model name (OpenAI or OpenAI-compatible)."
    )
    cloud_models: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], NoDecode] = Field(
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
    local_routing_header: str = Field(
        "x-fusion-thread",
        description="Header every local request carries with the thread's routing key (a stable hash "
        "of its id), so a gateway in front of several llama-servers (smg --policy manual "
        "--routing-key-headers x-fusion-thread) keeps each thread on one box; 'off' sends none.",
    )
    local_workers: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="The llama-server boxes' own base URLs when local_base_url is a gateway: their "
        "/props (slots, window) and /tokenize are read there, and they must agree on model and -np. "
        "Empty: local_base_url is llama-server itself.",
    )
    local_worker_header: str = Field(
        "x-smg-routed-worker-id",
        description="Response header in which a gateway names the box that served a local request; "
        "each thread's slot is then kept free on its own box. 'off': not read.",
    )
    shared_state: Literal["off", "postgres"] = Field(
        "off",
        description="Where the deployment's worker processes share slot leases, provider cooldowns, "
        "memory job claims and thread runs: 'off' keeps them in each process (one process, or an "
        "embedded app); 'postgres' keeps them in the Postgres at shared_state_url.",
    )
    shared_state_url: SecretStr | None = Field(
        None,
        description="Postgres URL of the shared state (shared_state='postgres'); empty: DATABASE_URI, "
        "the database a LangGraph server runs on.",
    )
    shared_state_timeout_s: Annotated[float, *between(0.5, 60)] = Field(
        3.0,
        description="Seconds one shared-state operation may take (connecting, checking a pooled "
        "connection, each statement) before the turn places in this process instead; a stalled or "
        "restarting database never holds a turn up longer.",
    )
    shared_state_namespace: str = Field(
        "",
        description="Keeps this app's rows (leases, claims, locks, cooldowns) apart from other apps "
        "that share the shared-state database; workers of one app share one. Empty: derived from "
        "DATABASE_URI (a LangGraph server's own database), else 'default'.",
    )
    slot_lease_s: Annotated[float, *between(10, 86_400)] = Field(
        900.0,
        description="Seconds a thread keeps its llama-server slot after its last local request when "
        "the state is shared (a new thread then may take it).",
    )
    slot_home_wait_s: Annotated[float, *between(0, 600)] = Field(
        2.0,
        description="Seconds a returning thread waits at least for a slot on the llama-server box whose "
        "host prompt cache holds its prefix (several boxes) before it moves to another box and "
        "prefills its prompt there once; longer while runs hold their slots longer (about one run "
        "there, at most request_timeout); 0 moves at once.",
    )
    memory_claim_lease_s: Annotated[float, *between(1, 3600)] = Field(
        15.0,
        description="Seconds a worker's claim on a memory job lasts without a heartbeat (a third of it "
        "apart) when the state is shared: a job whose worker died or froze is taken over this long "
        "after its last sign of life.",
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
    turn_cloud_budget_usd: Annotated[float | None, *between(0, 1_000_000)] = Field(
        None,
        description="Most USD one turn may spend on cloud: a step whose estimated cloud cost would pass "
        "it runs local. The ceiling of a run's own turn_cloud_budget_usd. Empty: no limit.",
    )
    thread_cloud_budget_usd: Annotated[float | None, *between(0, 1_000_000)] = Field(
        None,
        description="Most USD one thread may spend on cloud over all its turns (plans too run local "
        "once it is spent). The ceiling of a run's own thread_cloud_budget_usd. Empty: no limit.",
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
    cross_leg_fallover: bool = Field(
        False,
        description="Let a mode='local' run fall over to cloud (and mode='cloud' to local) when its own "
        "leg is down; off, a single-leg mode never calls the other leg's provider.",
    )
    secret_files: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], NoDecode] = Field(
        DEFAULT_SECRET_FILES,
        description="Name patterns (fnmatch, per path component; a trailing '/' names a directory) "
        "the built-in file tools refuse to read or edit. Set a longer list to extend it, [] to clear it.",
    )
    max_system_prompt_chars: Annotated[int, *between(1, 10_000_000)] = Field(
        100_000, description="Longest system_prompt a run's context may set (characters)."
    )
    max_input_chars: Annotated[int, *between(1, 100_000_000)] = Field(
        1_000_000, description="Longest new input a run may send (characters over its new messages)."
    )
    allow_history_edits: bool = Field(
        False,
        description="Let a run's input rewrite its thread's history: a message with the id of one "
        "already in the thread (which replaces it) or a RemoveMessage (REMOVE_ALL_MESSAGES wipes the "
        "thread). Off, such input is refused before anything is written (run input is untrusted "
        "under a server).",
    )
    durability: Literal["sync", "async", "exit"] = Field(
        "sync",
        description="The least LangGraph durability every run gets (a run may ask for more, never "
        "less). sync: each step's checkpoint is saved before the next step starts, so a tool call "
        "whose result was saved never runs again after a crash; async saves it while the next step "
        "runs (a crash can lose it); exit saves only at the end of the run.",
    )
    metrics: bool = Field(
        False,
        description="Count every inference in Prometheus metrics (the 'telemetry' extra), served at "
        "/metrics on metrics_port; an app that already serves prometheus-client's default registry "
        "gets them there too.",
    )
    metrics_port: Annotated[int, *between(1, 65535)] | None = Field(
        None,
        description="Serve /metrics on this port from this process: one port per worker process "
        "(each is a scrape target). Empty: not served by fusion-graph.",
    )
    metrics_host: Annotated[str, Field(min_length=1)] = Field(
        "127.0.0.1",
        description="Address /metrics listens on: this machine only by default (the metrics name "
        "providers, boxes and spend); 0.0.0.0 (or ::) where Prometheus scrapes from elsewhere, as "
        "in a container or a pod.",
    )
    traces: bool = Field(
        False,
        description="Export an OpenTelemetry span per turn, inference and tool call over OTLP (the "
        "'telemetry' extra); where to: the standard OTEL_EXPORTER_OTLP_* variables, unless the app "
        "set up OpenTelemetry itself.",
    )
    traces_exporter: Literal["otlp", "console"] = Field(
        "otlp",
        description="Where the spans go when fusion-graph sets up OpenTelemetry: 'otlp' (OTLP/HTTP, to "
        "OTEL_EXPORTER_OTLP_*) or 'console' (one JSON line per span on stderr, to look at spans without "
        "a receiver). Unused when the app set up OpenTelemetry itself.",
    )
    traces_error_detail: bool = Field(
        False,
        description="Put a failed run's error text (scrubbed of secrets) and stack trace on its span. "
        "Off: the span says the error's class and kind only, since a provider's error text may echo "
        "the prompt.",
    )

    def __init__(self, **values: Any) -> None:
        """Read the settings; a keyword that names no setting is refused (a typo is never dropped)."""
        unknown = sorted(k for k in values if not k.startswith("_") and k not in type(self).model_fields)
        if unknown:
            hints = [closest_name(k, type(self).model_fields) for k in unknown]
            named = ", ".join(
                f"{k!r}" + (f" (did you mean {h!r}?)" if h else "")
                for k, h in zip(unknown, hints, strict=True)
            )
            raise ContextError(f"unknown operator setting {named}; see FusionSettings for the valid names")
        super().__init__(**values)

    @field_validator("cloud_base_url", "local_base_url")
    @classmethod
    def _http_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Only ``http(s)://host...`` URLs: anything else would fail at the first call, or worse."""
        if value is None or value == "":
            return None if info.field_name == "cloud_base_url" else value
        parsed = urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"{info.field_name} must be an http:// or https:// URL with a host, got {value!r}"
            )
        return value

    @field_validator("cloud_models", "local_workers", "secret_files", mode="before")
    @classmethod
    def _text_list(cls, value: Any) -> Any:
        """A list setting from a variable: a JSON list, or plain comma-separated items (``[]``: none).

        An empty variable never gets here: it means the default, as for every setting.
        """
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f'not a valid JSON list ({error.msg}); write it as a,b or as ["a", "b"]'
                ) from None
        return tuple(item.strip() for item in text.split(",") if item.strip())

    @field_validator("local_workers")
    @classmethod
    def _worker_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Each box's base URL must be an ``http(s)://host...`` URL, named once."""
        for url in value:
            parsed = urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"local_workers entries must be http:// or https:// URLs, got {url!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"local_workers names a box twice: {list(value)}")
        return value

    @field_validator("local_routing_header", "local_worker_header")
    @classmethod
    def _header_name(cls, value: str, info: ValidationInfo) -> str:
        """An HTTP header name (token characters only), or ``off`` (or ``""``) to turn it off.

        ``off`` is how a variable turns it off: an empty variable means the default header.
        """
        if value.strip().lower() == "off":
            return ""
        allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~")
        if value and not set(value) <= allowed:
            raise ValueError(f"{info.field_name} must be an HTTP header name, got {value!r}")
        return value

    def api_key(self) -> SecretStr | None:
        """The cloud key: ``cloud_api_key``, else the variable named by ``cloud_api_key_env``.

        The variable is read from the environment, else from ``.env`` in the working
        directory; an empty value never stands for a key (nor hides one set elsewhere).
        """
        if self.cloud_api_key is not None and self.cloud_api_key.get_secret_value():
            return self.cloud_api_key
        value = os.environ.get(self.cloud_api_key_env) or dotenv_value(self.cloud_api_key_env)
        return SecretStr(value) if value else None

    @property
    def allowed_cloud_models(self) -> tuple[str, ...]:
        """``cloud_model`` and the allow-list: what a run's context may pick."""
        return (self.cloud_model, *(m for m in self.cloud_models if m != self.cloud_model))

    def shared_url(self) -> str | None:
        """The shared state's Postgres URL (``shared_state_url``, else ``DATABASE_URI``); ``None``: off."""
        if self.shared_state == "off":
            return None
        if self.shared_state_url is not None and self.shared_state_url.get_secret_value():
            return self.shared_state_url.get_secret_value()
        return os.environ.get("DATABASE_URI") or None

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
            sub = workspace_subpath(self.workspace_root, workspace_root)
            update["workspace_root"] = posixpath.join(self.workspace_root, *sub)
        return self.model_copy(update=update) if update else self


def workspace_subpath(operator_root: str, requested: str) -> tuple[str, ...]:
    """The directories from the operator's root down to a run's ``workspace_root``, lexically.

    ``requested`` is relative to the operator's root, or absolute under it. No
    filesystem call is made (this runs on the event loop); the tools walk the
    result from the operator's root without following symlinks, so a symlinked
    or swapped run root is refused when it is opened, not trusted here.

    Raises:
        ContextError: ``requested`` lies outside the operator's root.
    """
    outside = ContextError(
        f"workspace_root {requested!r} lies outside the operator's workspace; a run may only "
        "narrow it to a directory inside (the operator sets FUSION_WORKSPACE_ROOT)"
    )
    if "\0" in requested:
        raise ContextError(f"workspace_root {requested!r} contains a NUL character")
    if requested.startswith("/"):
        base = posixpath.normpath(operator_root)
        if not base.startswith("/"):
            raise ContextError(
                f"{outside} (the operator's workspace {operator_root!r} is relative: give the "
                "run's workspace_root relative to it)"
            )
        target = posixpath.normpath(requested)
        if target != base and not target.startswith(base.rstrip("/") + "/"):
            raise outside
        requested = posixpath.relpath(target, base)
    parts = lexical_parts(requested)
    if parts is None:
        raise outside
    return tuple(parts)


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
