"""`dmem-main`, asked before nearly every transaction in the distributed mode, goes over one
kept-alive connection per server and thread (store/git/advertisement.py `_KeptConnections`):
reused while the server keeps it, opened again once when the server closed it while idle, not
used where a proxy applies; and a stopped server ends its connections, so a kept one is never
answered by a server that stopped (loopback_server.py). Against real loopback servers."""

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from durable_memory.demo import free_port
from durable_memory.gitserver.server import GitServer, ServeSettings
from durable_memory.loopback_server import ThreadedHTTPServer
from durable_memory.memory.core.errors import GitRemoteUnavailable
from durable_memory.memory.store.bare_repos import ensure_bare_repository
from durable_memory.memory.store.git import advertisement
from durable_memory.memory.store.git.advertisement import (
    _MAX_BYTES,
    MAIN_CONTENT_TYPE,
    served_main,
)
from durable_memory.memory.store.git.refs import Unreadable

TOKEN = "keep-alive-token"
SHA = "a" * 40


def answering_main(*, close_after_each: bool) -> tuple[type[BaseHTTPRequestHandler], list[int]]:
    """A handler answering `dmem-main` with SHA, and the client ports it was asked from (one
    per connection the client opened). `close_after_each`: it closes the connection after
    each answer without saying so (as a server's idle timeout does between requests)."""
    ports: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            ports.append(self.client_address[1])
            body = f"{SHA}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", MAIN_CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = close_after_each

        def log_message(self, *_: object) -> None:
            pass

    return Handler, ports


class Answer:
    """How a scripted server answers one request."""

    def __init__(
        self,
        status: int = 200,
        body: bytes = f"{SHA}\n".encode(),
        *,
        chunked: bool = False,
        location: str | None = None,
    ) -> None:
        self.status, self.body, self.chunked, self.location = status, body, chunked, location


def answering(answers: list[Answer]) -> tuple[type[BaseHTTPRequestHandler], list[int]]:
    """A handler giving `answers` in turn (the last one again once they run out), each in
    `dmem-main`'s content type on a connection it keeps open, and the client ports it was
    asked from."""
    ports: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            ports.append(self.client_address[1])
            answer = answers[min(len(ports), len(answers)) - 1]
            self.send_response(answer.status)
            self.send_header("Content-Type", MAIN_CONTENT_TYPE)
            if answer.location is not None:
                self.send_header("Location", answer.location)
            if answer.chunked:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for at in range(0, len(answer.body), 7):
                    piece = answer.body[at : at + 7]
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

        def log_message(self, *_: object) -> None:
            pass

    return Handler, ports


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_one_connection_serves_a_threads_requests_to_a_server() -> None:
    handler, ports = answering_main(close_after_each=False)
    with ThreadedHTTPServer("127.0.0.1", 0, handler) as server:
        url = f"{server.url}/alice.git"
        assert [served_main(url, TOKEN) for _ in range(5)] == [SHA] * 5
        assert len(ports) == 5
        assert len(set(ports)) == 1  # one connection, kept

        thread = threading.Thread(target=served_main, args=(url, TOKEN))
        thread.start()
        thread.join()
        assert len(set(ports)) == 2  # another thread: a connection of its own


def test_a_connection_the_server_closed_is_opened_again_once() -> None:
    handler, ports = answering_main(close_after_each=True)
    with ThreadedHTTPServer("127.0.0.1", 0, handler) as server:
        url = f"{server.url}/alice.git"
        assert [served_main(url, TOKEN) for _ in range(4)] == [SHA] * 4
    assert len(set(ports)) == 4  # each on a new connection, none failed


def test_a_stopped_server_answers_nothing_on_a_kept_connection(tmp_path: Path) -> None:
    """The server's handler thread, waiting on the kept connection, would otherwise answer the
    next request after `stop()`: a remote that is down must look down."""
    root = tmp_path / "git"
    ensure_bare_repository(root, "alice")
    server = GitServer(ServeSettings(root=root, token=TOKEN)).start()
    url = f"{server.url}/alice.git"
    assert served_main(url, TOKEN) is None  # a repository, no main yet
    server.stop()
    with pytest.raises(GitRemoteUnavailable, match="unavailable"):
        served_main(url, TOKEN)


