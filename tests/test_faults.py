"""Fault suite: the worker process is killed with SIGKILL at every activity boundary of a turn
and of the rotation its approval triggers, one run per boundary. A supervisor restarts it.
Afterwards the turn has completed, the approved diff has exactly one commit, the rotated text
has exactly one archived copy, every message is in recall, and the model was asked once per
step."""

import asyncio
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.faults import MID_START, MID_TOOLS_THEN_MODEL
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.turn import RotationOutcome, TurnOutcome, turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.agent_helpers import edit_block, git_status
from tests.support.git_checks import assert_fsck_clean
from tests.support.temporal_helpers import workflow_result
from tests.support.worker_process import address, crash_settings, spawn_worker, stop_worker

TURN = ["start_turn", "tools_then_model", "finish_turn", "decide", "needs_rotation"]
ROTATION = ["plan_rotation", "archive_rotation", "commit_rotation"]
BOUNDARIES = [f"{when}:dmem.{name}" for name in TURN + ROTATION for when in ("before", "after")]
BOUNDARIES += [MID_START]  # inside the first activity: context stored, model not called
BOUNDARIES += [MID_TOOLS_THEN_MODEL]  # the step's diff proposed, the next model not called
NOTE = "Talked about the regional robotics competition and the 2am repair " + "q" * 360
SCRIPT: list[dict[str, Any]] = [
    {"content": [edit_block("human", operation="add_context", value=NOTE)]},
    {"text": "Noted."},
]


class Supervisor:
    """Keeps one worker process running: the first may crash at `crash_at`; any that dies is
    replaced by one without a crash point."""

    def __init__(
        self, settings: Any, temporal: str, model_url: str, crash_at: str, marker: Path
    ) -> None:
        self.args = (settings, temporal, model_url)
        self.process = spawn_worker(settings, temporal, model_url, crash_at, marker)
        self.deaths: list[int] = []
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            code = self.process.poll()
            if code is not None:
                self.deaths.append(code)
                self.process = await asyncio.to_thread(spawn_worker, *self.args)
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._task.cancel()
        stop_worker(self.process)


@pytest.mark.parametrize("boundary", BOUNDARIES)
async def test_sigkill_at_every_activity_boundary(
    temporal_env: WorkflowEnvironment, tmp_path: Path, boundary: str
) -> None:
    user = f"u{BOUNDARIES.index(boundary)}"
    settings = crash_settings(tmp_path)
    settings.memory.data_dir.mkdir(parents=True)
    stack = stack_from_settings(settings)
    backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
    stack.blocks.ensure_user(user)
    for i in range(2):  # the approval will push the human block over its threshold
        stack.edits.add_context(user, f"earlier note {i} " + "p" * 380, backend)
    client = MemoryClient(temporal_env.client, settings, stack)
    marker = tmp_path / "crashed"
    with ScriptedModelServer(SCRIPT) as model:
        supervisor = Supervisor(settings, address(temporal_env), model.url, boundary, marker)
        try:
            reply = await asyncio.wait_for(
                client.send_message(user, "we talked a lot", turn_id="f"), 120
            )
            diff_id = reply.diffs[0].id
            await asyncio.wait_for(client.approve(diff_id, "ms-rivera"), 120)
            turn: TurnOutcome = await workflow_result(
                client, turn_workflow_id(user, "f"), TurnOutcome
            )
            rotation: RotationOutcome = await workflow_result(
                client, f"rotation-{user}-human", RotationOutcome
            )
        finally:
            await supervisor.stop()
        assert marker.exists(), f"the flow never reached {boundary}"
        assert supervisor.deaths == [-9]
        assert len(model.requests) == 2  # once per step, crash or not
    assert [d.status for d in turn.decisions] == [DiffStatus.APPROVED]
    commits = stack.history.history(user, "human", 50)
    assert len([c for c in commits if c.trailers.get("Diff-Id") == diff_id]) == 1
    assert len([c for c in commits if "Rotation-Of" in c.trailers]) == 1
    assert rotation.rotated
    archived = stack.archive.page(user)
    assert sorted(p.id for p in archived) == sorted(rotation.passage_ids)  # one copy
    assert NOTE in "".join(p.text for p in sorted(archived, key=lambda p: p.chunk))
    messages = stack.recall.turn(user, "f")
    assert [m.role.value for m in messages] == ["user", "tool_call", "tool_result", "assistant"]
    repo = stack.git.repo_path(user)
    assert git_status(repo) == ""
    assert_fsck_clean(repo)
    stack.close()
