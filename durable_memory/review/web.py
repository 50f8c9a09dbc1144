"""The review page's HTTP plumbing, apart from its pages: the security headers on every
response, reading a POSTed form (bounded, URL-encoded only), rendering a template, and the
HTTP status each of our errors answers with."""

from typing import Any
from urllib.parse import parse_qsl

from jinja2 import Environment, PackageLoader
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from durable_memory.memory.core.errors import (
    DecisionRefused,
    DiffAlreadyDecided,
    DurableMemoryError,
    InvalidIdentifier,
    UnknownBlock,
    UnknownCommit,
    UnknownDiff,
    UnknownUser,
)
from durable_memory.review.signing import ReviewCredentialRefused

MAX_FORM_BYTES = 256 * 1024
"""A form larger than this is refused unread (a block is at most a few thousand chars)."""

SECURITY_HEADERS = {
    # Our one static script and stylesheet; no inline script or style, no eval, no framing.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # a link's signature never leaves in a Referer
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

_templates = Environment(
    loader=PackageLoader("durable_memory.review", "templates"), autoescape=True
)


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every response, static files and Starlette's own 404s too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


class RequestRefused(DurableMemoryError):
    """A request the page refuses as a whole (a wrong method or form), with its status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def status_of(error: DurableMemoryError) -> int:
    if isinstance(error, ReviewCredentialRefused):
        return 403
    if isinstance(
        error, UnknownUser | UnknownDiff | UnknownBlock | UnknownCommit | InvalidIdentifier
    ):
        return 404  # another user's id is reported exactly like a missing one
    if isinstance(error, DiffAlreadyDecided | DecisionRefused):
        return 409
    if isinstance(error, RequestRefused):
        return error.status
    return 400


def base_path(request: Request) -> str:
    """Where the page is mounted ("" at the root): links, forms and the cookie follow it."""
    root: str = request.scope.get("root_path", "")
    return root


def render(request: Request, template: str, status: int = 200, **values: Any) -> HTMLResponse:
    html = _templates.get_template(template).render(base=base_path(request), **values)
    return HTMLResponse(html, status_code=status)


async def read_form(request: Request) -> dict[str, str]:
    """The URL-encoded form of a POST, at most MAX_FORM_BYTES; anything else is refused."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind != "application/x-www-form-urlencoded":
        raise RequestRefused("a review form is sent as application/x-www-form-urlencoded", 415)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise RequestRefused(f"the form is larger than {MAX_FORM_BYTES} bytes", 413)
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
    except (UnicodeError, ValueError):
        raise RequestRefused("the form is not valid URL-encoded UTF-8", 400) from None
