"""The checks ``fusion-graph run`` makes before anything runs.

The cloud key is ``FusionSettings.api_key()``: ``FUSION_CLOUD_API_KEY``, else the
variable named by ``FUSION_CLOUD_API_KEY_ENV`` (``OPENAI_API_KEY``) from the
environment, else that variable from ``./.env``; it is never exported to the
process environment. ``doctor`` names the key and llama-server's start line
through the same functions (``key_variable``, ``local_start_line``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fusion_graph.cli.common import fail
from fusion_graph.redact import register_secret, scrub

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from fusion_graph.context import FusionContext
    from fusion_graph.errors import LlamaServerUnavailable
    from fusion_graph.settings import FusionSettings

#: An environment variable's name (POSIX): what ``FUSION_CLOUD_API_KEY_ENV`` must hold.
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Said instead of ``FUSION_CLOUD_API_KEY_ENV``'s value when that value is not a variable's name.
KEY_IN_NAME = "FUSION_CLOUD_API_KEY_ENV holds what looks like a key, not a variable name"
#: How to fix it (the key goes where a key belongs; the setting names a variable).
KEY_IN_NAME_FIX = (
    "put the key in FUSION_CLOUD_API_KEY (or in OPENAI_API_KEY), and set FUSION_CLOUD_API_KEY_ENV "
    "to the name of the variable that holds it, or unset it"
)


def key_variable(settings: FusionSettings) -> str | None:
    """The variable ``FUSION_CLOUD_API_KEY_ENV`` names; ``None`` when it holds something else.

    A value that is not a variable's name (``sk-proj-...``), or a mixed-case one
    that looks random, is taken for a key put in the wrong setting: it is
    registered as a secret (``scrub`` removes it from any text) and callers say
    ``KEY_IN_NAME`` instead of printing it.
    """
    name = settings.cloud_api_key_env
    if _VARIABLE.fullmatch(name) and (name == name.upper() or scrub(name) == name):
        return name
    register_secret(name)
    return None


def needs_local(context: FusionContext) -> bool:
    """Whether a run can call llama-server."""
    return context.mode == "local" or (context.mode == "fusion" and context.cloud_share < 100)


def check_cloud_key(settings: FusionSettings, context: FusionContext | None = None) -> None:
    """Raise a CLI error naming the variable to set when the cloud key is missing.

    The key is ``settings.api_key()`` (which reads ``./.env`` too). A run in
    ``mode="local"`` builds no cloud leg and needs none; every other mode builds
    both legs (a local step can fall over to the cloud), so it needs the key.
    """
    if settings.api_key() is not None or (context is not None and context.mode == "local"):
        return
    name = key_variable(settings)
    if name is None:
        raise fail(f"the cloud leg needs an API key, and {KEY_IN_NAME}: {KEY_IN_NAME_FIX}")
    raise fail(
        f"the cloud leg needs an API key: export {name}=... or write {name}=... in ./.env "
        "(FUSION_CLOUD_API_KEY_ENV names the variable; FUSION_CLOUD_API_KEY holds the key itself)"
    )


def first_prompt_tokens(context: FusionContext, settings: FusionSettings) -> int:
    """Estimated tokens of the first prompt a turn sends: system prompt, built-in tools, a short task."""
    from langchain_core.messages import HumanMessage

    from fusion_graph.sizing.turn import prompt_estimate
    from fusion_graph.tools import make_workspace_tools

    task = HumanMessage("Rename foo to bar in src/app.py and update its tests.")
    return prompt_estimate(context.system_prompt, [task], make_workspace_tools(settings=settings))


def local_start_line(context: FusionContext, settings: FusionSettings, slots: int = 4) -> str:
    """How to start llama-server for this run: slots that hold its first prompt and answer budget.

    ``run`` and ``doctor`` both say this line (``llama_server.start_command``).
    """
    from fusion_graph.providers.llama_server import start_command

    prompt = first_prompt_tokens(context, settings)
    return start_command(
        context.max_completion_tokens, prompt_tokens=prompt, slots=slots, base_url=settings.local_base_url
    )


def unreachable_reason(error: LlamaServerUnavailable) -> str:
    """Why llama-server could not be read, without the generic start hint (callers give their own)."""
    from fusion_graph.providers.llama_server import START_HINT_PREFIX

    return scrub(str(error).split("; " + START_HINT_PREFIX, 1)[0])


async def check_local_server(
    context: FusionContext, settings: FusionSettings, *, timeout: float = 3.0
) -> None:
    """Raise a CLI error naming the URL, the variable and how to start llama-server when it is down."""
    from fusion_graph.errors import LlamaServerUnavailable, NotLlamaServer
    from fusion_graph.providers.llama_server import fetch_total_slots

    if not needs_local(context):
        return
    try:
        await fetch_total_slots(settings.local_base_url, timeout=timeout)
    except LlamaServerUnavailable as error:
        raise fail(
            f"llama-server is not reachable at {settings.local_base_url} ({unreachable_reason(error)}): "
            f"start it: {local_start_line(context, settings)} (explicit -np keeps one KV cache per slot; "
            "context per slot is -c / -np), or point FUSION_LOCAL_BASE_URL at its /v1 URL"
        ) from error
    except NotLlamaServer:
        pass  # another OpenAI-compatible server: it runs, without slot affinity


async def default_models(
    context: FusionContext, settings: FusionSettings
) -> tuple[BaseChatModel, BaseChatModel] | None:
    """Check the configured endpoints (fail fast); the graph then builds its models from the settings."""
    check_cloud_key(settings, context)
    await check_local_server(context, settings)
    return None


#: ``FUSION_*`` variables read outside the settings and the run context: where the replays find
#: traces, where the llama-server build is cached, and the tokens of the auth example.
OTHER_VARIABLES = ("FUSION_TRACES_DIR", "FUSION_GRAPH_CACHE", "FUSION_EXAMPLE_TOKENS")


def unknown_variables(*sources: Iterable[str]) -> list[tuple[str, str | None]]:
    """Each ``FUSION_*`` name in ``sources`` that no setting reads, with the likeliest one meant.

    A misspelt variable is otherwise ignored without a word (``FUSION_CLOUD_SHAR=50``).
    """
    from fusion_graph.cli.docs import config_rows
    from fusion_graph.settings import closest_name

    known = {row[4] for row in config_rows()} | set(OTHER_VARIABLES)
    names = sorted({name for source in sources for name in source if name.startswith("FUSION_")} - known)
    return [(name, closest_name(name, known)) for name in names]


def dotenv_names(path: str = ".env") -> list[str]:
    """The variables ``./.env`` names (none without one)."""
    import os

    from dotenv import dotenv_values

    return list(dotenv_values(path)) if os.path.isfile(path) else []


def unknown_line(name: str, meant: str | None) -> str:
    """One line about an unknown variable: that it is ignored, and what was likely meant."""
    guess = f" (did you mean {meant}?)" if meant else ""
    return f"{name} is not a fusion-graph setting{guess}: it is ignored"
