"""``fusion-graph doctor``: check an operator's set-up, one row per check, and say how to fix each.

Checks, in order: the cloud key (by variable name, never its value), the cloud
endpoint (``GET /models``; ``--live`` adds a one-token completion), llama-server
(``GET /props``: slots, per-slot window against the completion budget, the chat
template's tool support, and ``POST /apply-template`` with a tool to see whether
``--jinja`` is on), the workspace, and the checkpoint database.

Each check is a small function returning ``Check`` rows; ``doctor`` renders
them. Exit code 0 when no row is ``fail`` (``warn`` and ``info`` allowed), else 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import typer
from rich.table import Table
from rich.text import Text

from fusion_graph.cli.common import build_context, build_settings, fail, stdout_console
from fusion_graph.redact import REDACTED, scrub

if TYPE_CHECKING:
    import httpx

    from fusion_graph.providers.llama_server import ServerProps
    from fusion_graph.settings import FusionSettings

Status = Literal["ok", "warn", "fail", "info"]

#: ``fusion_graph.cli.run.DEFAULT_DB``, repeated so importing this command loads no LangGraph (a test
#: checks they agree).
DEFAULT_DB = Path(".fusion-graph") / "threads.sqlite"

#: The cloud base URL when ``cloud_base_url`` is empty (what the OpenAI SDK uses).
OPENAI_BASE_URL = "https://api.openai.com/v1"

#: How to start llama-server the way fusion-graph expects (``-c`` is filled in per check).
LLAMA_START = "llama-server -m MODEL.gguf --jinja -np 4 -c {ctx} --port 8080"

#: The one tool ``POST /apply-template`` is asked to render (nothing is generated).
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "doctor_probe",
        "description": "fusion-graph doctor checks that the server accepts tools.",
        "parameters": {"type": "object", "properties": {}},
    },
}

#: What llama-server's ``GET /props`` does not say (b1-0c1e570, llama-cpp-python 0.3.36), so doctor
#: cannot check it; a later build that reports ``kv_unified`` gets that one checked.
NOT_IN_PROPS = (
    "--kv-unified",
    "whether -np was explicit (auto -np turns --kv-unified on)",
    "--cache-ram",
    "--slot-prompt-similarity",
    "--cache-reuse",
)

_STYLES: dict[str, str] = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "cyan"}


@dataclass(frozen=True)
class Check:
    """One row of the report.

    Attributes:
        name: What was checked (``cloud key``, ``slot window``...).
        status: ``ok``, ``warn`` (works, but not as well as it could), ``fail`` (will not
            work: exit code 1) or ``info`` (a note: something that could not be checked).
        detail: What was found.
        fix: The line to fix it; empty when there is nothing to do.
    """

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class FoundKey:
    """Where the cloud key was found: a variable's name, and whether the runtime sees it.

    Attributes:
        variable: The variable's name (``OPENAI_API_KEY``, ``FUSION_CLOUD_API_KEY``...).
        where: ``environment`` or ``.env``.
        exported: Whether ``FusionSettings.api_key()`` returns it (``fusion-graph run``,
            ``build_graph`` in the operator's own process).
        value: The key; never printed.
    """

    variable: str
    where: Literal["environment", ".env"]
    exported: bool
    value: str = field(repr=False)


# -- 1. cloud key ----------------------------------------------------------------------


def read_dotenv(path: Path = Path(".env")) -> dict[str, str]:
    """The variables a ``.env`` file sets (empty ones left out); ``{}`` without one."""
    from dotenv import dotenv_values

    if not path.is_file():
        return {}
    return {name: value for name, value in dotenv_values(path).items() if value}


def find_cloud_key(
    settings: FusionSettings, environ: Mapping[str, str], dotenv: Mapping[str, str]
) -> FoundKey | None:
    """The cloud key the way ``FusionSettings.api_key()`` finds it, plus one ``.env`` only sees.

    ``FusionSettings`` reads ``.env`` for ``FUSION_*`` names only: a key under the
    variable named by ``cloud_api_key_env`` (``OPENAI_API_KEY``) counts only once it
    is in the environment. ``langgraph dev`` loads ``.env`` into the environment.
    """
    secret = settings.cloud_api_key
    if secret is not None and secret.get_secret_value():
        name = "FUSION_CLOUD_API_KEY"
        in_env = any(key.upper() == name for key in environ)
        return FoundKey(name, "environment" if in_env else ".env", True, secret.get_secret_value())
    variable = settings.cloud_api_key_env
    if environ.get(variable):
        return FoundKey(variable, "environment", True, environ[variable])
    if dotenv.get(variable):
        return FoundKey(variable, ".env", False, dotenv[variable])
    return None


def cloud_key_check(settings: FusionSettings, found: FoundKey | None) -> Check:
    """The key is named by its variable; its value, length or any part of it is never shown."""
    variable = settings.cloud_api_key_env
    if found is None:
        return Check(
            "cloud key",
            "fail",
            f"no cloud API key: {variable} is not set in the environment or .env, "
            "nor is FUSION_CLOUD_API_KEY",
            f"export {variable}=... (FUSION_CLOUD_API_KEY_ENV names the variable; or set "
            "FUSION_CLOUD_API_KEY in the environment or .env)",
        )
    if not found.exported:
        return Check(
            "cloud key",
            "ok",
            f"{found.variable} is set in ./.env (`fusion-graph run` and `langgraph dev` read it there; "
            "build_graph() in your own process reads the environment or FUSION_CLOUD_API_KEY)",
        )
    return Check("cloud key", "ok", f"{found.variable} is set (in the {found.where})")


# -- 2. cloud endpoint -----------------------------------------------------------------


def _error_text(response: httpx.Response) -> str:
    """The error message of an OpenAI-style error body, else the start of the body; scrubbed."""
    try:
        body = response.json()
    except ValueError:
        body = None
    message = body.get("error") if isinstance(body, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    text = message if isinstance(message, str) and message else response.text
    return scrub(" ".join(text.split())[:200])


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _transport(error: httpx.HTTPError) -> str:
    return scrub(f"{type(error).__name__}: {error}".splitlines()[0])


def cloud_models_check(
    settings: FusionSettings, key: FoundKey | None, client: httpx.Client, base: str
) -> Check:
    """``GET {base}/models`` with the key: 2xx ok, 401/403 the key is refused."""
    import httpx

    name = "cloud endpoint"
    if key is None:
        return Check(
            name, "warn", f"skipped: no cloud key to call {base} with", "set the key (see cloud key)"
        )
    url = f"{base}/models"
    try:
        response = client.get(url, headers={"Authorization": f"Bearer {key.value}"})
    except httpx.HTTPError as error:
        return Check(
            name,
            "fail",
            f"cannot reach {url} ({_transport(error)})",
            "check FUSION_CLOUD_BASE_URL (empty means OpenAI) and the network",
        )
    code = response.status_code
    if code in (401, 403):
        return Check(
            name,
            "fail",
            f"key refused: GET {url} answered {code} ({_error_text(response)})",
            f"check the key in {key.variable} (and that FUSION_CLOUD_BASE_URL is the key's provider)",
        )
    if code >= 500:
        return Check(name, "fail", f"GET {url} answered {code} ({_error_text(response)})", "retry later")
    if code >= 400:
        return Check(
            name,
            "warn",
            f"GET {url} answered {code} ({_error_text(response)}); not every gateway lists models",
            "run doctor --live to send a one-token completion instead",
        )
    return _listed_models(settings, url, code, response)


def _listed_models(settings: FusionSettings, url: str, code: int, response: httpx.Response) -> Check:
    """OK, or a warning naming the allowed cloud models the list does not hold."""
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        data = None
    ids = {m.get("id") for m in data if isinstance(m, dict)} if isinstance(data, list) else set()
    missing = [m for m in settings.allowed_cloud_models if ids and m not in ids]
    if missing:
        return Check(
            "cloud endpoint",
            "warn",
            f"GET {url} answered {code}, but its {_count(len(ids), 'model')} do not include "
            f"{', '.join(missing)}",
            "check FUSION_CLOUD_MODEL / FUSION_CLOUD_MODELS against the provider's model names",
        )
    listed = f" ({_count(len(ids), 'model')}, {settings.cloud_model} among them)" if ids else ""
    return Check("cloud endpoint", "ok", f"GET {url} answered {code}{listed}")


def cloud_completion_check(settings: FusionSettings, key: FoundKey, client: httpx.Client, base: str) -> Check:
    """``--live``: a one-token chat completion (``max_completion_tokens=1``, as the graph sends it)."""
    import httpx

    name = "cloud completion"
    url = f"{base}/chat/completions"
    body = {
        "model": settings.cloud_model,
        "messages": [{"role": "user", "content": "Say ok."}],
        "max_completion_tokens": 1,
    }
    try:
        response = client.post(url, json=body, headers={"Authorization": f"Bearer {key.value}"})
    except httpx.HTTPError as error:
        return Check(name, "fail", f"cannot reach {url} ({_transport(error)})", "check FUSION_CLOUD_BASE_URL")
    code, text = response.status_code, _error_text(response)
    model = settings.cloud_model
    if code < 300:
        return Check(name, "ok", f"{model} answered a one-token completion (HTTP {code})")
    if code in (401, 403):
        return Check(name, "fail", f"key refused for {model}: HTTP {code} ({text})", f"check {key.variable}")
    if code == 404:
        return Check(name, "fail", f"{model} not found: HTTP 404 ({text})", "check FUSION_CLOUD_MODEL")
    if code == 429 and "quota" not in text.lower():
        return Check(name, "warn", f"rate limited: HTTP 429 ({text})", "retry later")
    if code == 429 or code >= 500:
        return Check(name, "fail", f"HTTP {code} ({text})", "check the account's quota, or retry later")
    return Check(
        name,
        "warn",
        f"HTTP {code} ({text}): the key was accepted, the one-token request was refused",
        "read the message: some models refuse a 1-token limit",
    )


def cloud_checks(
    settings: FusionSettings, key: FoundKey | None, *, live: bool, timeout: float
) -> list[Check]:
    """The cloud endpoint's rows: its model list, and with ``live`` a one-token completion."""
    import httpx

    base = (settings.cloud_base_url or OPENAI_BASE_URL).rstrip("/")
    with httpx.Client(timeout=timeout) as client:
        checks = [cloud_models_check(settings, key, client, base)]
        if live and key is not None and checks[0].status != "fail":
            checks.append(cloud_completion_check(settings, key, client, base))
    return checks


# -- 3. llama-server -------------------------------------------------------------------


def start_line(slots: int = 4, slot_window: int = 8192) -> str:
    """The llama-server command line fusion-graph expects, with ``-c`` for ``slots`` x ``slot_window``."""
    return LLAMA_START.replace("-np 4", f"-np {slots}").format(ctx=slots * slot_window)


def slots_check(props: ServerProps, settings: FusionSettings) -> Check:
    """``total_slots`` against ``FUSION_LOCAL_SLOTS`` and the reflection slot memory jobs use."""
    total, configured = props.total_slots, settings.local_slots
    if configured > total:
        return Check(
            "slots",
            "fail",
            f"FUSION_LOCAL_SLOTS={configured} but the server runs {total} (total_slots): requests pinned "
            f"to slots {total}..{configured - 1} are refused",
            f"start llama-server with -np {configured}, or set FUSION_LOCAL_SLOTS=0 (ask the server)",
        )
    if configured and configured < total:
        return Check(
            "slots",
            "warn",
            f"FUSION_LOCAL_SLOTS={configured} but the server runs {total}: "
            f"{total - configured} slot(s) unused",
            "set FUSION_LOCAL_SLOTS=0 to use what the server reports",
        )
    if total == 1:
        return Check(
            "slots",
            "warn",
            "1 slot (total_slots): memory jobs have no reflection slot of their own and evict the "
            "conversation's cached prefix",
            "start llama-server with an explicit -np of 2 or more (e.g. -np 4)",
        )
    if settings.reserve_reflection_slot:
        detail = f"{total} slots: {total - 1} for conversations, slot {total - 1} kept for memory jobs"
    else:
        detail = (
            f"{total} slots, shared by conversations and memory jobs (FUSION_RESERVE_REFLECTION_SLOT off)"
        )
    return Check("slots", "ok", detail)


def window_check(props: ServerProps, settings: FusionSettings, budget: int) -> Check:
    """The per-slot window (``default_generation_settings.n_ctx``) holds 2 x the completion budget or more."""
    name, window, configured = "slot window", props.slot_window, settings.local_window_tokens
    lower = "or lower max_completion_tokens (FUSION_MAX_COMPLETION_TOKENS, or the run's context)"
    if window is None and not configured:
        return Check(
            name,
            "warn",
            "/props does not say how many tokens a slot holds: every step is assumed to fit",
            "set FUSION_LOCAL_WINDOW_TOKENS to the per-slot context (-c / -np)",
        )
    if window is not None and configured > window:
        return Check(
            name,
            "fail",
            f"FUSION_LOCAL_WINDOW_TOKENS={configured} but a slot holds {window} tokens (n_ctx per slot): "
            "prompts sized for the setting overflow the slot",
            "set FUSION_LOCAL_WINDOW_TOKENS=0 (ask the server) or start it with "
            f"-c {configured * props.total_slots}",
        )
    effective = configured or window
    assert effective is not None
    source = "FUSION_LOCAL_WINDOW_TOKENS" if configured else "n_ctx per slot"
    if effective < 2 * budget:
        return Check(
            name,
            "fail",
            f"{effective} tokens per slot ({source}) < 2 x max_completion_tokens ({budget}): the answer "
            f"budget is cut to half the window",
            f"give each slot at least {2 * budget} tokens: "
            f"{start_line(props.total_slots, 2 * budget)} (per slot = -c / -np), {lower}",
        )
    return Check(
        name, "ok", f"{effective} tokens per slot ({source}) >= 2 x max_completion_tokens ({budget})"
    )


def jinja_check(code: int | None, message: str) -> Check:
    """Whether llama-server accepts ``tools`` (its Jinja engine is on): ``POST /apply-template`` with one.

    ``/props`` does not say whether ``--jinja`` is on; a server without it answers
    a request with tools "tools param requires --jinja flag".

    Args:
        code: The HTTP status of the probe, ``None`` when it could not be sent.
        message: Its error message, or the transport error.
    """
    name = "tool calling"
    if code is not None and code < 300:
        return Check(name, "ok", "--jinja is on: a request with tools is accepted (POST /apply-template)")
    if "jinja" in message.lower():
        return Check(
            name,
            "fail",
            f"llama-server refuses tools: {message!r} (POST /apply-template answered {code}); the agent's "
            "local steps would all fail",
            "restart llama-server with --jinja (and without --no-jinja / LLAMA_ARG_JINJA=false)",
        )
    if code == 404:
        return Check(
            name,
            "info",
            "this llama-server has no POST /apply-template: whether --jinja is on was not checked",
            "make sure llama-server runs with --jinja (tool calling needs it)",
        )
    what = f"answered {code}" if code is not None else "failed"
    return Check(
        name,
        "warn",
        f"POST /apply-template with a tool {what} ({message}): tool calling not confirmed",
        "make sure llama-server runs with --jinja (tool calling needs it)",
    )


def template_check(raw: Mapping[str, Any]) -> Check:
    """Whether the chat template renders tools: ``/props`` -> ``chat_template_caps.supports_tools``."""
    name = "chat template"
    caps = raw.get("chat_template_caps")
    if not isinstance(caps, dict) or not isinstance(caps.get("supports_tools"), bool):
        return Check(
            name,
            "info",
            "/props has no chat_template_caps.supports_tools: the template's tool support was not checked",
        )
    if caps["supports_tools"]:
        parallel = "with" if caps.get("supports_parallel_tool_calls") else "without"
        return Check(
            name,
            "ok",
            f"the chat template renders tools (chat_template_caps.supports_tools), {parallel} parallel calls",
        )
    return Check(
        name,
        "warn",
        "the chat template does not render tools (chat_template_caps.supports_tools=false): llama.cpp "
        "falls back to its generic JSON tool-call prompt",
        "serve a model whose template supports tools, or pass --chat-template-file TOOLS.jinja",
    )


def cache_checks(raw: Mapping[str, Any]) -> list[Check]:
    """KV-cache settings: checked when ``/props`` says them, else one ``info`` row naming what it does not."""
    checks: list[Check] = []
    unsaid = list(NOT_IN_PROPS)
    unified = raw.get("kv_unified")
    if isinstance(unified, bool):
        unsaid.remove("--kv-unified")
        checks.append(
            Check(
                "kv cache",
                "warn",
                "--kv-unified is on: slots share one KV buffer, so one conversation's prefix can be "
                "evicted by another's and slot affinity saves less",
                "start llama-server with an explicit -np N and --no-kv-unified",
            )
            if unified
            else Check("kv cache", "ok", "one KV cache per slot (kv_unified false)")
        )
    checks.append(
        Check(
            "not in /props",
            "info",
            "/props does not say " + ", ".join(unsaid) + ": not checked",
            "start it with an explicit -np N (one KV cache per slot; auto -np shares one)",
        )
    )
    return checks


def props_checks(
    props: ServerProps,
    raw: Mapping[str, Any],
    probe: tuple[int | None, str],
    settings: FusionSettings,
    budget: int,
) -> list[Check]:
    """The rows for a reachable llama-server, from its ``/props`` and the tools probe (pure)."""
    return [
        slots_check(props, settings),
        window_check(props, settings, budget),
        jinja_check(*probe),
        template_check(raw),
        *cache_checks(raw),
    ]


def _tools_probe(client: httpx.Client, root: str) -> tuple[int | None, str]:
    """``POST /apply-template`` with one tool: ``(status, error message)``; renders, generates nothing."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [PROBE_TOOL]}
    try:
        response = client.post(root + "/apply-template", json=body)
    except httpx.HTTPError as error:
        return None, _transport(error)
    return response.status_code, ("" if response.status_code < 300 else _error_text(response))


def _raw_props(client: httpx.Client, root: str) -> dict[str, Any]:
    """``GET /props`` as JSON (``fetch_props`` keeps only slots and window)."""
    import httpx

    try:
        data = client.get(root + "/props").json()
    except (httpx.HTTPError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _not_llama(settings: FusionSettings, error: Exception, client: httpx.Client) -> Check:
    """The local endpoint answers without ``/props``: an OpenAI-compatible server, or the wrong URL."""
    import httpx

    url = settings.local_base_url.rstrip("/") + "/models"
    try:
        models = client.get(url).status_code
    except httpx.HTTPError:
        models = None
    if models is not None and models < 300:
        return Check(
            "llama-server",
            "warn",
            f"{settings.local_base_url} is an OpenAI-compatible server but not llama-server ({error}): "
            "no slot affinity, no per-slot window, tool calling not checked",
            "use llama-server for slot affinity and prompt-cache reuse, or set FUSION_LOCAL_WINDOW_TOKENS",
        )
    return Check(
        "llama-server",
        "fail",
        f"{settings.local_base_url} answers, but neither as llama-server ({error}) nor with GET {url} "
        f"(HTTP {models})",
        "point FUSION_LOCAL_BASE_URL at llama-server's /v1 URL, e.g. http://127.0.0.1:8080/v1",
    )


def llama_checks(settings: FusionSettings, budget: int, *, timeout: float) -> list[Check]:
    """llama-server at ``local_base_url``: reachable, llama-server at all, then ``props_checks``."""
    import httpx

    from fusion_graph.errors import LlamaServerUnavailable, NotLlamaServer
    from fusion_graph.providers.llama_server import START_HINT, fetch_props, server_root

    root = server_root(settings.local_base_url)
    try:
        props = asyncio.run(fetch_props(settings.local_base_url, timeout=timeout))
    except LlamaServerUnavailable as error:
        reason = scrub(str(error).replace("; " + START_HINT, ""))
        return [
            Check(
                "llama-server",
                "fail",
                f"not reachable at {settings.local_base_url} ({reason})",
                f"start it: {start_line(4, 2 * budget)} (explicit -np: one KV cache per slot; "
                "per slot = -c / -np), "
                "or point FUSION_LOCAL_BASE_URL at its /v1 URL",
            )
        ]
    except NotLlamaServer as error:
        with httpx.Client(timeout=timeout) as client:
            return [_not_llama(settings, error, client)]
    with httpx.Client(timeout=timeout) as client:
        raw = _raw_props(client, root)
        probe = _tools_probe(client, root)
    build = raw.get("build_info")
    model = raw.get("model_alias") or raw.get("model_path")
    found = ", ".join(
        part for part in (f"build {build}" if build else "", f"model {model}" if model else "") if part
    )
    head = Check(
        "llama-server", "ok", f"{root}/props answers as llama-server" + (f" ({found})" if found else "")
    )
    return [head, *props_checks(props, raw, probe, settings, budget)]


def _v1(url: str) -> str:
    """A box's URL as an OpenAI-style base URL (ends in ``/v1``)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def pool_checks(settings: FusionSettings, budget: int, *, timeout: float) -> list[Check]:
    """A gateway over ``local_workers``: each box as llama-server, their agreement, the gateway itself."""
    import dataclasses

    import httpx

    from fusion_graph.errors import LlamaServerUnavailable, NotLlamaServer
    from fusion_graph.providers.llama_server import fetch_props

    rows: list[Check] = []
    seen: list[tuple[str, tuple[Any, ...]]] = []
    for index, url in enumerate(settings.local_workers, start=1):
        box = settings.model_copy(update={"local_base_url": _v1(url), "local_workers": ()})
        rows += [
            dataclasses.replace(check, name=f"box {index}: {check.name}")
            for check in llama_checks(box, budget, timeout=timeout)
        ]
        try:
            props = asyncio.run(fetch_props(url, timeout=timeout))
        except (LlamaServerUnavailable, NotLlamaServer):
            continue
        seen.append((url, (props.model, props.total_slots, props.slot_window)))
    if len({shape for _, shape in seen}) > 1:
        shapes = "; ".join(f"{url}: model {m!r}, {n} slots of {w} tokens" for url, (m, n, w) in seen)
        rows.append(
            Check(
                "boxes agree",
                "fail",
                f"the boxes differ ({shapes}): the first step would stop with LocalPoolMismatch",
                "start every box with the same model, --alias, -np and -c",
            )
        )
    elif len(seen) > 1:
        rows.append(Check("boxes agree", "ok", f"{len(seen)} boxes serve the same model, slots and window"))
    models = settings.local_base_url.rstrip("/") + "/models"
    try:
        with httpx.Client(timeout=timeout) as client:
            answer = client.get(models)
        served = [m.get("id") for m in answer.json().get("data", [])] if answer.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError) as error:
        return [
            *rows,
            Check(
                "gateway",
                "fail",
                f"not reachable at {settings.local_base_url} ({scrub(repr(error))})",
                "start it: smg launch --worker-urls BOX... --policy manual --routing-key-headers "
                f"{settings.local_routing_header or 'x-fusion-thread'} --assignment-mode min_group",
            ),
        ]
    if settings.local_model not in served:
        return [
            *rows,
            Check(
                "gateway",
                "fail",
                f"GET {models} lists {served}, not local_model {settings.local_model!r}: every local "
                "request would be refused",
                f"start each box with --alias {settings.local_model} (or set FUSION_LOCAL_MODEL)",
            ),
        ]
    header = settings.local_routing_header
    detail = f"{settings.local_base_url} serves {settings.local_model!r}" + (
        f"; local requests carry {header}" if header else "; no routing header: threads may change boxes"
    )
    return [*rows, Check("gateway", "ok" if header else "warn", detail)]


