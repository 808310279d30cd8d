"""Keep secrets out of everything fusion-graph persists, streams or logs.

Some gateways answer a 401 by echoing the API key they were sent, and a
provider's error text then travels into ``route_log`` (checkpointed), stream
events, ``ChainExhausted`` messages and logs. ``scrub`` replaces, in any text:

- the exact values registered with ``register_secret`` (or passed in), at
  least ``MIN_SECRET_LENGTH`` characters long (shorter ones would hit words);
- ``Authorization: ...`` headers and ``Bearer <token>``;
- ``sk-...`` keys (OpenAI's ``sk-``/``sk-proj-``, Anthropic's ``sk-ant-``...);
- ``key=...``, ``api_key: ...``, ``"api_key": "..."`` and similar assignments
  of keys, tokens, secrets and passwords;
- long high-entropy tokens: 32+ characters of ``[A-Za-z0-9_-]`` with letters
  and digits mixed (a hex digest or a UUID is scrubbed too; words and
  ``snake_case`` identifiers are not).

The text is scrubbed where fusion-graph formats an error (the chain's attempts
and health, memory jobs), not when it is written, so a record that reached a
checkpoint, a store or a stream is already clean.

Logs: a ``logging.Filter`` on a logger only sees records created by that very
logger, not by its children (``fusion_graph.providers.chain`` ...), so a filter on the
``fusion_graph`` logger alone would miss every record the package writes.
``install`` instead gives the ``fusion_graph`` logger a handler that emits
nothing and scrubs each record *in place* through ``RedactingFilter``: records
propagate child -> ``fusion_graph`` -> root, so the application's handlers
(on the root logger) receive them already scrubbed. Like the ``NullHandler``
the logging HOWTO recommends for libraries, it also stops ``lastResort`` from
printing the package's records when the application configured no logging.
The same is installed on the HTTP libraries' loggers the package drives
(``httpx``, ``httpcore``, ``openai``): at DEBUG they log request and response
headers, where a gateway may echo the key. Handlers attached to a child logger
(``fusion_graph.providers``, httpcore's ``http11``) run before it and see raw
records; add a ``RedactingFilter`` to those (or to any handler, to scrub other
libraries' records too). Streamed answers are scrubbed by ``StreamScrubber``.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

REDACTED = "[REDACTED]"
#: Registered or passed values shorter than this are ignored: they would match ordinary text.
MIN_SECRET_LENGTH = 8
#: Shortest run of ``[A-Za-z0-9_-]`` that is scrubbed for looking random.
MIN_TOKEN_LENGTH = 32
#: Bits per character a long token needs to count as random (a UUID4's hex has about 3.7).
MIN_TOKEN_ENTROPY = 3.0

_NAMES = r"(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|client[_-]?secret|secret|password|token)"
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # Authorization / Proxy-Authorization headers, as text, dict repr or JSON: the whole value.
    (
        re.compile(r"""(?i)((?:proxy-)?authorization["']?\s*[:=]\s*["']?)[^"'\r\n,}]+"""),
        rf"\g<1>{REDACTED}",
    ),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+"), rf"\g<1>{REDACTED}"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), REDACTED),
    # scheme://user:password@host (a database URL, however short its password): the password.
    (re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^:/@\s'\"]*:)[^@\s'\"]+@"), rf"\g<1>{REDACTED}@"),
    # "api_key": "v" / 'api_key': 'v' (JSON, dict repr): the quoted value.
    (
        re.compile(rf"""(?i)(["']{_NAMES}["']\s*:\s*)(["'])[^"'\r\n]*\2"""),
        rf"\g<1>\g<2>{REDACTED}\g<2>",
    ),
    # api_key=v, api_key: v, x-api-key: v, and a bare key=v (a query string); not prose "key: v".
    (
        re.compile(rf"""(?i)(\b(?:x-)?{_NAMES}\s*[:=]\s*|\bkey=)(?!\[REDACTED\])[^\s"',;&}}\])]+"""),
        rf"\g<1>{REDACTED}",
    ),
)
_TOKEN = re.compile(rf"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{{{MIN_TOKEN_LENGTH},}}(?![A-Za-z0-9_-])")

_lock = threading.Lock()
_secrets: set[str] = set()


def register_secret(value: str | None) -> bool:
    """Remember ``value`` process-wide so every later ``scrub`` removes it; thread-safe.

    Returns whether it was kept: ``None``, empty and short values (under
    ``MIN_SECRET_LENGTH`` characters) are ignored.
    """
    if not value or len(value) < MIN_SECRET_LENGTH:
        return False
    with _lock:
        if value not in _secrets:
            _secrets.add(value)
            _scrub_remembered.cache_clear()  # what was scrubbed before did not know this one
    return True


