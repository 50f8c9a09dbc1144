"""Record the workflow histories that tests/test_replay.py replays.

    .venv/bin/python -m tests.record_histories

Run it again (and commit the JSON) when a workflow change is meant to be incompatible and is
released behind a new workflow type; a compatible change must keep replaying the old files.
"""

import asyncio
import concurrent.futures
import sys
import tempfile
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from durable_memory.bootstrap import stack_from_settings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.service.redaction import redaction_id
from durable_memory.models.diffs import Proposer
from durable_memory.models.history import Author, AuthorKind, RedactInput, redact_workflow_id
from durable_memory.models.operations import LearnFact
from durable_memory.models.turn import SweepInput
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.dev_server import temporal_binary
from durable_memory.workers.worker import ACTIVITY_THREADS, WORKFLOWS, activities_for
from durable_memory.workflows.common import SEARCH_ATTRIBUTES
from durable_memory.workflows.redact import RedactWorkflow
from durable_memory.workflows.rotation import RotationSweepWorkflow
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import Rig, rig_settings, running_rig

HERE = Path(__file__).parent / "histories"


def _edit(label: str, field: str, value: str) -> dict[str, Any]:
    return edit_block(label, field=field, operation="set", value=value)


SCRIPT: list[dict[str, Any]] = [
    {
        "content": [
            {"type": "text", "text": "Noting three things."},
            _edit("student", "name", "Alice"),
            _edit("journey", "stage", "drafting"),
            _edit("engagement_strategy", "approach", "Socratic questions"),
        ]
    },
    {"text": "Welcome, Alice."},
]


async def record() -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        search_attributes=SEARCH_ATTRIBUTES,
        data_converter=pydantic_data_converter,
    )
    with tempfile.TemporaryDirectory() as tmp:
        settings = rig_settings(Path(tmp) / "data", ttl_s=3)
        async with running_rig(env.client, settings, SCRIPT) as rig:
            reply = await rig.client.send_message("alice", "Hi, I'm Alice", turn_id="h1")
            approve, reject, _expires = reply.diffs
            await rig.client.approve(approve.id, "ms-rivera")
            await rig.client.reject(reject.id, "ms-rivera", "too early")
            turn = env.client.get_workflow_handle(reply.workflow_id)
            await turn.result()  # the third diff expires
            (HERE / "turn_approve_reject_expire.json").write_text(
                (await turn.fetch_history()).to_json(), encoding="utf-8"
            )
            backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
            for i in range(3):
                rig.stack.edits.add_context("alice", f"note {i} " + "w" * 400, backend)
            await rig.client.rotate_now("alice", "human")
            rotation = env.client.get_workflow_handle("rotation-alice-human")
            (HERE / "rotation.json").write_text(
                (await rotation.fetch_history()).to_json(), encoding="utf-8"
            )
            await record_sweep(rig, "sweep.json")
        await record_standing_approval(env.client, Path(tmp) / "standing", HERE / STANDING)
        await record_redaction(env.client, Path(tmp) / "redaction", HERE / "redaction.json")
    await env.shutdown()


async def record_sweep(rig: Rig, file_name: str) -> None:
    """A rotation sweep that finds alice's human block over its threshold and starts its
    rotation (the schedule's run, started here by hand)."""
    backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
    for i in range(3):
        rig.stack.edits.add_context("alice", f"sweep note {i} " + "s" * 400, backend)
    sweep = await rig.client.client.start_workflow(
        RotationSweepWorkflow.run,
        SweepInput(),
        id="rotation-sweep-recorded",
        task_queue=rig.settings.temporal.task_queue,
    )
    assert await sweep.result() == 1
    await rig.client.client.get_workflow_handle("rotation-alice-human").result()
    (HERE / file_name).write_text((await sweep.fetch_history()).to_json(), encoding="utf-8")


STANDING = "turn_standing_approval.json"

