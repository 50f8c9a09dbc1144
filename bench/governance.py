"""How long the governance commands take (docs/governance.md): `MemoryClient.forget_user` and
`MemoryClient.redact`, end to end and per step, for users with a realistic history; the
redaction's history rewrite beside the floor a skeptic would pick, in the same run.

    .venv/bin/python -m bench.governance [--commits 20,200] [--turns 5] [--out results.json]

Real processes, as deployed: the dev server, one `dmem worker` (it runs the workflows'
activities), the scripted model server; the client in this process. Each user has, before
it is measured: `commits` approved edits of block `student` (each a diff proposed and
approved, so a commit with its trailers), recall of that many turns (a message and a reply
each), a summary per ten turns, two archival passages per turn, and `turns` real turns
through the worker (their executions are what a forget ends and deletes). A redaction's user
has the text approved into the block's first version, so every later version holds it too,
and in two recall messages, a summary and two passages.

Per step: both workflows delete their own execution as their last step, so their history
cannot be read after. It is read while they run instead (a long poll on the history,
`wait_new_event`, up to the deletion): each activity's span is its scheduled -> completed
time in the server's history (so queueing on the worker is counted in the step); the last
step (the self-deletion) has no completion event and is counted up to the moment the client
saw the end. What no activity covers (starting, workflow tasks, the client's own reads) is
`between steps`.

The floor of the rewrite, on a copy of the same repository taken just before the redaction:
`git fast-export main | sed 's/TEXT/[redacted]/g' | git fast-import --force`, then the same
purge as ours (the index and work tree reset to the new main, reflogs expired, `gc
--prune=now`). The text is as long as `[redacted]`, so the stream's `data <length>` headers
stay right under sed. The floor runs on three copies and its best run counts.

A forget has no floor: the figures name each step's share. Its deletion step is set beside the
server's part of it alone (`_deletion_floor`: the same executions deleted and visibility
listed until it lists none, from this process), measured once before the forgets (the first
deletion after the dev server starts, which waits far longer) and once after. The client's
check before a redaction starts (`preflight`, read-only) is timed alone too: it is part of the
redaction's `between steps`.

One module (over 300 lines), as each benchmark here is: the users' history, the two commands'
timing, and the floors they are set beside read together.
"""

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from bench.archive_search import RandomVectors
from bench.common import bench_settings, describe, machine, model_server_process
from bench.processes import stop_worker
from durable_memory.activities.forget import delete_execution, user_workflows_query
from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.service.redaction import Redactions, redaction_id
from durable_memory.memory.store.redaction.history import REDACTED
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.diffs import Proposer
from durable_memory.models.history import RedactInput, redact_workflow_id
from durable_memory.models.operations import SetField
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.models.turn import forget_workflow_id
from durable_memory.workers.dev_server import start_dev_server
from tests.support.worker_process import spawn_worker

SECRET = "zq7secretx"
"""The redacted text: as long as `[redacted]` (the floor's sed keeps the stream's lengths),
one token to the full-text indexes."""
assert len(SECRET) == len(REDACTED)
LABEL = "student"
REVIEWER = "ms-rivera"
DPO = "dpo@school.example"
REASON = "address approved by mistake"
FLOOR_RUNS = 3
"""The floor's rewrite runs on this many copies; its best run is the floor (its purge's gc
varies several-fold from run to run on this machine)."""


