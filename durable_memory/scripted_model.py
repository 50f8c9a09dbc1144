"""A scripted stand-in for the Messages API, for tests and the offline demo. Never a model.

It speaks `POST /v1/messages` (non-streaming) on loopback and answers each request with the
next entry of a script, so the real `anthropic` SDK can talk to it through `base_url`. It
records every request (unless told not to, for long benchmarks) so tests can assert on the
exact context and tools a model was given (`GET /_scripted/requests` returns them too).
Every response says it is scripted: the model name is prefixed with `scripted:` and the
`x-scripted-model` header is set.

Script entries (a JSON list, or `{"responses": [...]}`), or, for tests whose turns run
concurrently and may be retried after a crash (so the order of requests is not known),
`respond`: a function that returns the entry for each request from the request itself.

Script entries:

- `{"text": "Hello"}`: an `end_turn` reply with one text block;
- `{"content": [...], "stop_reason": "tool_use"}`: content blocks as the API returns them;
  `tool_use` blocks without an `id` get `toolu_scripted_NNNN`;
- `{"status": 529, "error_type": "overloaded_error", "message": "...", "headers": {...}}`:
  an API error with that status, body and headers (e.g. `retry-after`).

A request after the last entry gets a 400 `invalid_request_error` saying the script is
exhausted (which reply was asked for, how many there are): not retryable, so the turn fails
with that message.
"""

import json
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from durable_memory.loopback_server import ThreadedHTTPServer
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.tokens import count_tokens

SCRIPTED_PREFIX = "scripted:"


class ScriptError(DurableMemoryError):
    """A script file that cannot be used."""


def load_script(path: str | Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ScriptError(f"{path}: cannot read the model script: {error}") from None
    entries = data.get("responses") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ScriptError(f"{path}: a script is a JSON list of response objects")
    return entries


def _error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


class ScriptedModelServer(ThreadedHTTPServer):
    """Run with `with ScriptedModelServer(script) as server:`; `server.url` is the base URL."""

    def __init__(
        self,
        script: Sequence[dict[str, Any]],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        record_requests: bool = True,
        respond: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        self._script = list(script)
        self._respond = respond
        self._record = record_requests
        self._lock = threading.Lock()
        self._next = 0
        self._tool_ids = 0
        self.requests: list[dict[str, Any]] = []
        super().__init__(host, port, self._handler())

    @property
    def remaining(self) -> int:
        return len(self._script) - self._next

    def extend(self, entries: Sequence[dict[str, Any]]) -> None:
        with self._lock:
            self._script.extend(entries)

    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        problem = self._check_request(body)
        if problem:
            return 400, _error_body("invalid_request_error", problem), {}
        with self._lock:
            if self._record:
                self.requests.append(body)
            if self._respond is not None:
                entry = self._respond(body)
            elif self._next >= len(self._script):
                return 400, _error_body("invalid_request_error", self._exhausted()), {}
            else:
                entry = self._script[self._next]
            self._next += 1
            number = self._next
            if "status" in entry:
                status = int(entry["status"])
                kind = entry.get("error_type", "api_error")
                error = _error_body(kind, entry.get("message", f"scripted {kind}"))
                return status, error, dict(entry.get("headers", {}))
            content = self._content(entry)
        stop = entry.get("stop_reason") or (
            "tool_use" if any(b.get("type") == "tool_use" for b in content) else "end_turn"
        )
        reply = {
            "id": f"msg_scripted_{number:04d}",
            "type": "message",
            "role": "assistant",
            "model": SCRIPTED_PREFIX + str(body.get("model")),
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {
                "input_tokens": count_tokens(json.dumps(body, ensure_ascii=False)),
                "output_tokens": count_tokens(json.dumps(content, ensure_ascii=False)),
            },
        }
        return 200, reply, {}

    def _exhausted(self) -> str:
        """Said to the caller (and through the turn's failure, to the person running it) when
        a request finds no reply left: a bad request, so nobody retries it."""
        count = len(self._script)
        return (
            f"scripted model: the script is exhausted: reply {self._next + 1} was asked for, "
            f"but the script has only {count} {'reply' if count == 1 else 'replies'}"
        )

    def _content(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        if "text" in entry:
            return [{"type": "text", "text": str(entry["text"])}]
        content = [dict(b) for b in entry.get("content", [])]
        for block in content:
            if block.get("type") == "tool_use" and "id" not in block:
                self._tool_ids += 1
                block["id"] = f"toolu_scripted_{self._tool_ids:04d}"
        return content

    @staticmethod
    def _check_request(body: dict[str, Any]) -> str | None:
        for key in ("model", "max_tokens", "messages"):
            if key not in body:
                return f"{key}: Field required"
        if body.get("stream"):
            return "the scripted model server does not stream"
        if not isinstance(body["messages"], list) or not body["messages"]:
            return "messages: at least one message is required"
        return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: tests and the demo print what matters themselves."""

            def _send(self, status: int, body: Any, headers: dict[str, str]) -> None:
                data = json.dumps(body, ensure_ascii=False).encode("utf-8")
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("x-scripted-model", "true")
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/_scripted/requests":
                    with server._lock:
                        self._send(200, server.requests, {})
                else:
                    self._send(404, _error_body("not_found_error", "not found"), {})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                if self.path.split("?")[0] != "/v1/messages":
                    self._send(404, _error_body("not_found_error", f"no route {self.path}"), {})
                    return
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._send(400, _error_body("invalid_request_error", "body is not JSON"), {})
                    return
                self._send(*server._answer(body if isinstance(body, dict) else {}))

        return Handler
