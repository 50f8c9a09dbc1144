"""Turn reply overhead, approval -> commit visible, and throughput, each beside its floor in
the same run (same dev server, worker settings and converter). The model is the scripted
server, in a process of its own, answering at once, so the figures are our own cost.

Each latency leg's user has memory already (their first turn, which creates it, runs before
the leg); a new user's first turn is a leg of its own (`first_turns`).

    .venv/bin/python -m bench.pipeline [--turns 40] [--users 1,10,50] [--leg-turns 100]
                                       [--out results.json]

The latency floors are the ones a skeptic picks (bench/floor.py): a turn against
update-with-start + only its model call(s) as regular activities (the same scripted model)
+ the reply; a tool-using turn (model -> tool -> model) against two model calls; an approval
against an Update + one activity that commits. Where the time goes is read from the
histories of both sides (`history_spans`) and from each activity's run in the worker
(`StepTimer`, local ones included).

One module (over 300 lines), as each benchmark here is: its legs, their floors and the
breakdown of where the time goes read together; bench/distributed.py reuses its timing
helpers.

Throughput: each user sends turns one after another (a conversation), the users at once;
their repositories exist beforehand. Ours and the floor run in the order ours, floor,
floor, ours so that neither gets the warmer machine. CPU per turn is read per process.
"""

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

from bench.common import (
    CpuMeter,
    bench_settings,
    describe,
    machine,
    model_server_process,
    p50_p95,
)
from bench.floor import (
    FloorCallsInput,
    FloorCommit,
    FloorCommitWorkflow,
    FloorModelCallWorkflow,
)
from bench.floor_activities import FloorActivities
from durable_memory.activities.offered_settings import offer_turn_settings
from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.sandbox import sandboxed_runner
from durable_memory.workers.worker import (
    ACTIVITY_THREADS,
    WORKFLOW_RUNNER,
    WORKFLOWS,
    activities_for,
    freeze_startup_objects,
)

Turn = Callable[[int, str], Awaitable[None]]


async def timed_ms(action: Awaitable[Any]) -> float:
    t = time.perf_counter()
    await action
    return (time.perf_counter() - t) * 1000


async def timed_cpu_ms(action: Awaitable[Any], cpu: dict[str, float], side: str) -> float:
    """`timed_ms`, and the CPU this process spent meanwhile added to `cpu[side]` (ms)."""
    before = time.process_time()
    ms = await timed_ms(action)
    cpu[side] += (time.process_time() - before) * 1000
    return ms


def cpu_line(cpu: dict[str, float], turns: int) -> dict[str, float]:
    """CPU ms per turn of this process (worker, workflows and client) for each side."""
    per_turn = {side: ms / turns for side, ms in cpu.items()}
    print(
        f"   this process's CPU per turn: ours {per_turn['ours']:.1f} ms, floor "
        f"{per_turn['floor']:.1f} ms ({per_turn['ours'] / per_turn['floor']:.2f}x); load "
        f"average {os.getloadavg()[0]:.1f}"
    )
    return per_turn


FIRST_TURNS = 10
"""New users whose first turn the first-turn leg measures."""


async def first_turns(
    ours: Callable[[int], Awaitable[None]], floor: Callable[[int], Awaitable[Any]], count: int
) -> dict[str, Any]:
    """A new user's first turn (their memory created: a repository and its first commit, in
    the distributed mode a bare repository on the git server, the push and the worker's
    clone) beside a floor turn, interleaved. A one-time cost per user, kept out of the
    latency legs above (each measures a user who has memory) and shown here; no target."""
    mine, floors = [], []
    for i in range(count):
        mine.append(await timed_ms(ours(i)))
        floors.append(await timed_ms(floor(i)))
    return ratio_line("a new user's first turn", mine, floors)


BOOTSTRAP_RESAMPLES = 2000


def p50_ratio_interval(ours: list[float], floor: list[float]) -> tuple[float, float]:
    """A 90% bootstrap interval of the p50 ratio: the pairs (each of ours with the floor's
    sample taken right after it, on the same machine state) resampled with replacement, with
    a fixed seed. Read it as the leg's own precision: it treats the pairs as independent,
    which a conversation growing through the leg makes them only nearly, and says nothing of
    the spread between sittings."""
    pairs = list(zip(ours, floor, strict=True))
    draw = random.Random(17)
    ratios = sorted(
        statistics.median(o for o, _ in sample) / statistics.median(f for _, f in sample)
        for sample in (draw.choices(pairs, k=len(pairs)) for _ in range(BOOTSTRAP_RESAMPLES))
    )
    return ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]


