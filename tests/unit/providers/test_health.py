"""Provider health: error classification, Retry-After, and one provider's circuit."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import format_datetime

import httpx
import openai
import pytest

from fusion_graph.errors import LlamaServerUnavailable, MalformedAnswer
from fusion_graph.providers.chain import (
    Health,
    HealthPolicy,
    classify,
    context_overflow,
    overflow_numbers,
    retry_after,
)
from fusion_graph.routing.records import ErrorClass
from tests.plugins.errors import (
    EPOCH,
    URL,
    bad_request,
    caused,
    lc_error,
    llama_overflow,
    openai_overflow,
    plain_request,
    plain_response,
    rate_limited,
    refused,
    request,
    response,
    sdk_httpx,
)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(lambda: rate_limited(), "rate_limited", id="openai-429"),
        pytest.param(lambda: openai.APITimeoutError(request=request()), "timeout", id="openai-timeout"),
        pytest.param(lambda: openai.APIConnectionError(request=request()), "connection", id="openai-conn"),
        pytest.param(
            lambda: openai.InternalServerError("boom", response=response(500), body=None),
            "server_error",
            id="openai-500",
        ),
        pytest.param(
            lambda: openai.APIStatusError("unavailable", response=response(503), body=None),
            "server_error",
            id="openai-503",
        ),
        pytest.param(bad_request, "bad_request", id="openai-400"),
        pytest.param(
            lambda: openai.UnprocessableEntityError("bad", response=response(422), body=None),
            "bad_request",
            id="openai-422",
        ),
        pytest.param(
            lambda: openai.AuthenticationError("key", response=response(401), body=None),
            "misconfigured",
            id="openai-401",
        ),
        pytest.param(
            lambda: openai.NotFoundError("no model", response=response(404), body=None),
            "misconfigured",
            id="openai-404",
        ),
        pytest.param(
            lambda: httpx.ReadTimeout("slow", request=plain_request()), "timeout", id="httpx-read-timeout"
        ),
        pytest.param(
            lambda: httpx.ConnectTimeout("slow", request=plain_request()), "timeout", id="httpx-conn-tmo"
        ),
        pytest.param(refused, "connection", id="httpx-connect-error"),
        pytest.param(
            lambda: httpx.RemoteProtocolError("eof", request=plain_request()),
            "connection",
            id="httpx-protocol",
        ),
        pytest.param(
            lambda: httpx.HTTPStatusError(
                "bad gateway", request=plain_request(), response=plain_response(502)
            ),
            "server_error",
            id="httpx-502",
        ),
        pytest.param(
            lambda: httpx.HTTPStatusError("slow", request=plain_request(), response=plain_response(429)),
            "rate_limited",
            id="httpx-429",
        ),
        pytest.param(
            lambda: httpx.HTTPStatusError("bad", request=plain_request(), response=plain_response(422)),
            "bad_request",
            id="httpx-422",
        ),
        pytest.param(
            lambda: httpx.HTTPStatusError("slow", request=plain_request(), response=plain_response(408)),
            "timeout",
            id="httpx-408",
        ),
        pytest.param(lambda: TimeoutError(), "timeout", id="asyncio-timeout"),
        pytest.param(lambda: ConnectionRefusedError(), "connection", id="connection-refused"),
        pytest.param(lambda: LlamaServerUnavailable("down"), "connection", id="llama-unavailable"),
        pytest.param(lambda: lc_error("ModelRateLimitError"), "rate_limited", id="lc-rate-limit"),
        pytest.param(lambda: lc_error("ModelTimeoutError"), "timeout", id="lc-timeout"),
        pytest.param(lambda: lc_error("ModelConnectionError"), "connection", id="lc-connection"),
        pytest.param(lambda: lc_error("ModelAPIError"), "server_error", id="lc-api"),
        pytest.param(lambda: lc_error("ModelAuthenticationError"), "misconfigured", id="lc-auth"),
        pytest.param(lambda: lc_error("ContextOverflowError"), "context_overflow", id="lc-context-overflow"),
        pytest.param(llama_overflow, "context_overflow", id="llama-server-context-size-400"),
        pytest.param(openai_overflow, "context_overflow", id="openai-context-length-exceeded"),
        pytest.param(lambda: caused(llama_overflow()), "context_overflow", id="overflow-as-cause"),
        pytest.param(lambda: MalformedAnswer("no choices"), "malformed_response", id="malformed-answer"),
        pytest.param(lambda: caused(MalformedAnswer("x")), "malformed_response", id="malformed-as-cause"),
        pytest.param(lambda: ValueError("parse"), "other", id="other"),
        pytest.param(lambda: caused(refused()), "connection", id="cause-followed"),
        pytest.param(lambda: caused(ValueError("x")), "other", id="cause-unknown"),
    ],
)
def test_classify(make: Callable[[], BaseException], expected: ErrorClass) -> None:
    assert classify(make()) == expected


def test_classify_errors_of_the_sdks_http_library() -> None:
    req = sdk_httpx.Request("POST", URL)
    assert classify(sdk_httpx.ReadTimeout("slow", request=req)) == "timeout"
    assert classify(sdk_httpx.ConnectError("refused", request=req)) == "connection"
    limited = openai.RateLimitError(
        "slow", response=sdk_httpx.Response(429, request=req, headers={"retry-after": "3"}), body=None
    )
    assert (classify(limited), retry_after(limited, EPOCH)) == ("rate_limited", 3.0)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param({"retry-after": "7"}, 7.0, id="seconds"),
        pytest.param({"retry-after": "2.5"}, 2.5, id="fractional"),
        pytest.param({"retry-after-ms": "1500", "retry-after": "9"}, 1.5, id="ms-wins"),
        pytest.param(
            {"retry-after": format_datetime(datetime.fromtimestamp(EPOCH + 30, UTC))}, 30.0, id="date"
        ),
        pytest.param(
            {"retry-after": format_datetime(datetime.fromtimestamp(EPOCH - 30, UTC))}, 0.0, id="past"
        ),
        pytest.param({"retry-after": "soon"}, None, id="garbage"),
        pytest.param({}, None, id="absent"),
    ],
)
def test_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert retry_after(rate_limited(headers), EPOCH) == expected


def test_retry_after_from_plain_httpx() -> None:
    error = httpx.HTTPStatusError(
        "slow", request=plain_request(), response=httpx.Response(429, headers={"Retry-After": "4"})
    )
    assert retry_after(error, EPOCH) == 4.0


def test_retry_after_without_a_response() -> None:
    assert retry_after(refused(), EPOCH) is None
    assert retry_after(ValueError(), EPOCH) is None


def test_health_is_pure() -> None:
    health = Health(HealthPolicy(allowed_failures=1, window_s=10, cooldown_s=5))
    health.failed(0.0, "x", None, immediate=False)
    assert health.state(0.0) == "healthy"
    health.failed(9.0, "x", None, immediate=False)
    assert (health.state(13.9), health.state(14.0)) == ("cooldown", "half_open")
    assert health.available(14.0)
    health.probing = True
    assert not health.available(14.0)


def test_a_context_size_error_reports_the_request_and_the_window() -> None:
    assert overflow_numbers(llama_overflow()) == (4019, 2048)
    assert overflow_numbers(openai_overflow()) == (None, None)
    assert overflow_numbers(bad_request()) == (None, None)


def test_a_plain_bad_request_is_not_an_overflow() -> None:
    assert not context_overflow(bad_request())  # "context too long" alone names no window
    assert classify(bad_request()) == "bad_request"
