"""Every error fusion-graph raises on purpose, in one hierarchy (as httpx's ``_exceptions.py``).

Each class also derives from the built-in error it has always been, so code
that catches ``ValueError`` or ``ConnectionError`` keeps working::

    FusionError                      anything below: catch it to catch them all
    ├── InvalidInput                 (ValueError) the run's input cannot start a turn; nothing was sent
    │   ├── IdentityRefused          (PermissionError) an authenticated run named another user
    │   └── InvalidThreadId          a thread id the graph's checkpointer or store cannot hold
    ├── ContextError                 (ValueError) a run context asks for what the operator did not allow
    ├── ProviderConfigError          (ValueError) a provider cannot be built (no key, bad URL)
    ├── ProviderError                (RuntimeError) a provider call ended without an answer
    │   ├── ChainExhausted           every provider failed or is cooling down
    │   └── ProviderRequestError     the request itself was refused (4xx) or failed unexpectedly
    ├── MalformedAnswer              (ValueError) a provider's answer is not a chat completion
    ├── LocalServerError             the local endpoint is not what the graph needs
    │   ├── LlamaServerUnavailable   (ConnectionError) llama-server cannot be reached
    │   ├── NotLlamaServer           (ValueError) it answers, but not as llama-server
    │   ├── LocalPoolMismatch        (RuntimeError) the boxes behind a gateway disagree
    │   └── SlotBusy                 (TimeoutError) a slot stayed busy with another request too long
    ├── ThreadBusy                   (RuntimeError) another run of the thread holds it (shared checkpointer)
    ├── SharedStateUnavailable       (RuntimeError) the shared state's Postgres failed (callers fall back)
    ├── WorkspaceError               (LangChain's ToolException) a path or edit the file tools refuse
    ├── TraceError                   (ValueError) a trace file is missing or malformed
    ├── CalibrationError             (ValueError) the calibration set cannot support the request
    ├── PlotUnavailable              (RuntimeError) matplotlib is not installed
    ├── RunError                     (ValueError) a CLI command cannot start as asked
    ├── UsageError                   (ValueError, TypeError) an API called with arguments it cannot take
    │   └── UnknownProvider          (KeyError) a provider id the chain does not hold
    ├── Closed                       (RuntimeError) a provider chain or resolver used after ``aclose()``
    ├── SyncInEventLoop              (RuntimeError) a sync ``invoke``/``stream`` inside a running event loop
    └── StateError                   (RuntimeError) a node ran on a state it cannot act on

``WorkspaceError`` is defined beside the file tools (``fusion_graph.tools.files``):
it is a LangChain ``ToolException``, and this module stays free of LangChain so
the CLI can import it before any command runs. ``SharedStateUnavailable`` lives
beside the shared state (``fusion_graph.coordination.shared_base``), whose callers catch it.

Every message names the fix. Errors that carry a provider's failure are the
package's own, scrubbed of secrets and never chained to the provider's
exception (its text, body or headers may echo the key). ``causes`` walks an
error's chain of causes, for code that must tell what lies under a wrapper.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class FusionError(Exception):
    """Base of every error fusion-graph raises on purpose."""


class InvalidInput(FusionError, ValueError):
    """A run's input cannot start a turn (no new user message, too much text); nothing was sent."""


class IdentityRefused(InvalidInput, PermissionError):
    """An authenticated run named another user (``configurable.user_id``); nothing was written."""


class InvalidThreadId(InvalidInput):
    """A thread id the graph's checkpointer or store cannot hold; nothing was written.

    LangGraph takes any string as a thread id, but a lone surrogate is not UTF-8
    (SQLite, Postgres and every other store that writes text refuse it) and
    PostgreSQL's text refuses a NUL byte. The saver would fail at the run's first
    write, with an encoding error that does not say why; this says why, before it.
    """


class ContextError(FusionError, ValueError):
    """A run's context asks for something the operator did not allow; the message names the field."""


class ProviderConfigError(FusionError, ValueError):
    """A provider cannot be built from the settings; the message names the fix."""


class ProviderError(FusionError, RuntimeError):
    """A provider call ended without an answer; ``attempts`` holds the call's failed attempts."""

    attempts: tuple[Any, ...]


