"""`dmem git-serve DIR`: bare repositories `DIR/<user>.git` over smart HTTP, at `/<user>.git`.

A thin HTTP front over `git http-backend` (CGI), which does the git protocol. This front does
what the backend leaves to a web server: every request carries the token (a bearer token or the
password of HTTP basic auth, compared in constant time) or gets 401; the user id in the path is
validated before any path is built, and only the smart protocol's three endpoints and
`dmem-main` (below) are served (no dumb HTTP file access); a missing repository is created,
atomically, on the first push; request bodies are bounded (413); the backend's stderr is logged
and a backend that hangs is killed after a timeout (504). A push with the `Dmem-History-Rewrite`
header (`dmem redact`) may replace main by a rewritten history (still lease-protected), and the
repository is garbage-collected after it. `DELETE /<user>.git` (with the token) deletes a user's
repository, for `dmem forget`: renamed out of place, then removed (204; 404 if there is none).
`GET /<user>.git/dmem-main` (with the token) answers the commit main names, read from the
repository's files (an empty body: no repository, or no main yet), so that a worker that asks
whether its clone is current before every read costs this server no git process
(memory/store/git/advertisement.py; other git servers are asked for their ref advertisement).
"""

import logging
import os
import re
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote

from durable_memory.gitserver.requests import BodyTooLarge, authorized, read_body
from durable_memory.loopback_server import ThreadedHTTPServer
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.store.bare_repos import (
    EXISTING_REPOSITORY_HEADER,
    delete_bare_repository,
    ensure_bare_repository,
    existing_bare_repository,
    install_hook,
)
from durable_memory.memory.store.git.advertisement import MAIN_CONTENT_TYPE
from durable_memory.memory.store.git.refs import Unreadable, read_head
from durable_memory.memory.store.redaction.history import HISTORY_REWRITE_HEADER, prune_repository

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 << 20
DEFAULT_CGI_TIMEOUT_SECONDS = 300.0
_REPOSITORY = re.compile(r"/([^/]+)\.git/?")
_ROUTE = re.compile(r"/([^/]+)\.git/(info/refs|git-upload-pack|git-receive-pack)")
_SERVICES = ("git-upload-pack", "git-receive-pack")
_MAIN = re.compile(r"/([^/]+)\.git/dmem-main")


def http_backend() -> str:
    """Debian's git ships the CGI program in git's exec path."""
    exec_path = subprocess.run(
        ["git", "--exec-path"], check=True, capture_output=True, text=True, timeout=30
    ).stdout.strip()
    return str(Path(exec_path) / "git-http-backend")