# -- 4. workspace ----------------------------------------------------------------------


def workspace_checks(settings: FusionSettings, source: str) -> list[Check]:
    """``workspace_root`` is a readable directory; a ``.env`` inside it is a ``secret_files`` match."""
    root = Path(settings.workspace_root)
    shown = (
        f"{root} ({source})" if str(root) == str(root.resolve()) else f"{root} = {root.resolve()} ({source})"
    )
    fix = "set FUSION_WORKSPACE_ROOT (or `fusion-graph run --workspace`) to the project directory"
    if not root.exists():
        return [Check("workspace", "fail", f"{shown} does not exist", fix)]
    if not root.is_dir():
        return [Check("workspace", "fail", f"{shown} is not a directory", fix)]
    if not os.access(root, os.R_OK | os.X_OK):
        return [Check("workspace", "fail", f"{shown} is not readable", f"chmod u+rx {root}, or {fix}")]
    checks = [
        Check("workspace", "ok", f"{shown} is a readable, writable directory")
        if os.access(root, os.W_OK)
        else Check(
            "workspace",
            "warn",
            f"{shown} is readable but not writable: the edit tools will fail",
            f"chmod u+w {root}",
        )
    ]
    return [*checks, _dotenv_secret_check(root, settings.secret_files)]


def _dotenv_secret_check(root: Path, patterns: Sequence[str]) -> Check:
    """``.env`` files at the workspace's top level must match a ``secret_files`` pattern."""
    from fusion_graph.tools.files import WorkspaceRoot
    from fusion_graph.tools.workspace import secret_match

    try:
        names = sorted(p.name for p in root.iterdir() if p.name == ".env" or p.name.startswith(".env."))
    except OSError as error:
        return Check("workspace secrets", "warn", f"cannot list {root}: {error.strerror}")
    exposed = [n for n in names if secret_match(WorkspaceRoot(root), n, patterns) is None]
    if exposed:
        return Check(
            "workspace secrets",
            "warn",
            f"{', '.join(exposed)} in the workspace and not covered by secret_files: the file tools "
            "can read it (and send it to the model)",
            'add ".env" and ".env.*" to FUSION_SECRET_FILES (unset it for the defaults)',
        )
    if names:
        return Check("workspace secrets", "ok", f"{', '.join(names)} covered by secret_files (top level)")
    return Check("workspace secrets", "ok", "no .env at the workspace's top level")


