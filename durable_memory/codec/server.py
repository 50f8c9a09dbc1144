"""`dmem codec-server`: Temporal's codec-server protocol over the payload codec, so that an
authorised operator reads encrypted turns in the Web UI (its "Codec Server" setting) or with
`temporal workflow show --codec-endpoint URL --codec-auth "Bearer TOKEN"`.

`POST /decode` and `POST /encode` (also under `/{namespace}/`, for the CLI's endpoint
templating) take and answer `{"payloads": [...]}`, each payload in protobuf's JSON form
(metadata values and data base64). Every request needs `Authorization: Bearer <token>`;
a browser's request must come from one of the configured origins (CORS), and any request
naming another namespace (`X-Namespace`, or the path) than the deployment's is refused.
A payload whose key was destroyed (its user forgotten) is answered still encrypted.

Every `/decode` request, answered or refused, is audit-logged: one JSON line on the logger
`durable_memory.codec.audit` (AUDIT_LOGGER) with the time, the peer's address, the namespace,
the status, how many payloads were asked for, the ids of the keys that decrypted them and how
many stayed encrypted; never a payload's content, never the token. `dmem codec-server`
writes the lines to stderr, or appends them to `codec_server.audit_log`.
"""

import hmac
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import uvicorn
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from temporalio.api.common.v1 import Payload, Payloads

from durable_memory.codec.keys import PayloadKeyError
from durable_memory.codec.payload_codec import (
    ENCODING,
    UserPayloadCodec,
    key_id_of,
    payload_codec_for,
)
from durable_memory.config import ConfigError, Settings

MAX_BODY_BYTES = 32 << 20
"""A history's payloads, as the UI sends them in one request, stay far below this."""
MAX_PAYLOADS = 10_000
"""Payloads in one request: each names a key looked up at once (one query), so the count is
bounded too, not only the bytes."""
ALLOWED_HEADERS = "authorization, content-type, x-namespace"
AUDIT_LOGGER = "durable_memory.codec.audit"
"""Where the decode audit lines go: route it like any Python logger (they are at INFO)."""

audit_log = logging.getLogger(AUDIT_LOGGER)


@dataclass
class DecodeAudit:
    """What one /decode request asked for and got, filled in as it is answered."""

    payloads: int = 0
    key_ids: set[str] = field(default_factory=set)
    """The keys that decrypted a payload of the request."""
    kept_encrypted: int = 0
    """Encrypted payloads answered as they were: their key is destroyed (user forgotten)."""

    def record(self, asked: Sequence[Payload], answered: Sequence[Payload]) -> None:
        for before, after in zip(asked, answered, strict=True):
            if before.metadata.get("encoding") != ENCODING:
                continue
            if after.metadata.get("encoding") == ENCODING:
                self.kept_encrypted += 1
            else:
                self.key_ids.add(key_id_of(before))


def log_decode(request: Request, namespace: str, status: int, audit: DecodeAudit) -> None:
    peer = request.client
    entry = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "event": "codec.decode",
        "remote": f"{peer.host}:{peer.port}" if peer is not None else None,
        "namespace": namespace[:100],
        "status": status,
        "payloads": audit.payloads,
        "key_ids": sorted(audit.key_ids),
        "kept_encrypted": audit.kept_encrypted,
    }
    audit_log.info(json.dumps(entry), extra={"dmem_audit": entry})