@dataclass(frozen=True)
class ServeSettings:
    root: Path
    token: str | None
    """None only when auth is off explicitly (`--no-auth`, loopback)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    cgi_timeout_seconds: float = DEFAULT_CGI_TIMEOUT_SECONDS
    pre_receive_hook: str | None = None
    """The hook script each repository gets (pre_receive.hook_script), or None."""


class _Handler(BaseHTTPRequestHandler):
    settings: ServeSettings
    backend: str
    protocol_version = "HTTP/1.1"
    # Keep-alive replies written in several pieces would otherwise stall ~40 ms on the
    # client's delayed ACK (Nagle): git's curl reuses its connection within a fetch or push.
    disable_nagle_algorithm = True
    # A connection idle this long between requests (or a request stalled as long) is closed:
    # workers keep theirs open to ask `dmem-main`, and one whose host vanished would otherwise
    # hold its thread here for good. Workers stop using a connection after 5 s idle.
    timeout = 120

    def log_message(self, format: str, *args: object) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        main = _MAIN.fullmatch(unquote(self.path))
        if main is None:
            self._serve()
        elif self._authorized():
            self._answer_main(main.group(1))

    def _answer_main(self, user_id: str) -> None:
        """The commit id main names, from the bare repository's ref files; empty when there
        is no repository or no main yet (what a fetch would find)."""
        try:
            bare = existing_bare_repository(self.settings.root, user_id)
            sha = read_head(bare) if bare is not None else None
        except (DurableMemoryError, Unreadable) as error:  # an invalid id, an odd repository
            # Answered in this endpoint's type: the client asks git for this user, and goes
            # on asking this server the cheap way for the others.
            log.warning("refused %s: %s", self.path[:200], error)
            status, body = HTTPStatus.UNPROCESSABLE_ENTITY, f"{error}\n".encode()
        else:
            status, body = HTTPStatus.OK, (f"{sha}\n".encode() if sha else b"")
        self.send_response(status)
        self.send_header("Content-Type", MAIN_CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        """Delete one user's repository (a forget): the only request that removes anything."""
        if not self._authorized():
            return
        route = _REPOSITORY.fullmatch(unquote(self.path))
        if route is None:
            self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "only a repository can be deleted")
            return
        try:
            removed = delete_bare_repository(self.settings.root, route.group(1))
        except DurableMemoryError as error:  # an invalid user id
            self._refuse(HTTPStatus.NOT_FOUND, str(error))
            return
        if not removed:
            self._refuse(HTTPStatus.NOT_FOUND, f"no repository for user '{route.group(1)}'")
            return
        log.info("deleted the repository of user '%s' (a forget)", route.group(1))
        self.send_response(HTTPStatus.NO_CONTENT)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _authorized(self) -> bool:
        """Whether the request carries the token; if not, it is answered 401 here."""
        if self.settings.token is None or authorized(
            self.headers.get("Authorization"), self.settings.token
        ):
            return True
        self._refuse(
            HTTPStatus.UNAUTHORIZED,
            "a token is required",
            **{"WWW-Authenticate": 'Basic realm="dmem git"'},
        )
        return False

    def _refuse(self, status: HTTPStatus, message: str, **headers: str) -> None:
        body = f"{message}\n".encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _serve(self) -> None:
        settings = self.settings
        if not self._authorized():
            return
        path, _, query = self.path.partition("?")
        route = _ROUTE.fullmatch(unquote(path))
        if route is None:
            self._refuse(HTTPStatus.NOT_FOUND, "not a repository endpoint")
            return
        user_id, endpoint = route.groups()
        service = query.removeprefix("service=") if endpoint == "info/refs" else endpoint
        if service not in _SERVICES:
            self._refuse(HTTPStatus.FORBIDDEN, "only the smart protocol is served")
            return
        try:
            if service == "git-receive-pack" and EXISTING_REPOSITORY_HEADER not in self.headers:
                ensure_bare_repository(
                    settings.root, user_id, pre_receive_hook=settings.pre_receive_hook
                )
            elif existing_bare_repository(settings.root, user_id) is None:
                self._refuse(HTTPStatus.NOT_FOUND, f"no repository for user '{user_id}'")
                return
        except DurableMemoryError as error:
            log.warning("refused %s: %s", self.path[:200], error)
            self._refuse(HTTPStatus.NOT_FOUND, str(error))
            return
        # A push rewriting history (`dmem redact`) is let through the non-fast-forward guard,
        # still lease-protected by the client's --force-with-lease; its repository is
        # garbage-collected once it is done, so nothing of the old history stays here.
        rewrite = service == "git-receive-pack" and HISTORY_REWRITE_HEADER in self.headers
        # The path the backend sees is rebuilt from the validated parts, not passed through.
        self._run_backend(f"/{user_id}.git/{endpoint}", query, rewrite=rewrite)
        if rewrite and endpoint == "git-receive-pack":
            log.info("user '%s': history rewritten (dmem redact); pruning the old", user_id)
            prune_repository(settings.root / f"{user_id}.git")

    def _run_backend(self, path: str, query: str, *, rewrite: bool = False) -> None:
        settings = self.settings
        headers = {name.lower(): value for name, value in self.headers.items()}
        with tempfile.TemporaryFile() as body:
            try:
                length = read_body(self.rfile, headers, settings.max_body_bytes, body)
            except BodyTooLarge:
                self._refuse(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request body over {settings.max_body_bytes} bytes",
                )
                return
            except ValueError:  # a chunk size or Content-Length that is not a number
                self._refuse(HTTPStatus.BAD_REQUEST, "malformed request body framing")
                return
            body.seek(0)
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "GIT_PROJECT_ROOT": str(settings.root),
                "GIT_HTTP_EXPORT_ALL": "1",
                "GATEWAY_INTERFACE": "CGI/1.1",
                "REQUEST_METHOD": self.command,
                "PATH_INFO": path,
                "QUERY_STRING": query,
                "CONTENT_TYPE": headers.get("content-type", ""),
                "CONTENT_LENGTH": str(length),
                "REMOTE_ADDR": self.client_address[0],
                # Authenticated (or auth explicitly off): http-backend allows pushes only then.
                "REMOTE_USER": "dmem",
            }
            if "content-encoding" in headers:
                env["HTTP_CONTENT_ENCODING"] = headers["content-encoding"]
            if "git-protocol" in headers:
                env["GIT_PROTOCOL"] = headers["git-protocol"]
            if rewrite:
                env["GIT_CONFIG_COUNT"] = "1"
                env["GIT_CONFIG_KEY_0"] = "receive.denyNonFastForwards"
                env["GIT_CONFIG_VALUE_0"] = "false"
            # Its own process group: a timeout kills the backend's children (receive-pack, the
            # hook) with it, where killing the backend alone would leave them running.
            process = subprocess.Popen(
                [self.backend],
                stdin=body,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
            try:
                out, err = process.communicate(timeout=settings.cgi_timeout_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                log.error(
                    "git http-backend %s killed after %ss", path, settings.cgi_timeout_seconds
                )
                self._refuse(HTTPStatus.GATEWAY_TIMEOUT, "git http-backend timed out")
                return
        if err:
            log.warning("git http-backend %s: %s", path, err.decode("utf-8", "replace").strip())
        self._relay(out)

    def _relay(self, out: bytes) -> None:
        separator = b"\r\n\r\n" if b"\r\n\r\n" in out else b"\n\n"  # CGI allows either
        head, _, payload = out.partition(separator)
        status = HTTPStatus.OK.value
        reason = "OK"
        cgi_headers: list[tuple[str, str]] = []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                code, _, reason = value.strip().partition(" ")
                status = int(code)
            else:
                cgi_headers.append((name.strip(), value.strip()))
        self.send_response(status, reason or None)
        for name, value in cgi_headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class GitServer(ThreadedHTTPServer):
    """The server on a thread (tests, `dmem git-serve`): `start()`, `url`, `stop()`."""

    def __init__(self, settings: ServeSettings, host: str = "127.0.0.1", port: int = 0) -> None:
        if settings.token is None and host not in ("127.0.0.1", "::1", "localhost"):
            raise DurableMemoryError("refusing to serve without a token on a non-loopback host")
        settings.root.mkdir(parents=True, exist_ok=True)
        if settings.pre_receive_hook is not None:
            for repository in sorted(settings.root.glob("*.git")):
                try:
                    if existing_bare_repository(settings.root, repository.name[:-4]):
                        install_hook(repository, "pre-receive", settings.pre_receive_hook)
                except DurableMemoryError as error:
                    log.warning("skipping %s: %s", repository.name, error)
        handler = type("Handler", (_Handler,), {"settings": settings, "backend": http_backend()})
        super().__init__(host, port, handler)
        self._httpd.daemon_threads = True


def serve(settings: ServeSettings, host: str, port: int) -> None:
    """`dmem git-serve`: serve until interrupted."""
    server = GitServer(settings, host, port).start()
    auth = "token required" if settings.token else "NO AUTH (loopback)"
    print(f"git server for {settings.root} on {server.url}/<user>.git ({auth}); Ctrl-C stops")
    try:
        threading.Event().wait()
    finally:
        server.stop()
