"""An HTTP server on a background thread, for the servers the project runs itself (the scripted
model, the git server): `start()`, `url`, `stop()`, or `with Server(...) as server:`."""

import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class _Connections(ThreadingHTTPServer):
    """`ThreadingHTTPServer` that knows its open connections, so that stopping it ends them:
    a handler waiting on a kept-alive connection for its next request would otherwise go on
    answering it after the server stopped (its thread is a daemon, never joined)."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.accepted = 0

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        with self._lock:
            self._open.add(connection)
            self.accepted += 1
        return connection, address

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def end_connections(self) -> None:
        with self._lock:
            still_open = list(self._open)
        for connection in still_open:
            with contextlib.suppress(OSError):  # closed by its handler meanwhile
                connection.shutdown(socket.SHUT_RDWR)


class ThreadedHTTPServer:
    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> None:
        self._httpd = _Connections((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def connections_accepted(self) -> int:
        """TCP connections accepted so far (a client that keeps one alive opens one)."""
        return self._httpd.accepted

    def start(self) -> Self:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, and end every open connection (a request in flight is cut, as by
        the server's process ending)."""
        self._httpd.shutdown()
        self._httpd.end_connections()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
