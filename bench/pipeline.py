"""Turn reply overhead, approval -> commit visible, and throughput, each beside its floor in
the same run (same dev server, worker settings and converter). The model is the scripted
server, in a process of its own, answering at once, so the figures are our own cost.

    .venv/bin/python -m bench.pipeline [--turns 40] [--users 1,10,50] [--leg-turns 100]
                                       [--out results.json]

Throughput: each user sends turns one after another (a conversation), the users at once;
their repositories exist beforehand. Ours and the floor run in the order ours, floor,
floor, ours so that neither gets the warmer machine. CPU per turn is read per process.
"""

import argparse
import asyncio
import concurrent.futures
import json
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from bench.common import (
    CpuMeter,
    bench_settings,
    describe,
    machine,
    model_server_process,
    p50_p95,
)
from bench.floor import (
    FloorDecisionWorkflow,
    FloorInput,
    FloorTurnWorkflow,
    noop,
    plain_git_commit,
)
from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.worker import (
    ACTIVITY_THREADS,
    WORKFLOWS,
    activities_for,
    freeze_startup_objects,
)

Turn = Callable[[int, str], Awaitable[None]]


async def timed_ms(action: Awaitable[Any]) -> float:
    t = time.perf_counter()
    await action
    return (time.perf_counter() - t) * 1000


def ratio_line(name: str, ours: list[float], floor: list[float]) -> dict[str, Any]:
    o50, o95 = p50_p95(ours)
    f50, f95 = p50_p95(floor)
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
        "ours_ms": ours,
        "floor_ms": floor,
    }


async def activity_times(client: Client, user: str) -> dict[str, float]:
    """Where a turn's time goes: each activity's run time, from the turn's own history."""
    last = [w async for w in client.list_workflows(f"DmemUserId = '{user}'", limit=1)]
    history = await client.get_workflow_handle(last[0].id).fetch_history()
    names: dict[int, str] = {}
    started: dict[int, float] = {}
    spent: dict[str, float] = {}
    for event in history.events:
        t = event.event_time.ToDatetime().timestamp() * 1000
        if event.HasField("activity_task_scheduled_event_attributes"):
            names[event.event_id] = (
                event.activity_task_scheduled_event_attributes.activity_type.name
            )
        elif event.HasField("activity_task_started_event_attributes"):
            started[event.activity_task_started_event_attributes.scheduled_event_id] = t
        elif event.HasField("activity_task_completed_event_attributes"):
            scheduled = event.activity_task_completed_event_attributes.scheduled_event_id
            name = names[scheduled].removeprefix("dmem.")
            spent[name] = spent.get(name, 0.0) + t - started[scheduled]
    print(
        "   one turn, activity run times: " + ", ".join(f"{k} {v:.1f} ms" for k, v in spent.items())
    )
    return spent


async def turns_per_second(turn: Turn, prefix: str, users: int, per_user: int) -> float:
    """Turns per second: `users` conversations at once, each `per_user` turns in a row."""

    async def conversation(u: int) -> None:
        for i in range(per_user):
            await turn(i, f"{prefix}u{u}")

    t = time.perf_counter()
    await asyncio.gather(*(conversation(u) for u in range(users)))
    return users * per_user / (time.perf_counter() - t)


async def _throughput(
    ours: Turn, floor: Turn, stack: MemoryStack, meter: CpuMeter, users: int, total: int
) -> dict[str, Any]:
    per_user = max(2, total // users)
    turns = users * per_user
    rates: dict[str, list[float]] = {"ours": [], "floor": []}
    cpu: dict[str, dict[str, float]] = {}
    for n, side in enumerate(("ours", "floor", "floor", "ours")):
        prefix = f"tp{users}-{n}-"
        for u in range(users):  # existing users: repository creation is not a turn's cost
            await asyncio.to_thread(stack.blocks.ensure_user, f"{prefix}u{u}")
        before = meter.read()
        rates[side].append(
            await turns_per_second(ours if side == "ours" else floor, prefix, users, per_user)
        )
        spent = CpuMeter.per_turn(before, meter.read(), turns)
        cpu[side] = {k: cpu.get(side, {}).get(k, 0.0) + v / 2 for k, v in spent.items()}
    ours_tps, floor_tps = sum(rates["ours"]) / 2, sum(rates["floor"]) / 2
    print(
        f"throughput, {users:>2} concurrent users   ours {ours_tps:6.1f} turns/s | "
        f"floor {floor_tps:6.1f} turns/s | ratio {ours_tps / floor_tps:.2f}x"
    )
    for side in ("ours", "floor"):
        print(
            f"   CPU ms per turn, {side:<5}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu[side].items())
        )
    return {
        "users": users,
        "turns_per_user": per_user,
        "ours": ours_tps,
        "floor": floor_tps,
        "ratio": ours_tps / floor_tps,
        "cpu_ms_per_turn": cpu,
    }


async def main_async(turns: int, user_counts: list[int], leg_turns: int, out: Path | None) -> None:
    info = machine()
    print(f"machine: {describe(info)}")
    results: dict[str, Any] = {"machine": info}
    with (
        tempfile.TemporaryDirectory() as tmp,
        model_server_process() as (model_url, model_pid),
        concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool,
    ):
        settings = bench_settings(Path(tmp) / "data")
        env = await start_dev_server(settings)
        stack = stack_from_settings(settings)
        model = AnthropicModel(base_url=model_url)
        worker = Worker(
            env.client,
            task_queue="bench",
            workflows=[*WORKFLOWS, FloorTurnWorkflow, FloorDecisionWorkflow],
            activities=[*activities_for(stack, model, settings, env.client), noop],
            activity_executor=pool,
            max_concurrent_activities=ACTIVITY_THREADS,
        )
        client = MemoryClient(env.client, settings, stack)
        freeze_startup_objects()  # as run_worker does

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
                ours.append(await timed_ms(our_turn(i)))
                floor.append(await timed_ms(floor_turn(i)))
            results["turn_reply"] = ratio_line("turn: start -> reply", ours, floor)
            results["turn_breakdown"] = await activity_times(env.client, "bench")

            # Approval -> commit visible, against an Update round trip + a plain git commit.
            stack.blocks.ensure_user("floor")
            repo = stack.git.repo_path("floor")
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
            results["approval_commit"] = ratio_line("approval -> commit visible", ours, floor)

            meter = CpuMeter(model_pid)
            results["throughput"] = [
                await _throughput(our_turn, floor_turn, stack, meter, users, leg_turns)
                for users in user_counts
            ]
        stack.close()
        model.close()
        await env.shutdown()
    if out:
        out.write_text(json.dumps(results, indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=40, help="latency samples of each kind")
    parser.add_argument("--users", default="1,10,50")
    parser.add_argument("--leg-turns", type=int, default=100, help="turns per throughput leg")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    users = [int(u) for u in args.users.split(",")]
    asyncio.run(main_async(args.turns, users, args.leg_turns, args.out))


if __name__ == "__main__":
    main()
