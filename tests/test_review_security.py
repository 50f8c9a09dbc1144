"""The review page's security rules, in process (httpx over the ASGI app): no page without a
credential; links are signed, expiring and opened once; the session cookie is HttpOnly and
SameSite=Strict; every POST needs the session's CSRF token; every id is checked against the
session's user; hostile text is escaped and no page holds an inline script. A refused request
changes nothing (every store snapshotted before and after)."""

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.cli import main
from durable_memory.client import MemoryClient
from durable_memory.config import ConfigError, ReviewSettings
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.diffs import PendingDiff, Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import LearnPreference
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.review.app import SESSION_COOKIE, build_app
from durable_memory.review.server import review_link
from durable_memory.review.signing import Signer
from tests.support.review import HOSTILE, REVIEW_SECRET, csrf_of, open_session, with_review
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import rig_settings

BASE = "http://review.test"


@dataclass
class Page:
    http: httpx.AsyncClient
    stack: MemoryStack
    review: ReviewSettings
    alice_diff: PendingDiff
    bob_diff: PendingDiff

    def link(self, user: str = "alice", ttl_s: float = 60) -> str:
        return review_link(self.review, user, ttl_s)

    async def login(self, user: str = "alice") -> None:
        await open_session(self.http, self.link(user))

    async def csrf(self, path: str) -> str:
        return await csrf_of(self.http, path)


def _propose(stack: MemoryStack, user: str, preference: str, reasoning: str) -> PendingDiff:
    op = LearnPreference(preference=preference)
    return stack.review.propose(user, "human", op, reasoning, Proposer.turn(f"t-{user}"))


@pytest.fixture
async def page(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[Page]:
    settings = with_review(rig_settings(tmp_path / "data"), tmp_path, BASE)
    stack = stack_from_settings(settings)
    for user in ("alice", "bob"):
        stack.blocks.ensure_user(user)
    alice_diff = _propose(stack, "alice", "Socratic questions", "she asked for them")
    bob_diff = _propose(stack, "bob", "Short answers", "he said so")
    client = MemoryClient(temporal_env.client, settings, stack)
    app = build_app(client, settings.review)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
        yield Page(http, stack, settings.review, alice_diff, bob_diff)
    stack.close()


def test_no_secret_no_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DMEM_REVIEW_SECRET", raising=False)
    with pytest.raises(ConfigError, match="no secret to sign review links with"):
        ReviewSettings().secret()
    monkeypatch.setenv("DMEM_REVIEW_SECRET", "short")
    with pytest.raises(ConfigError, match="is 5 characters; use at least 32"):
        ReviewSettings().secret()
    missing = tmp_path / "nothing-here"
    with pytest.raises(ConfigError, match=r"review\.secret_file: cannot read"):
        ReviewSettings(secret_file=missing).secret()
    with pytest.raises(ConfigError, match=r"review\.base_url"):
        ReviewSettings(base_url="javascript:alert(1)")


@pytest.mark.parametrize("command", [("serve",), ("review-link", "alice")])
def test_the_commands_refuse_to_start_without_a_secret(
    command: tuple[str, ...],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("DMEM_REVIEW_SECRET", raising=False)
    monkeypatch.delenv("DMEM_CONFIG", raising=False)
    monkeypatch.setenv("DMEM_TEMPORAL_ADDRESS", "127.0.0.1:1")  # never reached
    monkeypatch.chdir(tmp_path)
    assert main(["--data-dir", str(tmp_path / "data"), *command]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("dmem: error: review: no secret to sign review links with")
    assert err.count("\n") == 1


def test_review_link_prints_a_link_for_the_configured_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DMEM_REVIEW_SECRET", REVIEW_SECRET)
    monkeypatch.setenv("DMEM_REVIEW_BASE_URL", "https://example.org/review")
    monkeypatch.delenv("DMEM_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["review-link", "alice", "--ttl", "30"]) == 0
    link = capsys.readouterr().out.strip()
    assert link.startswith("https://example.org/review/open?")
    query = parse_qs(urlsplit(link).query)
    assert query["u"] == ["alice"]
    assert main(["review-link", "../bob"]) == 2
    assert "dmem: error: " in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/", "/state", "/diffs/{diff}", "/blocks/human"])
async def test_no_page_without_a_session(page: Page, path: str) -> None:
    response = await page.http.get(path.format(diff=page.alice_diff.id))
    assert response.status_code == 403
    assert "no review session" in response.text
    assert "Socratic" not in response.text


async def test_a_link_opens_one_session_for_its_user_once(page: Page) -> None:
    link = page.link("alice")
    opened = await page.http.get(link)
    assert opened.status_code == 200
    # The page moves on by itself, from our origin: a SameSite=Strict cookie is then sent
    # even when the link was followed from another site (test_review_browser.py).
    assert '<meta http-equiv="refresh" content="0; url=/">' in opened.text
    cookie = opened.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=")
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert "Secure" not in cookie  # an http base URL; an https one marks it Secure
    overview = await page.http.get("/")
    assert overview.status_code == 200
    assert page.alice_diff.id in overview.text
    assert page.bob_diff.id not in overview.text
    assert "Short answers" not in overview.text

    again = await httpx.AsyncClient(transport=page.http._transport, base_url=BASE).get(link)
    assert again.status_code == 403
    assert "already used" in again.text
    assert "set-cookie" not in again.headers


def _with(link: str, **changes: str) -> str:
    parts = urlsplit(link)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query.update(changes)
    return f"{parts.path}?{urlencode({k: v for k, v in query.items() if v != '-'})}"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"u": "bob"}, "not valid"),
        ({"exp": "9999999999"}, "not valid"),
        ({"n": "another-nonce"}, "not valid"),
        ({"sig": "0" * 64}, "not valid"),
        ({"sig": "-"}, "not complete"),
        ({"u": "../../etc"}, "not valid"),
    ],
)
async def test_a_tampered_link_is_refused(
    page: Page, changes: dict[str, str], message: str
) -> None:
    before = snapshot(page.stack)
    response = await page.http.get(_with(page.link("alice"), **changes))
    assert response.status_code == 403
    assert message in response.text
    assert "set-cookie" not in response.headers
    assert (await page.http.get("/")).status_code == 403
    assert snapshot(page.stack) == before


