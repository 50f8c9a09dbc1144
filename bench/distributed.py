"""The distributed mode (docs/deploy.md), each figure beside its floor in the same run: every
"host" a process of its own on this machine, on loopback: the Temporal dev server, PostgreSQL,
the git server (`dmem git-serve`), real `dmem worker` processes with separate data dirs, the
client (this process, its own data dir) and the scripted model server answering at once.

- approval -> commit pushed, against an Update through a floor worker running one activity
  that makes a plain `git commit` in a local clone and `git push`es it to the same server;
- turn start -> reply (a plain one, and a tool-using one: model -> tool -> model) on one
  worker, against the floor worker's update-with-start + only the model call(s) as regular
  activities (the same scripted model) + the reply; each leg's user has memory already
  (their first turn runs before the leg);
- a new user's first turn (their memory created, pushed and cloned) beside a floor turn;
- turn start -> reply with two workers on the task queue, against the same turns with one;
- throughput at 50 users, two workers against one (the users' repositories exist beforehand).

Three `dmem worker` processes run throughout: one alone on a task queue, two together on
another, so both sides have the same processes alive; the sides run interleaved (latency) or
in the order two, one, one, two (throughput), so neither gets the warmer machine.

PostgreSQL comes from Debian's packages: run under `pg_virtualenv` (a throwaway cluster on
loopback, `make bench` does it) or give --database-url.

One module (over 300 lines), as each benchmark here is: the hosts it starts, the floors and the
figures read together; what other benchmarks share lives in common.py and processes.py.

    pg_virtualenv -t .venv/bin/python -m bench.distributed [--turns 40] [--users 50]
                                                           [--leg-turns 100] [--out results.json]
"""

import argparse
import asyncio
import concurrent.futures
import functools
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import create_engine, text
from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy

from bench.common import (
    bench_settings,
    describe,
    dev_server_pids,
    machine,
    model_server_process,
    process_tree_cpu,
)
from bench.floor import (
    FloorCallsInput,
    FloorCommit,
    FloorCommitWorkflow,
    FloorModelCallWorkflow,
    plain_git_commit,
    plain_git_push,
)
from bench.pipeline import (
    FIRST_TURNS,
    Turn,
    first_turns,
    history_spans,
    our_workflow_ids,
    ratio_line,
    timed_ms,
    turns_per_second,
)
from bench.processes import start_until_polling, stop_worker
from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import MemorySettings, Settings, TemporalSettings
from durable_memory.demo import free_port
from durable_memory.memory.store.git.remote import CLONES_DIR
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.worker import ACTIVITY_THREADS

ONE, TWO, FLOOR = "bench-one", "bench-two", "bench-floor"
"""The task queues: one worker alone, two workers together, the floor worker."""
WORKER_QUEUES = {"worker-one": ONE, "worker-two-a": TWO, "worker-two-b": TWO}
"""Our workers (each named as its data dir) and their task queues."""


def database_url_from_env() -> str:
    """The PostgreSQL that `pg_virtualenv` started, from the PG* variables it sets."""
    if "PGHOST" not in os.environ or "PGUSER" not in os.environ:
        raise SystemExit(
            "bench.distributed needs PostgreSQL: run it under pg_virtualenv (Debian's "
            "postgresql-common; `make bench` does) or give --database-url"
        )
    user = os.environ["PGUSER"]
    password = quote(os.environ.get("PGPASSWORD", ""), safe="")
    host, port = os.environ["PGHOST"], os.environ.get("PGPORT", "5432")
    database = os.environ.get("PGDATABASE", user)
    return f"postgresql+psycopg://{user}:{password}@{host}:{port}/{database}"


