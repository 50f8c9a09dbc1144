"""The remote's main without starting git, so that a transaction whose clone is already up to
date costs one small request: `dmem git-serve`'s `GET <repo>/dmem-main` (the ref read from the
repository's files: no git process on the server either), else a smart HTTP git server's ref
advertisement (`GET <repo>/info/refs?service=git-upload-pack`, which costs the server an
upload-pack). Anything unexpected is `Unreadable`, and the caller lets `git fetch` find out
what is wrong.

Also how every HTTP request of ours to the git server fails (`git_remote_errors`): this
one and the deletion of a forgotten user's repository (remote.py)."""

import contextlib
import http.client
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

from durable_memory.memory.core.errors import GitRemoteRefused, GitRemoteUnavailable
from durable_memory.memory.store.git.refs import BRANCH_REF, FULL_SHA, Unreadable

ADVERTISEMENT_TIMEOUT_S = 30.0
_MAX_BYTES = 1 << 20
_CONTENT_TYPE = "application/x-git-upload-pack-advertisement"
MAIN_CONTENT_TYPE = "application/x-dmem-main"
"""`dmem git-serve`'s answer to `GET <repo>/dmem-main`, whatever its status."""
_WITHOUT_MAIN_ENDPOINT: set[str] = set()
"""Servers (a repository URL less its last part) that did not answer `dmem-main` as `dmem
git-serve` does: this process asks them for the advertisement from then on."""


@contextlib.contextmanager
def git_remote_errors(where: str) -> Iterator[None]:
    """A request to the git server, its failure in our error types: HTTP 401 and 403 are
    GitRemoteRefused (the token; not retried), 5xx and a connection that fails or times out
    GitRemoteUnavailable (retried, waited out). Any other HTTP status is re-raised as the
    HTTPError, for the caller to say what it means to it (404: no such repository)."""
    try:
        yield
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise GitRemoteRefused(
                f"{where}: the git remote refused the token (HTTP {error.code})"
            ) from None
        if error.code >= 500:
            raise GitRemoteUnavailable(
                f"{where}: the git remote is unavailable (HTTP {error.code})"
            ) from None
        raise
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        # HTTPException: a reply cut short or malformed (IncompleteRead, BadStatusLine...).
        reason = getattr(error, "reason", error)
        raise GitRemoteUnavailable(f"{where}: the git remote is unavailable: {reason}") from None


def remote_main(repository_url: str, token: str | None) -> str | None:
    """The commit `refs/heads/main` names on the server; None if the repository is missing or
    has no main yet. Asked the cheap way first (`dmem-main`), else the ref advertisement."""
    server = repository_url.rsplit("/", 1)[0]
    if server not in _WITHOUT_MAIN_ENDPOINT:
        try:
            return served_main(repository_url, token)
        except _NotServed:
            _WITHOUT_MAIN_ENDPOINT.add(server)
    return advertised_main(repository_url, token)


class _NotServed(Unreadable):
    """The server does not answer `dmem-main` (not `dmem git-serve`, or an older one)."""


def served_main(repository_url: str, token: str | None) -> str | None:
    """`dmem git-serve`'s `GET <repo>/dmem-main`: the commit main names, None for no
    repository or no main. `_NotServed` from any other server; `Unreadable` when this server
    could not read this user's repository (another user's may be fine)."""
    try:
        body = _get(
            f"{repository_url}/dmem-main", repository_url, token, MAIN_CONTENT_TYPE, keep_alive=True
        )
    except _OtherContent:
        raise _NotServed(f"{repository_url} is not dmem git-serve") from None
    except urllib.error.HTTPError as error:
        if error.headers.get_content_type() == MAIN_CONTENT_TYPE:
            raise Unreadable(f"HTTP {error.code} for {repository_url}/dmem-main") from None
        raise _NotServed(f"HTTP {error.code}") from None
    sha = body.decode("ascii", "replace").strip()
    if not sha:
        return None
    if not FULL_SHA.fullmatch(sha):
        raise Unreadable(f"main is served as {sha[:60]!r}")
    return sha


def advertised_main(repository_url: str, token: str | None) -> str | None:
    """The commit `refs/heads/main` names on the server; None if the repository is missing or
    has no main yet."""
    url = f"{repository_url}/info/refs?service=git-upload-pack"
    try:
        body = _get(url, repository_url, token, _CONTENT_TYPE)
    except _OtherContent:
        raise Unreadable(f"{repository_url} is not a smart HTTP git server") from None
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise Unreadable(f"HTTP {error.code}") from None
    if len(body) > _MAX_BYTES:
        raise Unreadable("the ref advertisement is too large")
    return main_of_advertisement(body)


class _OtherContent(Exception):
    """The server answered, in another content type than asked."""