def test_where_a_proxy_applies_the_request_goes_through_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As urllib would send it: here to a proxy that is down, so it fails, though the server
    itself answers."""
    # urlopen's opener reads the proxies once, when first built: one of this test's own,
    # and the process's (whatever it was) again after it
    monkeypatch.setattr(urllib.request, "_opener", None)
    handler, ports = answering_main(close_after_each=False)
    with ThreadedHTTPServer("127.0.0.1", 0, handler) as server:
        url = f"{server.url}/alice.git"
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        with pytest.raises(GitRemoteUnavailable):
            served_main(url, TOKEN)
        assert ports == []
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        monkeypatch.setattr(urllib.request, "_opener", None)
        assert served_main(url, TOKEN) == SHA
        assert len(ports) == 1


def test_each_server_has_a_connection_of_its_own() -> None:
    (first, first_ports), (second, second_ports) = (
        answering_main(close_after_each=False) for _ in range(2)
    )
    with (
        ThreadedHTTPServer("127.0.0.1", 0, first) as one,
        ThreadedHTTPServer("127.0.0.1", 0, second) as two,
    ):
        for _ in range(3):
            assert served_main(f"{one.url}/alice.git", TOKEN) == SHA
            assert served_main(f"{two.url}/bob.git", TOKEN) == SHA
    assert (len(first_ports), len(set(first_ports))) == (3, 1)
    assert (len(second_ports), len(set(second_ports))) == (3, 1)


def test_a_connection_idle_too_long_is_not_used_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """One a NAT or a proxy dropped silently while idle would hang the next question until
    its timeout: past `KEEP_IDLE_S` a new one is opened."""
    handler, ports = answering_main(close_after_each=False)
    with ThreadedHTTPServer("127.0.0.1", 0, handler) as server:
        url = f"{server.url}/alice.git"
        assert served_main(url, TOKEN) == SHA
        monkeypatch.setattr(advertisement, "KEEP_IDLE_S", 0.0)
        assert served_main(url, TOKEN) == SHA
        monkeypatch.setattr(advertisement, "KEEP_IDLE_S", 60.0)
        assert served_main(url, TOKEN) == SHA
    assert len(ports) == 3
    assert len(set(ports)) == 2  # the second asked on a new connection, the third reused it


def test_a_url_whose_port_is_not_one_is_an_unavailable_remote() -> None:
    with pytest.raises(GitRemoteUnavailable):
        served_main("http://127.0.0.1:notaport/alice.git", TOKEN)


def test_an_answer_too_large_is_refused_and_its_connection_not_kept() -> None:
    """An answer over `_MAX_BYTES` is not read to its end: it is refused, and the connection,
    with the rest of it unread, is closed; the next question opens a new one."""
    handler, ports = answering([Answer(body=b"a" * (_MAX_BYTES + 100)), Answer()])
    with ThreadedHTTPServer("127.0.0.1", 0, handler) as server:
        url = f"{server.url}/alice.git"
        with pytest.raises(Unreadable, match="main is served as"):
            served_main(url, TOKEN)
        assert served_main(url, TOKEN) == SHA
        assert served_main(url, TOKEN) == SHA
    assert len(ports) == 3
    assert ports[1] != ports[0]  # not asked again on the connection left mid-answer
    assert ports[2] == ports[1]  # the new one is kept


def test_a_chunked_answer_read_to_its_end_keeps_its_connection() -> None:
    handler, ports = answering([Answer(chunked=True)])
    with ThreadedHTTPServer("127.0.0.1", 0, handler) as server:
        url = f"{server.url}/alice.git"
        assert [served_main(url, TOKEN) for _ in range(3)] == [SHA] * 3
    assert len(ports) == 3
    assert len(set(ports)) == 1


def test_a_redirect_is_followed_as_urllib_follows_it() -> None:
    """A kept connection does not follow redirects: urllib asks, and follows it (here to
    another server), and the redirecting connection is not kept."""
    target, target_ports = answering([Answer()])
    with ThreadedHTTPServer("127.0.0.1", 0, target) as other:
        moved, ports = answering([Answer(302, b"", location=f"{other.url}/alice.git/dmem-main")])
        with ThreadedHTTPServer("127.0.0.1", 0, moved) as server:
            url = f"{server.url}/alice.git"
            assert served_main(url, TOKEN) == SHA
            assert served_main(url, TOKEN) == SHA
    assert len(ports) == 4  # each question: the kept connection's, then urllib's
    assert len(set(ports)) == 4  # none of them kept
    assert len(target_ports) == 2


def test_an_error_answer_read_whole_keeps_its_connection() -> None:
    """A 4xx in `dmem-main`'s content type is this server's answer for this repository
    (`Unreadable`); the connection it came on is whole and asked again."""
    handler, ports = answering([Answer(404, b"no such repository"), Answer()])
    with ThreadedHTTPServer("127.0.0.1", 0, handler) as server:
        url = f"{server.url}/alice.git"
        with pytest.raises(Unreadable, match="HTTP 404"):
            served_main(url, TOKEN)
        assert served_main(url, TOKEN) == SHA
    assert len(ports) == 2
    assert len(set(ports)) == 1
