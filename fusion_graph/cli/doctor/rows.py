"""The row every doctor check returns, and the wording the checks share (counts, HTTP errors).

Each check is a small function returning ``Check`` rows; ``cli.doctor.command``
renders them. A row's status says what it means for a run: ``fail`` (it will
not work: exit code 1), ``warn`` (it works, not as well as it could), ``ok``,
or ``info`` (something that could not be checked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fusion_graph.redact import scrub

if TYPE_CHECKING:
    import httpx

Status = Literal["ok", "warn", "fail", "info"]


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


def count(number: int, noun: str) -> str:
    """``1 model``, ``2 models``."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


def transport(error: httpx.HTTPError) -> str:
    """A transport error in one scrubbed line (``ConnectError: ...``)."""
    return scrub(f"{type(error).__name__}: {error}".splitlines()[0])


def json_body(response: httpx.Response) -> object | None:
    """The response's JSON body; ``None`` when it is not JSON (an HTML page, plain text)."""
    try:
        body: object = response.json()
    except ValueError:
        return None
    return body


def error_text(response: httpx.Response) -> str:
    """The error message of an OpenAI-style error body, else the start of the body; scrubbed."""
    body = json_body(response)
    message = body.get("error") if isinstance(body, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    text = message if isinstance(message, str) and message else response.text
    return scrub(" ".join(text.split())[:200])
