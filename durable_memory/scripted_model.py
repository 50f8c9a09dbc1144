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

Usage is computed, not measured: `PromptCache` applies Anthropic's documented prompt-caching
rules to each request (see its docstring), and every response carries the
`x-scripted-usage: documented-caching-rules` header to say so. Tokens are our local estimate
(memory/core/tokens.py), not Claude's tokenizer.

One module over 300 lines because the server and its cache accounting are one stand-in for
one API: the usage a reply reports is part of the reply.
"""

import functools
import hashlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from durable_memory.loopback_server import ThreadedHTTPServer
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.tokens import count_tokens
from durable_memory.models.llm import (
    CACHE_LOOKBACK_BLOCKS,
    CACHE_TTL_SECONDS,
    MAX_CACHE_BREAKPOINTS,
    TokenUsage,
    min_cacheable_tokens,
)

SCRIPTED_PREFIX = "scripted:"
USAGE_HEADER = ("x-scripted-usage", "documented-caching-rules")


class CacheRequestError(ValueError):
    """A request the API would refuse for its `cache_control` markers (a 400)."""


@dataclass(frozen=True)
class _PromptBlock:
    key: str
    """The block as it counts for the cache: its role and content, `cache_control` left out."""
    tokens: int
    ttl: str | None
    """The TTL of the breakpoint on this block, None if it carries none."""


def _ttl(marker: Any) -> str:
    if not isinstance(marker, dict) or marker.get("type") != "ephemeral":
        raise CacheRequestError("cache_control: type must be 'ephemeral'")
    ttl = marker.get("ttl", "5m")
    if ttl not in CACHE_TTL_SECONDS:
        raise CacheRequestError(f"cache_control.ttl: must be one of 5m, 1h (got {ttl!r})")
    return str(ttl)


@functools.lru_cache(maxsize=16_384)
def _key_tokens(key: str) -> int:
    """Tokens of a block's cache key. A conversation sends every earlier block again each
    turn, so most are counted already: counting them afresh made this stand-in for an
    instant model spend ~1 ms a request of a 40-turn conversation that the benchmarks' floor,
    sending one short message, never paid (docs/benchmarks.md, "The fourth pass")."""
    return count_tokens(key)


def _prompt_block(part: str, block: Any, first: bool) -> _PromptBlock:
    content = {"type": "text", "text": block} if isinstance(block, str) else dict(block)
    marker = content.pop("cache_control", None)
    key = json.dumps([part, first, content], ensure_ascii=False, sort_keys=True)
    return _PromptBlock(key, _key_tokens(key), _ttl(marker) if marker is not None else None)


def cache_blocks(body: dict[str, Any]) -> list[_PromptBlock]:
    """The request as the cache sees it: tools, then system, then messages, block by block.
    CacheRequestError for markers the API refuses."""
    blocks = [_prompt_block("tool", t, True) for t in body.get("tools") or []]
    system = body.get("system") or []
    for block in [system] if isinstance(system, str) else system:
        blocks.append(_prompt_block("system", block, True))
    for message in body["messages"]:
        content = message.get("content")
        for index, block in enumerate([content] if isinstance(content, str) else content):
            blocks.append(_prompt_block(str(message.get("role")), block, index == 0))
    automatic = body.get("cache_control")
    if automatic is not None and blocks and blocks[-1].ttl is None:
        # The top-level marker: a breakpoint on the last cacheable block.
        last = blocks[-1]
        blocks[-1] = _PromptBlock(last.key, last.tokens, _ttl(automatic))
    ttls = [b.ttl for b in blocks if b.ttl is not None]
    if len(ttls) > MAX_CACHE_BREAKPOINTS:
        raise CacheRequestError(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be "
            f"provided. Found {len(ttls)}."
        )
    if any(a == "5m" and b == "1h" for a, b in itertools.combinations(ttls, 2)):
        raise CacheRequestError(
            "cache_control: a breakpoint with ttl '1h' must not come after one with '5m'"
        )
    return blocks


class PromptCache:
    """Anthropic's prompt cache, by its documented rules, so usage is tested offline.

    A request is read as blocks in the order tools -> system -> messages; a cache entry is
    the hash of the whole prefix through a block that carries `cache_control` (the model is
    part of the key). At each breakpoint the cache looks for an entry at that block and up
    to CACHE_LOOKBACK_BLOCKS blocks before it; the longest live hit is read. The prefix
    through the last breakpoint beyond the hit is written (each of those breakpoints makes
    an entry), the rest is uncached input. A breakpoint whose prefix is shorter than the
    model's minimum cacheable length is ignored, silently. More than MAX_CACHE_BREAKPOINTS
    markers, or a 1-hour breakpoint after a 5-minute one, is a request error. An entry lives
    for its TTL after its last write or read.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._expiry: dict[str, tuple[float, str]] = {}
        """Prefix hash -> (when it expires, its TTL)."""

    def account(self, model: str, blocks: Sequence[_PromptBlock]) -> TokenUsage:
        """The input usage of a request's `blocks` (checked by `cache_blocks`; output left
        at 0); the cache is updated as the API would after the request."""
        marked = [i for i, b in enumerate(blocks) if b.ttl is not None]
        prefix_hashes, through = [], []
        digest = hashlib.sha256(model.encode())
        total = 0
        for block in blocks:
            digest.update(block.key.encode())
            prefix_hashes.append(digest.hexdigest())
            total += block.tokens
            through.append(total)
        minimum = min_cacheable_tokens(model)
        breakpoints = [i for i in marked if through[i] >= minimum]
        now = self._clock()
        read_to = -1
        for point in breakpoints:
            for index in range(point, max(-1, point - CACHE_LOOKBACK_BLOCKS - 1), -1):
                if self._live(prefix_hashes[index], now):
                    read_to = max(read_to, index)
                    break
        read = through[read_to] if read_to >= 0 else 0
        written, written_1h, start = 0, 0, read
        for point in (p for p in breakpoints if p > read_to):
            ttl = str(blocks[point].ttl)
            written += through[point] - start
            written_1h += through[point] - start if ttl == "1h" else 0
            start = through[point]
            self._expiry[prefix_hashes[point]] = (now + CACHE_TTL_SECONDS[ttl], ttl)
        if read_to >= 0:
            ttl = self._expiry[prefix_hashes[read_to]][1]
            self._expiry[prefix_hashes[read_to]] = (now + CACHE_TTL_SECONDS[ttl], ttl)
        return TokenUsage(
            input_tokens=total - read - written,
            cache_creation_input_tokens=written,
            cache_read_input_tokens=read,
            cache_write_1h_tokens=written_1h,
            calls=1,
        )

    def _live(self, prefix_hash: str, now: float) -> bool:
        found = self._expiry.get(prefix_hash)
        return found is not None and found[0] > now


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
        clock: Callable[[], float] = time.monotonic,
        keep_alive: bool = False,
    ):
        """`keep_alive`: answer in HTTP/1.1 and keep each connection open for the client's
        next request, as the Messages API does (the benchmarks' server); by default each
        answer closes its connection (HTTP/1.0), so a test that stops the server and starts
        another leaves no pooled connection to the first behind."""
        self._script = list(script)
        self._keep_alive = keep_alive
        self._respond = respond
        self._record = record_requests
        self._lock = threading.Lock()
        self._next = 0
        self._tool_ids = 0
        self.requests: list[dict[str, Any]] = []
        self.cache = PromptCache(clock)
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
        try:
            blocks = cache_blocks(body)
        except CacheRequestError as refused:
            return 400, _error_body("invalid_request_error", str(refused)), {}
        except (AttributeError, TypeError, ValueError) as malformed:  # not the API's shapes
            message = f"malformed request: {malformed}"
            return 400, _error_body("invalid_request_error", message), {}
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
            usage = self.cache.account(str(body["model"]), blocks)
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
                "input_tokens": usage.input_tokens,
                "cache_creation_input_tokens": usage.cache_creation_input_tokens,
                "cache_read_input_tokens": usage.cache_read_input_tokens,
                "cache_creation": {
                    "ephemeral_5m_input_tokens": usage.cache_creation_input_tokens
                    - usage.cache_write_1h_tokens,
                    "ephemeral_1h_input_tokens": usage.cache_write_1h_tokens,
                },
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
            protocol_version = "HTTP/1.1" if server._keep_alive else "HTTP/1.0"
            # An answer is written as its headers, then its body: on a kept-alive connection,
            # Nagle would hold the body until the client acknowledged the headers, which a
            # client out of TCP's quick-ack start delays by up to 40 ms.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: tests and the demo print what matters themselves."""

            def _send(self, status: int, body: Any, headers: dict[str, str]) -> None:
                data = json.dumps(body, ensure_ascii=False).encode("utf-8")
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("x-scripted-model", "true")
                self.send_header(*USAGE_HEADER)
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
                # As the Messages API does: a request without these is refused.
                if self.headers.get_content_type() != "application/json":
                    self._send(400, _error_body("invalid_request_error", "not JSON"), {})
                    return
                if not self.headers.get("anthropic-version"):
                    refusal = "anthropic-version: header is required"
                    self._send(400, _error_body("invalid_request_error", refusal), {})
                    return
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._send(400, _error_body("invalid_request_error", "body is not JSON"), {})
                    return
                self._send(*server._answer(body if isinstance(body, dict) else {}))

        return Handler
