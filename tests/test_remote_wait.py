"""A git remote outage during a decision's commit (issue 15 §1): the turn says "waiting for
git remote" in its details, tries the commit again with backoff, and completes when the
remote is back; after `turn.git_remote_wait_s` it answers the decision as not applied.

The orchestration (bound, backoff, expiry deadline, queued decisions) is tested on the
time-skipping server with stand-in activities, as in test_turn_workflow_unit.py; the outage
itself end to end on a real worker whose git server is stopped and restarted.
"""

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from durable_memory.config import Settings
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    GitRemoteContended,
    GitRemoteRefused,
    GitRemoteUnavailable,
)
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import (
    DecisionOutcome,
    DiffDecision,
    TurnOutcome,
    TurnReply,
    TurnStatus,
    WorkerTurnSettings,
)
from durable_memory.workflows.turn import MAX_GIT_REMOTE_WAIT_ROUNDS, TurnWorkflow
from durable_memory.workflows.turn_details import WAITING_FOR_GIT_REMOTE
from tests.support.agent_helpers import edit_block
from tests.support.distributed import (
    distributed_settings,
    git_server,
    remote_log,
    restart_git_server,
)
from tests.support.postgres import fresh_schema_url
from tests.support.temporal_helpers import (
    current_details,
    running_rig,
    time_skipping,
    turn_outcome,
)
from tests.test_turn_workflow_unit import StandInActivities, _decision, _diff_id, started_turn


@dataclass
class RemoteDownActivities(StandInActivities):
    """Stand-ins whose `decide` fails as the remote store does while its git server is
    down, for the first `failing_decides` calls (None: always)."""

    failing_decides: int | None = None
    failure_type: str = GitRemoteUnavailable.__name__
    decides: int = 0

    @activity.defn(name="dmem.decide")
    async def decide(self, decision: DiffDecision) -> DecisionOutcome:
        self.decides += 1
        if self.failing_decides is None or self.decides <= self.failing_decides:
            self.calls.append(("decide failed", decision.diff_id))
            raise ApplicationError(
                f"dmem.decide failed: {self.failure_type}: git server at 127.0.0.1 refused "
                f"the connection (call {self.decides})",
                type=self.failure_type,
                non_retryable=self.failure_type == GitRemoteRefused.__name__,
            )
        return await super().decide(decision)


def _settings(**update: Any) -> WorkerTurnSettings:
    return Settings().turn_settings().model_copy(update=update)


async def _details_saying(handle: WorkflowHandle[Any, Any], text: str) -> str:
    for _ in range(200):
        details = await current_details(handle)
        if text in details:
            return details
        await asyncio.sleep(0.05)
    raise AssertionError(f"the details never said {text!r}:\n{details}")


@pytest.mark.parametrize("outage", [GitRemoteUnavailable, GitRemoteContended])
async def test_an_outage_is_waited_out_and_the_approval_completes(
    time_skipping_env: WorkflowEnvironment, outage: type[DurableMemoryError]
) -> None:
    stand_ins = RemoteDownActivities(
        model_steps=[1, 0], failing_decides=3, failure_type=outage.__name__
    )
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        approval = asyncio.create_task(
            handle.execute_update("decide", _decision(1, "approve"), result_type=DecisionOutcome)
        )
        # Time is not skipped here: the first retry waits the commit's initial interval.
        details = await _details_saying(handle, WAITING_FOR_GIT_REMOTE)
        assert details.startswith(f"**{WAITING_FOR_GIT_REMOTE}** since ")
        assert "approve " + _diff_id(1)[:8] + " by ms-rivera, attempt 1 failed" in details
        assert "refused the connection (call 1)" in details
        assert await handle.query(TurnWorkflow.status) == TurnStatus.COMMITTING
        assert not approval.done()
        async with time_skipping(time_skipping_env):
            approved = await approval
        outcome: TurnOutcome = await handle.result()
        details = await current_details(handle)
    assert approved.status is DiffStatus.APPROVED
    assert stand_ins.decides == 4  # each failure reached the turn once: Temporal retried none
    assert WAITING_FOR_GIT_REMOTE not in details
    assert outcome.status is TurnStatus.DONE


