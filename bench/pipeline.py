"""Turn reply overhead, approval -> commit visible, and throughput, each beside its floor in
the same run (same dev server, worker settings and converter). The model is the scripted
server answering at once, so the figures are our own cost.

    .venv/bin/python -m bench.pipeline [--turns 60] [--users 1,10,50]
"""

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio.client import WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from bench.floor import (
    FloorDecisionWorkflow,
    FloorInput,
    FloorTurnWorkflow,
    noop,
    plain_git_commit,
)
from durable_memory.client import MemoryClient
from durable_memory.config import MemorySettings, Settings, TemporalSettings
from durable_memory.demo import free_port
from durable_memory.memory.llm import AnthropicModel
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.worker import (
    ACTIVITY_THREADS,
    WORKFLOWS,
    activities_for,
    stack_from_settings,
)

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


class EndlessScript(ScriptedModelServer):
    """Answers every request at once: text-only replies, or one proposal then text."""

    def __init__(self) -> None:
        super().__init__([])

    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        last = body["messages"][-1]["content"]
        blocks = last if isinstance(last, list) else [{"type": "text", "text": last}]
        propose = any(b.get("type") == "text" and "propose" in b["text"] for b in blocks)
        self.extend([PROPOSAL if propose else {"text": "ok"}])
        return super()._answer(body)


def _stats(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.95 * (len(ordered) - 1))]


async def _ms(action: Awaitable[Any]) -> float:
    t = time.perf_counter()
    await action
    return (time.perf_counter() - t) * 1000


async def _throughput(
    turn: Callable[[int, str], Awaitable[None]], users: int, per_user: int
) -> float:
    """Turns per second with `users` users sending `per_user` turns each, all at once."""
    t = time.perf_counter()
    await asyncio.gather(
        *(turn(i, f"tp{users}u{u}") for u in range(users) for i in range(per_user))
    )
    return users * per_user / (time.perf_counter() - t)


async def _breakdown(client: Any, user: str) -> dict[str, float]:
    """Where a turn's time goes: each activity's run time, from the turn's own history."""
    last = [w async for w in client.list_workflows(f"DmemUserId = '{user}'", limit=1)]
    history = await client.get_workflow_handle(last[0].id).fetch_history()
    started: dict[int, tuple[str, float]] = {}
    names: dict[int, str] = {}
    spent: dict[str, float] = {}
    for event in history.events:
        t = event.event_time.ToDatetime().timestamp() * 1000
        if event.HasField("activity_task_scheduled_event_attributes"):
            names[event.event_id] = (
                event.activity_task_scheduled_event_attributes.activity_type.name
            )
        elif event.HasField("activity_task_started_event_attributes"):
            scheduled = event.activity_task_started_event_attributes.scheduled_event_id
            started[scheduled] = (names[scheduled], t)
        elif event.HasField("activity_task_completed_event_attributes"):
            name, begin = started[event.activity_task_completed_event_attributes.scheduled_event_id]
            spent[name] = spent.get(name, 0.0) + t - begin
    print(
        "   one turn, activity run times: "
        + ", ".join(f"{k.removeprefix('dmem.')} {v:.1f} ms" for k, v in spent.items())
    )
    return spent


def _line(name: str, ours: list[float], floor: list[float]) -> dict[str, float]:
    o50, o95 = _stats(ours)
    f50, f95 = _stats(floor)
    print(
        f"{name:<28} ours p50 {o50:7.1f} ms p95 {o95:7.1f} ms | floor p50 {f50:7.1f} ms "
        f"p95 {f95:7.1f} ms | ratio p50 {o50 / f50:.2f}x p95 {o95 / f95:.2f}x"
    )
    return {
        "ours_p50": o50,
        "ours_p95": o95,
        "floor_p50": f50,
        "floor_p95": f95,
        "ratio_p50": o50 / f50,
        "ratio_p95": o95 / f95,
    }


