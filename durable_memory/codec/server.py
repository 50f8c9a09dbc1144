"""`dmem codec-server`: Temporal's codec-server protocol over the payload codec, so that an
authorised operator reads encrypted turns in the Web UI (its "Codec Server" setting) or with
`temporal workflow show --codec-endpoint URL --codec-auth "Bearer TOKEN"`.

`POST /decode` and `POST /encode` (also under `/{namespace}/`, for the CLI's endpoint
templating) take and answer `{"payloads": [...]}`, each payload in protobuf's JSON form
(metadata values and data base64). Every request needs `Authorization: Bearer <token>`;
a browser's request must come from one of the configured origins (CORS), and any request
naming another namespace (`X-Namespace`, or the path) than the deployment's is refused.
A payload whose key was destroyed (its user forgotten) is answered still encrypted.
"""

import hmac
from collections.abc import Sequence

import uvicorn
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from temporalio.api.common.v1 import Payloads

from durable_memory.codec.keys import PayloadKeyError
from durable_memory.codec.payload_codec import UserPayloadCodec, payload_codec_for
from durable_memory.config import ConfigError, Settings

MAX_BODY_BYTES = 32 << 20
"""A history's payloads, as the UI sends them in one request, stay far below this."""
MAX_PAYLOADS = 10_000
"""Payloads in one request: each names a key looked up at once (one query), so the count is
bounded too, not only the bytes."""
ALLOWED_HEADERS = "authorization, content-type, x-namespace"


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
        if len(payloads.payloads) > MAX_PAYLOADS:
            return PlainTextResponse(
                f"{len(payloads.payloads)} payloads in one request; at most {MAX_PAYLOADS}",
                status_code=413,
                headers=headers,
            )
        try:
            if request.url.path.endswith("/decode"):
                answer = await codec.decode_for_view(payloads.payloads)
            else:
                answer = await codec.encode(payloads.payloads)
        except PayloadKeyError as error:
            return PlainTextResponse(str(error), status_code=422, headers=headers)
        return Response(
            json_format.MessageToJson(Payloads(payloads=answer)),
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


async def serve(settings: Settings, host: str | None = None, port: int | None = None) -> None:
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
    await uvicorn.Server(config).serve()
