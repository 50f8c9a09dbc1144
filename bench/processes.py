"""Starting the long-running processes a benchmark or test talks to (`dmem worker`, the floor
worker) and knowing when they are ready. Shared by bench/ and tests/support/worker_process.py
(a benchmark does not import tests/)."""

import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

POLLING = "worker on task queue"
"""The line a worker (ours or the floor's) writes to stderr once it polls its task queue."""


def start_until_polling(
    argv: list[str], env: dict[str, str], cwd: Path, log: Path | None = None
) -> subprocess.Popen[str]:
    """Start a worker process and return once it says it polls its task queue. Its stderr is
    drained in a thread, so a chatty worker never blocks on a full pipe; with `log`, every
    line is appended there, for a test that must show what its workers said."""
    process = subprocess.Popen(argv, env=env, text=True, stderr=subprocess.PIPE, cwd=cwd)
    assert process.stderr is not None
    sink = open(log, "a", encoding="utf-8") if log else None  # noqa: SIM115 (the drain closes it)
    deadline = time.monotonic() + 60
    for line in process.stderr:
        if sink:
            sink.write(line)
        if POLLING in line or time.monotonic() > deadline:
            break
    threading.Thread(target=_drain, args=(process.stderr, sink), daemon=True).start()
    return process


def _drain(stream: IO[str], sink: IO[str] | None) -> None:
    if sink is None:
        stream.read()
        return
    with sink:
        for line in stream:
            sink.write(line)
            sink.flush()


def stop_worker(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        process.wait(30)
