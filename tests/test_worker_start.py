"""A worker refuses to start against a namespace that lacks one of the turn's search attributes:
every turn would upsert it, fail its workflow task and retry forever without answering. The
error names each missing attribute and the one command that registers them. A worker makes
the rotation sweep's Schedule unless its configuration leaves it to others. It says it polls
only once its Temporal worker has started, with what a start loads already loaded, and stamps
its workflow tasks with a digest of our source."""

import asyncio
import concurrent.futures
import gc
import shutil
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import ScheduleActionStartWorkflow
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

import durable_memory
from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import ConfigError, load_settings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.core.tokens import load_encoding
from durable_memory.models.turn import turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.dev_server import DEV_SERVER_ARGS, DEV_SERVER_STARTUP, temporal_binary
from durable_memory.workers.worker import (
    ACTIVITY_THREADS,
    build_id,
    build_worker,
    require_search_attributes,
    run_worker,
    source_digest,
)
from durable_memory.workflows.common import SEARCH_ATTRIBUTES
from tests.support.temporal_helpers import rig_settings
from tests.support.worker_process import address, spawn_worker, stop_worker


async def test_a_worker_refuses_a_namespace_without_its_search_attributes() -> None:
    """Against a real dev server (the test server does not list search attributes) that was
    started with only the first of them, as a cluster set up for an older version would be."""
    keys: list[SearchAttributeKey[Any]] = list(SEARCH_ATTRIBUTES)
    first, others = keys[0], keys[1:]
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        search_attributes=[first],
        data_converter=pydantic_data_converter,
        dev_server_log_level="error",
        dev_server_extra_args=DEV_SERVER_ARGS,
        dev_server_startup_timeout=DEV_SERVER_STARTUP,
    )
    try:
        client, namespace = env.client, env.client.namespace
        with pytest.raises(ConfigError) as refused:
            await require_search_attributes(client, namespace)
        message = str(refused.value)
        assert first.name not in message.split("register them")[0]
        for key in others:
            assert key.name in message
        assert "temporal operator search-attribute create" in message
        assert "--name DmemDiffIds --type KeywordList" in message
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=namespace,
                search_attributes={
                    key.name: IndexedValueType.ValueType(key.indexed_value_type) for key in others
                },
            )
        )
        await require_search_attributes(client, namespace)  # all there: starts
    finally:
        await env.shutdown()


@pytest.mark.parametrize("manage", [True, False])
async def test_a_worker_makes_the_rotation_schedule_unless_told_to_leave_it(
    temporal_env: WorkflowEnvironment, tmp_path: Path, manage: bool
) -> None:
    """A real `dmem worker`: by default it creates the sweep's Schedule on its task queue;
    with `rotation.manage_schedule: false` it leaves the server without one."""
    settings = rig_settings(tmp_path / "data")
    rotation = settings.rotation.model_copy(update={"schedule_id": f"sweep-{uuid.uuid4().hex}"})
    settings = settings.model_copy(update={"rotation": rotation})
    with ScriptedModelServer([]) as model:
        worker = spawn_worker(settings, address(temporal_env), model.url, manage_schedule=manage)
        stop_worker(worker)
    ids = [s.id async for s in await temporal_env.client.list_schedules()]
    handle = temporal_env.client.get_schedule_handle(rotation.schedule_id)
    if not manage:
        assert rotation.schedule_id not in ids
        with pytest.raises(RPCError):
            await handle.describe()
        return
    described = await handle.describe()
    action = described.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow)
    assert action.task_queue == settings.temporal.task_queue
    assert described.schedule.spec.intervals[0].every == timedelta(seconds=rotation.interval_s)
    await handle.delete()


