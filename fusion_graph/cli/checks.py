"""The checks ``fusion-graph run`` makes before anything runs, and where it reads the cloud key.

The cloud key is read like the graph reads its settings: ``FUSION_CLOUD_API_KEY``,
else the variable named by ``FUSION_CLOUD_API_KEY_ENV`` (``OPENAI_API_KEY``)
from the environment, else that variable from ``./.env`` (``with_dotenv_key``),
handed to the graph as the settings' ``cloud_api_key``: never exported to the
process environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fusion_graph.cli.common import fail

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from fusion_graph.context import FusionContext
    from fusion_graph.settings import FusionSettings

ENV_FILE = Path(".env")


def needs_local(context: FusionContext) -> bool:
    """Whether a run can call llama-server."""
    return context.mode == "local" or (context.mode == "fusion" and context.cloud_share < 100)


def with_dotenv_key(settings: FusionSettings, env_file: Path = ENV_FILE) -> FusionSettings:
    """``settings`` with the cloud key from ``env_file`` when neither settings nor environment hold it.

    ``FusionSettings`` reads ``FUSION_*`` names from ``.env`` but takes the key
    variable (``cloud_api_key_env``, default ``OPENAI_API_KEY``) from the
    environment only; this reads that variable from ``.env`` too and passes it
    as ``cloud_api_key``, so only the graph's cloud model sees it.
    """
    if settings.api_key() is not None or not env_file.is_file():
        return settings
    from dotenv import dotenv_values
    from pydantic import SecretStr

    value = dotenv_values(env_file).get(settings.cloud_api_key_env)
    return settings.model_copy(update={"cloud_api_key": SecretStr(value)}) if value else settings


def check_cloud_key(settings: FusionSettings) -> None:
    """Raise a CLI error naming the variable to set when the cloud key is missing.

    The key is ``settings.api_key()`` (pass settings through ``with_dotenv_key`` to
    honour ``.env``). The graph's default chain builds both legs whatever the mode,
    so the key is needed even for a run that would only use llama-server.
    """
    if settings.api_key() is None:
        name = settings.cloud_api_key_env
        raise fail(
            f"the cloud leg needs an API key: export {name}=... or write {name}=... in ./.env "
            "(FUSION_CLOUD_API_KEY_ENV names the variable; FUSION_CLOUD_API_KEY holds the key itself)"
        )


async def check_local_server(
    context: FusionContext, settings: FusionSettings, *, timeout: float = 3.0
) -> None:
    """Raise a CLI error naming the URL, the variable and how to start llama-server when it is down."""
    from fusion_graph.errors import LlamaServerUnavailable, NotLlamaServer
    from fusion_graph.providers.llama_server import START_HINT, fetch_total_slots

    if not needs_local(context):
        return
    try:
        await fetch_total_slots(settings.local_base_url, timeout=timeout)
    except LlamaServerUnavailable as error:
        raise fail(
            f"llama-server is not reachable at {settings.local_base_url}: point FUSION_LOCAL_BASE_URL "
            f"at its /v1 URL, or {START_HINT}.\n  ({error})"
        ) from error
    except NotLlamaServer:
        pass  # another OpenAI-compatible server: it runs, without slot affinity


async def default_models(
    context: FusionContext, settings: FusionSettings
) -> tuple[BaseChatModel, BaseChatModel] | None:
    """Check the configured endpoints (fail fast); the graph then builds its models from the settings."""
    check_cloud_key(settings)
    await check_local_server(context, settings)
    return None
