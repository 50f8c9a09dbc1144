"""Where a turn's CPU goes in the worker: py-spy samples a real `dmem worker` process while it
answers turns one after another (a message, one call to an instant scripted model, the
reply), and the samples are drawn as a flame graph and summed by library and by turn step.

With `--cpu`, no sampling: the worker's CPU per turn beside the floor worker's
(`bench/floor_worker.py`, a process of its own on the same dev server: update-with-start,
only the model call(s), the reply), for plain turns and tool-using turns (model -> tool ->
model against two model calls), in the order ours, floor, floor, ours. Each worker is a
process of its own, so the figures are the workers' alone (no client, no dev server).

py-spy (a dev dependency) reads the worker's memory through ptrace: run as root, or where
/proc/sys/kernel/yama/ptrace_scope allows a process to trace its children. Only threads
running at a sample count (py-spy leaves idle ones out), so the figures are CPU, not waits.

    .venv/bin/python -m bench.profile_turn [--turns 200] [--rate 250] [--say hello|search]
        [--out bench/results/profile_turn.json] [--image docs/images/turn-flamegraph.png]
        [--stacks FILE]
    .venv/bin/python -m bench.profile_turn --cpu [--turns 200] [--out bench/results/turn_cpu.json]
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle
from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy

from bench.common import bench_settings, describe, machine, model_server_process
from bench.floor import FloorCallsInput, FloorModelCallWorkflow
from bench.processes import start_until_polling, stop_worker
from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.worker import ACTIVITY_THREADS
from tests.support.worker_process import spawn_worker

USERS = 10
"""Turns go round these users, so no one conversation grows long (bench/context_compile.py
measures that)."""
WARM_UP_TURNS = 20
"""Run before sampling: each user's first turn creates their memory, the first turn of the
process loads the tokenizer."""

LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ours", ("durable_memory/",)),
    ("temporalio", ("temporalio/", "google/protobuf")),
    ("anthropic SDK, httpx", ("anthropic/", "httpx", "httpcore", "h11/", "anyio/")),
    ("pydantic", ("pydantic",)),
    ("SQLAlchemy, sqlite3", ("sqlalchemy/", "sqlmodel/", "sqlite3/")),
    ("GitPython, subprocess", ("git/", "gitdb/", "subprocess.py")),
    ("tiktoken", ("tiktoken",)),
)
"""A frame's library, from the start of its file name as py-spy shortens it."""
COLORS = {
    "ours": "#4c72b0",
    "temporalio": "#dd8452",
    "anthropic SDK, httpx": "#55a868",
    "pydantic": "#c44e52",
    "SQLAlchemy, sqlite3": "#8172b3",
    "GitPython, subprocess": "#937860",
    "tiktoken": "#da8bc3",
    "Python (stdlib)": "#b0b0b0",
}
STEPS = {
    "prepare": "prepare",
    "prepare_context": "prepare",
    "call_model": "call_model",
    "run_tools": "run_tools",
    "finish": "finish",
}
"""The turn's steps (`TurnSteps`, memory/agent/steps.py), found by name in a stack (method ->
step): a turn's first activity runs prepare (as `prepare_context`, which hands the stored
context on) and call_model, a later one run_tools and call_model."""
STEPS_FILE = "agent/steps.py"
ACTIVITIES = ("start_turn", "tools_then_model", "prepare_turn", "call_model", "run_tools")
"""The turn's activities (activities/turn.py) that run those steps: a sample in one of them
but in none of its steps is the activity's own work around them (its checks, the gate)."""
THREAD_START = ("Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run")
"""Frames every thread's stack starts with, left out of the picture."""

Stack = tuple[str, ...]
OUT = Path("bench/results/profile_turn.json")


def library(frame: str) -> str:
    """`name (file:line)` -> the library the file belongs to."""
    file = frame[frame.rfind("(") + 1 :]
    for name, prefixes in LIBRARIES:
        if file.startswith(prefixes):
            return name
    return "Python (stdlib)"


def read_stacks(raw: Path) -> Counter[Stack]:
    """py-spy's raw output (`frame;frame;... count`, outermost first) as counts per stack."""
    stacks: Counter[Stack] = Counter()
    for line in raw.read_text(encoding="utf-8").splitlines():
        path, _, count = line.rpartition(" ")
        frames = tuple(path.split(";"))
        while frames and frames[0].split(" ")[0] in THREAD_START:
            frames = frames[1:]
        if frames:
            stacks[frames] += int(count)
    return stacks


def step_of(stack: Stack) -> str:
    """Which part of the worker's work a sample is in."""
    around = None
    for frame in stack:
        name = frame.split(" ")[0].rsplit(".", 1)[-1]
        if name in STEPS and STEPS_FILE in frame:
            return f"step {STEPS[name]}"
        if name in ACTIVITIES and around is None:
            around = f"activity {name}, around its steps"
    if around is not None:
        return around
    files = " ".join(stack)
    if "_workflow_instance" in files or "workflow_sandbox" in files:
        return "workflow tasks (the sandboxed TurnWorkflow)"
    if "temporalio/" in files:
        return "Temporal worker, other (polling, completing tasks)"
    return "other"