def build_codec_app(
    codec: UserPayloadCodec, *, token: str, origins: Sequence[str], namespace: str
) -> Starlette:
    expected = f"Bearer {token}".encode()

    def cors(origin: str | None) -> dict[str, str]:
        if origin is None:
            return {}
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Credentials": "true",
            "Vary": "Origin",
        }

    async def endpoint(request: Request) -> Response:
        audit = DecodeAudit()
        response = await answer(request, audit)
        if request.method == "POST" and request.url.path.endswith("/decode"):
            asked = request.path_params.get("namespace") or request.headers.get("x-namespace")
            log_decode(request, asked or namespace, response.status_code, audit)
        return response

    async def answer(request: Request, audit: DecodeAudit) -> Response:
        origin = request.headers.get("origin")
        if origin is not None and origin not in origins:
            return PlainTextResponse(f"origin {origin[:100]} is not allowed", status_code=403)
        if request.method == "OPTIONS":  # a browser's preflight carries no credentials
            return Response(
                status_code=204,
                headers={
                    **cors(origin),
                    "Access-Control-Allow-Methods": "POST",
                    "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                    "Access-Control-Max-Age": "600",
                },
            )
        headers = cors(origin)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return PlainTextResponse(
                "a bearer token is needed (Authorization: Bearer <token>)",
                status_code=401,
                headers={**headers, "WWW-Authenticate": "Bearer"},
            )
        asked = request.path_params.get("namespace") or request.headers.get("x-namespace")
        if asked not in (None, namespace):
            return PlainTextResponse(
                f"this codec server serves namespace {namespace!r}, not {asked[:100]!r}",
                status_code=403,
                headers=headers,
            )
        body = await _body(request)
        if body is None:
            return PlainTextResponse(
                f"the body exceeds {MAX_BODY_BYTES} bytes", status_code=413, headers=headers
            )
        try:
            payloads = json_format.Parse(body, Payloads())
        except json_format.ParseError as error:
            return PlainTextResponse(
                f'expected {{"payloads": [...]}}: {error}'[:300], status_code=400, headers=headers
            )
        audit.payloads = len(payloads.payloads)
        if len(payloads.payloads) > MAX_PAYLOADS:
            return PlainTextResponse(
                f"{len(payloads.payloads)} payloads in one request; at most {MAX_PAYLOADS}",
                status_code=413,
                headers=headers,
            )
        try:
            if request.url.path.endswith("/decode"):
                answered = await codec.decode_for_view(payloads.payloads)
                audit.record(payloads.payloads, answered)
            else:
                answered = await codec.encode(payloads.payloads)
        except PayloadKeyError as error:
            return PlainTextResponse(str(error), status_code=422, headers=headers)
        return Response(
            json_format.MessageToJson(Payloads(payloads=answered)),
            media_type="application/json",
            headers=headers,
        )

    methods = ["POST", "OPTIONS"]
    return Starlette(
        routes=[
            Route(path, endpoint, methods=methods)
            for path in ("/decode", "/encode", "/{namespace}/decode", "/{namespace}/encode")
        ]
    )


async def _body(request: Request) -> bytes | None:
    """The request's body, None past MAX_BODY_BYTES (read no further than that)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return None
    return bytes(body)


def codec_app_for(settings: Settings) -> Starlette:
    """The app for the deployment's settings; a ConfigError without a master key or token."""
    server = settings.payload_encryption.codec_server
    token = server.token()
    codec = payload_codec_for(settings)
    if codec is None:
        raise ConfigError(
            "dmem codec-server: no master key (DMEM_PAYLOAD_MASTER_KEY or "
            "payload_encryption.master_key_file): there is nothing it could decrypt"
        )
    return build_codec_app(
        codec, token=token, origins=server.cors_origins, namespace=settings.temporal.namespace
    )


@contextmanager
def audit_lines_to(path: Path | None) -> Iterator[None]:
    """The audit lines, one JSON object each, appended to `path` (stderr when None) while
    the block runs; they still reach any handler the process configured for the logger."""
    handler: logging.Handler = (
        logging.FileHandler(path, encoding="utf-8")
        if path is not None
        else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(logging.Formatter("%(message)s"))
    audit_log.addHandler(handler)
    level = audit_log.level
    audit_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        audit_log.setLevel(level)
        audit_log.removeHandler(handler)
        handler.close()


async def serve(
    settings: Settings,
    host: str | None = None,
    port: int | None = None,
    audit_log_path: Path | None = None,
) -> None:
    """Serve until interrupted; the master key and token are checked before it starts."""
    server = settings.payload_encryption.codec_server
    config = uvicorn.Config(
        codec_app_for(settings),
        host=host or server.host,
        port=port or server.port,
        log_level="warning",
        proxy_headers=False,
        lifespan="off",
    )
    with audit_lines_to(audit_log_path or server.audit_log):
        await uvicorn.Server(config).serve()
