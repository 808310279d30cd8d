"""An OpenAI-compatible fake server on loopback, for request capture and fault injection.

A real server cannot produce a 429 with ``Retry-After``, a 500, a hang or a
malformed body on demand; this one can. It speaks just enough of
``POST /v1/chat/completions`` (plain and ``stream: true``) for ``ChatOpenAI``,
records every request body, and answers from a script of ``Reply`` items
(the last one repeats). A reply can also be held open until the test lets it go
(``Reply.hold``), to crash or cancel whoever is waiting on it mid-call.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

#: Longest a held reply waits for its event (s): a forgotten hold frees the handler thread eventually.
HOLD_LIMIT_S = 600.0


@dataclass
class Reply:
    """One scripted answer.

    Attributes:
        content: Assistant text.
        tool_calls: ``[(name, arguments_dict), ...]`` to return as tool calls.
        status: HTTP status; non-200 sends an OpenAI-style error body.
        headers: Extra response headers (e.g. ``{"Retry-After": "2"}``).
        delay: Seconds to wait before answering (a hang past the client timeout).
        raw: Send these bytes as the body verbatim (malformed JSON).
        prompt_tokens: Reported ``usage.prompt_tokens`` (default: a word count of the request).
        cached_tokens: Reported ``usage.prompt_tokens_details.cached_tokens``.
        hold: Answer only once this event is set (at most ``HOLD_LIMIT_S``): a response held
            open for as long as the test needs, unlike a fixed ``delay``. The request is
            recorded in ``requests`` before the hold, so a test can wait for it to arrive.
        pieces: Streamed, the content goes out in these pieces, one chunk each (they should join
            to ``content``); empty: in one chunk.
    """

    content: str = "ok"
    tool_calls: Sequence[tuple[str, dict[str, Any]]] = ()
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    raw: bytes | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    hold: threading.Event | None = None
    pieces: Sequence[str] = ()


def _count_words(body: dict[str, Any]) -> int:
    text = json.dumps(body.get("messages", []))
    return max(1, len(text.split()))


class FakeOpenAI:
    """A threaded fake of the OpenAI chat completions API on ``127.0.0.1``."""

    def __init__(self, replies: Sequence[Reply] | Callable[[dict[str, Any]], Reply] = ()) -> None:
        """Serve ``replies`` in order (the last repeats), or call ``replies(body)`` per request."""
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []
        """The headers of each request in ``requests`` (names lower-cased)."""
        self.props: dict[str, Any] | None = None
        """What ``GET /props`` answers (as llama-server would); ``None``: 404."""
        self.completions: list[dict[str, Any]] = []
        """Bodies of llama-server's own ``POST /completion`` (slot warm-ups), kept out of ``requests``."""
        self._slot_prompts: dict[int, int] = {}
        self._in_flight: list[int | None] = []
        self.slot_overlaps = 0
        """Requests that arrived naming a slot another request in flight named (llama-server's hazard)."""
        self.unnamed_beside_named = 0
        """Requests that arrived while a named and an unnamed request were both in flight."""
        self._replies = replies
        self._script_start = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (ends in ``/v1``)."""
        if self._server is None:
            raise RuntimeError("FakeOpenAI is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def script(self, replies: Sequence[Reply] | Callable[[dict[str, Any]], Reply]) -> None:
        """Replace the script: its first reply answers the next request."""
        with self._lock:
            self._replies = replies
            self._script_start = len(self.requests)

    def slots(self) -> list[dict[str, Any]]:
        """What ``GET /slots`` answers while ``props`` is set: each slot, busy or not, and its prompt.

        A slot is busy while a request naming it is answered (a held or delayed
        reply: the server still generating).
        """
        total = int((self.props or {}).get("total_slots") or 0)
        with self._lock:
            return [
                {
                    "id": i,
                    "is_processing": i in self._in_flight,
                    "n_prompt_tokens": self._slot_prompts.get(i, 0),
                }
                for i in range(total)
            ]

    def _arrived(self, slot: int | None) -> None:
        """Count the hazards a request meets on arrival (see ``slot_overlaps``), then note it in flight."""
        with self._lock:
            if slot is not None and slot in self._in_flight:
                self.slot_overlaps += 1
            self._in_flight.append(slot)
            named = any(s is not None for s in self._in_flight)
            if named and None in self._in_flight:
                self.unnamed_beside_named += 1

    def _held(self, body: dict[str, Any]) -> None:
        slot = body.get("id_slot")
        if isinstance(slot, int):
            self._slot_prompts[slot] = max(
                1, len(json.dumps(body.get("messages") or body.get("prompt"))) // 4
            )

    def _next(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
        with self._lock:
            self._held(body)
            self.requests.append(body)
            self.request_headers.append({k.lower(): v for k, v in (headers or {}).items()})
            if callable(self._replies):
                return self._replies(body)
            if not self._replies:
                return Reply()
            index = min(len(self.requests) - 1 - self._script_start, len(self._replies) - 1)
            return list(self._replies)[index]

    def start(self) -> Self:
        """Listen on a free loopback port in a daemon thread."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
                elif self.path.rstrip("/") == "/props" and fake.props is not None:
                    self._json(200, fake.props)
                elif self.path.rstrip("/") == "/slots" and fake.props is not None:
                    self._send(200, json.dumps(fake.slots()).encode(), "application/json", {})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                path = self.path.rstrip("/")
                if not (path.endswith("/chat/completions") or path == "/completion"):
                    self._answer(body)  # a prompt count or a template: no slot generates for it
                    return
                slot = body.get("id_slot") if isinstance(body.get("id_slot"), int) else None
                fake._arrived(slot)
                try:
                    self._answer(body)
                finally:
                    with fake._lock:
                        fake._in_flight.remove(slot)

            def _answer(self, body: dict[str, Any]) -> None:
                if self.path.rstrip("/") == "/completion":  # llama-server's own endpoint (a slot warm-up)
                    if fake.props is None:
                        self._json(404, {"error": {"message": "not found"}})
                        return
                    with fake._lock:
                        fake._held(body)
                        fake.completions.append(body)
                    self._json(200, {"content": "", "id_slot": body.get("id_slot"), "stop": True})
                    return
                reply = fake._next(body, dict(self.headers.items()))
                if reply.hold is not None:
                    reply.hold.wait(HOLD_LIMIT_S)  # outside the fake's lock: other requests go on
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.raw is not None:
                    self._send(reply.status, reply.raw, "application/json", reply.headers)
                    return
                if reply.status != 200:
                    error = {"error": {"message": f"fake error {reply.status}", "type": "fake"}}
                    self._json(reply.status, error, reply.headers)
                    return
                if body.get("stream"):
                    self._stream(body, reply)
                else:
                    self._json(200, fake.completion(body, reply), reply.headers)

            def _stream(self, body: dict[str, Any], reply: Reply) -> None:
                full = fake.completion(body, reply)
                message = full["choices"][0]["message"]
                delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
                if message.get("tool_calls"):
                    delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(message["tool_calls"])]
                base = {"id": full["id"], "object": "chat.completion.chunk", "model": full["model"]}
                pieces = list(reply.pieces) or [delta["content"]]
                chunks = [
                    {
                        **base,
                        "choices": [
                            {"index": 0, "delta": {**delta, "content": pieces[0]}, "finish_reason": None}
                        ],
                    },
                    *(
                        {
                            **base,
                            "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                        }
                        for piece in pieces[1:]
                    ),
                    {
                        **base,
                        "choices": [
                            {"index": 0, "delta": {}, "finish_reason": full["choices"][0]["finish_reason"]}
                        ],
                    },
                ]
                if (body.get("stream_options") or {}).get("include_usage"):
                    chunks.append({**base, "choices": [], "usage": full["usage"]})
                data = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
                self._send(200, data, "text/event-stream", reply.headers)

            def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                self._send(status, json.dumps(payload).encode(), "application/json", headers or {})

            def _send(self, status: int, data: bytes, kind: str, headers: dict[str, str]) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(data)))
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (timeout tests)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def completion(body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        """The non-streaming response for ``reply``."""
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for name, args in reply.tool_calls
        ]
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        prompt = reply.prompt_tokens if reply.prompt_tokens is not None else _count_words(body)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": max(1, len(reply.content.split())),
            "total_tokens": prompt + max(1, len(reply.content.split())),
        }
        if reply.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [
                {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}
            ],
            "usage": usage,
        }

    def stop(self) -> None:
        """Shut the server down."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