# -- 5. checkpoint database ------------------------------------------------------------


def _writable_dir(directory: Path) -> tuple[Path, bool]:
    """The nearest existing directory at or above ``directory``, and whether files can be made in it."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return candidate, candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return directory, False


def sqlite_check(db: Path) -> Check:
    """The SQLite file opens (``PRAGMA schema_version``), or its directory can be made and written."""
    name = "checkpoint db"
    if db.exists():
        if not db.is_file():
            return Check(name, "fail", f"--db {db} is not a file", "pass --db a file path")
        if not os.access(db, os.R_OK | os.W_OK):
            return Check(name, "fail", f"--db {db} is not readable and writable", f"chmod u+rw {db}")
        try:
            with closing(sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True)) as connection:
                version = connection.execute("PRAGMA schema_version").fetchone()[0]
        except sqlite3.Error as error:
            return Check(
                name,
                "fail",
                f"--db {db} does not open as SQLite ({error})",
                "pass --db a SQLite file (or a new path: `fusion-graph run` creates it)",
            )
        directory, writable = _writable_dir(db.parent)
        if not writable:
            return Check(
                name, "fail", f"{directory.resolve()} is not writable (SQLite writes its journal there)", ""
            )
        return Check(name, "ok", f"{db} opens as SQLite (schema_version {version})")
    directory, writable = _writable_dir(db.parent)
    if not writable:
        return Check(
            name,
            "fail",
            f"{db} does not exist and {directory.resolve()} is not a writable directory",
            f"pass --db a path in a writable directory (default {DEFAULT_DB})",
        )
    return Check(
        name,
        "ok",
        f"{db} does not exist yet; `fusion-graph run` creates it ({directory.resolve()} is writable)",
    )


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``[REDACTED]``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{netloc}"))


def postgres_check(url: str, *, timeout: float) -> Check:
    """A connection opens (``psycopg``, an optional dependency) and answers ``SELECT 1``."""
    name, shown = "checkpoint db", redact_url(url)
    if not url.startswith(("postgres://", "postgresql://")):
        return Check(
            name,
            "fail",
            f"--postgres {scrub(shown)!r} is not a URL",
            "use postgresql://user:password@host:port/db",
        )
    try:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver  # noqa: F401  (what `run --postgres` needs)
    except ImportError as error:
        return Check(
            name,
            "fail",
            f"--postgres needs {error.name or 'psycopg'}, which is not installed",
            "pip install 'langgraph-checkpoint-postgres' 'psycopg[binary]'",
        )
    try:
        with psycopg.connect(url, connect_timeout=max(1, round(timeout))) as connection:
            version = connection.info.server_version
            connection.execute("SELECT 1")
    except psycopg.Error as error:
        detail = scrub(f"{type(error).__name__}: {error}".splitlines()[0], [url])
        return Check(
            name, "fail", f"cannot connect to {shown} ({detail})", "check the URL and that the server runs"
        )
    return Check(name, "ok", f"{shown} connects (server version {version})")


# -- the command -----------------------------------------------------------------------


def _hide(checks: Sequence[Check], key: FoundKey | None) -> list[Check]:
    """Every row with the key's value replaced, wherever an error message may have echoed it."""
    if key is None or not key.value:
        return list(checks)
    return [
        Check(c.name, c.status, c.detail.replace(key.value, REDACTED), c.fix.replace(key.value, REDACTED))
        for c in checks
    ]


