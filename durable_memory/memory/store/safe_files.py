"""Files under a data dir are untrusted input: read and written without following symlinks.

A user's repository can be changed by hand, so any path in it may be a symbolic link (to
`/etc/passwd`, to another user's block), a FIFO (a read would hang), a device or a directory.
Every path is walked from a trusted directory one component at a time with `O_NOFOLLOW`, the
file is `lstat`ed before it is opened (a FIFO or a device is never opened) and `fstat`ed after
(it is the same regular file). Whatever is not a plain directory or regular file is refused with
one line naming it (`UnsafeFile`); so is text that is not valid UTF-8.
"""

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from durable_memory.memory.core.errors import UnsafeFile

MAX_FILE_BYTES = 1 << 20
"""A block file is a few KB; anything over this is refused rather than read into memory."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
    """What kind of file a mode is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refusal(shown: str, what: str) -> UnsafeFile:
    return UnsafeFile(f"{shown} is {what}, not a regular file: refused, nothing was read from it")


@contextlib.contextmanager
def open_dir(
    base: Path, parts: Sequence[str], shown: str, *, create: bool = False
) -> Iterator[int]:
    """A descriptor of `base/parts...`, every component a real directory (no symlink followed).

    `base` is trusted (the configured data dir); `shown` names the path in errors. With
    `create`, missing components are made."""
    fd = os.open(base, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            try:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise  # absent: the caller decides what that means
            except OSError:  # ELOOP (a symlink) or ENOTDIR (a file, a FIFO...): say which
                mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
                where = "/".join([shown, *parts[: i + 1]])
                raise UnsafeFile(
                    f"{where} is {kind_of(mode)}, not a directory: refused, nothing was read "
                    "from it"
                ) from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def read_bytes_at(dir_fd: int, name: str, shown: str) -> bytes | None:
    """The bytes of the regular file `name` in the directory `dir_fd`; None if it is absent."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(before.st_mode):
        raise _refusal(shown, kind_of(before.st_mode))
    if before.st_size > MAX_FILE_BYTES:
        raise UnsafeFile(f"{shown} is {before.st_size} bytes, over {MAX_FILE_BYTES}: refused")
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except FileNotFoundError:
        return None
    except OSError:  # replaced by something else between the lstat and the open
        raise _refusal(shown, "not what it was a moment ago") from None
    with os.fdopen(fd, "rb") as file:
        after = os.fstat(file.fileno())
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (
            before.st_dev,
            before.st_ino,
        ):
            raise _refusal(shown, "not what it was a moment ago")
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise UnsafeFile(f"{shown} grew over {MAX_FILE_BYTES} bytes while read: refused")
    return data


def decode_utf8(data: bytes, shown: str) -> str:
    """Strict UTF-8: a bad byte is refused (never replaced by U+FFFD)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = data[error.start : error.start + 1]
        raise UnsafeFile(
            f"{shown} is not valid UTF-8 (byte {error.start}: {bad!r}): refused"
        ) from None


def write_bytes_at(dir_fd: int, name: str, data: bytes, *, tmp_suffix: str = ".tmp") -> None:
    """Replace `name` in `dir_fd` atomically and durably: a new file `<name><tmp_suffix>` (never
    opened through a symlink left at that name), fsynced, renamed over the old one."""
    tmp = f"{name}{tmp_suffix}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=dir_fd,
    )
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)
