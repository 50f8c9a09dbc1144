"""The memory benchmark's floor process: a worker with only the floor workflows, the same
worker settings and data converter as ours, and nothing of ours imported (the caller passes
the activity thread count), so that its memory is Temporal's and Python's alone.

    .venv/bin/python -m bench.floor_worker ADDRESS TASK_QUEUE THREADS
"""

import argparse
import asyncio
import concurrent.futures
import gc
import signal
import sys

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from bench.floor import FloorDecisionWorkflow, FloorTurnWorkflow, noop


async def _serve(address: str, task_queue: str, threads: int) -> None:
    """A worker with only the floor workflows: the memory benchmark's floor process."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        worker = Worker(
            client,
            task_queue=task_queue,
            workflows=[FloorTurnWorkflow, FloorDecisionWorkflow],
            activities=[noop],
            activity_executor=pool,
            max_concurrent_activities=threads,
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
    args = parser.parse_args()
    asyncio.run(_serve(args.address, args.task_queue, args.threads))


if __name__ == "__main__":
    main()
