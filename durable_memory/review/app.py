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

One module though over 300 lines: it is the page's table of routes and their handlers, each a
few lines over the client; the HTTP plumbing they share is in web.py, the credentials in
signing.py.
"""

import asyncio
import difflib
import re
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from durable_memory.client import MemoryClient
from durable_memory.config import ReviewSettings
from durable_memory.decision_delivery import DecisionLost
from durable_memory.memory.core.errors import DurableMemoryError, UnknownCommit
from durable_memory.memory.core.formats import to_markdown
from durable_memory.memory.core.operations import apply_operation
from durable_memory.memory.service.access import Block
from durable_memory.models.blocks import BlockSpec
from durable_memory.models.context import ContextWindowOverview
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.review.signing import ReviewCredentialRefused, Session, Signer
from durable_memory.review.web import (
    RequestRefused,
    SecurityHeaders,
    base_path,
    read_form,
    render,
    status_of,
)

SESSION_COOKIE = "dmem_review"
_SHA = re.compile(r"[0-9a-f]{7,40}")
SEARCH_RESULTS = 20
SHOWN_VERSIONS = 50
"""A block's history page lists its newest versions, this many."""
MAX_VERSIONS = 1000
"""How far back a version to restore is looked for in the block's history."""

Handler = Callable[[Request], Awaitable[Response]]