async def test_an_expired_link_is_refused(page: Page) -> None:
    signer = Signer(page.review.secret())
    link = signer.link("alice", 60, now=1_000_000)  # expired long ago, correctly signed
    response = await page.http.get(f"/open?{link.query()}")
    assert response.status_code == 403
    assert "expired" in response.text
    assert "set-cookie" not in response.headers


async def test_a_link_for_a_user_without_memory_says_so(page: Page) -> None:
    before = snapshot(page.stack)
    await page.login("carol")
    response = await page.http.get("/")
    assert response.status_code == 404
    assert "user &#39;carol&#39; has no memory yet" in response.text
    assert snapshot(page.stack) == before


async def test_a_tampered_or_foreign_session_is_refused(page: Page) -> None:
    await page.login("alice")
    cookie = page.http.cookies[SESSION_COOKIE]
    forged = cookie[:-4] + ("AAAA" if not cookie.endswith("AAAA") else "BBBB")
    page.http.cookies.set(SESSION_COOKIE, forged)
    assert (await page.http.get("/")).status_code == 403
    other = Signer(b"another-deployment's-secret-0123456789")
    _, foreign = other.new_session("alice", 60)
    page.http.cookies.set(SESSION_COOKIE, foreign)
    response = await page.http.get("/")
    assert response.status_code == 403
    assert "not valid" in response.text


async def test_a_post_without_the_sessions_csrf_token_is_refused(page: Page) -> None:
    await page.login("alice")
    path = f"/diffs/{page.alice_diff.id}/decide"
    token = await page.csrf(f"/diffs/{page.alice_diff.id}")
    before = snapshot(page.stack)
    other_session = Signer(page.review.secret()).new_session("alice", 60)[0]
    for form in (
        {"action": "approve"},
        {"action": "approve", "csrf": ""},
        {"action": "approve", "csrf": token[:-1]},
        {"action": "approve", "csrf": Signer(page.review.secret()).csrf_token(other_session)},
    ):
        response = await page.http.post(path, data=form)
        assert response.status_code == 403, form
        assert "CSRF token" in response.text
    as_json = await page.http.post(path, json={"action": "approve", "csrf": token})
    assert as_json.status_code == 415
    by_get = await page.http.get(path, params={"action": "approve", "csrf": token})
    assert by_get.status_code == 405
    restore = await page.http.post("/blocks/human/restore", data={"sha": "a" * 40})
    assert restore.status_code == 403
    assert snapshot(page.stack) == before


async def test_another_users_ids_are_refused_whatever_the_url_or_form(page: Page) -> None:
    await page.login("alice")
    token = await page.csrf(f"/diffs/{page.alice_diff.id}")
    # A version only bob's repository has (their first commits are identical, sha and all).
    page.stack.edits.learn_fact("bob", "Plays chess", Author(name="bob", kind=AuthorKind.USER))
    bob_head = page.stack.blocks.last_change("bob")
    assert bob_head is not None
    before = snapshot(page.stack)
    seen = await page.http.get(f"/diffs/{page.bob_diff.id}")
    assert seen.status_code == 404
    assert "Short answers" not in seen.text
    assert "he said so" not in seen.text
    for action in ("approve", "reject", "edit"):
        decided = await page.http.post(
            f"/diffs/{page.bob_diff.id}/decide",
            data={"csrf": token, "action": action, "reason": "r", "markdown": "x"},
        )
        assert decided.status_code == 404
    for path in ("/blocks/%2E%2E", "/blocks/..%2F..%2Fbob", "/blocks/nope", "/diffs/..%2Fx"):
        assert (await page.http.get(path)).status_code == 404, path
    for sha in (bob_head.sha, "--output=/tmp/x", "HEAD~1", "a" * 41):
        restored = await page.http.post("/blocks/human/restore", data={"csrf": token, "sha": sha})
        assert restored.status_code == 404, sha
    compared = await page.http.get("/blocks/human", params={"a": bob_head.sha, "b": "HEAD"})
    assert compared.status_code == 404
    assert snapshot(page.stack) == before


