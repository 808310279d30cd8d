"""Secret scrubbing: the pure ``scrub``, the secret registry, and the log filter on the package logger."""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import uuid

import pytest
from langchain_openai import ChatOpenAI

from fusion_graph import redact
from fusion_graph.redact import REDACTED, RedactingFilter, register_model_secrets, register_secret, scrub


def unique(prefix: str = "") -> str:
    """A value no rule but the registry catches: dotted chunks, each too short to look random."""
    return prefix + ".".join(uuid.uuid4().hex[:10] for _ in range(3))


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        pytest.param(
            "Incorrect API key provided: sk-proj-abcDEF1234567890xyz.", "sk-proj-abcDEF1234567890xyz"
        ),
        pytest.param("key sk-test-0123456789abcdef was refused", "sk-test-0123456789abcdef", id="sk-test"),
        pytest.param("sent Authorization: Basic dXNlcjpwYXNz to it", "dXNlcjpwYXNz", id="authorization"),
        pytest.param("{'Authorization': 'Bearer tok.en-v4lue'}", "tok.en-v4lue", id="authorization-dict"),
        pytest.param("got Bearer abc.DEF-ghi_123 back", "abc.DEF-ghi_123", id="bearer"),
        pytest.param('{"api_key": "hunter2hunter2", "model": "m"}', "hunter2hunter2", id="json"),
        pytest.param("{'apiKey': 'hunter2hunter2'}", "hunter2hunter2", id="dict-repr"),
        pytest.param("GET /v1/models?key=AIzaSyXyz-12&alt=json", "AIzaSyXyz-12", id="query"),
        pytest.param("api_key: s3cr3tvalue and more", "s3cr3tvalue", id="api_key-colon"),
        pytest.param("x-api-key: abcd1234 refused", "abcd1234", id="x-api-key"),
        pytest.param("password=pa55word!", "pa55word!", id="password"),
        pytest.param(f"token {uuid.uuid4().hex} end", None, id="uuid-hex"),
        pytest.param(f"digest {hashlib.sha256(b'x').hexdigest()}", None, id="sha256"),
        pytest.param("AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"),
    ],
)
def test_key_shapes_are_scrubbed(text: str, secret: str | None) -> None:
    out = scrub(text)
    assert REDACTED in out
    if secret is not None:
        assert secret not in out


def test_the_scrubbed_text_keeps_its_context() -> None:
    text = "Error code: 401 - {'error': {'message': 'Incorrect API key provided: sk-abcdef123456'}}"
    assert scrub(text) == (
        f"Error code: 401 - {{'error': {{'message': 'Incorrect API key provided: {REDACTED}'}}}}"
    )
    assert (
        scrub('{"api_key": "hunter2hunter2", "model": "m"}') == f'{{"api_key": "{REDACTED}", "model": "m"}}'
    )
    assert scrub("Authorization: Bearer abc, next") == f"Authorization: {REDACTED}, next"