class ReviewApp:
    """The handlers, over one client and one signer."""

    def __init__(self, client: MemoryClient, settings: ReviewSettings) -> None:
        self.client = client
        self.settings = settings
        self.signer = Signer(settings.secret())
        self.secure_cookie = settings.base_url.startswith("https://")

    # -- plumbing --------------------------------------------------------------------------

    def refusal(self, request: Request, error: DurableMemoryError) -> Response:
        status = status_of(error)
        return render(request, "refused.html", status, code=status, message=str(error))

    def session_of(self, request: Request) -> Session:
        return self.signer.session(request.cookies.get(SESSION_COOKIE))

    async def form_of(self, request: Request, session: Session) -> dict[str, str]:
        """The POSTed form, once its CSRF token is this session's."""
        form = await read_form(request)
        self.signer.check_csrf(session, form.get("csrf"))
        return form

    def page(self, handler: Callable[[Request, Session], Awaitable[Response]]) -> Handler:
        """A handler that runs for a valid session only, and turns our errors into a page."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request, self.session_of(request))
            except DurableMemoryError as error:
                return self.refusal(request, error)

        return run

    async def stack_call(self, work: Callable[..., Any], *args: Any) -> Any:
        """`work` on the memory stack off the event loop, its reads in one state of memory
        (each user's git remote asked once), as MemoryClient's own reads are."""

        def pinned() -> Any:
            with self.client.stack.git.pinned():
                return work(*args)

        return await asyncio.to_thread(pinned)

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
        base = base_path(request)
        # Not a redirect: a link followed from another site (a mail, a chat) starts a
        # cross-site navigation, and a browser sends no SameSite=Strict cookie on its
        # redirects. This page moves on by itself (a meta refresh, no script), from our own
        # origin, so the next request carries the cookie; the used link is dead anyway.
        response = render(request, "opened.html", user=user_id)
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
        context = await self.client.context_overview(user)
        return render(
            request,
            "overview.html",
            context=context,
            sections=_context_sections(context),
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
        return render(
            request,
            "diff.html",
            status,
            poll=diff.status is DiffStatus.PENDING,
            user=session.user_id,
            diff=diff,
            pending=diff.status is DiffStatus.PENDING,
            preview=preview,
            current=to_markdown(block.spec, block.fields),
            proposal=diff.effective_operation.model_dump_json(indent=2),
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
        if action not in ("approve", "edit", "reject"):
            raise RequestRefused("the form names no decision (approve, edit or reject)", 400)
        approver = session.user_id  # the session's user decides on their own memory
        try:
            if action == "reject":
                await self.client.reject(
                    diff.id, approver, form.get("reason", ""), user_id=session.user_id
                )
            else:
                edited_markdown = form.get("markdown", "") if action == "edit" else None
                await self.client.approve(
                    diff.id, approver, user_id=session.user_id, edited_markdown=edited_markdown
                )
        except DecisionLost as error:  # who decided what: the message and the diff's status
            return await self.diff_page(request, session, status=409, message=str(error))
        except DurableMemoryError as error:
            edited = form.get("markdown") if action == "edit" else None
            return await self.diff_page(
                request, session, status=status_of(error), message=str(error), edited=edited
            )
        base = base_path(request)
        return RedirectResponse(f"{base}/diffs/{diff.id}", 303)

    async def block_page(self, request: Request, session: Session) -> Response:
        user, label = session.user_id, request.path_params["label"]
        block = await self.stack_call(self.client.stack.blocks.read_block, user, label)
        versions = await self.client.history(user, label, SHOWN_VERSIONS)
        # A redaction's record changes no file, so the block's own history never lists it.
        log = await self.stack_call(self.client.stack.history.log, user, SHOWN_VERSIONS)
        redactions = [c for c in log if c.trailers.get("Redacted-Block") == label]
        compare: dict[str, str] | None = None
        a, b = request.query_params.get("a"), request.query_params.get("b")
        if a and b:
            text = await self.stack_call(self.compare, user, block.spec, _sha(a), _sha(b))
            compare = {"a": a, "b": b, "text": text or "(no difference)"}
        return render(
            request,
            "block.html",
            user=user,
            block=_block_view(block),
            versions=versions,
            redactions=redactions,
            compare=compare,
            csrf=self.signer.csrf_token(session),
        )

    async def search(self, request: Request, session: Session) -> Response:
        """Archival memory (hybrid search) or recall (every message), for the session's user."""
        user = session.user_id
        query = request.query_params.get("q", "")
        where = request.query_params.get("in", "archive")
        if where not in ("archive", "recall"):
            raise RequestRefused("search in 'archive' or 'recall'", 400)
        hits, messages = [], []
        if where == "archive":
            hits = await self.client.search_archive(user, query, top_k=SEARCH_RESULTS)
        else:
            found = await self.stack_call(
                partial(self.client.stack.recall.search, user, query, limit=SEARCH_RESULTS)
            )
            messages = found.messages
        return render(
            request,
            "search.html",
            user=user,
            query=query,
            where=where,
            hits=hits,
            messages=messages,
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
        versions = await self.client.history(user, label, MAX_VERSIONS)
        version = next((c.sha for c in versions if c.sha.startswith(sha)), None)
        if version is None:  # another user's, another block's, or none at all
            raise UnknownCommit(f"no version {sha[:12]} of block '{label}' for user '{user}'")
        await self.client.restore(user, label, version, user)
        base = base_path(request)
        return RedirectResponse(f"{base}/blocks/{label}", 303)


def _sha(value: str) -> str:
    if not _SHA.fullmatch(value):
        raise UnknownCommit(f"{value[:45]!r} is not a commit id (7 to 40 hex digits)")
    return value


def _block_view(block: Block) -> Mapping[str, Any]:
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


def _context_sections(overview: ContextWindowOverview) -> list[Mapping[str, Any]]:
    """The context window's sections as the overview bar draws them: tokens, and where each
    starts and how wide it is in a bar 1000 units long (drawn as SVG attributes, as the CSP
    allows no inline style)."""
    sections = [
        ("system", "system instructions", overview.system_tokens),
        ("memory", "core memory", overview.core_memory_tokens),
        ("metadata", "memory metadata", overview.metadata_tokens),
        ("summary", "summary", overview.summary_tokens),
        ("messages", "messages", overview.messages_tokens),
        ("tools", "tools", overview.tools_tokens),
    ]
    scale = 1000 / max(overview.context_window, overview.total_tokens, 1)
    drawn: list[Mapping[str, Any]] = []
    start = 0.0
    for key, name, tokens in sections:
        width = tokens * scale
        drawn.append({"key": key, "name": name, "tokens": tokens, "x": start, "width": width})
        start += width
    return drawn


def build_app(client: MemoryClient, settings: ReviewSettings) -> Starlette:
    """The review page over `client`; refuses to build without a signing secret
    (ConfigError). Mount it under a path of your own with Starlette's `Mount`."""
    review = ReviewApp(client, settings)

    async def not_allowed(request: Request) -> Response:
        return review.refusal(request, RequestRefused("only POST changes anything here", 405))

    static = Path(__file__).parent / "static"
    routes = [
        Route("/open", review.open_link, methods=["GET"]),
        Route("/", review.page(review.overview), methods=["GET"]),
        Route("/state", review.page(review.state), methods=["GET"]),
        Route("/diffs/{diff_id}", review.page(review.diff_page), methods=["GET"]),
        Route("/diffs/{diff_id}/decide", review.page(review.decide), methods=["POST"]),
        Route("/diffs/{diff_id}/decide", not_allowed, methods=["GET"]),
        Route("/blocks/{label}", review.page(review.block_page), methods=["GET"]),
        Route("/search", review.page(review.search), methods=["GET"]),
        Route("/blocks/{label}/restore", review.page(review.restore), methods=["POST"]),
        Route("/blocks/{label}/restore", not_allowed, methods=["GET"]),
        Mount("/static", StaticFiles(directory=static), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)])
