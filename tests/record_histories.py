"""Record the workflow histories that tests/test_replay.py replays.

    .venv/bin/python -m tests.record_histories

Run it again (and commit the JSON) when a workflow change is meant to be incompatible and is
released behind a new workflow type; a compatible change must keep replaying the old files.
"""

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from durable_memory.models.history import Author, AuthorKind
from durable_memory.workers.dev_server import temporal_binary
from durable_memory.workflows.common import SEARCH_ATTRIBUTES
from tests.support.temporal_helpers import rig_settings, running_rig

HERE = Path(__file__).parent / "histories"


def _edit(label: str, field: str, value: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "name": "edit_memory_block",
        "input": {
            "label": label,
            "field": field,
            "operation": "set",
            "value": value,
            "reasoning": "r",
        },
    }


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
    await env.shutdown()


if __name__ == "__main__":
    asyncio.run(record())