@pytest.mark.parametrize(
    "text",
    [
        "Connection refused: http://127.0.0.1:8080/v1/chat/completions",
        "test_a_local_step_costs_the_local_price_while_cloud_is_the_override",
        "internationalization_and_localization_configuration",
        "KeyError: 'choices'; missing key: foo; max_tokens: 512; cached_tokens=5; monkey=3",
        "provider cloud:gpt-4o-mini-2024-07-18 failed: RateLimitError [rate_limited] slow down",
        "Rate limit reached for gpt-4o-mini in organization org-abc on tokens per min (TPM): Limit 200000",
        "aaaaaaaaaaaaaaaa1111111111111111111",  # long but not random
        "Error code: 500 - {'error': {'message': 'fake error 500', 'type': 'fake'}}",
        "",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert scrub(text) == text


def test_passed_and_registered_secrets_are_removed_exactly() -> None:
    passed, registered = unique("p-"), unique("r-")
    assert scrub(f"a {passed} b", [passed]) == f"a {REDACTED} b"
    assert scrub(f"a {registered} b") == f"a {registered} b", "not registered yet"
    assert register_secret(registered) is True
    assert registered in redact.registered_secrets()
    assert scrub(f"a {registered}{registered} b") == f"a {REDACTED}{REDACTED} b"


def test_short_and_empty_secrets_are_ignored() -> None:
    assert register_secret("short") is False
    assert register_secret("") is False
    assert register_secret(None) is False
    assert "short" not in redact.registered_secrets()
    assert scrub("a short note", ["short", ""]) == "a short note"


def test_a_longer_secret_is_removed_before_a_shorter_one_inside_it() -> None:
    inner = unique()
    outer = inner + "-and-more"
    assert scrub(f"[{outer}]", [inner, outer]) == f"[{REDACTED}]"


def test_registration_is_thread_safe() -> None:
    values = [unique() for _ in range(200)]
    threads = [threading.Thread(target=register_secret, args=(value,)) for value in values]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(values) <= redact.registered_secrets()


def test_a_chat_models_key_is_registered() -> None:
    key = unique("gw-")
    model = ChatOpenAI(model="m", api_key=key, base_url="http://127.0.0.1:9/v1")
    register_model_secrets(model)
    assert key in redact.registered_secrets()
    register_model_secrets(object())  # no key attribute: nothing happens


# --------------------------------------------------------------------------- logs


def test_the_filter_scrubs_message_args_exception_and_stack() -> None:
    key = unique()
    register_secret(key)
    try:
        raise ValueError(f"refused {key}") from PermissionError(f"cause {key}")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("any", logging.ERROR, __file__, 1, "failed with %s", (key,), exc_info)
    record.stack_info = f"Stack (most recent call last): {key}"
    assert RedactingFilter().filter(record) is True
    assert record.getMessage() == f"failed with {REDACTED}"
    assert record.exc_info is None
    assert record.exc_text is not None and "PermissionError" in record.exc_text
    assert key not in record.exc_text and REDACTED in record.exc_text
    assert record.stack_info == f"Stack (most recent call last): {REDACTED}"
    assert key not in logging.Formatter().format(record)


def test_the_filter_survives_bad_arguments() -> None:
    key = unique()
    register_secret(key)
    record = logging.LogRecord("any", logging.INFO, __file__, 1, "two %s %s", (key,), None)
    assert RedactingFilter().filter(record) is True  # getMessage() would raise: the record survives
    assert record.getMessage() == f"two %s %s ('{REDACTED}',)", "the arguments are kept, scrubbed"


def test_package_records_reach_the_application_scrubbed(caplog: pytest.LogCaptureFixture) -> None:
    key = unique()
    register_secret(key)
    caplog.set_level(logging.DEBUG)
    child = logging.getLogger("fusion_graph.providers.chain")
    child.debug("answer echoed %s", key)
    try:
        raise RuntimeError(f"provider said {key}") from KeyError(key)
    except RuntimeError:
        logging.getLogger("fusion_graph.deep.module").exception("call failed")
    logging.getLogger("fusion_graph").warning("package %s", key)
    assert len(caplog.records) == 3
    assert key not in caplog.text
    assert caplog.text.count(REDACTED) >= 4  # message, exception, its cause, the package record
    assert "provider said" in caplog.text


def test_other_loggers_are_not_touched(caplog: pytest.LogCaptureFixture) -> None:
    key = unique()
    register_secret(key)
    caplog.set_level(logging.INFO)
    logging.getLogger("somebody.else").info("raw %s", key)
    assert key in caplog.text, "only fusion_graph records are scrubbed unless a handler adds the filter"


def test_a_handler_with_the_filter_scrubs_any_logger() -> None:
    key = unique()
    register_secret(key)
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("somebody.else.entirely")
    logger.addHandler(handler)
    try:
        logger.warning("raw %s", key)
    finally:
        logger.removeHandler(handler)
    assert lines == [f"raw {REDACTED}"]


def test_install_is_idempotent() -> None:
    package = logging.getLogger("fusion_graph")
    before = (list(package.handlers), list(package.filters))
    redact.install()
    assert (package.handlers, package.filters) == before
    assert any(isinstance(f, RedactingFilter) for h in package.handlers for f in h.filters)


def test_a_database_urls_password_is_scrubbed_however_the_url_is_spelt() -> None:
    from fusion_graph.redact import register_url_secrets

    register_url_secrets(
        "postgress://fusion:pw-short@127.0.0.1:5432/db"
    )  # a misspelt scheme, a short password
    logged = 'missing "=" after "postgress://fusion:pw-short@127.0.0.1:5432/db" in connection info string'
    assert "pw-short" not in scrub(logged)
    register_url_secrets("postgresql://fusion:a-longer-secret-9@db:5432/app")
    assert "a-longer-secret-9" not in scrub("password authentication failed: a-longer-secret-9")
    assert scrub("host=db password=hunter22 dbname=app").count("hunter22") == 0


def test_a_remembered_scrub_forgets_when_a_new_secret_is_registered() -> None:
    text = "provider cloud:plainwordsremembered"
    assert redact.scrub_repeated(text) == text  # nothing key-shaped in it: kept, and remembered
    assert redact.register_secret("plainwordsremembered")
    assert redact.scrub_repeated(text) == "provider cloud:[REDACTED]"