async def main_async(turns: int, user_counts: list[int], out: Path | None) -> None:
    results: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        EndlessScript() as model_server,
        concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool,
    ):
        settings = Settings(
            memory=MemorySettings(data_dir=Path(tmp) / "data", profile="essay_coach"),
            temporal=TemporalSettings(task_queue="bench"),
        )
        settings = settings.model_copy(
            update={
                "dev_server": settings.dev_server.model_copy(
                    update={"port": free_port(), "ui_port": free_port(), "log_level": "error"}
                )
            }
        )
        env = await start_dev_server(settings)
        stack = stack_from_settings(settings)
        model = AnthropicModel(base_url=model_server.url)
        worker = Worker(
            env.client,
            task_queue="bench",
            workflows=[*WORKFLOWS, FloorTurnWorkflow, FloorDecisionWorkflow],
            activities=[*activities_for(stack, model), noop],
            activity_executor=pool,
            max_concurrent_activities=ACTIVITY_THREADS,
        )
        client = MemoryClient(env.client, settings, stack)

        async def our_turn(i: int, user: str = "bench") -> None:
            await client.send_message(user, f"hello {i}")

        async def floor_turn(i: int, user: str = "bench") -> None:
            start = WithStartWorkflowOperation(
                FloorTurnWorkflow.run,
                FloorInput(user_id=user, message=f"hello {i}"),
                id=f"floor-{uuid.uuid4().hex}",
                task_queue="bench",
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            )
            await env.client.execute_update_with_start_workflow(
                FloorTurnWorkflow.reply, start_workflow_operation=start
            )

        async with worker:
            for _ in range(3):  # warm up both paths
                await our_turn(-1)
                await floor_turn(-1)
            ours, floor = [], []
            for i in range(turns):  # interleaved, so both see the same machine state
                ours.append(await _ms(our_turn(i)))
                floor.append(await _ms(floor_turn(i)))
            results["turn_reply"] = _line("turn: start -> reply", ours, floor)
            results["turn_breakdown"] = await _breakdown(env.client, "bench")

            # Approval -> commit visible, against an Update round trip + a plain git commit.
            stack.service.ensure_user("floor")
            repo = stack.service.git.repo_path("floor")
            ours, floor = [], []
            for i in range(turns):
                reply = await client.send_message("approver", f"propose {i}")
                t = time.perf_counter()
                await client.approve(reply.diffs[0].id, "bench")
                ours.append((time.perf_counter() - t) * 1000)
                handle = await env.client.start_workflow(
                    FloorDecisionWorkflow.run, id=f"floor-d-{uuid.uuid4().hex}", task_queue="bench"
                )
                t = time.perf_counter()
                await handle.execute_update(FloorDecisionWorkflow.decide, i)
                await asyncio.to_thread(plain_git_commit, repo, f'name = "floor {i}"\n')
                floor.append((time.perf_counter() - t) * 1000)
            results["approval_commit"] = _line("approval -> commit visible", ours, floor)

            for users in user_counts:
                per_user = max(2, turns // users)
                ours_tps = await _throughput(our_turn, users, per_user)
                floor_tps = await _throughput(floor_turn, users, per_user)
                print(
                    f"throughput, {users:>2} concurrent users   ours {ours_tps:6.1f} turns/s | "
                    f"floor {floor_tps:6.1f} turns/s | ratio {ours_tps / floor_tps:.2f}x"
                )
                results[f"throughput_{users}"] = {
                    "ours": ours_tps,
                    "floor": floor_tps,
                    "ratio": ours_tps / floor_tps,
                }
        stack.close()
        model.close()
        await env.shutdown()
    if out:
        out.write_text(json.dumps(results, indent=2), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--users", default="1,10,50")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    print(
        f"machine: {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} "
        "cores; dev server and worker in this process; scripted model answering at once"
    )
    asyncio.run(main_async(args.turns, [int(u) for u in args.users.split(",")], args.out))


if __name__ == "__main__":
    main()
