"""The review page's ASGI app: `build_app(client, review_settings)`.

Every request is for the one user of its session (signing.py); every id that comes from a URL
or a form (diff id, block label, commit sha) is looked up *for that user* and refused like a
missing one otherwise. Only POST changes anything, and every POST carries the session's CSRF
token. Reads and decisions go through the `MemoryClient`, so the page is a thin client in
the distributed mode too: a decision is the turn's own Update (`MemoryClient.approve`/
`reject`), serialised with the turn like one from the CLI.

The pages are server-rendered Jinja2 templates with autoescaping on (block values, reasoning
and messages are hostile input), and the Content-Security-Policy allows only our own static
script, never an inline one.
"""

import asyncio
import difflib
import re
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from jinja2 import Environment, PackageLoader
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from durable_memory.client import MemoryClient
from durable_memory.config import ReviewSettings
from durable_memory.decision_delivery import DecisionLost
from durable_memory.memory.core.errors import (
    DecisionRefused,
    DiffAlreadyDecided,
    DurableMemoryError,
    InvalidIdentifier,
    UnknownBlock,
    UnknownCommit,
    UnknownDiff,
)
from durable_memory.memory.core.formats import to_markdown
from durable_memory.memory.core.operations import apply_operation
from durable_memory.models.blocks import BlockSpec
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.review.signing import ReviewCredentialRefused, Session, Signer

SESSION_COOKIE = "dmem_review"
MAX_FORM_BYTES = 256 * 1024
"""A form larger than this is refused unread (a block is at most a few thousand chars)."""
_SHA = re.compile(r"[0-9a-f]{7,40}")