def render(checks: Sequence[Check]) -> Table:
    """The report as a table: check, status, what was found, how to fix it."""
    table = Table(title="fusion-graph doctor", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("found", ratio=3, overflow="fold")
    table.add_column("fix", ratio=2, overflow="fold")
    for check in checks:
        table.add_row(
            check.name, Text(check.status, style=_STYLES[check.status]), Text(check.detail), Text(check.fix)
        )
    return table


def summary(checks: Sequence[Check]) -> str:
    """One line: how many rows failed and warned."""
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    verdict = "not ready" if fails else "ready"
    return f"{verdict}: {fails} failed, {_count(warns, 'warning')}, {_count(len(checks), 'check')}"


def doctor(
    db: Annotated[Path, typer.Option(help="SQLite checkpoint file `fusion-graph run` uses.")] = DEFAULT_DB,
    postgres: Annotated[
        str | None, typer.Option(help="Postgres URL to check instead of the SQLite file.")
    ] = None,
    workspace: Annotated[
        Path | None,
        typer.Option(help="Workspace to check; default FUSION_WORKSPACE_ROOT (or '.')."),
    ] = None,
    context: Annotated[
        str | None,
        typer.Option(
            help="Run context JSON (or file); its max_completion_tokens and cloud_model are checked."
        ),
    ] = None,
    live: Annotated[
        bool, typer.Option("--live", help="Also send the cloud model a one-token chat completion.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds each network check may take.", min=0.1)] = 5.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of the table.")
    ] = False,
) -> None:
    """Check the set-up: cloud key and endpoint, llama-server, workspace, checkpoint database.

    One row per check with what was found and the line that fixes it. The key
    is only ever named by its variable. llama-server's GET /props gives slots,
    the per-slot window (checked against 2 x max_completion_tokens) and the chat
    template's tool support; a POST /apply-template with one tool shows whether
    --jinja is on. Exit code 0 when no check fails (warnings allowed), else 1.
    """
    from fusion_graph.errors import ContextError

    run_context = build_context(context)
    settings = build_settings(workspace_root=str(workspace) if workspace is not None else None)
    try:
        settings = settings.narrow(cloud_model=run_context.cloud_model)
    except ContextError as error:
        raise fail(str(error)) from error
    if workspace is not None:
        source = "--workspace"
    elif os.environ.get("FUSION_WORKSPACE_ROOT"):
        source = "FUSION_WORKSPACE_ROOT"
    else:
        source = "default" if settings.workspace_root == "." else "FUSION_WORKSPACE_ROOT in .env"
    key = find_cloud_key(settings, os.environ, read_dotenv())
    checks = [
        cloud_key_check(settings, key),
        *cloud_checks(settings, key, live=live, timeout=timeout),
        *(
            pool_checks(settings, run_context.max_completion_tokens, timeout=timeout)
            if settings.local_workers
            else llama_checks(settings, run_context.max_completion_tokens, timeout=timeout)
        ),
        *workspace_checks(settings, source),
        postgres_check(postgres, timeout=timeout) if postgres else sqlite_check(db),
    ]
    checks = _hide(checks, key)
    ok = not any(c.status == "fail" for c in checks)
    if as_json:
        typer.echo(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        console = stdout_console()
        console.print(render(checks))
        console.print(summary(checks), highlight=False)
    if not ok:
        raise typer.Exit(1)