async def test_the_wait_before_a_lost_workers_turns_move_is_the_configured_one(
    temporal_env: WorkflowEnvironment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn whose worker died waits on that worker's sticky queue before another worker
    takes it over: `temporal.sticky_schedule_to_start_s` from the config file (the kill tests
    set it to 1 s, which is what makes each about 8 s shorter), else the SDK's 10 s."""
    config = tmp_path / "worker.yaml"
    data = tmp_path / "data"
    config.write_text(
        f"memory:\n  data_dir: {data}\ntemporal:\n  sticky_schedule_to_start_s: 2.5\n",
        encoding="utf-8",
    )
    monkeypatch.delenv("DMEM_CONFIG", raising=False)
    for path, expected in [(config, timedelta(seconds=2.5)), (None, timedelta(seconds=10))]:
        settings = load_settings(path) if path else rig_settings(data)
        stack = stack_from_settings(settings)
        with concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool:
            model = AnthropicModel(base_url="http://127.0.0.1:9")  # never called here
            worker = build_worker(temporal_env.client, settings, stack, model, pool)
            assert worker.config()["sticky_queue_schedule_to_start_timeout"] == expected
        stack.close()


async def test_a_worker_says_it_polls_only_once_what_a_start_loads_is_loaded(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """`run_worker` calls `polling` (where `dmem worker` prints the line that operators, the
    tests and the benchmarks wait for) once its worker runs, after the tokenizer's encoding
    is loaded (~0.4 s the first turn after a start paid) and the start's objects are frozen:
    before, the line came first and the worker polled ~1 s later."""
    load_encoding.cache_clear()
    seen: dict[str, bool] = {}
    stop = asyncio.Event()

    def polling() -> None:
        seen["encoding loaded"] = load_encoding.cache_info().currsize == 1
        seen["start frozen"] = gc.get_freeze_count() > 0
        stop.set()

    settings = rig_settings(tmp_path / "data")
    model = AnthropicModel(base_url="http://127.0.0.1:9")  # never called here
    try:
        await asyncio.wait_for(run_worker(temporal_env.client, settings, model, stop, polling), 60)
    finally:
        gc.unfreeze()  # this test process's objects, frozen as a worker's are
        model.close()
    assert seen == {"encoding loaded": True, "start frozen": True}


def test_the_build_id_digests_our_source_wherever_it_is_installed(tmp_path: Path) -> None:
    package = Path(durable_memory.__file__).resolve().parent
    ours = source_digest(package)
    assert build_id() == f"durable-memory-{ours}"
    copy = tmp_path / "elsewhere" / "durable_memory"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == ours  # the same source at another path
    (copy / "py.typed").write_text("not source", encoding="utf-8")
    assert source_digest(copy) == ours
    turn = copy / "workflows" / "turn.py"
    turn.write_text(turn.read_text(encoding="utf-8") + "\n# changed\n", encoding="utf-8")
    changed = source_digest(copy)
    assert changed != ours
    (copy / "workflows" / "added.py").write_text("", encoding="utf-8")
    assert source_digest(copy) not in {ours, changed}


async def test_a_workers_tasks_are_stamped_with_the_build_id(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A real `dmem worker`: every workflow task of a turn it completed carries `build_id()`
    (the SDK's default would have cost the start 0.7 s)."""
    settings = rig_settings(tmp_path / "data")
    stack = stack_from_settings(settings)
    client = MemoryClient(temporal_env.client, settings, stack)
    with ScriptedModelServer([{"text": "hello"}]) as model:
        worker = spawn_worker(settings, address(temporal_env), model.url)
        try:
            reply = await asyncio.wait_for(client.send_message("stamped", "hi", turn_id="t1"), 60)
        finally:
            stop_worker(worker)
            stack.close()
    assert reply.reply == "hello"
    history = await temporal_env.client.get_workflow_handle(
        turn_workflow_id("stamped", "t1")
    ).fetch_history()
    stamps = [
        event.workflow_task_completed_event_attributes.worker_version.build_id
        for event in history.events
        if event.HasField("workflow_task_completed_event_attributes")
    ]
    assert stamps
    assert set(stamps) == {build_id()}