async def test_hostile_text_is_inert_and_no_page_has_an_inline_script(page: Page) -> None:
    alice = Author(name="alice", kind=AuthorKind.USER)
    page.stack.edits.learn_fact("alice", HOSTILE, alice)
    hostile_diff = _propose(page.stack, "alice", "Tea", HOSTILE)
    await page.login("alice")
    pages = [
        await page.http.get(path)
        for path in ("/", f"/diffs/{hostile_diff.id}", "/blocks/human", "/diffs/nope-x")
    ]
    for response in pages:
        assert "<script>window" not in response.text
        assert "<img src=x" not in response.text
        scripts = re.findall(r"<script[^>]*>", response.text)
        assert scripts
        assert all(" src=" in s for s in scripts), scripts
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert response.headers["cache-control"] == "no-store"
    assert "&lt;script&gt;window.pwned" in pages[0].text
    assert "&lt;script&gt;window.pwned" in pages[1].text
    static = await page.http.get("/static/review.js")
    assert static.status_code == 200
    assert "script-src 'self'" in static.headers["content-security-policy"]


async def test_mounted_under_a_path_its_links_forms_and_cookie_follow_it(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = with_review(rig_settings(tmp_path / "data"), tmp_path, f"{BASE}/review")
    stack = stack_from_settings(settings)
    stack.blocks.ensure_user("alice")
    diff = _propose(stack, "alice", "Socratic questions", "she asked for them")
    client = MemoryClient(temporal_env.client, settings, stack)
    backend = Starlette(routes=[Mount("/review", build_app(client, settings.review))])
    transport = httpx.ASGITransport(app=backend)
    try:
        async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
            link = review_link(settings.review, "alice")
            assert link.startswith(f"{BASE}/review/open?")
            opened = await http.get(link)
            assert 'content="0; url=/review/"' in opened.text
            assert "Path=/review/" in opened.headers["set-cookie"]
            overview = await http.get("/review/")
            assert f'href="/review/diffs/{diff.id}"' in overview.text
            assert 'src="/review/static/review.js"' in overview.text
            assert (await http.get("/review/static/review.js")).status_code == 200
            page = await http.get(f"/review/diffs/{diff.id}")
            assert f'action="/review/diffs/{diff.id}/decide"' in page.text
            assert (await http.get("/")).status_code == 404  # the backend's, not ours
    finally:
        stack.close()


async def test_search_and_the_context_bar_show_only_the_sessions_user(page: Page) -> None:
    for user in ("alice", "bob"):
        secret = f"{user}'s robot workshop {HOSTILE}"
        page.stack.archive.insert(
            NewPassage(user_id=user, text=secret, source=PassageSource.AGENT, tags=("robots",))
        )
        message = NewMessage(role=MessageRole.USER, content=f"{user} talks about robots")
        page.stack.recall.append(user, f"t-{user}", [message])
    await page.login("alice")
    before = snapshot(page.stack)

    overview = await page.http.get("/")
    assert 'class="context-bar"' in overview.text
    assert "core memory: " in overview.text
    assert "1 in recall, 1 archival passages" in overview.text
    assert " style=" not in overview.text  # the CSP allows no inline style: SVG attributes

    archive = await page.http.get("/search", params={"q": "robot workshop", "in": "archive"})
    assert archive.status_code == 200
    assert "alice&#39;s robot workshop &lt;script&gt;" in archive.text
    assert "bob" not in archive.text
    recall = await page.http.get("/search", params={"q": "robots", "in": "recall"})
    assert "alice talks about robots" in recall.text
    assert "bob" not in recall.text
    elsewhere = await page.http.get("/search", params={"q": "x", "in": "../bob"})
    assert elsewhere.status_code == 400
    assert snapshot(page.stack) == before


HOSTILE_IDS = ["%2E%2E", "a%2Fb", "%00", ".git", "-x", "x" * 300, "%EF%BD%81", "$(id)", "é"]
"""Ids a URL or form may carry, percent-encoded where a URL needs it (a client resolves a
bare ".." in a path itself)."""


async def test_hostile_ids_get_one_clear_refusal_and_change_nothing(page: Page) -> None:
    await page.login("alice")
    token = await page.csrf(f"/diffs/{page.alice_diff.id}")
    before = snapshot(page.stack)
    for hostile in HOSTILE_IDS:
        for response in (
            await page.http.get(f"/diffs/{hostile}"),
            await page.http.post(
                f"/diffs/{hostile}/decide", data={"csrf": token, "action": "approve"}
            ),
            await page.http.get(f"/blocks/{hostile}"),
            await page.http.get("/blocks/human", params={"a": hostile, "b": hostile}),
            await page.http.post("/blocks/human/restore", data={"csrf": token, "sha": hostile}),
        ):
            assert 400 <= response.status_code < 500, (hostile, response.url)
            assert "Refused (" in response.text or response.status_code == 404, hostile
    assert snapshot(page.stack) == before
