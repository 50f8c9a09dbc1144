"""The floor process of the memory and distributed benchmarks: a worker with only the floor
workflows, the same worker settings, data converter and C allocator settings as ours, and
nothing else of ours imported (the caller passes the activity thread count), so that its
memory is Temporal's and Python's alone. With a model URL it also runs the floors' model call
and commit activities (floor_activities.py).

    .venv/bin/python -m bench.floor_worker ADDRESS TASK_QUEUE THREADS [MODEL_URL]
"""

import argparse
import asyncio
import concurrent.futures
import gc
import signal
import sys
from typing import Any

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from bench.floor import (
    FLOOR_WORKFLOW_RUNNER,
    FloorCommitWorkflow,
    FloorDecisionWorkflow,
    FloorModelCallWorkflow,
    FloorTurnWorkflow,
    noop,
)
from durable_memory.workers.malloc import bound_malloc  # imports nothing else of ours


async def _serve(address: str, task_queue: str, threads: int, model_url: str | None) -> None:
    """A worker with only the floor workflows: the memory benchmark's floor process."""
    bound_malloc()  # as `dmem worker` does at its start: a process setting both share
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    real_work: list[Any] = []
    if model_url is not None:
        # Imported only here: the memory benchmark's floor (no model URL) must not carry the
        # anthropic SDK it never uses.
        from bench.floor_activities import FloorActivities

        floor = FloorActivities(model_url)
        real_work = [floor.model_call, floor.commit]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        worker = Worker(
            client,
            task_queue=task_queue,
            workflows=[
                FloorTurnWorkflow,
                FloorDecisionWorkflow,
                FloorModelCallWorkflow,
                FloorCommitWorkflow,
            ],
            activities=[noop, *real_work],
            activity_executor=pool,
            max_concurrent_activities=threads,
            workflow_runner=FLOOR_WORKFLOW_RUNNER,
        )
        gc.collect()  # as our worker does (freeze_startup_objects)
        gc.freeze()
        async with worker:
            print(f"worker on task queue {task_queue}", file=sys.stderr, flush=True)
            await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="run a worker with only the floor workflows")
    parser.add_argument("address")
    parser.add_argument("task_queue")
    parser.add_argument("threads", type=int)
    parser.add_argument("model_url", nargs="?", help="the scripted model (real-work floors)")
    args = parser.parse_args()
    asyncio.run(_serve(args.address, args.task_queue, args.threads, args.model_url))


if __name__ == "__main__":
    main()
