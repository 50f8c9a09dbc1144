"""The "mystery wait": sequential turns after an idle period, latency per turn, on a dev
server started with the default cap on its transfer queue's polling and on one started as
every server of ours is (`DEV_SERVER_ARGS` lifts it), both in the same run.

The dev server has one history shard, whose transfer queue (among others, the tasks that hand
each workflow task and activity task to matching) is read at most
`history.transferProcessorMaxPollRPS` = 20 times a second by default ("max poll rate per
second for transferQueueProcessor": one per shard; `...MaxPollHostRPS` is the per-host one).
A rested server has a burst of polls in hand; a turn needs several, so after about ten
sequential turns the burst is spent and every later poll waits for the limiter: up to 50 ms
per task, several times a turn, for as long as turns keep coming. A cluster with many history
shards has that budget per shard, and turns (one workflow each, placed by the hash of its id)
spread over the shards, so it rarely hits it.

    .venv/bin/python -m bench.idle [--turns 60] [--idle-s 60] [--out results.json]

For each server and each kind of turn (a plain reply; a reply with one memory edit, which
proposes a diff), the server rests `--idle-s` seconds, then one conversation sends `--turns`
turns one after another. Besides each turn's latency, its history gives the time its tasks
waited to be handed out (each workflow and activity task from scheduled to started, up to
the reply): where the limiter's wait shows, apart from the machine's CPU contention.
"""

import argparse
import asyncio
import concurrent.futures
import json
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from bench.common import bench_settings, describe, machine, model_server_process, p50_p95
from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.workers.dev_server import DEV_SERVER_ARGS, start_dev_server
from durable_memory.workers.worker import ACTIVITY_THREADS, build_worker, freeze_startup_objects

SERVERS = {"default cap (20 polls/s)": (), "cap lifted (DEV_SERVER_ARGS)": DEV_SERVER_ARGS}
"""Each server's extra arguments: none, so the dev server's own default; ours."""
KINDS = {"plain reply": "hello", "reply with one memory edit": "propose"}
"""What each kind of turn says (the scripted model proposes an edit when told 'propose')."""


async def idle_then_turns(
    client: MemoryClient, user: str, say: str, turns: int, idle_s: float
) -> tuple[list[float], list[str]]:
    """Rest, then `turns` sequential turns of one conversation: each one's latency in ms, and
    its workflow id."""
    await asyncio.sleep(idle_s)
    latencies, workflow_ids = [], []
    for i in range(turns):
        t = time.perf_counter()
        reply = await client.send_message(user, f"{say} {i}")
        latencies.append((time.perf_counter() - t) * 1000)
        workflow_ids.append(reply.workflow_id)
    return latencies, workflow_ids


async def dispatch_wait_ms(client: Client, workflow_id: str) -> float:
    """How long a turn's tasks waited from scheduled to started, up to its reply."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    scheduled: dict[int, float] = {}
    waited = 0.0
    for event in history.events:
        t = event.event_time.ToDatetime().timestamp() * 1000
        if event.HasField("workflow_execution_update_completed_event_attributes"):
            break
        if event.HasField("workflow_task_scheduled_event_attributes") or event.HasField(
            "activity_task_scheduled_event_attributes"
        ):
            scheduled[event.event_id] = t
        elif event.HasField("workflow_task_started_event_attributes"):
            waited += t - scheduled[event.workflow_task_started_event_attributes.scheduled_event_id]
        elif event.HasField("activity_task_started_event_attributes"):
            waited += t - scheduled[event.activity_task_started_event_attributes.scheduled_event_id]
    return waited


async def main_async(turns: int, idle_s: float, out: Path | None) -> None:
    info = machine()
    print(f"machine: {describe(info)}")
    results: dict[str, Any] = {"machine": info, "turns": turns, "idle_s": idle_s, "legs": {}}
    async with AsyncExitStack() as resources:
        tmp = Path(resources.enter_context(tempfile.TemporaryDirectory()))
        model_url, _ = resources.enter_context(model_server_process())
        pool = resources.enter_context(concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS))
        model = AnthropicModel(base_url=model_url)
        clients: dict[str, MemoryClient] = {}
        for n, (server, extra_args) in enumerate(SERVERS.items()):
            settings = bench_settings(tmp / f"server-{n}")
            env = await start_dev_server(settings, extra_args=extra_args)
            resources.push_async_callback(env.shutdown)
            stack = stack_from_settings(settings)
            resources.callback(stack.close)
            worker: Worker = build_worker(env.client, settings, stack, model, pool)
            await resources.enter_async_context(worker)
            clients[server] = MemoryClient(env.client, settings, stack)
        freeze_startup_objects()
        for client in clients.values():  # every path warm, every user's repository made
            for say in KINDS.values():
                await client.send_message(f"u-{say}", f"{say} warm-up")
        for kind, say in KINDS.items():
            for server, client in clients.items():
                print(f"{server}, {kind}: {idle_s:.0f} s idle, then {turns} turns", flush=True)
                latencies, workflow_ids = await idle_then_turns(
                    client, f"u-{say}", say, turns, idle_s
                )
                waits = [await dispatch_wait_ms(client.client, w) for w in workflow_ids]
                first, rest = latencies[:10], latencies[10:]
                p50, p95 = p50_p95(rest)
                print(
                    f"   first 10 p50 {p50_p95(first)[0]:6.1f} ms | after them p50 {p50:6.1f} "
                    f"ms p95 {p95:6.1f} ms | tasks waited to be handed out: first 10 p50 "
                    f"{p50_p95(waits[:10])[0]:5.1f} ms, after them {p50_p95(waits[10:])[0]:5.1f} ms"
                )
                results["legs"].setdefault(kind, {})[server] = {
                    "first_10_p50": p50_p95(first)[0],
                    "rest_p50": p50,
                    "rest_p95": p95,
                    "ms": latencies,
                    "dispatch_wait_ms": waits,
                }
        model.close()
    if out:
        out.write_text(json.dumps(results, indent=1), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=60, help="sequential turns after the rest")
    parser.add_argument("--idle-s", type=float, default=60.0, help="seconds of rest before them")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    asyncio.run(main_async(args.turns, args.idle_s, args.out))


if __name__ == "__main__":
    main()