async def test_the_wait_is_bounded_then_the_decision_is_answered_as_not_applied(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    hour = _settings(git_remote_wait_s=3600, approval_ttl_s=2 * 3600)
    stand_ins = RemoteDownActivities(model_steps=[1, 0], settings=hour)
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        approval = asyncio.create_task(
            handle.execute_update("decide", _decision(1, "approve"), result_type=DecisionOutcome)
        )
        # Skipping time only once the decision is being applied: skipped before the Update
        # reaches the turn, the approval window would close first.
        await _details_saying(handle, WAITING_FOR_GIT_REMOTE)
        async with time_skipping(time_skipping_env):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await approval
            waited = stand_ins.decides
        outcome: TurnOutcome = await handle.result()
        details = await current_details(handle)
    cause = refused.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == "DecisionRefused"
    assert "was not applied" in cause.message
    assert "GitRemoteUnavailable" in cause.message
    # 1, 2, 4 ... 32 s, then every 60 s (the commit retry's maximum) up to the hour: about
    # 65 attempts, however long the activities took, and never more.
    assert 60 <= waited <= 70
    # The diff stayed open (approving again would have started a new wait) until the window
    # closed; nothing waits any more.
    assert stand_ins.decides == waited
    assert stand_ins.calls[-1] == ("expire_diffs", [_diff_id(1)])
    assert outcome.status is TurnStatus.EXPIRED
    assert WAITING_FOR_GIT_REMOTE not in details


async def test_a_whole_default_wait_keeps_the_history_far_from_temporals_limits(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """24 hours at the commit retry's 60 s would be some 1,440 attempts and 16,000 events;
    the intervals stretch so that the whole wait takes about MAX_GIT_REMOTE_WAIT_ROUNDS."""
    stand_ins = RemoteDownActivities(model_steps=[1, 0])
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        approval = asyncio.create_task(
            handle.execute_update("decide", _decision(1, "approve"), result_type=DecisionOutcome)
        )
        await _details_saying(handle, WAITING_FOR_GIT_REMOTE)
        async with time_skipping(time_skipping_env):
            with pytest.raises(WorkflowUpdateFailedError):
                await approval
        events = len((await handle.fetch_history()).events)
        await handle.result()  # the approval window closes: the diff expires
    # 1, 2 ... 128 s, then every 172.8 s (a 500th of the day): 508 attempts, 5,648 events.
    assert stand_ins.decides <= MAX_GIT_REMOTE_WAIT_ROUNDS + 10
    assert events < 6_000  # Temporal warns at 10,240 events and terminates at 51,200


async def test_a_final_git_error_is_not_waited_out(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stand_ins = RemoteDownActivities(
        model_steps=[1, 0], failure_type=GitRemoteRefused.__name__, failing_decides=1
    )
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(
                "decide", _decision(1, "approve"), result_type=DecisionOutcome
            )
        approved = await handle.execute_update(
            "decide", _decision(1, "approve"), result_type=DecisionOutcome
        )
        await handle.result()
    assert isinstance(refused.value.cause, ApplicationError)
    assert "GitRemoteRefused" in refused.value.cause.message
    assert approved.status is DiffStatus.APPROVED
    assert stand_ins.decides == 2


async def test_decisions_taken_in_time_outlast_the_expiry_deadline(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """The approval window closes while an approval waits for the remote: that approval and
    a rejection queued behind it still apply; only the undecided diff expires."""
    minute = _settings(approval_ttl_s=60)
    stand_ins = RemoteDownActivities(model_steps=[1, 1, 1, 0], settings=minute, failing_decides=8)
    async with started_turn(time_skipping_env, stand_ins) as handle:
        await handle.execute_update("reply", result_type=TurnReply)
        approval = asyncio.create_task(
            handle.execute_update("decide", _decision(1, "approve"), result_type=DecisionOutcome)
        )
        await _details_saying(handle, WAITING_FOR_GIT_REMOTE)
        await handle.signal("reject", _decision(2, "reject"))  # queued behind the approval
        async with time_skipping(time_skipping_env):
            approved = await approval
        outcome: TurnOutcome = await handle.result()
    assert approved.status is DiffStatus.APPROVED
    # Eight failures: 1 + 2 + 4 + ... + 32 + 60 + 60 s of waiting, past the minute.
    assert [call for call in stand_ins.calls if call[0] in ("decide", "expire_diffs")] == [
        ("decide", ("approve", _diff_id(1))),
        ("decide", ("reject", _diff_id(2))),
        ("expire_diffs", [_diff_id(3)]),
    ]
    assert {d.diff_id: d.status for d in outcome.decisions} == {
        _diff_id(1): DiffStatus.APPROVED,
        _diff_id(2): DiffStatus.REJECTED,
        _diff_id(3): DiffStatus.EXPIRED,
    }


ONE_EDIT: list[dict[str, Any]] = [
    {
        "content": [
            {"type": "text", "text": "Noting your name."},
            edit_block("student", field="name", operation="set", value="Alice"),
        ]
    },
    {"text": "Welcome, Alice."},
]


def _commits_carrying(bare: Path, diff_id: str) -> list[str]:
    """The commits on the remote's main whose Diff-Id trailer is `diff_id`."""
    log = remote_log(bare, "main", "--format=%H %(trailers:key=Diff-Id,valueonly,separator=)")
    return [line.split()[0] for line in log.splitlines() if line.endswith(f" {diff_id}")]


@pytest.mark.postgres
async def test_an_approval_waits_for_a_stopped_git_server_and_commits_once_it_is_back(
    temporal_env: WorkflowEnvironment, postgres_url: str, tmp_path: Path
) -> None:
    root = tmp_path / "remote"
    with git_server(root) as server:
        settings = distributed_settings(
            tmp_path / "data",
            database_url=fresh_schema_url(postgres_url),
            git_remote=server.url,
        )
        bare = root / "alice.git"
        async with running_rig(temporal_env.client, settings, ONE_EDIT) as rig:
            reply = await rig.client.send_message("alice", "Hi, I'm Alice", turn_id="t1")
            (diff,) = reply.diffs
            handle = temporal_env.client.get_workflow_handle(reply.workflow_id)
            server.stop()
            approval = asyncio.create_task(rig.client.approve(diff.id, "ms-rivera"))
            details = await _details_saying(handle, WAITING_FOR_GIT_REMOTE)
            assert "GitRemoteUnavailable" in details
            assert await handle.query(TurnWorkflow.status) == TurnStatus.COMMITTING
            assert not approval.done()  # the Update waits
            assert _commits_carrying(bare, diff.id) == []  # nothing reached the remote
            restarted = restart_git_server(server, root)
            try:
                approved = await approval
                outcome = await turn_outcome(rig.client, "alice", "t1")
                details = await current_details(handle)
            finally:
                restarted.stop()
    assert approved is not None
    assert approved.status is DiffStatus.APPROVED
    assert _commits_carrying(bare, diff.id) == [approved.commit_sha]
    assert outcome.status is TurnStatus.DONE
    assert WAITING_FOR_GIT_REMOTE not in details
