"""Children a test stops with SIGINT, as a person's Ctrl-C stops the command."""

import signal
import subprocess
from typing import Any


def popen_interruptible(argv: list[str], **options: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, **options)` whose child takes SIGINT as a terminal's Ctrl-C
    does (Python's KeyboardInterrupt). A child inherits an ignored SIGINT: a test run started
    in the background by a shell without job control (`make test &`, `nohup`) ignores it,
    and so would every command it starts, which then never stops on SIGINT. A handled
    signal is reset to its default across exec, so the child gets Python's handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, **options)
    finally:
        signal.signal(signal.SIGINT, previous)