def _populate(stack: MemoryStack, archive: SqliteArchive, user: str, commits: int) -> None:
    """The user's history (module docstring); with the secret if the user is a redaction's."""
    secret = user.startswith("redact")
    stack.blocks.ensure_user(user)
    for n in range(commits):
        if n == 0:
            where = f"lives at {SECRET}" if secret else "first in the family to apply"
            edit = SetField(field="background", value=f"junior, {where}")
        elif n % 2:
            edit = SetField(field="name", value=f"Alex (draft {n})")
        else:
            edit = SetField(field="goals", value=[f"study robotics (essay {n})"])
        diff = stack.review.propose(user, LABEL, edit, "learned", Proposer.turn(f"t{n}"))
        stack.review.approve(diff.id, REVIEWER, user_id=user)
        said = f"I live at {SECRET} now" if secret and n in (0, commits // 2) else f"turn {n}"
        stack.recall.append(
            user,
            f"t{n}",
            [
                NewMessage(role=MessageRole.USER, content=f"{said}: the essay, part {n}"),
                NewMessage(role=MessageRole.ASSISTANT, content=f"noted, part {n} of the essay"),
            ],
        )
        if n % 10 == 9:
            where = f" at {SECRET}" if secret and n == 9 else ""
            stack.summaries.add(user, 2 * n + 2, f"the student{where} drafted part {n}")
        for k in range(2):
            held = f" (home {SECRET})" if secret and n == 0 else ""
            archive.insert(
                NewPassage(
                    user_id=user,
                    text=f"{user}: turn {n} note {k} on the essay plan{held}",
                    source=PassageSource.AGENT,
                )
            )


async def _history_while_it_runs(
    client: Client, workflow_id: str, events: list[HistoryEvent]
) -> None:
    """Append the execution's events as they happen, until it is deleted (or cancelled)."""
    handle = client.get_workflow_handle(workflow_id)
    while True:
        try:
            async for event in handle.fetch_history_events(wait_new_event=True):
                events.append(event)
            return
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND or events:  # not started yet: again
                return
            await asyncio.sleep(0.005)


def _steps(events: list[HistoryEvent], ended_ms: float) -> dict[str, float]:
    """Each activity's scheduled -> completed span in ms, named by its summary, in order; an
    activity never completed (the self-deletion) up to `ended_ms`."""
    scheduled: dict[int, tuple[str, float]] = {}
    found: dict[str, float] = {}
    for event in events:
        at = float(event.event_time.ToMilliseconds())
        if event.HasField("activity_task_scheduled_event_attributes"):
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            if event.user_metadata.HasField("summary"):
                name = json.loads(event.user_metadata.summary.data)
            scheduled[event.event_id] = (name, at)
            found[name] = 0.0  # its place in the order
        elif event.HasField("activity_task_completed_event_attributes"):
            attributes = event.activity_task_completed_event_attributes
            name, since = scheduled.pop(attributes.scheduled_event_id)
            found[name] = at - since
    for name, since in scheduled.values():
        found[name] = ended_ms - since
    return found


async def _timed(
    client: MemoryClient, workflow_id: str, call: Any, total_label: str
) -> dict[str, Any]:
    """Run the client call, reading its workflow's history meanwhile: end to end and steps."""
    events: list[HistoryEvent] = []
    watcher = asyncio.create_task(_history_while_it_runs(client.client, workflow_id, events))
    t = time.perf_counter()
    await call
    total = (time.perf_counter() - t) * 1000
    ended_ms = time.time() * 1000
    await asyncio.sleep(0.2)  # the last events, if the long poll has them
    watcher.cancel()
    steps = _steps(events, ended_ms)
    between = total - sum(steps.values())
    print(f"  {total_label}: {total:8.0f} ms end to end")
    for name, ms in steps.items():
        print(f"    {ms:8.1f} ms {100 * ms / total:5.1f}%  {name}")
    print(f"    {between:8.1f} ms {100 * between / total:5.1f}%  between steps")
    return {"total_ms": total, "steps_ms": steps, "between_steps_ms": between}


def _git(repository: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repository, check=True, capture_output=True, text=True
    ).stdout


def _floor_rewrite(repository: Path) -> dict[str, float]:
    """The skeptic's rewrite of the same history on a copy, and the same purge: ms each."""
    t = time.perf_counter()
    subprocess.run(
        [
            "bash",
            "-o",
            "pipefail",
            "-c",
            f"git fast-export main | sed 's/{SECRET}/{REDACTED}/g' | git fast-import --force "
            "--quiet",
        ],
        cwd=repository,
        check=True,
    )
    rewrite = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    _git(repository, "read-tree", "-u", "--reset", "main")
    _git(repository, "reflog", "expire", "--expire=now", "--all")
    _git(repository, "gc", "--prune=now", "--quiet")
    purge = (time.perf_counter() - t) * 1000
    objects = subprocess.run(
        ["git", "cat-file", "--batch-all-objects", "--batch"],
        cwd=repository,
        check=True,
        capture_output=True,
    ).stdout
    if SECRET.encode() in objects:
        raise RuntimeError("the floor's rewrite left the text in the repository")
    return {"rewrite_ms": rewrite, "purge_ms": purge, "total_ms": rewrite + purge}


async def _forget(client: MemoryClient, user: str) -> dict[str, Any]:
    return await _timed(
        client,
        forget_workflow_id(user),
        client.forget_user(user, requested_by=DPO, reason="erasure request (bench)"),
        f"forget {user}",
    )


async def _deletion_floor(client: MemoryClient, user: str) -> dict[str, float]:
    """The server's part of the forget's deletion step, alone: the user's executions (found
    as the forget finds them) deleted and visibility listed every 200 ms until it lists none,
    as `dmem.delete_user_workflows` does, from this process."""
    executions = [
        (w.id, w.run_id) async for w in client.client.list_workflows(user_workflows_query(user))
    ]
    t = time.perf_counter()
    for workflow_id, run_id in executions:
        await delete_execution(client.client, workflow_id, run_id)
    deleted = (time.perf_counter() - t) * 1000
    while [w async for w in client.client.list_workflows(user_workflows_query(user))]:
        await asyncio.sleep(0.2)
    listed_empty = (time.perf_counter() - t) * 1000
    print(
        f"  deleting {len(executions)} executions of {user} alone: the calls {deleted:.0f} ms, "
        f"until visibility lists none {listed_empty:.0f} ms"
    )
    return {
        "executions": len(executions),
        "delete_calls_ms": deleted,
        "until_unlisted_ms": listed_empty,
    }


def _preflight_ms(stack: MemoryStack, user: str) -> float:
    """The client's check before it starts a redaction (`Redactions.preflight`, read-only),
    alone: part of `between steps`."""
    request = RedactInput(
        user_id=user,
        label=LABEL,
        text=SECRET,
        requested_by=DPO,
        reason=REASON,
        redaction_id=redaction_id(user, LABEL, SECRET),
    )
    t = time.perf_counter()
    Redactions(stack.blocks, stack.git, stack.engine).preflight(request)
    return (time.perf_counter() - t) * 1000


async def _redact(
    client: MemoryClient, stack: MemoryStack, user: str, scratch: Path
) -> dict[str, Any]:
    """The redaction timed (end to end, steps, the client's check) beside its floor."""
    repository = stack.git.repo_path(user)
    copies = [scratch / f"floor-{user}-{n}" for n in range(FLOOR_RUNS)]
    for copy in copies:
        shutil.copytree(repository, copy, symlinks=True)
    commits = int(_git(repository, "rev-list", "--count", "main"))
    preflight = await asyncio.to_thread(_preflight_ms, stack, user)
    ours = await _timed(
        client,
        redact_workflow_id(user),
        client.redact(user, LABEL, SECRET, requested_by=DPO, reason=REASON),
        f"redact {user} ({commits} commits)",
    )
    runs = [await asyncio.to_thread(_floor_rewrite, copy) for copy in copies]
    floor: dict[str, Any] = {**min(runs, key=lambda run: run["total_ms"]), "runs": runs}
    rewrite = next(ms for name, ms in ours["steps_ms"].items() if "rewrite" in name)
    ratios = {
        "repository_step_vs_floor": rewrite / floor["total_ms"],
        "end_to_end_vs_floor": ours["total_ms"] / floor["total_ms"],
    }
    print(
        f"    floor (fast-export | sed | fast-import, then the same purge): "
        f"{floor['rewrite_ms']:.0f} + {floor['purge_ms']:.0f} ms; our repository step "
        f"{ratios['repository_step_vs_floor']:.2f}x, end to end "
        f"{ratios['end_to_end_vs_floor']:.2f}x"
    )
    print(f"    of its between steps: the client's check before it starts {preflight:.0f} ms")
    return ours | {"commits": commits, "preflight_ms": preflight, "floor": floor} | ratios


async def main_async(sizes: list[int], turns: int, out: Path | None) -> None:
    info = machine()
    print(f"machine: {describe(info)}")
    results: dict[str, Any] = {"machine": info, "turns_per_user": turns, "users": {}}
    with tempfile.TemporaryDirectory() as tmp, model_server_process() as (model_url, _):
        settings = bench_settings(Path(tmp) / "data", task_queue="bench-governance")
        stack = stack_from_settings(settings)
        real = default_embedder()  # the worker embeds a redacted passage with the real one
        archive = SqliteArchive(
            settings.memory.data_dir / "archive.db", RandomVectors(real.name, real.dim)
        )
        t = time.perf_counter()
        for size in sizes:
            for kind in ("forget", "redact"):
                await asyncio.to_thread(_populate, stack, archive, f"{kind}{size}", size)
        for probe in ("probe", "probe2"):
            await asyncio.to_thread(_populate, stack, archive, probe, 1)
        archive.close()
        print(f"users populated in {time.perf_counter() - t:.0f}s")
        env = await start_dev_server(settings)
        worker = spawn_worker(settings, env.client.service_client.config.target_host, model_url)
        client = MemoryClient(env.client, settings, stack)
        try:
            users = [f"{kind}{size}" for size in sizes for kind in ("forget", "redact")]
            for user in [*users, "probe", "probe2"]:
                for n in range(turns):
                    await client.send_message(user, f"hello {n}")
            results["load_average_at_start"] = os.getloadavg()
            # The first deletion of closed executions after the server starts waits for the
            # server far longer than later ones: measured alone, before the forgets.
            results["deletion_floor_first"] = await _deletion_floor(client, "probe")
            for size in sizes:
                results["users"][str(size)] = {
                    "redact": await _redact(client, stack, f"redact{size}", Path(tmp)),
                    "forget": await _forget(client, f"forget{size}"),
                }
            results["deletion_floor"] = await _deletion_floor(client, "probe2")
            results["load_average_at_end"] = os.getloadavg()
        finally:
            stop_worker(worker)
            stack.close()
            await env.shutdown()
    if out:
        out.write_text(json.dumps(results, indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--commits", default="20,200", help="approved commits per user")
    parser.add_argument("--turns", type=int, default=5, help="real turns per user")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    sizes = [int(n) for n in args.commits.split(",")]
    asyncio.run(main_async(sizes, args.turns, args.out))


if __name__ == "__main__":
    main()
