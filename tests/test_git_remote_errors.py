"""Every HTTP request of ours to the git server (the remote's main read before each
transaction, `dmem-main` or the ref advertisement, the deletion of a forgotten user's repository) fails the same way, through one
mapping (store/git/advertisement.py `git_remote_errors`): 401 and 403 are GitRemoteRefused,
not retried; 5xx and a connection that fails are GitRemoteUnavailable, retried. Against a
real loopback HTTP server answering each status."""

from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from durable_memory.demo import free_port
from durable_memory.loopback_server import ThreadedHTTPServer
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    GitRemoteRefused,
    GitRemoteUnavailable,
)
from durable_memory.memory.store.git import RemoteGitBlockStore
from durable_memory.memory.store.git.advertisement import (
    advertised_main,
    remote_main,
    served_main,
)

TOKEN = "secret-token-never-shown"
Request = Callable[[str], object]
"""A request to the server at a base URL, for user alice."""


def answering(status: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_DELETE(self) -> None:
            self.do_GET()

        def log_message(self, *_: object) -> None:
            pass

    return Handler


@pytest.fixture(params=["advertisement", "main", "delete"])
def request_to(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Request]:
    if request.param == "advertisement":
        yield lambda base: advertised_main(f"{base}/alice.git", TOKEN)
        return
    if request.param == "main":  # dmem-main, then (a server without it) the advertisement
        yield lambda base: remote_main(f"{base}/alice.git", TOKEN)
        return
    yield lambda base: RemoteGitBlockStore(tmp_path / "data", base, TOKEN).forget_user("alice")


@pytest.mark.parametrize(
    ("status", "error", "message"),
    [
        (401, GitRemoteRefused, "the git remote refused the token (HTTP 401)"),
        (403, GitRemoteRefused, "the git remote refused the token (HTTP 403)"),
        (500, GitRemoteUnavailable, "the git remote is unavailable (HTTP 500)"),
        (503, GitRemoteUnavailable, "the git remote is unavailable (HTTP 503)"),
    ],
)
def test_a_refusal_or_an_outage_is_named_the_same_by_every_request(
    request_to: Request, status: int, error: type[DurableMemoryError], message: str
) -> None:
    with (
        ThreadedHTTPServer("127.0.0.1", 0, answering(status)) as server,
        pytest.raises(error) as raised,
    ):
        request_to(server.url)
    assert message in str(raised.value)
    assert "alice.git" in str(raised.value)  # says which repository
    assert TOKEN not in str(raised.value)
    assert raised.value.retryable is (error is GitRemoteUnavailable)


def test_no_server_is_unavailable_for_every_request(request_to: Request) -> None:
    with pytest.raises(GitRemoteUnavailable, match=r"the git remote is unavailable: .*refused"):
        request_to(f"http://127.0.0.1:{free_port()}")  # nothing listens there


class _NotHTTP(BaseHTTPRequestHandler):
    """Answers with a status line that is not HTTP's (a proxy or server gone wrong), then
    closes."""

    def do_GET(self) -> None:
        self.wfile.write(b"NOT-HTTP 200 hello\r\n\r\n")
        self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.parametrize("read", [advertised_main, served_main, remote_main])
def test_a_reply_that_is_not_http_is_unavailable(read: Callable[[str, str | None], object]) -> None:
    """http.client's own errors (BadStatusLine here; IncompleteRead, LineTooLong) are not
    OSError: they are unavailable too, retried, not an error of no kind of ours."""
    with (
        ThreadedHTTPServer("127.0.0.1", 0, _NotHTTP) as server,
        pytest.raises(GitRemoteUnavailable, match="unavailable"),
    ):
        read(f"{server.url}/alice.git", TOKEN)