def shares(counts: Iterable[tuple[str, int]], total: int) -> dict[str, float]:
    summed: Counter[str] = Counter()
    for key, count in counts:
        summed[key] += count
    return {key: round(100 * count / total, 1) for key, count in summed.most_common()}


def summarize(stacks: Counter[Stack]) -> dict[str, Any]:
    """Shares of the samples (percent): by library of the innermost frame (where the CPU
    is spent), by step (inclusive), and the functions with most samples of their own."""
    total = sum(stacks.values())
    return {
        "samples": total,
        "by_library_self_pct": shares(((library(s[-1]), n) for s, n in stacks.items()), total),
        "by_step_pct": shares(((step_of(s), n) for s, n in stacks.items()), total),
        "top_self_pct": dict(
            list(shares(((s[-1], n) for s, n in stacks.items()), total).items())[:15]
        ),
    }


@dataclass
class Node:
    count: int = 0
    children: dict[str, "Node"] = field(default_factory=dict)


def _tree(stacks: Counter[Stack]) -> Node:
    root = Node()
    for stack, count in stacks.items():
        root.count += count
        node = root
        for frame in stack:
            node = node.children.setdefault(frame, Node())
            node.count += count
    return root


def _short(frame: str) -> str:
    """`Class.method (package/module.py:12)` -> `Class.method (module.py)`."""
    name, _, file = frame.partition(" (")
    return f"{name} ({file.rstrip(')').rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