def _get(
    url: str, repository_url: str, token: str | None, content_type: str, *, keep_alive: bool = False
) -> bytes:
    """GET `url` with the token, its failures named by `git_remote_errors`; the body (at most
    one byte over `_MAX_BYTES`) if it is of `content_type`. Any other HTTP error status is
    raised as the `HTTPError`. `keep_alive`: over this thread's open connection to the server
    where one can be kept (`_KeptConnections`), else as a request of its own."""
    headers = {"User-Agent": "git/durable-memory", "Cache-Control": "no-cache"} | (
        {"Authorization": f"Bearer {token}"} if token else {}
    )
    with git_remote_errors(repository_url):
        if keep_alive and (answer := _KEPT.get(url, headers)) is not None:
            status, reason, reply_headers, body = answer
            if status >= 400:
                raise urllib.error.HTTPError(url, status, reason, reply_headers, None)
            if reply_headers.get_content_type() != content_type:
                raise _OtherContent
            return body
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=ADVERTISEMENT_TIMEOUT_S) as response:
            if response.headers.get_content_type() != content_type:
                raise _OtherContent
            got: bytes = response.read(_MAX_BYTES + 1)
    return got


Answer = tuple[int, str, http.client.HTTPMessage, bytes]
"""An HTTP answer read whole: status, reason, headers, body (at most `_MAX_BYTES` + 1)."""

_STALE = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
)
"""How a kept connection the server has closed meanwhile fails (its idle timeout)."""
KEEP_IDLE_S = 5.0
"""A connection unused this long is not used again: one a NAT or a proxy dropped silently
while idle would wait out `ADVERTISEMENT_TIMEOUT_S` on its next question. A busy worker asks
many times a second; a quiet one opens a new connection, as before."""


class _KeptConnections(threading.local):
    """One open HTTP/1.1 connection per server and thread, for `dmem-main`, asked before
    nearly every transaction: a request of its own cost a TCP connection (and, on `dmem
    git-serve`, a thread) each time, ~1 ms against ~0.4 on loopback. Only where urllib would
    connect straight to the server: http or https, no credentials in the URL, no proxy for
    the host (those keep urllib's request of their own). A connection the server closed while
    idle is opened again once, one unused for `KEEP_IDLE_S` is closed; a redirect, an answer
    too large or one that ends the connection is not kept."""

    def __init__(self) -> None:
        self.open: dict[tuple[str, str, int | None], tuple[http.client.HTTPConnection, float]] = {}

    def get(self, url: str, headers: dict[str, str]) -> Answer | None:
        """The answer to GET `url`; None where this cannot ask (the caller asks with urllib)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.username or parts.hostname is None:
            return None
        try:
            key = (parts.scheme, parts.hostname, parts.port)
        except ValueError:  # not a port: urllib says so, as an unavailable remote
            return None
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        kept, used = self.open.pop(key, (None, 0.0))
        if kept is not None and time.monotonic() - used > KEEP_IDLE_S:
            kept.close()
            kept = None
        if kept is not None:
            # Kept: no proxy applied when it was opened (the environment is read then, ~60 us,
            # not at every request; urllib's opener reads it once). One the server closed
            # while idle fails at once (`_ask` closes it): asked once more, on a new one.
            with contextlib.suppress(*_STALE):
                return self._ask(key, kept, target, headers)
        proxies = urllib.request.getproxies()
        if parts.scheme in proxies and not urllib.request.proxy_bypass(parts.netloc):
            return None
        return self._ask(key, self._connect(key), target, headers)

    @staticmethod
    def _connect(key: tuple[str, str, int | None]) -> http.client.HTTPConnection:
        scheme, host, port = key
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=ADVERTISEMENT_TIMEOUT_S)
        return http.client.HTTPConnection(host, port, timeout=ADVERTISEMENT_TIMEOUT_S)

    def _ask(
        self,
        key: tuple[str, str, int | None],
        connection: http.client.HTTPConnection,
        target: str,
        headers: dict[str, str],
    ) -> Answer | None:
        try:
            connection.request("GET", target, headers=headers)
            response = connection.getresponse()
            body = response.read(_MAX_BYTES + 1)
            complete = response.isclosed() or not response.length
        except BaseException:
            connection.close()
            raise
        if 300 <= response.status < 400:
            connection.close()
            return None  # urllib follows redirects: it asks
        if complete and not response.will_close and len(body) <= _MAX_BYTES:
            self.open[key] = (connection, time.monotonic())
        else:
            connection.close()
        return response.status, response.reason, response.headers, body


_KEPT = _KeptConnections()


def main_of_advertisement(body: bytes) -> str | None:
    """refs/heads/main in a v0 advertisement: pkt-lines (4 hex digits of length, then data)."""
    at = 0
    while at + 4 <= len(body):
        try:
            size = int(body[at : at + 4], 16)
        except ValueError:
            raise Unreadable("not a pkt-line") from None
        if size == 0:  # a flush-pkt: between the service line and the refs, and at the end
            at += 4
            continue
        if size < 4 or at + size > len(body):
            raise Unreadable("a torn pkt-line")
        line = (
            body[at + 4 : at + size].rstrip(b"\n").split(b"\x00", 1)[0].decode("ascii", "replace")
        )
        at += size
        sha, _, name = line.partition(" ")
        if name == BRANCH_REF:
            if not FULL_SHA.fullmatch(sha):
                raise Unreadable(f"main is advertised as {sha[:60]!r}")
            return sha
    return None