SECURITY_HEADERS = {
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

Handler = Callable[[Request], Awaitable[Response]]


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


class _Refused(DurableMemoryError):
    """A request the page refuses as a whole (a wrong method or form), with its status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _status_of(error: DurableMemoryError) -> int:
    if isinstance(error, ReviewCredentialRefused):
        return 403
    if isinstance(error, UnknownDiff | UnknownBlock | UnknownCommit | InvalidIdentifier):
        return 404
    if isinstance(error, DiffAlreadyDecided | DecisionRefused):
        return 409
    if isinstance(error, _Refused):
        return error.status
    return 400


class ReviewApp:
    """The handlers, over one client and one signer."""

    def __init__(self, client: MemoryClient, settings: ReviewSettings) -> None:
        self.client = client
        self.settings = settings
        self.signer = Signer(settings.secret())
        self.secure_cookie = settings.base_url.startswith("https://")

    # -- plumbing --------------------------------------------------------------------------

    def render(
        self, request: Request, template: str, status: int = 200, **values: Any
    ) -> HTMLResponse:
        html = _templates.get_template(template).render(
            base=request.scope.get("root_path", ""), **values
        )
        return HTMLResponse(html, status_code=status)

    def refusal(self, request: Request, error: DurableMemoryError) -> HTMLResponse:
        status = _status_of(error)
        return self.render(request, "refused.html", status, code=status, message=str(error))

    def session_of(self, request: Request) -> Session:
        return self.signer.session(request.cookies.get(SESSION_COOKIE))

    async def form_of(self, request: Request, session: Session) -> dict[str, str]:
        """The POSTed form, once its CSRF token is this session's."""
        if request.headers.get("content-type", "").split(";")[0].strip() != (
            "application/x-www-form-urlencoded"
        ):
            raise _Refused("a review form is sent as application/x-www-form-urlencoded", 415)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise _Refused(f"the form is larger than {MAX_FORM_BYTES} bytes", 413)
        try:
            fields = dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
        except (UnicodeError, ValueError):
            raise _Refused("the form is not valid URL-encoded UTF-8", 400) from None
        self.signer.check_csrf(session, fields.get("csrf"))
        return fields

    def page(self, handler: Callable[[Request, Session], Awaitable[Response]]) -> Handler:
        """A handler that runs for a valid session only, and turns our errors into a page."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request, self.session_of(request))
            except DurableMemoryError as error:
                return self.refusal(request, error)

        return run

    async def stack_call(self, work: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(work, *args)

    # -- opening a link --------------------------------------------------------------------

    async def open_link(self, request: Request) -> Response:
        query = request.query_params
        try:
            if not all(query.get(k) for k in ("u", "exp", "n", "sig")):
                raise ReviewCredentialRefused(
                    "this review link is not complete: open the whole link you were given"
                )
            user_id = self.signer.open_link(query["u"], query["exp"], query["n"], query["sig"])
        except DurableMemoryError as error:
            return self.refusal(request, error)
        _, cookie = self.signer.new_session(user_id, self.settings.session_ttl_s)
        base = request.scope.get("root_path", "")
        # Redirected, so the signed link leaves the address bar and the history at once.
        response = RedirectResponse(f"{base}/", status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            cookie,
            max_age=int(self.settings.session_ttl_s),
            path=f"{base}/",
            httponly=True,
            samesite="strict",
            secure=self.secure_cookie,
        )
        return response

    # -- pages -----------------------------------------------------------------------------

    async def overview(self, request: Request, session: Session) -> Response:
        user = session.user_id
        blocks = await self.stack_call(self.client.stack.blocks.read_blocks, user)
        pending = await self.client.pending_diffs(user)
        return self.render(
            request,
            "overview.html",
            poll=True,
            user=user,
            blocks=[_block_view(b) for b in blocks.values()],
            pending=pending,
            csrf=self.signer.csrf_token(session),
        )

    async def state(self, _request: Request, session: Session) -> Response:
        """What the page polls: it reloads when the pending diffs or the HEAD change."""
        user = session.user_id
        pending = await self.client.pending_diffs(user)
        head = await self.stack_call(self.client.stack.blocks.last_change, user)
        body = {"pending": [d.id for d in pending], "head": head.sha if head else None}
        return JSONResponse(body)

    async def diff_page(
        self,
        request: Request,
        session: Session,
        *,
        status: int = 200,
        message: str | None = None,
        edited: str | None = None,
    ) -> Response:
        diff = await self._diff(request, session)
        block = await self.stack_call(
            self.client.stack.blocks.read_block, session.user_id, diff.label
        )
        proposed: str | None
        try:
            proposed = to_markdown(
                block.spec, apply_operation(block.spec, block.fields, diff.effective_operation)
            )
        except DurableMemoryError:
            proposed = None  # no longer applies: the preview says why
        preview = await self.client.preview(diff.id, session.user_id)
        return self.render(
            request,
            "diff.html",
            status,
            poll=diff.status is DiffStatus.PENDING,
            user=session.user_id,
            diff=diff,
            pending=diff.status is DiffStatus.PENDING,
            preview=preview,
            current=to_markdown(block.spec, block.fields),
            edited=proposed if edited is None else edited,
            limit=block.spec.limit,
            message=message,
            csrf=self.signer.csrf_token(session),
        )

    async def _diff(self, request: Request, session: Session) -> PendingDiff:
        diff: PendingDiff = await self.stack_call(
            self.client.stack.review.get, request.path_params["diff_id"], session.user_id
        )
        return diff

    async def decide(self, request: Request, session: Session) -> Response:
        form = await self.form_of(request, session)
        diff = await self._diff(request, session)  # this session's user's, or refused
        action = form.get("action")
        approver = session.user_id
        try:
            if action == "approve":
                await self.client.approve(diff.id, approver, user_id=session.user_id)
            elif action == "edit":
                await self.client.approve(
                    diff.id,
                    approver,
                    user_id=session.user_id,
                    edited_markdown=form.get("markdown", ""),
                )
            elif action == "reject":
                await self.client.reject(
                    diff.id, approver, form.get("reason", ""), user_id=session.user_id
                )
            else:
                raise _Refused("the form names no decision (approve, edit or reject)", 400)
        except DecisionLost as error:
            return await self.diff_page(request, session, status=409, message=str(error))
        except DurableMemoryError as error:
            if isinstance(error, _Refused):
                raise
            edited = form.get("markdown") if action == "edit" else None
            return await self.diff_page(
                request, session, status=_status_of(error), message=str(error), edited=edited
            )
        base = request.scope.get("root_path", "")
        return RedirectResponse(f"{base}/diffs/{diff.id}", 303)

    async def block_page(self, request: Request, session: Session) -> Response:
        user, label = session.user_id, request.path_params["label"]
        block = await self.stack_call(self.client.stack.blocks.read_block, user, label)
        versions = await self.client.history(user, label, 50)
        compare: dict[str, str] | None = None
        a, b = request.query_params.get("a"), request.query_params.get("b")
        if a and b:
            text = await self.stack_call(self.compare, user, block.spec, _sha(a), _sha(b))
            compare = {"a": a, "b": b, "text": text or "(no difference)"}
        return self.render(
            request,
            "block.html",
            user=user,
            block=_block_view(block),
            versions=versions,
            compare=compare,
            csrf=self.signer.csrf_token(session),
        )

    def compare(self, user_id: str, spec: BlockSpec, a: str, b: str) -> str:
        """Two versions of a block as a unified diff of their Markdown form, as the preview
        of a pending diff shows it."""
        history = self.client.stack.history
        before, after = (
            to_markdown(spec, history.read_at(user_id, spec.label, sha)).splitlines(keepends=True)
            for sha in (a, b)
        )
        name = f"{spec.label}.md"
        return "".join(difflib.unified_diff(before, after, f"{name}@{a[:12]}", f"{name}@{b[:12]}"))

    async def restore(self, request: Request, session: Session) -> Response:
        form = await self.form_of(request, session)
        user, label = session.user_id, request.path_params["label"]
        sha = _sha(form.get("sha", ""))
        known = {c.sha for c in await self.client.history(user, label, 1000)}
        if not any(full.startswith(sha) for full in known):
            raise UnknownCommit(f"no version {sha[:12]} of block '{label}' for user '{user}'")
        await self.client.restore(user, label, sha, user)
        base = request.scope.get("root_path", "")
        return RedirectResponse(f"{base}/blocks/{label}", 303)


def _sha(value: str) -> str:
    if not _SHA.fullmatch(value):
        raise UnknownCommit(f"{value[:45]!r} is not a commit id (7 to 40 hex digits)")
    return value


def _block_view(block: Any) -> Mapping[str, Any]:
    chars = len(block.value)
    return {
        "label": block.label,
        "description": block.spec.description,
        "value": block.value,
        "chars": chars,
        "limit": block.spec.limit,
        "percent": min(100, round(100 * chars / block.spec.limit)),
        "read_only": block.spec.read_only,
    }


def build_app(client: MemoryClient, settings: ReviewSettings) -> Starlette:
    """The review page over `client`; refuses to build without a signing secret
    (ConfigError). Mount it under a path of your own with Starlette's `Mount`."""
    review = ReviewApp(client, settings)

    async def not_allowed(request: Request) -> Response:
        return review.refusal(request, _Refused("only POST changes anything here", 405))

    static = Path(__file__).parent / "static"
    routes = [
        Route("/open", review.open_link, methods=["GET"]),
        Route("/", review.page(review.overview), methods=["GET"]),
        Route("/state", review.page(review.state), methods=["GET"]),
        Route("/diffs/{diff_id}", review.page(review.diff_page), methods=["GET"]),
        Route("/diffs/{diff_id}/decide", review.page(review.decide), methods=["POST"]),
        Route("/diffs/{diff_id}/decide", not_allowed, methods=["GET"]),
        Route("/blocks/{label}", review.page(review.block_page), methods=["GET"]),
        Route("/blocks/{label}/restore", review.page(review.restore), methods=["POST"]),
        Route("/blocks/{label}/restore", not_allowed, methods=["GET"]),
        Mount("/static", StaticFiles(directory=static), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)])
