"""Doctor's cloud rows: the key (named by its variable, never shown), the endpoint, the model's price.

The endpoint is asked ``GET /models`` with the key; ``--live`` adds a one-token
completion, made as the graph makes every inference (``providers.chain``), and reads
the failed attempt's class and text for the cause. A URL that answers with
something other than JSON (an HTML page) is not an OpenAI-compatible API, and says so.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from fusion_graph.cli.checks import KEY_IN_NAME, KEY_IN_NAME_FIX, key_variable
from fusion_graph.cli.doctor.rows import Check, count, error_text, json_body, transport
from fusion_graph.routing.records import Attempt
from fusion_graph.routing.score import Leg

if TYPE_CHECKING:
    import httpx

    from fusion_graph.context import FusionContext
    from fusion_graph.providers.chain import Asked
    from fusion_graph.settings import FusionSettings

#: The fix of a row whose endpoint is not an OpenAI-compatible API (it answered HTML, or no completion).
NOT_AN_API_FIX = (
    "set FUSION_CLOUD_BASE_URL to the provider's API base URL (it ends in /v1; empty means OpenAI)"
)
#: The cloud base URL when ``cloud_base_url`` is empty (what the OpenAI SDK uses).
OPENAI_BASE_URL = "https://api.openai.com/v1"


@dataclass(frozen=True)
class FoundKey:
    """Where the cloud key was found: a variable's name, and whether the runtime sees it.

    Attributes:
        variable: The variable's name (``OPENAI_API_KEY``, ``FUSION_CLOUD_API_KEY``...).
        where: ``environment`` or ``.env``.
        exported: Whether it is in the process environment (``FUSION_CLOUD_API_KEY`` counts
            wherever it is set); ``False``: only ``./.env`` holds it, which ``api_key()``
            reads from the working directory.
        value: The key; never printed.
    """

    variable: str
    where: Literal["environment", ".env"]
    exported: bool
    value: str = field(repr=False)


# -- the key -----------------------------------------------------------------------------


def read_dotenv(path: Path = Path(".env")) -> dict[str, str | None]:
    """The variables a ``.env`` file names, empty ones too (``blank_key_check`` looks for those).

    ``{}`` without one; read once for every check.
    """
    from dotenv import dotenv_values

    if not path.is_file():
        return {}
    return dict(dotenv_values(path))


def blank_key_check(settings: FusionSettings, dotenv: Mapping[str, str | None]) -> Check | None:
    """A warning when ``.env`` (``read_dotenv``) sets the key's variable to nothing.

    ``langgraph dev`` loads ``.env`` over the environment, so it would blank an exported key.
    """
    variable = key_variable(settings)
    if variable is None:
        return None
    if variable not in dotenv or dotenv[variable]:
        return None
    return Check(
        "cloud key in .env",
        "warn",
        f"./.env sets {variable} to nothing: `langgraph dev` loads .env over the environment, so the "
        "key you exported would be blank there",
        f"delete that line from .env, or comment it out (# {variable}=)",
    )


def find_cloud_key(
    settings: FusionSettings, environ: Mapping[str, str], dotenv: Mapping[str, str | None]
) -> FoundKey | None:
    """The cloud key in the order ``FusionSettings.api_key()`` looks: setting, environment, ``.env``.

    ``api_key()`` reads the key's variable from ``./.env`` in the working directory, so
    a key only there works for ``fusion-graph run`` and ``build_graph`` run from it;
    ``langgraph dev`` loads ``.env`` into the environment.
    """
    secret = settings.cloud_api_key
    if secret is not None and secret.get_secret_value():
        name = "FUSION_CLOUD_API_KEY"
        in_env = any(key.upper() == name for key in environ)
        return FoundKey(name, "environment" if in_env else ".env", True, secret.get_secret_value())
    variable = key_variable(settings)
    if variable is None:
        return None
    if environ.get(variable):
        return FoundKey(variable, "environment", True, environ[variable])
    value = dotenv.get(variable)
    return FoundKey(variable, ".env", False, value) if value else None


def cloud_key_check(settings: FusionSettings, found: FoundKey | None, *, local_only: bool = False) -> Check:
    """The key is named by its variable; its value, length or any part of it is never shown.

    ``local_only`` (the checked context's ``mode`` is ``local``): no cloud leg is
    built, so a missing key is said, not failed (``run`` needs none either).
    """
    variable = key_variable(settings)
    if found is None and local_only:
        return Check(
            "cloud key",
            "info",
            f"no cloud API key ({variable or 'FUSION_CLOUD_API_KEY_ENV'} unset): not needed, "
            "the checked context runs local only (mode local)",
            f"export {variable or 'OPENAI_API_KEY'}=... before a run in fusion or cloud mode",
        )
    if variable is None:
        if found is None:
            return Check("cloud key", "fail", f"no cloud API key: {KEY_IN_NAME}", KEY_IN_NAME_FIX)
        return Check(
            "cloud key",
            "warn",
            f"{found.variable} is set, but {KEY_IN_NAME}: a key kept in a setting's name ends up where "
            "names are shown",
            KEY_IN_NAME_FIX,
        )
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
            f"{found.variable} is set in ./.env (`fusion-graph run`, `langgraph dev` and build_graph() "
            "run from this directory read it there)",
        )
    return Check("cloud key", "ok", f"{found.variable} is set (in the {found.where})")


# -- the endpoint ------------------------------------------------------------------------


def not_an_api(name: str, method: str, url: str, base: str, response: httpx.Response) -> Check:
    """The row for a URL that answered with something other than JSON: not an OpenAI-compatible API."""
    from fusion_graph.providers.chain import what_answered

    return Check(
        name,
        "fail",
        f"{method} {url} answered {response.status_code} with {what_answered(response)}: {base} is not "
        "an OpenAI-compatible API",
        NOT_AN_API_FIX,
    )


def cloud_models_check(
    settings: FusionSettings, key: FoundKey | None, client: httpx.Client, base: str
) -> Check:
    """``GET {base}/models`` with the key: 2xx ok, 401/403 the key is refused, not JSON: not an API."""
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
            f"cannot reach {url} ({transport(error)})",
            "check FUSION_CLOUD_BASE_URL (empty means OpenAI) and the network",
        )
    code = response.status_code
    if code < 500 and json_body(response) is None:
        return not_an_api(name, "GET", url, base, response)
    if code in (401, 403):
        return Check(
            name,
            "fail",
            f"key refused: GET {url} answered {code} ({error_text(response)})",
            f"check the key in {key.variable} (and that FUSION_CLOUD_BASE_URL is the key's provider)",
        )
    if code >= 500:
        return Check(name, "fail", f"GET {url} answered {code} ({error_text(response)})", "retry later")
    if code >= 400:
        return Check(
            name,
            "warn",
            f"GET {url} answered {code} ({error_text(response)}); not every gateway lists models",
            "run doctor --live to send a one-token completion instead",
        )
    return _listed_models(settings, url, code, response)


def _listed_models(settings: FusionSettings, url: str, code: int, response: httpx.Response) -> Check:
    """OK, or a warning naming the allowed cloud models the list does not hold."""
    body = json_body(response)
    data = body.get("data") if isinstance(body, dict) else None
    ids = {m.get("id") for m in data if isinstance(m, dict)} if isinstance(data, list) else set()
    missing = [m for m in settings.allowed_cloud_models if ids and m not in ids]
    if missing:
        return Check(
            "cloud endpoint",
            "warn",
            f"GET {url} answered {code}, but its {count(len(ids), 'model')} "
            f"{'does' if len(ids) == 1 else 'do'} not include {', '.join(missing)}",
            "check FUSION_CLOUD_MODEL / FUSION_CLOUD_MODELS against the provider's model names",
        )
    listed = f" ({count(len(ids), 'model')}, {settings.cloud_model} among them)" if ids else ""
    return Check("cloud endpoint", "ok", f"GET {url} answered {code}{listed}")


#: ``openai``'s status errors say ``Error code: 401 - ...``; the attempt keeps that text (scrubbed).
_STATUS = re.compile(r"Error code: (\d{3})")
#: The one leg ``--live`` asks (a ``cross_leg_fallover`` chain would go on to the local one).
CLOUD_ONLY: tuple[Leg, ...] = ("cloud",)
#: What ``providers.chain.error_text`` adds to a status error whose body was an HTML page: a site.
_HTML_PAGE = "answered an HTML page"


def live_completion(settings: FusionSettings, timeout: float) -> Asked | Attempt:
    """``--live``'s one-token completion: what came back, or the attempt that failed last.

    Made as the graph makes every call: the link built by the resolver, the request
    sent through ``ask`` (``max_tokens=1``, which the OpenAI client sends as
    ``max_completion_tokens``).
    """
    from langchain_core.messages import HumanMessage

    from fusion_graph.context import FusionContext
    from fusion_graph.errors import ProviderRequestError
    from fusion_graph.providers.chain import Ask, Bounds, ask
    from fusion_graph.providers.resolver import ProviderResolver
    from fusion_graph.routing.score import RouteDecision

    async def once() -> Asked | Attempt:
        # A check, not a run: nothing shared, no metrics port opened, no span exported.
        quick = settings.model_copy(
            update={"request_timeout": timeout, "shared_state": "off", "metrics": False, "traces": False}
        )
        resolver = ProviderResolver(settings=quick)
        try:
            chain = (await resolver.chain(FusionContext(mode="cloud"))).only(CLOUD_ONLY)
            call = Ask(
                kind="plan",
                turn=0,
                step=0,
                decision=RouteDecision("cloud", None, None, "doctor --live: a one-token completion"),
                prompt=(HumanMessage("Say ok."),),
                thread_id="",
                max_tokens=1,
                config={"callbacks": [], "run_name": "doctor:cloud"},
            )
            try:
                asked = await ask(
                    call, chain=chain, placer=resolver.placement, bounds=Bounds(timeout_s=timeout)
                )
            except ProviderRequestError as refused:  # a 4xx no provider would take: its attempt says why
                return cast(Attempt, refused.attempts[-1])
            if asked.answer is None and asked.exhausted is not None and asked.exhausted.attempts:
                return cast(Attempt, asked.exhausted.attempts[-1])
            return asked
        finally:
            await resolver.aclose()

    return asyncio.run(once())


def cloud_completion_check(settings: FusionSettings, key: FoundKey, *, timeout: float) -> Check:
    """``--live``: a one-token chat completion through ``ask``; a failed attempt is read for its cause."""
    name, model = "cloud completion", settings.cloud_model
    result = live_completion(settings, timeout)
    if not isinstance(result, Attempt):
        if result.answer is None:  # nothing tried (the only link cooling down)
            return Check(name, "fail", f"no provider answered: {result.record['reason']}", "retry later")
        return Check(name, "ok", f"{model} answered a one-token completion")
    text = result.message
    found = _STATUS.search(text)
    code = int(found.group(1)) if found else None
    where = f"HTTP {code}" if code is not None else result.error
    if _HTML_PAGE in text or result.kind == "malformed_response":
        said = (
            f"the chat completion answered {where} with an HTML page"
            if _HTML_PAGE in text
            else f"the answer is not a chat completion ({text})"
        )
        return Check(name, "fail", f"{said}: the endpoint is not an OpenAI-compatible API", NOT_AN_API_FIX)
    if code in (401, 403):
        return Check(name, "fail", f"key refused for {model}: {where} ({text})", f"check {key.variable}")
    if code == 404:
        return Check(name, "fail", f"{model} not found: {where} ({text})", "check FUSION_CLOUD_MODEL")
    if result.kind == "rate_limited" and "quota" not in text.lower():
        return Check(name, "warn", f"rate limited: {where} ({text})", "retry later")
    if result.kind == "rate_limited":
        return Check(name, "fail", f"out of quota: {where} ({text})", "check the account's quota and billing")
    if result.kind in ("timeout", "connection"):
        return Check(
            name,
            "fail",
            f"cannot reach the endpoint ({where}: {text})",
            "check FUSION_CLOUD_BASE_URL and the network",
        )
    if result.kind == "server_error":
        return Check(name, "fail", f"{where} ({text})", "retry later")
    return Check(
        name,
        "warn",
        f"{where} ({text}): the key was accepted, the one-token request was refused",
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
            checks.append(cloud_completion_check(settings, key, timeout=timeout))
    return checks


# -- the price ---------------------------------------------------------------------------


def cloud_price_check(context: FusionContext, settings: FusionSettings) -> Check:
    """The cloud model's price (overrides or the catalogue); without one, costs are unknown: a warning."""
    from fusion_graph.cli.prices import cloud_prices, price_fix, price_source

    model = context.cloud_model or settings.cloud_model
    prices = cloud_prices(context, settings)
    if prices is None:
        return Check(
            "cloud price",
            "warn",
            f"{model!r} has no known price ({price_source(settings, model)}): run costs, savings and "
            "cloud budgets cannot count its steps",
            price_fix(settings, model),
        )
    cached = "" if prices.cached_input is None else f", ${prices.cached_input:g} cached"
    return Check(
        "cloud price",
        "ok",
        f"{model}: ${prices.input:g} in, ${prices.output:g} out{cached} per million tokens "
        f"({price_source(settings, model)})",
    )
