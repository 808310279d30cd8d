"""Doctor's llama-server rows: is it reachable, is it llama-server at all, then what ``props`` says.

An unreachable server gets the start line ``run`` gives too
(``providers.llama_server.start_command``, sized to the run's budget and first prompt).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fusion_graph.cli.doctor.props import PROBE_TOOL, props_checks
from fusion_graph.cli.doctor.rows import Check, error_text, transport
from fusion_graph.cli.doctor.speed import speed_check

if TYPE_CHECKING:
    import httpx

    from fusion_graph.providers.llama_server import ServerProps
    from fusion_graph.settings import FusionSettings


def _tools_probe(client: httpx.Client, root: str) -> tuple[int | None, str]:
    """``POST /apply-template`` with one tool: ``(status, error message or rendered prompt)``."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [PROBE_TOOL]}
    try:
        response = client.post(root + "/apply-template", json=body)
    except httpx.HTTPError as error:
        return None, transport(error)
    if response.status_code >= 300:
        return response.status_code, error_text(response)
    try:
        prompt = response.json().get("prompt")
    except (ValueError, AttributeError):
        prompt = None
    return response.status_code, prompt if isinstance(prompt, str) else ""


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


def llama_checks(
    settings: FusionSettings, budget: int, *, timeout: float, prompt_tokens: int = 0, live: bool = False
) -> list[Check]:
    """llama-server at ``local_base_url``: reachable, llama-server at all, then ``props_checks``.

    Args:
        settings: The operator's settings.
        budget: The run's ``max_completion_tokens``.
        timeout: Seconds each request may take.
        prompt_tokens: The graph's first prompt (sizes the start line and the window check).
        live: Also measure the generation speed (``speed.speed_check``: a short completion).
    """
    return server_checks(settings, budget, timeout=timeout, prompt_tokens=prompt_tokens, live=live)[0]


def server_checks(
    settings: FusionSettings, budget: int, *, timeout: float, prompt_tokens: int = 0, live: bool = False
) -> tuple[list[Check], ServerProps | None]:
    """``llama_checks``, and what ``/props`` said (``None``: not llama-server), for a gateway's boxes."""
    import httpx

    from fusion_graph.cli.checks import unreachable_reason
    from fusion_graph.errors import LlamaServerUnavailable, NotLlamaServer
    from fusion_graph.providers.llama_server import fetch_props, server_root, start_command

    root = server_root(settings.local_base_url)
    try:
        props = asyncio.run(fetch_props(settings.local_base_url, timeout=timeout))
    except LlamaServerUnavailable as error:
        start = start_command(budget, prompt_tokens=prompt_tokens, base_url=settings.local_base_url)
        return [
            Check(
                "llama-server",
                "fail",
                f"not reachable at {settings.local_base_url} ({unreachable_reason(error)})",
                f"start it: {start} (explicit -np keeps one KV cache per slot; context per slot is "
                "-c / -np), or point FUSION_LOCAL_BASE_URL at its /v1 URL",
            )
        ], None
    except NotLlamaServer as error:
        with httpx.Client(timeout=timeout) as client:
            return [_not_llama(settings, error, client)], None
    with httpx.Client(timeout=timeout) as client:
        raw = _raw_props(client, root)
        probe = _tools_probe(client, root)
        speed = [speed_check(settings, props, budget, client, timeout=timeout)] if live else []
    build = raw.get("build_info")
    model = raw.get("model_alias") or raw.get("model_path")
    found = ", ".join(
        part for part in (f"build {build}" if build else "", f"model {model}" if model else "") if part
    )
    head = Check(
        "llama-server", "ok", f"{root}/props answers as llama-server" + (f" ({found})" if found else "")
    )
    rows = props_checks(props, raw, probe, settings, budget, prompt_tokens=prompt_tokens)
    return [head, *rows, *speed], props