class ChainExhausted(ProviderError):
    """Every provider failed or is cooling down; ``attempts`` holds this call's failures.

    Raised ``from None``: the providers' exceptions are not chained, because
    their text, ``body`` and ``response`` may carry the API key (some gateways
    echo it in a 401) and a chained cause is printed by every traceback, e.g.
    the LangGraph server's run-error log. The message and ``attempts`` are the
    scrubbed summary (class, kind, message, latency of each failure).
    """

    def __init__(self, message: str, attempts: Sequence[Any], retry_in_s: float | None) -> None:
        super().__init__(message)
        self.attempts, self.retry_in_s = tuple(attempts), retry_in_s


class ProviderRequestError(ProviderError):
    """A request no provider could take: the request itself was refused (4xx), or an unexpected error.

    The project's own error in place of the provider's: its text is scrubbed,
    the failed attempts are in its notes and ``attempts``, and the provider's
    exception is not chained (it may carry the key; LangGraph stores and serves
    a run's error). ``error_type`` names the original exception's class.
    """

    def __init__(self, message: str, attempts: Sequence[Any], error_type: str, kind: str) -> None:
        super().__init__(message)
        self.attempts, self.error_type, self.kind = tuple(attempts), error_type, kind


class MalformedAnswer(FusionError, ValueError):
    """A provider answered with something that is not a usable chat completion.

    Empty ``choices``, a choice without a message, tool-call arguments that are
    not a JSON string, or an answer the model's own parsing chokes on
    (``IndexError``, a validation error). Classed ``malformed_response``: a
    health failure, and the chain falls over.
    """


class LocalServerError(FusionError):
    """The local endpoint is not what the graph needs; the message names the URL and the fix."""


class LlamaServerUnavailable(LocalServerError, ConnectionError):
    """llama-server could not be reached; the message names the URL and how to start one."""


class NotLlamaServer(LocalServerError, ValueError):
    """The local endpoint answers, but not as llama-server (no ``/props`` with ``total_slots``)."""


class LocalPoolMismatch(LocalServerError, RuntimeError):
    """The boxes of ``local_workers`` do not serve the same model with the same slots."""


class SlotBusy(LocalServerError, TimeoutError):
    """A llama-server slot stayed busy with another request for as long as a request may wait for it.

    The request is not sent (naming a busy slot can corrupt the generation running
    there); as a timeout, the provider chain retries it or falls over.
    """


class ThreadBusy(FusionError, RuntimeError):
    """Another run of this thread is in progress on the shared checkpointer; nothing was written.

    Within one process runs of a thread queue behind each other; across
    processes on one checkpointer they cannot, so the second is refused.
    """


class TraceError(FusionError, ValueError):
    """A trace path is missing or a record is malformed; the message names the file and line."""


class CalibrationError(FusionError, ValueError):
    """The calibration set cannot support the request (e.g. no continuation steps)."""


class PlotUnavailable(FusionError, RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


class RunError(FusionError, ValueError):
    """A CLI command cannot start as asked (an unknown thread, a bad ``--postgres`` URL).

    The message names the fix; the commands print it as one line on stderr and exit 2.
    """


class UsageError(FusionError, ValueError, TypeError):
    """The package's API was called with arguments it cannot take (together, or of that type or value).

    A programming error, not a run's input: the message names the argument and
    what it takes. Both ``ValueError`` and ``TypeError``, as these checks were.
    """


class UnknownProvider(UsageError, KeyError):
    """A provider id the chain does not hold; the message lists the ones it does."""

    def __str__(self) -> str:
        """The message as given (``KeyError`` would quote it)."""
        return str(self.args[0]) if self.args else ""


class Closed(FusionError, RuntimeError):
    """A provider chain or resolver was used after ``aclose()``: build a new graph to run again."""


class SyncInEventLoop(FusionError, RuntimeError):
    """A sync ``invoke``/``stream``/``batch`` was called inside a running event loop (it would block it)."""


class StateError(FusionError, RuntimeError):
    """A node ran on a state it cannot act on.

    A thread edited by hand, or a ``Command`` that jumped into the middle of a
    step (e.g. to an executor with no decision for it).
    """


def causes(error: BaseException, *, context: bool = False) -> Iterator[BaseException]:
    """``error``, then what caused it (``__cause__``; with ``context``, else ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (current.__context__ if context else None)