def postgres_pid(database_url: str) -> int | None:
    """The postmaster's pid (from postmaster.pid in its data directory), to read its CPU;
    None when the role may not see the data directory."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            data_dir = conn.execute(text("SHOW data_directory")).scalar_one()
        return int((Path(data_dir) / "postmaster.pid").read_text(encoding="utf-8").split()[0])
    except Exception:  # not a superuser, or a server on another host
        return None
    finally:
        engine.dispose()


def postgres_cpu(pid: int) -> float:
    """The postmaster, the backends it has reaped and the ones still running."""
    live = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text(encoding="utf-8").rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                live += process_tree_cpu(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # a backend that ended meanwhile
    return process_tree_cpu(pid) + live


@contextmanager
def git_server_process(root: Path, token: str, log: Path) -> Iterator[tuple[str, int]]:
    """`dmem git-serve root` in a process of its own, on loopback: (git remote, pid)."""
    port = free_port()
    env = os.environ | {"DMEM_GIT_TOKEN": token}
    argv = [sys.executable, "-m", "durable_memory.cli", "git-serve", str(root)]
    with open(log, "w", encoding="utf-8") as sink:
        process = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the git server did not start: see {log}") from None
                    time.sleep(0.1)
            yield f"http://127.0.0.1:{port}", process.pid
        finally:
            stop_worker(process)


def host_settings(base: Settings, data_dir: Path, task_queue: str, **shared: Any) -> Settings:
    """A host of the distributed mode: its own data dir (clones only), the shared PostgreSQL
    (database and archive) and the git remote (`shared`: database_url, git_remote,
    git_token_file)."""
    memory = MemorySettings(
        data_dir=data_dir, profile=base.memory.profile, archive="postgres", **shared
    )
    temporal = TemporalSettings(task_queue=task_queue)
    return base.model_copy(update={"memory": memory, "temporal": temporal})


def spawn_dmem_worker(
    settings: Settings, temporal: str, model_url: str, token: str, log: Path
) -> subprocess.Popen[str]:
    """`dmem worker` on another "host": only what the distributed mode needs, as variables."""
    memory = settings.memory
    assert memory.database_url is not None
    assert memory.git_remote is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMEM_", "ANTHROPIC_", "PG"))}
    env |= {
        "DMEM_DATA_DIR": str(memory.data_dir),
        "DMEM_DATABASE_URL": memory.database_url,
        "DMEM_ARCHIVE": memory.archive,
        "DMEM_GIT_REMOTE": memory.git_remote,
        "DMEM_GIT_TOKEN": token,
        "DMEM_PROFILE": memory.profile,
        "DMEM_TEMPORAL_ADDRESS": temporal,
        "DMEM_TASK_QUEUE": settings.temporal.task_queue,
        "ANTHROPIC_BASE_URL": model_url,
    }
    argv = [sys.executable, "-m", "durable_memory.cli", "worker"]
    memory.data_dir.mkdir(parents=True)
    return start_until_polling(argv, env, memory.data_dir.parent, log)


def floor_clone(remote: str, token: str, where: Path) -> Path:
    """The floor's local clone of `{remote}/floor.git`, made by a first push."""
    subprocess.run(["git", "init", "-q", "-b", "main", str(where)], check=True)
    (where / "blocks").mkdir()
    plain_git_commit(where, 'name = "floor"\n')
    subprocess.run(
        ["git", "-C", str(where), "remote", "add", "origin", f"{remote}/floor.git"], check=True
    )
    plain_git_push(where, token)
    return where