def ratio_line(name: str, ours: list[float], floor: list[float]) -> dict[str, Any]:
    o50, o95 = p50_p95(ours)
    f50, f95 = p50_p95(floor)
    low, high = p50_ratio_interval(ours, floor)
    print(
        f"{name:<28} ours p50 {o50:7.1f} ms p95 {o95:7.1f} ms | floor p50 {f50:7.1f} ms "
        f"p95 {f95:7.1f} ms | ratio p50 {o50 / f50:.2f}x p95 {o95 / f95:.2f}x "
        f"(p50 90% interval {low:.2f}-{high:.2f}x)"
    )
    return {
        "ratio_p50_interval_90": [low, high],
        "ours_p50": o50,
        "ours_p95": o95,
        "floor_p50": f50,
        "floor_p95": f95,
        "ratio_p50": o50 / f50,
        "ratio_p95": o95 / f95,
        "ours_ms": ours,
        "floor_ms": floor,
    }


def _local_activity_type(event: Any) -> str | None:
    """A local activity marker's activity type, else None. (Its times are workflow time,
    not the run's: `StepTimer` measures the runs.)"""
    marker = event.marker_recorded_event_attributes
    if marker.marker_name != "core_local_activity":
        return None
    details: dict[str, Any] = json.loads(marker.details["data"].payloads[0].data)
    return str(details["activity_type"])