STANDING_SCRIPT: list[dict[str, Any]] = [
    {
        "content": [
            edit_block(
                "human",
                operation="add_context",
                value="Talked through the robotics competition " + "r" * 420,
            )
        ]
    },
    {"text": "Noted."},
]


async def record_standing_approval(client: Client, tmp: Path, path: Path) -> None:
    """A turn whose one edit a standing approval commits at once, on a block it fills past
    its rotation threshold: the turn ends without waiting for a person."""
    settings = rig_settings(tmp / "data")
    async with running_rig(client, settings, STANDING_SCRIPT) as rig:
        rig.stack.blocks.ensure_user("sam")
        backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
        for i in range(2):
            rig.stack.edits.add_context("sam", f"note {i} " + "y" * 420, backend)
        await rig.client.set_standing_approval(
            "sam", "human", ["add_context"], "ms-rivera", datetime.now(UTC) + timedelta(days=30)
        )
        reply = await rig.client.send_message("sam", "we talked a lot", turn_id="s1")
        turn = client.get_workflow_handle(reply.workflow_id)
        await turn.result()
        path.write_text((await turn.fetch_history()).to_json(), encoding="utf-8")


@activity.defn(name="dmem.delete_redact_execution")
async def _kept_execution() -> None:
    """Stands in for the redaction's last step, which deletes its execution (and so the
    history to record): it never completes; the recording terminates the workflow."""
    await asyncio.Event().wait()


async def record_redaction(client: Client, tmp: Path, path: Path) -> None:
    """The history of a redaction, up to its last step (which would delete it)."""
    settings = rig_settings(tmp / "data")
    stack = stack_from_settings(settings)
    stack.blocks.ensure_user("alice")
    fact = "lives at 12 Elm St"
    diff = stack.review.propose("alice", "human", LearnFact(fact=fact), "why", Proposer.turn("t0"))
    stack.review.approve(diff.id, "ms-rivera", user_id="alice")
    request = RedactInput(
        user_id="alice",
        label="human",
        text="12 Elm St",
        requested_by="dpo@school",
        reason="recorded",
        redaction_id=redaction_id("alice", "human", "12 Elm St"),
    )
    with (
        ScriptedModelServer([]) as server,
        concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool,
    ):
        model = AnthropicModel(base_url=server.url)
        activities = [
            a
            for a in activities_for(stack, model, settings, client)
            if getattr(a, "__name__", "") != "delete_redact_execution"
        ]
        async with Worker(
            client,
            task_queue=settings.temporal.task_queue,
            workflows=list(WORKFLOWS),
            activities=[*activities, _kept_execution],
            activity_executor=pool,
        ):
            handle = await client.start_workflow(
                RedactWorkflow.run,
                request,
                id=redact_workflow_id("alice"),
                task_queue=settings.temporal.task_queue,
            )
            while "dmem.delete_redact_execution" not in (await handle.fetch_history()).to_json():
                await asyncio.sleep(0.2)
            path.write_text((await handle.fetch_history()).to_json(), encoding="utf-8")
            await handle.terminate("recorded")
        model.close()
    stack.close()


Recorder = Callable[[Client, Path, Path], Awaitable[None]]

ALONE: dict[str, Recorder] = {"redaction": record_redaction, "standing": record_standing_approval}
"""The histories that can be recorded alone (`-m tests.record_histories NAME FILE`)."""


async def record_alone(recorder: Recorder, path: Path) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        search_attributes=SEARCH_ATTRIBUTES,
        data_converter=pydantic_data_converter,
    )
    with tempfile.TemporaryDirectory() as tmp:
        await recorder(env.client, Path(tmp), path)
    await env.shutdown()


if __name__ == "__main__":
    # `-m tests.record_histories redaction|standing FILE`: that history alone, into FILE.
    if len(sys.argv) == 3 and sys.argv[1] in ALONE:
        asyncio.run(record_alone(ALONE[sys.argv[1]], Path(sys.argv[2])))
    else:
        asyncio.run(record())
