"""A request dropped on its way to Temporal (the connection reset, or the request cancelled
under it by a proxy or by the server itself under load: "operation was canceled", which
Temporal's client does not resend) costs nothing: the client resends what is safe to repeat,
under the same Update id, and the caller gets the one true answer. Seen in CI: a decision sent
while the workers were down came back as `TemporalUnavailable('the decision was not sent:
operation was canceled')` and its turn waited forever for it.

The client talks to the dev server through a loopback proxy that drops every request in flight
at the chosen moment; the worker talks to the server directly."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import Settings
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import turn_workflow_id
from tests.support.agent_helpers import edit_block
from tests.support.cutting_proxy import CuttingProxy
from tests.support.temporal_helpers import (
    listed_workflow_ids,
    rig_settings,
    running_rig,
    turn_outcome,
)

ONE_EDIT: list[dict[str, Any]] = [
    {"content": [edit_block("student", field="name", operation="set", value="Fay")]},
    {"text": "Hi Fay."},
]
DROPS = ["cancel_streams", "reset_connections"]


@asynccontextmanager
async def client_through(
    env: WorkflowEnvironment, settings: Settings
) -> AsyncIterator[tuple[MemoryClient, CuttingProxy]]:
    """A MemoryClient whose every Temporal request passes the proxy."""
    target = env.client.service_client.config.target_host
    async with CuttingProxy(target) as proxy:
        client = await Client.connect(
            proxy.address, namespace=env.client.namespace, data_converter=pydantic_data_converter
        )
        async with MemoryClient(client, settings, stack_from_settings(settings)) as memory_client:
            yield memory_client, proxy


async def drop_when_in_flight(proxy: CuttingProxy, drop: str) -> None:
    """Wait until the client has a request in flight (waiting on the server: no worker polls
    yet), then drop it."""
    for _ in range(500):
        if proxy.in_flight():
            break
        await asyncio.sleep(0.02)
    assert proxy.in_flight(), "the client never had a request in flight"
    await asyncio.sleep(0.3)  # well inside the server's wait for a worker
    if drop == "cancel_streams":
        assert proxy.cancel_streams() >= 1
    else:
        proxy.reset_connections()


@pytest.mark.parametrize("drop", DROPS)
async def test_a_dropped_decision_is_resent_and_applies_once(
    temporal_env: WorkflowEnvironment, tmp_path: Path, drop: str
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, ONE_EDIT, keep_running=True) as rig:
        reply = await rig.client.send_message("fay", "I'm Fay", turn_id="dropped")
    diff_id = reply.diffs[0].id
    # The worker is gone: the approval's Update waits on the server until one polls again.
    async with client_through(temporal_env, settings) as (client, proxy):
        approval = asyncio.create_task(client.approve(diff_id, "ms-rivera", user_id="fay"))
        await drop_when_in_flight(proxy, drop)
        async with running_rig(temporal_env.client, settings, []) as rig:
            outcome = await asyncio.wait_for(approval, 60)
            assert outcome is not None
            assert outcome.status is DiffStatus.APPROVED
            assert outcome.decided_by == "ms-rivera"
            ended = await turn_outcome(rig.client, "fay", "dropped")
            assert [(d.diff_id, d.status) for d in ended.decisions] == [
                (diff_id, DiffStatus.APPROVED)
            ]
            commits = rig.stack.history.history("fay", "student", 10)
            assert [c.trailers.get("Diff-Id") for c in commits].count(diff_id) == 1


@pytest.mark.parametrize("drop", DROPS)
async def test_a_dropped_turn_start_is_resent_and_runs_one_turn(
    temporal_env: WorkflowEnvironment, tmp_path: Path, drop: str
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with client_through(temporal_env, settings) as (client, proxy):
        # No worker yet: the turn's update-with-start waits on the server for its reply.
        sent = asyncio.create_task(client.send_message("fay", "I'm Fay", turn_id="dropped"))
        await drop_when_in_flight(proxy, drop)
        async with running_rig(temporal_env.client, settings, ONE_EDIT) as rig:
            reply = await asyncio.wait_for(sent, 60)
            assert reply.reply == "Hi Fay."
            assert len(reply.diffs) == 1
            workflow_id = turn_workflow_id("fay", "dropped")
            queue = settings.temporal.task_queue
            query = f"WorkflowId = '{workflow_id}' AND TaskQueue = '{queue}'"
            assert await listed_workflow_ids(temporal_env.client, query) == [workflow_id]
            said = [
                m.content
                for m in rig.stack.recall.turn("fay", "dropped")
                if m.role is MessageRole.USER
            ]
            assert said == ["I'm Fay"]