class StepTimer(Interceptor):
    """Measures each activity run in this worker, local or regular: {type: [ms, ...]}."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _TimedActivity(next, self.runs)

    def medians(self) -> dict[str, float]:
        """Each activity type's median run, printed; the runs so far are forgotten."""
        found = {k: sorted(v)[len(v) // 2] for k, v in self.runs.items()}
        self.runs.clear()
        for name, ms in found.items():
            print(f"   {ms:6.1f} ms  {name} ran (median)")
        return found


class _TimedActivity(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, runs: dict[str, list[float]]) -> None:
        super().__init__(next)
        self.runs = runs

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        t = time.perf_counter()
        try:
            return await super().execute_activity(input)
        finally:
            name = f"{'local ' if info.is_local else ''}{info.activity_type}"
            self.runs.setdefault(name, []).append((time.perf_counter() - t) * 1000)


def _event_name(event: Any, activities: dict[int, str]) -> str:
    """An event's type, with its activity's type for activity events (local ones are
    markers: `MARKER_RECORDED`, as one step of the workflow task that ran them)."""
    kind = str(event.WhichOneof("attributes")).removesuffix("_event_attributes")
    if event.HasField("activity_task_scheduled_event_attributes"):
        activities[event.event_id] = (
            event.activity_task_scheduled_event_attributes.activity_type.name
        )
        return f"{kind} {activities[event.event_id]}"
    if event.HasField("marker_recorded_event_attributes"):
        local = _local_activity_type(event)
        return f"{kind} {local}" if local else kind
    for field in ("activity_task_started", "activity_task_completed"):
        if event.HasField(f"{field}_event_attributes"):
            attributes = getattr(event, f"{field}_event_attributes")
            return f"{kind} {activities[attributes.scheduled_event_id]}"
    return kind


async def history_spans(client: Client, workflow_ids: list[str]) -> dict[str, float]:
    """Where a turn's time goes, from its history: the median time from each event to the
    next, up to the workflow task that answered the reply (its `workflow_task_completed`),
    over `workflow_ids`. Keys are "<n>. <event> -> <next event>"."""
    spans: dict[str, list[float]] = {}
    for workflow_id in workflow_ids:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        activities: dict[int, str] = {}
        events = [
            (_event_name(e, activities), e.event_time.ToDatetime().timestamp() * 1000)
            for e in history.events
        ]
        answered = next(
            i
            for i, e in enumerate(history.events)
            if e.HasField("workflow_execution_update_completed_event_attributes")
        )
        for n, ((before, t0), (after, t1)) in enumerate(itertools.pairwise(events[: answered + 1])):
            spans.setdefault(f"{n + 1:02d}. {before} -> {after}", []).append(t1 - t0)
    medians = {k: sorted(v)[len(v) // 2] for k, v in spans.items()}
    for name, ms in medians.items():
        print(f"   {ms:6.1f} ms  {name}")
    return medians


async def our_workflow_ids(client: Client, user: str, limit: int) -> list[str]:
    """The last `limit` turns of `user`."""
    return [w.id async for w in client.list_workflows(f"DmemUserId = '{user}'", limit=limit)]


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
        floor_activities = FloorActivities(model_url)
        timer = StepTimer()
        offer_turn_settings("bench", settings.turn_settings())  # as build_worker does
        worker = Worker(
            env.client,
            task_queue="bench",
            workflows=[*WORKFLOWS, FloorModelCallWorkflow, FloorCommitWorkflow],
            activities=[
                *activities_for(stack, model, settings, env.client),
                floor_activities.model_call,
                floor_activities.commit,
            ],
            activity_executor=pool,
            max_concurrent_activities=ACTIVITY_THREADS,
            # build_worker's, with the floor's module passed through as well (as the floor
            # worker's FLOOR_WORKFLOW_RUNNER): neither side imports its workflows per run
            workflow_runner=sandboxed_runner(
                WORKFLOW_RUNNER.restrictions.with_passthrough_modules("bench")
            ),
            interceptors=[timer],
        )
        client = MemoryClient(env.client, settings, stack)
        freeze_startup_objects()  # as run_worker does
        floor_ids: list[str] = []

        async def our_turn(i: int, user: str = "bench", say: str = "hello") -> None:
            await client.send_message(user, f"{say} {i}")

        async def floor_turn(i: int, user: str = "bench", model_calls: int = 1) -> None:
            floor_ids.append(f"floor-{user}-{uuid.uuid4().hex}")
            start = WithStartWorkflowOperation(
                FloorModelCallWorkflow.run,
                FloorCallsInput(message=f"floor {i}", model_calls=model_calls),
                id=floor_ids[-1],
                task_queue="bench",
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            )
            await env.client.execute_update_with_start_workflow(
                FloorModelCallWorkflow.reply, start_workflow_operation=start
            )

        async with worker:
            for _ in range(3):  # warm up both paths
                await our_turn(-1, "warm")
                await our_turn(-1, "warm", "search")
                await floor_turn(-1, "warm")
            for key, say, calls, name in (
                ("turn_reply", "hello", 1, "turn: start -> reply"),
                ("tool_turn_reply", "search", 2, "tool turn: model-tool-model"),
            ):
                ours, floor = [], []
                cpu = {"ours": 0.0, "floor": 0.0}
                floor_ids.clear()
                # The user's first turn creates their memory, a one-time cost measured on its
                # own below: the leg measures a user who has one.
                await our_turn(-1, key, say)
                timer.runs.clear()  # each leg's activity runs its own, without the warm-up's
                load_before = os.getloadavg()
                for i in range(turns):  # interleaved, so both see the same machine state
                    ours.append(await timed_cpu_ms(our_turn(i, key, say), cpu, "ours"))
                    floor.append(await timed_cpu_ms(floor_turn(i, key, calls), cpu, "floor"))
                results[key] = ratio_line(name, ours, floor)
                results[key]["load_average"] = [load_before, os.getloadavg()]
                results[key]["process_cpu_ms_per_turn"] = cpu_line(cpu, turns)
                print("   ours, median time between the events of a turn's history:")
                ours_ids = await our_workflow_ids(env.client, key, turns)
                spans = {"ours": await history_spans(env.client, ours_ids)}
                print("   floor:")
                spans["floor"] = await history_spans(env.client, list(floor_ids))
                results[f"{key}_spans"] = spans
                print("   each activity's run in the worker, ours and the floor's:")
                results[f"{key}_activity_runs"] = timer.medians()

            results["first_turn_reply"] = await first_turns(
                lambda i: our_turn(i, f"first-{i}"), floor_turn, FIRST_TURNS
            )

            # Approval -> commit visible, against an Update running one activity that commits.
            stack.blocks.ensure_user("floor")
            repo = stack.git.repo_path("floor")
            ours, floor = [], []
            for i in range(turns):
                reply = await client.send_message("approver", f"propose {i}")
                ours.append(await timed_ms(client.approve(reply.diffs[0].id, "bench")))
                handle = await env.client.start_workflow(
                    FloorCommitWorkflow.run, id=f"floor-d-{uuid.uuid4().hex}", task_queue="bench"
                )
                commit = FloorCommit(repo=str(repo), content=f'name = "floor {i}"\n')
                floor.append(
                    await timed_ms(handle.execute_update(FloorCommitWorkflow.decide, commit))
                )
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
    users = [int(u) for u in args.users.split(",") if u]  # --users '': no throughput legs
    asyncio.run(main_async(args.turns, users, args.leg_turns, args.out))


if __name__ == "__main__":
    main()
