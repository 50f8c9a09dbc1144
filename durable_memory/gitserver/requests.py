"""The HTTP side of a git request that `git http-backend` leaves to its web server: whether it
carries the token, and its body, read (Content-Length or chunked) within a bound."""

import base64
import hmac
from io import BufferedIOBase
from typing import IO

DRAIN_BYTES = 8 << 20
"""How far past the bound a body is still read (and dropped) so that the client sees the 413."""


class BodyTooLarge(Exception):
    """The request body is over the server's bound."""


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token`: `Bearer <token>`, or basic auth whose
    password is the token (any user name: git asks for one)."""
    if header is None:
        return False
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        offered = value.strip().encode()
    elif scheme.lower() == "basic":
        try:
            offered = base64.b64decode(value.strip(), validate=True).partition(b":")[2]
        except ValueError:
            return False
    else:
        return False
    return hmac.compare_digest(offered, token.encode())


def read_body(rfile: BufferedIOBase, headers: dict[str, str], limit: int, into: IO[bytes]) -> int:
    """Copy the request body (Content-Length or chunked) into `into` and return its size;
    BodyTooLarge past `limit`. A body at most DRAIN_BYTES over the limit is read to its end and
    dropped, so that the client reads the 413 instead of a broken pipe; past that, reading
    stops and the connection is closed."""
    total = 0

    def take(size: int) -> None:
        nonlocal total
        if size < 0:  # a negative length would lower the count and defeat the bound
            raise ValueError(f"negative body length {size}")
        total += size
        if total > limit + DRAIN_BYTES:
            raise BodyTooLarge
        while size > 0:
            piece = rfile.read(min(size, 1 << 16))
            if not piece:
                raise ValueError("the request body ended early")
            size -= len(piece)
            if total <= limit:
                into.write(piece)

    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int(rfile.readline(1024).split(b";")[0].strip() or b"0", 16):
            take(size)
            rfile.readline(8)  # the CRLF after the chunk
        while rfile.readline(1024).strip():  # trailers, up to the blank line
            pass
    else:
        take(int(headers.get("content-length") or 0))
    if total > limit:
        raise BodyTooLarge
    return total
