"""Nothing hangs when the whole fleet is down: a caller waiting for a turn's reply or a
decision's answer while no worker polls the task queue gets `NoWorkerPolling` after
`temporal.no_worker_grace_s`, with what happens to its request; sending again once a worker
runs gets the one true answer (one turn, one commit). Before, such a caller waited forever."""

import asyncio
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import DecisionLost, MemoryClient, NoWorkerPolling
from durable_memory.config import Settings
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import DecisionOutcome
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import rig_settings, running_rig, turn_outcome

ONE_EDIT: list[dict[str, Any]] = [
    {"content": [edit_block("student", field="name", operation="set", value="Fay")]},
    {"text": "Hi Fay."},
]
GRACE_S = 1.0
"""Far below a live worker's long poll (about a minute): only for a queue nobody polls."""


def impatient(settings: Settings) -> Settings:
    temporal = settings.temporal.model_copy(update={"no_worker_grace_s": GRACE_S})
    return settings.model_copy(update={"temporal": temporal})


async def test_a_turn_with_no_worker_says_so_and_runs_once_a_worker_starts(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    waiting = impatient(settings)
    async with MemoryClient(temporal_env.client, waiting, stack_from_settings(waiting)) as client:
        try:
            await asyncio.wait_for(client.send_message("fay", "I'm Fay", turn_id="t1"), 60)
            raise AssertionError("a turn with no worker answered")
        except NoWorkerPolling as error:
            assert settings.temporal.task_queue in str(error)
            assert "runs when a worker starts" in str(error)
    async with running_rig(temporal_env.client, settings, ONE_EDIT) as rig:
        reply = await rig.client.send_message("fay", "I'm Fay", turn_id="t1")
        assert reply.reply == "Hi Fay."
        said = [m.content for m in rig.stack.recall.turn("fay", "t1") if m.role is MessageRole.USER]
        assert said == ["I'm Fay"]


async def test_a_decision_with_no_worker_says_so_and_applies_once(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, ONE_EDIT, keep_running=True) as rig:
        reply = await rig.client.send_message("fay", "I'm Fay", turn_id="t1")
    diff_id = reply.diffs[0].id
    waiting = impatient(settings)
    async with MemoryClient(temporal_env.client, waiting, stack_from_settings(waiting)) as client:
        try:
            await asyncio.wait_for(client.approve(diff_id, "ms-rivera", user_id="fay"), 60)
            raise AssertionError("a decision with no worker answered")
        except NoWorkerPolling as error:
            assert "the decision's answer did not arrive" in str(error)
    async with running_rig(temporal_env.client, settings, []) as rig:
        # The first approval may have applied when the worker came: either way, the truth.
        try:
            outcome: DecisionOutcome | None = await rig.client.approve(
                diff_id, "ms-rivera", user_id="fay"
            )
        except DecisionLost as lost:
            outcome = lost.outcome
        assert outcome is not None
        assert outcome.status is DiffStatus.APPROVED
        assert outcome.decided_by == "ms-rivera"
        ended = await turn_outcome(rig.client, "fay", "t1")
        assert [(d.diff_id, d.status) for d in ended.decisions] == [(diff_id, DiffStatus.APPROVED)]
        commits = rig.stack.history.history("fay", "student", 10)
        assert [c.trailers.get("Diff-Id") for c in commits].count(diff_id) == 1