def draw_flame_graph(stacks: Counter[Stack], title: str, out: Path) -> None:
    """A flame graph: the outermost frames at the bottom, each frame as wide as its share of
    the samples, coloured by library; frames under 0.3% of the samples are left out."""
    root = _tree(stacks)
    boxes: list[tuple[float, int, float, str]] = []  # x, depth, width, frame

    def place(node: Node, x: float, depth: int) -> None:
        for frame, child in sorted(node.children.items(), key=lambda kv: -kv[1].count):
            width = child.count / root.count
            if width >= 0.003:
                boxes.append((x, depth, width, frame))
                place(child, x, depth + 1)
            x += width

    place(root, 0.0, 0)
    depth = max(d for _, d, _, _ in boxes) + 1
    fig, ax = plt.subplots(figsize=(18, 0.19 * depth + 1.6))
    for x, d, width, frame in boxes:
        ax.add_patch(
            Rectangle(
                (x, d), width, 0.92, facecolor=COLORS[library(frame)], edgecolor="white", lw=0.3
            )
        )
        label = _short(frame)
        room = int(width * 260)  # characters that fit at this figure width and font size
        if room >= 6:
            text = label if len(label) <= room else label[: room - 2] + ".."
            ax.text(x + 0.002, d + 0.45, text, fontsize=5.5, va="center", clip_on=True)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, depth)
    ax.set_yticks([])
    ax.set_xlabel("share of the worker's CPU samples")
    ax.set_title(title, fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: make setup (it is a dev dependency)")
    return found


async def _turns(client: MemoryClient, start: int, count: int, say: str = "hello") -> None:
    for n in range(start, start + count):
        await client.send_message(f"user{n % USERS:02d}", f"{say} again, message {n}")


FLOOR_QUEUE = "bench-profile-floor"
KINDS = (("plain", "hello", 1), ("tool", "search", 2))
"""Each kind of turn: what our user says (the scripted model answers "search" with an
archival search, so model -> tool -> model), and the floor's model calls for it."""


async def _floor_turns(client: Client, start: int, count: int, model_calls: int) -> None:
    for n in range(start, start + count):
        operation = WithStartWorkflowOperation(
            FloorModelCallWorkflow.run,
            FloorCallsInput(message=f"floor {n}", model_calls=model_calls),
            id=f"floor-{model_calls}-{n}",
            task_queue=FLOOR_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        await client.execute_update_with_start_workflow(
            FloorModelCallWorkflow.reply, start_workflow_operation=operation
        )


async def cpu_per_turn(turns: int) -> dict[str, Any]:
    """Worker CPU ms per turn, ours and the floor worker's, for each kind of turn."""
    with tempfile.TemporaryDirectory() as tmp, model_server_process() as (model_url, _):
        settings = bench_settings(Path(tmp) / "data", task_queue="bench-profile")
        env = await start_dev_server(settings)
        stack = stack_from_settings(settings)
        client = MemoryClient(env.client, settings, stack)
        address = env.client.service_client.config.target_host
        ours = spawn_worker(settings, address, model_url)
        floor_argv = ["-m", "bench.floor_worker", address, FLOOR_QUEUE, str(ACTIVITY_THREADS)]
        floor = start_until_polling(
            [sys.executable, *floor_argv, model_url],
            {k: v for k, v in os.environ.items() if not k.startswith("DMEM_")},
            Path.cwd(),
        )
        results: dict[str, Any] = {}
        try:
            for kind, say, calls in KINDS:
                await _turns(client, 0, WARM_UP_TURNS, say)
                await _floor_turns(env.client, -WARM_UP_TURNS, WARM_UP_TURNS, calls)
                spent = {"ours": 0.0, "floor": 0.0}
                half = turns // 2
                for n, side in enumerate(("ours", "floor", "floor", "ours")):
                    process = ours if side == "ours" else floor
                    before = _cpu_seconds(process.pid)
                    if side == "ours":
                        await _turns(client, WARM_UP_TURNS + n * half, half, say)
                    else:
                        await _floor_turns(env.client, n * half, half, calls)
                    spent[side] += _cpu_seconds(process.pid) - before
                per_turn = {side: round(s * 1000 / (2 * half), 1) for side, s in spent.items()}
                ratio = round(per_turn["ours"] / per_turn["floor"], 2)
                results[kind] = {**per_turn, "ratio": ratio}
                print(f"{kind} turn, worker CPU ms per turn: {results[kind]}")
        finally:
            stop_worker(ours)
            stop_worker(floor)
            stack.close()
            await env.shutdown()
    return {"turns": turns, "load_average": os.getloadavg(), "worker_cpu_ms_per_turn": results}


async def profile(turns: int, rate: int, raw: Path, say: str = "hello") -> dict[str, Any]:
    """Sample a worker through `turns` turns (after a warm-up) into `raw`; `say`: what the
    user says (`search`: tool-using turns)."""
    with tempfile.TemporaryDirectory() as tmp, model_server_process() as (model_url, _):
        settings = bench_settings(Path(tmp) / "data", task_queue="bench-profile")
        env = await start_dev_server(settings)
        stack = stack_from_settings(settings)
        client = MemoryClient(env.client, settings, stack)
        worker = spawn_worker(settings, env.client.service_client.config.target_host, model_url)
        try:
            await _turns(client, 0, WARM_UP_TURNS, say)
            sampling = ["--pid", str(worker.pid), "--rate", str(rate), "--nonblocking", "--gil"]
            recorder = subprocess.Popen(
                [_py_spy(), "record", *sampling, "--format", "raw", "--function", "-o", str(raw)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            await asyncio.sleep(1)  # py-spy attached
            cpu = _cpu_seconds(worker.pid)
            await _turns(client, WARM_UP_TURNS, turns, say)
            cpu_ms = (_cpu_seconds(worker.pid) - cpu) * 1000 / turns
            recorder.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            _, err = recorder.communicate(timeout=60)
            if recorder.returncode != 0 or not raw.exists():
                raise SystemExit(f"py-spy failed (ptrace not allowed here?):\n{err}")
        finally:
            stop_worker(worker)
            stack.close()
            await env.shutdown()
    return {
        "turns": turns,
        "says": say,
        "rate_hz": rate,
        "worker_cpu_ms_per_turn": round(cpu_ms, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument(
        "--cpu", action="store_true", help="no sampling: CPU per turn, ours and the floor's"
    )
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--image", type=Path, default=Path("docs/images/turn-flamegraph.png"))
    parser.add_argument(
        "--say",
        default="hello",
        help="what each turn's user says: hello (plain turns) or search (model -> tool -> model)",
    )
    parser.add_argument(
        "--stacks",
        type=Path,
        help="keep py-spy's samples here, one stack a line (flamegraph.pl, speedscope read them)",
    )
    args = parser.parse_args()
    matplotlib.use("Agg")
    info = machine()
    print(f"machine: {describe(info)}")
    if args.cpu:
        out = args.out if args.out != OUT else Path("bench/results/turn_cpu.json")
        cpu = {"machine": info, **asyncio.run(cpu_per_turn(args.turns))}
        out.write_text(json.dumps(cpu, indent=1), encoding="utf-8")
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.stacks or Path(tmp) / "stacks.txt"
        run = asyncio.run(profile(args.turns, args.rate, raw, args.say))
        stacks = read_stacks(raw)
    results = {"machine": info, **run, **summarize(stacks)}
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1))
    args.out.write_text(json.dumps(results, indent=1), encoding="utf-8")
    args.image.parent.mkdir(parents=True, exist_ok=True)
    shape = (
        "two instant scripted model calls around an archival search"
        if args.say == "search"
        else "one instant scripted model call, no tool"
    )
    draw_flame_graph(
        stacks,
        f"dmem worker, {args.turns} turns one after another (each: {shape}): "
        f"{run['worker_cpu_ms_per_turn']} ms of worker CPU per turn, "
        f"{results['samples']} samples by py-spy",
        args.image,
    )


if __name__ == "__main__":
    main()