_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*:([^@/?#]+)@")


def register_url_secrets(url: str | None) -> None:
    """Register a database URL's password, and the whole URL, as secrets (``shared_state_url``...).

    The password is found in any ``scheme://user:password@host`` shape, a
    misspelt scheme too (psycopg logs a URL it cannot parse whole), and also as
    a ``password=...`` setting of a key/value connection string.
    """
    if not url:
        return
    register_secret(url)
    found = _URL_PASSWORD.match(url)
    if found:
        register_secret(found.group(1))
        register_secret(unquote(found.group(1)))
    for match in re.finditer(r"(?:^|\s|[?&])password=([^\s&]+)", url):
        register_secret(match.group(1))
        register_secret(unquote(match.group(1)))


def registered_secrets() -> frozenset[str]:
    """The values registered so far."""
    with _lock:
        return frozenset(_secrets)


def register_model_secrets(model: object) -> None:
    """Register the API key a LangChain chat model holds (``openai_api_key``, ``api_key``...)."""
    for attr in ("openai_api_key", "api_key", "anthropic_api_key", "google_api_key"):
        value = getattr(model, attr, None)
        getter = getattr(value, "get_secret_value", None)
        if callable(getter):
            secret = getter()
            register_secret(secret if isinstance(secret, str) else None)


def _entropy(token: str) -> float:
    counts = Counter(token)
    return -sum(n / len(token) * math.log2(n / len(token)) for n in counts.values())


def _looks_random(token: str) -> bool:
    has_digit = any(c.isdigit() for c in token)
    has_letter = any(c.isalpha() for c in token)
    return has_digit and has_letter and _entropy(token) >= MIN_TOKEN_ENTROPY


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with secrets and anything shaped like a key or bearer token replaced by ``[REDACTED]``.

    Args:
        text: Any text (an error message, a log line).
        secrets: Extra exact values to remove, besides the registered ones;
            values under ``MIN_SECRET_LENGTH`` characters are ignored.
    """
    known = registered_secrets() | {s for s in secrets if s and len(s) >= MIN_SECRET_LENGTH}
    for secret in sorted(known, key=len, reverse=True):  # a longer secret may contain a shorter one
        text = text.replace(secret, REDACTED)
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return _TOKEN.sub(lambda m: REDACTED if _looks_random(m.group()) else m.group(), text)


@functools.lru_cache(maxsize=4096)
def _scrub_remembered(text: str) -> str:
    return scrub(text)


def scrub_repeated(text: str) -> str:
    """``scrub(text)``, remembered for text that comes again and again (provider ids, label values).

    Telemetry scrubs the same few strings on every step; registering a secret forgets them all.
    """
    return _scrub_remembered(text)


def scrub_known(text: str, known: frozenset[str] | None = None) -> str:
    """``text`` with only the registered secret values replaced (for content: tool results, answers).

    Unlike ``scrub`` it leaves key-shaped text alone: a tool result or an answer
    may rightly hold hashes, UUIDs or ``key=value`` lines; the operator's keys never.
    ``known``: the registered secrets when the caller read them already (once per
    streamed chunk, not once per piece of it).
    """
    for secret in sorted(registered_secrets() if known is None else known, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub_content(content: Any, known: frozenset[str] | None = None) -> Any:
    """A message's ``content`` (text or blocks) with the registered secret values replaced.

    ``known``: as for ``scrub_known``; read here once for all the blocks otherwise.
    """
    if known is None:
        known = registered_secrets()
    if isinstance(content, str):
        return scrub_known(content, known)
    if isinstance(content, list):
        return [scrub_content(block, known) for block in content]
    if isinstance(content, dict):
        return {key: scrub_content(value, known) for key, value in content.items()}
    return content


class StreamScrubber:
    """Scrubs the registered secrets from text that arrives in pieces (a streamed answer's chunks).

    A key split across two chunks is in neither whole, so each stream (by its
    message id) holds back a tail one character shorter than the longest
    secret: whatever is let out can no longer be the start of a secret. The
    tail goes out with the stream's last piece (``last``) or ``flush``.
    """

    def __init__(self) -> None:
        self._held: dict[str, str] = {}

    def feed(self, stream: str, text: str, *, last: bool = False, known: frozenset[str] | None = None) -> str:
        """The part of ``stream``'s text so far that is safe to let out, scrubbed.

        ``known``: the registered secrets when the caller read them already (``scrub_known``).
        """
        text = self._held.pop(stream, "") + text
        secrets = registered_secrets() if known is None else known
        if not secrets:
            return text
        text = scrub_known(text, secrets)
        hold = 0 if last else max(len(secret) for secret in secrets) - 1
        if hold <= 0 or len(text) <= 0:
            return text
        out, self._held[stream] = text[:-hold], text[-hold:]
        return out

    def flush(self, stream: str) -> str:
        """What ``stream`` still holds back (scrubbed): its end came without a last piece."""
        return scrub_known(self._held.pop(stream, ""))

    def holding(self) -> list[str]:
        """The streams that hold text back."""
        return [stream for stream, text in self._held.items() if text]


class RedactingFilter(logging.Filter):
    """Scrubs a log record in place: its message (args merged in), exception and stack text.

    The exception is formatted and scrubbed into ``exc_text`` and ``exc_info``
    is dropped, so no formatter can render the raw exception (whose message,
    ``__cause__`` or response may hold the key) afterwards. Never drops a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Scrub ``record``; always ``True``."""
        try:
            message = record.getMessage()
        except (TypeError, ValueError, KeyError):  # bad args: keep both, scrubbed, for the reader
            message = f"{record.msg} {record.args!r}"
        record.msg, record.args = scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


class _ScrubbingHandler(logging.Handler):
    """Emits nothing; its ``RedactingFilter`` scrubs each record before outer handlers see it."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RedactingFilter())

    def emit(self, record: logging.LogRecord) -> None:
        return


def install(logger_name: str = "fusion_graph") -> None:
    """Scrub the records of ``logger_name`` and its children before outer handlers see them; idempotent."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(handler, _ScrubbingHandler) for handler in logger.handlers):
        logger.addHandler(_ScrubbingHandler())
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())  # records logged on the package logger itself


#: The loggers whose records are scrubbed: the package's, and those of the HTTP libraries it drives
#: (at DEBUG they log request and response headers, where a gateway may echo the key), and psycopg's
#: (its pool logs a connection string it cannot parse, password and all).
SCRUBBED_LOGGERS = ("fusion_graph", "httpx", "httpcore", "openai", "psycopg")

for _name in SCRUBBED_LOGGERS:
    install(_name)