def commits_with_diff_id(bare: Path) -> int:
    """Commits on the server's copy of a repository that carry an approved diff's Diff-Id."""
    out = subprocess.run(
        ["git", "--git-dir", str(bare), "log", "--format=%(trailers:key=Diff-Id,valueonly)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sum(1 for line in out.splitlines() if line.strip())


def clones_by_worker(data_dirs: dict[str, Path]) -> dict[str, int]:
    """How many users each worker holds a clone of (its cache, `<data_dir>/clones/`)."""
    return {
        name: sum(1 for _ in (data_dir / CLONES_DIR).glob("*/.git"))
        for name, data_dir in data_dirs.items()
    }


class CpuByProcess:
    """CPU seconds by "host": this process (the client), the dev server, the git server and
    each worker with the git processes they ran, the model server, and PostgreSQL (when its
    postmaster is visible)."""

    def __init__(self, pids: dict[str, int], postmaster: int | None) -> None:
        self.pids = pids
        self.postmaster = postmaster

    def read(self) -> dict[str, float]:
        own = os.times()
        found = {
            "client": own.user + own.system,
            "temporal": sum(process_tree_cpu(pid) for pid in dev_server_pids()),
        }
        found |= {name: process_tree_cpu(pid) for name, pid in self.pids.items()}
        if self.postmaster is not None:
            found["postgres"] = postgres_cpu(self.postmaster)
        return found


async def throughput(
    sides: dict[str, Turn],
    prepare: Callable[[str], object],
    meter: CpuByProcess,
    clones: Callable[[], dict[str, int]],
    users: int,
    total: int,
) -> dict[str, Any]:
    """Turns per second with `users` conversations at once, each side twice (two, one, one,
    two), each process's CPU per turn, and the clones the workers made (a user's first turn
    on a worker clones it)."""
    per_user = max(2, total // users)
    turns = users * per_user
    rates: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, dict[str, float]] = {side: {} for side in sides}
    cloned: dict[str, int] = dict.fromkeys(sides, 0)
    order = [*sides, *reversed(sides)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for n, side in enumerate(order):
            prefix = f"tp{users}-{n}-"
            # existing users: creating a repository on the server is not a turn's cost
            await asyncio.gather(
                *(
                    asyncio.get_running_loop().run_in_executor(pool, prepare, f"{prefix}u{u}")
                    for u in range(users)
                )
            )
            before, clones_before = meter.read(), sum(clones().values())
            rates[side].append(await turns_per_second(sides[side], prefix, users, per_user))
            after, made = meter.read(), sum(clones().values()) - clones_before
            cloned[side] += made
            print(
                f"   leg {n + 1}/{len(order)}, {side}: {rates[side][-1]:.1f} turns/s, "
                f"{made} clones made for {users} users"
            )
            for name in before:
                spent = (after[name] - before[name]) * 1000 / turns / 2
                cpu[side][name] = cpu[side].get(name, 0.0) + spent
    mean = {side: sum(r) / len(r) for side, r in rates.items()}
    ours, floor = list(sides)
    print(
        f"throughput, {users} users        {ours} {mean[ours]:6.1f} turns/s | "
        f"{floor} {mean[floor]:6.1f} turns/s | ratio {mean[ours] / mean[floor]:.2f}x"
    )
    for side in sides:
        print(
            f"   CPU ms per turn, {side:<12}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu[side].items())
        )
    return {
        "users": users,
        "turns_per_user": per_user,
        "ours": mean[ours],
        "floor": mean[floor],
        "ratio": mean[ours] / mean[floor],
        "legs": rates,
        "cpu_ms_per_turn": cpu,
        "clones_per_leg": {side: made / 2 for side, made in cloned.items()},
    }


async def approvals(
    client: MemoryClient, temporal: Client, repo: Path, token: str, samples: int
) -> dict[str, Any]:
    """Approval -> commit pushed (ours, one worker) against the floor, interleaved."""
    ours, floor = [], []
    for i in range(samples):
        reply = await client.send_message("approver", f"propose {i}")
        ours.append(await timed_ms(client.approve(reply.diffs[0].id, "bench")))
        handle = await temporal.start_workflow(
            FloorCommitWorkflow.run, id=f"floor-d-{uuid.uuid4().hex}", task_queue=FLOOR
        )
        commit = FloorCommit(repo=str(repo), content=f'name = "floor {i}"\n', push_token=token)
        floor.append(await timed_ms(handle.execute_update(FloorCommitWorkflow.decide, commit)))
    return ratio_line("approval -> commit pushed", ours, floor)


async def measure(
    stack: MemoryStack,
    clients: dict[str, MemoryClient],
    temporal: Client,
    git: tuple[str, Path, str],
    meter: CpuByProcess,
    args: argparse.Namespace,
    scratch: Path,
) -> dict[str, Any]:
    remote, root, token = git
    one, two = clients[ONE], clients[TWO]

    def turn_on(client: MemoryClient) -> Turn:
        async def turn(i: int, user: str) -> None:
            await client.send_message(user, f"hello {i}")

        return turn

    turn_one, turn_two = turn_on(one), turn_on(two)

    async def floor_turn(i: int, model_calls: int) -> str:
        workflow_id = f"floor-{uuid.uuid4().hex}"
        await temporal.execute_update_with_start_workflow(
            FloorModelCallWorkflow.reply,
            start_workflow_operation=WithStartWorkflowOperation(
                FloorModelCallWorkflow.run,
                FloorCallsInput(message=f"floor {i}", model_calls=model_calls),
                id=workflow_id,
                task_queue=FLOOR,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            ),
        )
        return workflow_id

    for i in range(3):  # warm up every worker and the floor's path
        await turn_one(-1, "warm-one")
        await one.send_message("warm-one", "search -1")
        await turn_two(-1, f"warm-two-{i}")
        await floor_turn(-1, 1)
    results: dict[str, Any] = {}
    for key, say, calls, name in (
        ("turn_reply", "hello", 1, "turn: start -> reply"),
        ("tool_turn_reply", "search", 2, "tool turn: model-tool-model"),
    ):
        ours, floor, floor_ids = [], [], []
        await one.send_message(key, f"{say} -1")  # a user with memory: see `first_turns`
        for i in range(args.turns):  # interleaved, so both see the same machine state
            ours.append(await timed_ms(one.send_message(key, f"{say} {i}")))
            t = time.perf_counter()
            floor_ids.append(await floor_turn(i, calls))
            floor.append((time.perf_counter() - t) * 1000)
        results[key] = ratio_line(name, ours, floor)
        print("   ours, median time between the events of a turn's history:")
        spans = {"ours": await history_spans(temporal, await our_workflow_ids(temporal, key, 10))}
        print("   floor:")
        spans["floor"] = await history_spans(temporal, floor_ids[-10:])
        results[f"{key}_spans"] = spans
    results["first_turn_reply"] = await first_turns(
        lambda i: turn_one(i, f"first-{i}"), lambda i: floor_turn(i, 1), FIRST_TURNS
    )
    ours, floor = [], []
    for _ in range(3):  # users with memory, and (most likely) a clone on each worker
        await turn_two(-1, "latency-two")
    await turn_one(-1, "latency-one")
    for i in range(args.turns):
        ours.append(await timed_ms(turn_two(i, "latency-two")))
        floor.append(await timed_ms(turn_one(i, "latency-one")))
    results["turn_two_workers"] = ratio_line("turn, two workers vs one", ours, floor)

    repo = await asyncio.to_thread(floor_clone, remote, token, scratch / "floor-clone")
    results["approval_commit"] = await approvals(one, temporal, repo, token, args.turns)
    pushed = commits_with_diff_id(root / "approver.git")
    print(f"   on the git server: {pushed} commits with a Diff-Id for {args.turns} approvals")
    results["approval_commits_on_remote"] = pushed

    workers = {name: scratch / name for name in WORKER_QUEUES}
    results["throughput"] = await throughput(
        {"two workers": turn_two, "one worker": turn_one},
        stack.blocks.ensure_user,
        meter,
        functools.partial(clones_by_worker, workers),
        args.users,
        args.leg_turns,
    )
    return results


async def main_async(args: argparse.Namespace) -> None:
    info = machine()
    print(f"machine: {describe(info)}")
    database_url = args.database_url or database_url_from_env()
    results: dict[str, Any] = {"machine": info, "load_average_at_start": os.getloadavg()}
    with ExitStack() as resources:
        scratch = Path(resources.enter_context(tempfile.TemporaryDirectory()))
        model_url, model_pid = resources.enter_context(model_server_process())
        token = secrets.token_hex(16)
        (scratch / "git-token").write_text(token + "\n", encoding="utf-8")
        root = scratch / "git"
        remote, git_pid = resources.enter_context(
            git_server_process(root, token, scratch / "git-serve.log")
        )
        shared = {
            "database_url": database_url,
            "git_remote": remote,
            "git_token_file": scratch / "git-token",
        }
        base = bench_settings(scratch / "temporal")  # the dev server's own "host"
        env = await start_dev_server(base)
        settings = host_settings(base, scratch / "client", ONE, **shared)
        temporal = env.client.service_client.config.target_host
        stack = stack_from_settings(settings)  # creates the schema before any worker starts
        hosts = WORKER_QUEUES
        with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
            started = {
                name: pool.submit(
                    spawn_dmem_worker,
                    host_settings(base, scratch / name, queue, **shared),
                    temporal,
                    model_url,
                    token,
                    scratch / f"{name}.log",
                )
                for name, queue in hosts.items()
            }
            workers = {name: future.result() for name, future in started.items()}
        floor_env = {k: v for k, v in os.environ.items() if not k.startswith(("DMEM_", "PG"))}
        workers["floor-worker"] = start_until_polling(
            [
                *(sys.executable, "-m", "bench.floor_worker", temporal, FLOOR),
                *(str(ACTIVITY_THREADS), model_url),
            ],
            floor_env,
            Path.cwd(),
        )
        print(f"hosts: {', '.join(workers)}, git server, temporal, postgres, model, client")
        try:
            pids = {name: process.pid for name, process in workers.items()}
            meter = CpuByProcess(
                pids | {"git-server": git_pid, "model": model_pid}, postgres_pid(database_url)
            )
            clients = {
                queue: MemoryClient(
                    env.client,
                    settings.model_copy(update={"temporal": TemporalSettings(task_queue=queue)}),
                    stack,
                )
                for queue in (ONE, TWO)
            }
            git = (remote, root, token)
            results |= await measure(stack, clients, env.client, git, meter, args, scratch)
        finally:
            for process in workers.values():
                stop_worker(process)
            stack.close()
            await env.shutdown()
    # The machine is shared (two cores): a run beside other work says so in its figures.
    results["load_average_at_end"] = os.getloadavg()
    print(
        f"load average at start {results['load_average_at_start'][0]:.1f}, at end "
        f"{results['load_average_at_end'][0]:.1f}"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=40, help="latency samples of each kind")
    parser.add_argument("--users", type=int, default=50, help="concurrent users, throughput")
    parser.add_argument("--leg-turns", type=int, default=100, help="turns per throughput leg")
    parser.add_argument("--database-url", help="PostgreSQL (default: pg_virtualenv's PG*)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
