"""A TCP forwarder on loopback between a Temporal client and its server that can drop what is
in flight, the two ways a real network path drops a gRPC request:

- `reset_connections()`: every open connection is reset (TCP RST), as by a load balancer, a
  NAT timeout or a restarting server: the client sees "transport error" (UNKNOWN).
- `cancel_streams()`: every request in flight is cancelled in both directions with an HTTP/2
  RST_STREAM (CANCEL), as a proxy or the server itself does under load: the client sees
  CANCELLED ("operation was canceled"), which Temporal's client does not resend.

Both leave the server free to have acted on the request already (an Update admitted, a signal
recorded): exactly what a caller must survive by resending idempotently."""

import asyncio
import socket
import struct
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = struct.Struct(">BHBBL")  # length (24 bits, split 8 + 16), type, flags, stream
DATA, HEADERS, RST_STREAM = 0x0, 0x1, 0x3
END_STREAM = 0x1
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    length = len(payload)
    return FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream) + payload


def rst_stream(stream: int) -> bytes:
    return frame(RST_STREAM, 0, stream, struct.pack(">L", CANCEL))


@dataclass(eq=False)
class Connection:
    """One client connection and its upstream, with the HTTP/2 streams open on it."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    open_streams: set[int] = field(default_factory=set)


class CuttingProxy:
    """Forwards 127.0.0.1:<port> (`address`) to `target` ("host:port")."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.server: asyncio.Server | None = None
        self.connections: set[Connection] = set()
        self.cancelled = 0
        """Requests cancelled by `cancel_streams` so far."""

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> "CuttingProxy":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()
        self.reset_connections()
        await self.server.wait_closed()

    def in_flight(self) -> int:
        return sum(len(c.open_streams) for c in self.connections)

    def cancel_streams(self) -> int:
        """Cancel every request in flight; returns how many."""
        count = 0
        for connection in list(self.connections):
            for stream in sorted(connection.open_streams):
                connection.client.write(rst_stream(stream))
                connection.server.write(rst_stream(stream))
                count += 1
            connection.open_streams.clear()
        self.cancelled += count
        return count

    def reset_connections(self) -> None:
        for connection in list(self.connections):
            for writer in (connection.client, connection.server):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with suppress(OSError):
                        linger = struct.pack("ii", 1, 0)  # close with RST
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                writer.transport.abort()
        self.connections.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        connection = Connection(writer, upstream_writer)
        self.connections.add(connection)

        def opened(kind: int, _flags: int, stream: int) -> None:
            if kind == HEADERS and stream:
                connection.open_streams.add(stream)
            elif kind == RST_STREAM:
                connection.open_streams.discard(stream)

        def answered(kind: int, flags: int, stream: int) -> None:
            if kind == RST_STREAM or (kind in (DATA, HEADERS) and flags & END_STREAM):
                connection.open_streams.discard(stream)

        with suppress(OSError, ConnectionError, asyncio.IncompleteReadError):
            await asyncio.gather(
                self._pump(reader, upstream_writer, opened, preface=True),
                self._pump(upstream_reader, writer, answered, preface=False),
            )
        for side in (writer, upstream_writer):
            side.transport.abort()
        self.connections.discard(connection)

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        seen: Callable[[int, int, int], None],
        *,
        preface: bool,
    ) -> None:
        """Forward frame by frame, telling `seen` each frame's type, flags and stream."""
        if preface:
            writer.write(await reader.readexactly(len(PREFACE)))
        while True:
            header = await reader.readexactly(FRAME_HEADER.size)
            high, low, kind, flags, stream = FRAME_HEADER.unpack(header)
            payload = await reader.readexactly((high << 16) | low)
            seen(kind, flags, stream & 0x7FFFFFFF)
            writer.write(header + payload)
            await writer.drain()
