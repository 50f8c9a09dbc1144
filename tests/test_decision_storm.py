"""A decision storm: 50 concurrent decisions on the four diffs of one turn, through every door
at once: MemoryClient Updates (approve, reject, edit-then-approve), `dmem approve` / `dmem
reject` processes, raw signals and raw Updates from a client with Temporal's default JSON
converter (as a TypeScript or Go backend sends them). One Update can be in flight ten at a time
per workflow, so the storm also runs into Temporal's Update limit.

Afterwards each diff has exactly one outcome, one commit if approved and none otherwise, and
every caller was told the truth: whoever was told "approved" or "rejected" is the one the
store names as the decider; every loser was told the real outcome and who decided it; a caller
turned away for the Update limit decided nothing."""

import asyncio
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack
from durable_memory.client import DecisionBusy, DecisionLost, MemoryClient
from durable_memory.memory.core.formats import to_markdown
from durable_memory.models.diffs import DiffStatus, PendingDiff
from durable_memory.models.turn import DecisionOutcome, TurnStatus
from tests.support.agent_helpers import edit_block
from tests.support.git_checks import assert_fsck_clean
from tests.support.temporal_helpers import (
    default_converter_client,
    rig_settings,
    running_rig,
    turn_outcome,
)

SEED = int(os.environ.get("DMEM_STORM_SEED", "4242"))
USER = "stormy"
DMEM = str(Path(sys.executable).parent / "dmem")

SCRIPT: list[dict[str, Any]] = [
    {
        "content": [
            edit_block("student", field="strengths", operation="add", value="Grit"),
            edit_block("journey", field="stage", operation="set", value="drafting"),
            edit_block("engagement_strategy", field="approach", operation="set", value="Socratic"),
            {
                "type": "tool_use",
                "name": "edit_memory_block",
                "input": {
                    "label": "human",
                    "operation": "learn_fact",
                    "value": "Has a dog",
                    "reasoning": "r",
                },
            },
        ]
    },
    {"text": "Noted four things."},
]


@dataclass
class Told:
    """What one caller was told: `won` (its decision applied), `lost` (with the outcome it
    was given), `busy` (nothing decided), `ended` (a plain SDK's Update that reached the turn
    after it ended: no outcome), or `sent` (a signal: no answer)."""

    approver: str
    decision: str
    diff_id: str
    door: str
    kind: str
    outcome: DecisionOutcome | dict[str, Any] | None = None
    text: str = ""


def _edited(stack: MemoryStack, diff: PendingDiff) -> str:
    """The block as a reviewer sends it back with the proposal changed."""
    block = stack.blocks.read_block(diff.user_id, diff.label)
    field = "strengths" if diff.label == "student" else "preferences"
    return to_markdown(block.spec, {**block.fields, field: ["Edited by a reviewer"]})


async def _client_update(client: MemoryClient, told: Told, edited: str | None = None) -> Told:
    try:
        if told.decision == "approve":
            result = await client.approve(told.diff_id, told.approver, edited_markdown=edited)
        else:
            result = await client.reject(told.diff_id, told.approver, "storm")
        told.kind, told.outcome = "won", result
    except DecisionLost as error:
        told.kind, told.outcome, told.text = "lost", error.outcome, str(error)
    except DecisionBusy as error:
        told.kind, told.text = "busy", str(error)
    return told


async def _cli(env: dict[str, str], told: Told) -> Told:
    extra = ["--reason", "storm"] if told.decision == "reject" else []
    process = await asyncio.create_subprocess_exec(
        DMEM,
        told.decision,
        told.diff_id,
        "--as",
        told.approver,
        *extra,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    told.text = (out + err).decode()
    if process.returncode == 0:
        told.kind = "won"
    elif "already" in told.text:
        told.kind = "lost"
    elif "in-flight updates" in told.text or "Update limit" in told.text:
        told.kind = "busy"
    else:
        raise AssertionError(f"dmem {told.decision} exited {process.returncode}: {told.text}")
    return told


def _payload(told: Told) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "diff_id": told.diff_id,
        "user_id": USER,
        "decision": told.decision,
        "approver": told.approver,
    }
    if told.decision == "reject":
        payload["reason"] = "storm"
    return payload


async def test_fifty_concurrent_decisions_one_outcome_each_and_every_answer_true(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    print(f"decision storm seed {SEED} (set DMEM_STORM_SEED to repeat)")
    settings = rig_settings(tmp_path / "data")
    foreign = await default_converter_client(temporal_env)
    env = {
        **os.environ,
        "DMEM_DATA_DIR": str(settings.memory.data_dir),
        "DMEM_PROFILE": "essay_coach",
        "DMEM_TASK_QUEUE": settings.temporal.task_queue,
        "DMEM_TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
    }
    async with running_rig(temporal_env.client, settings, SCRIPT) as rig:
        reply = await rig.client.send_message(USER, "a lot happened", turn_id="storm")
        diffs = [rig.stack.review.get(d.id, USER) for d in reply.diffs]
        assert len(diffs) == 4
        handle = foreign.get_workflow_handle(reply.workflow_id)

        calls: list[tuple[Told, Callable[[], Awaitable[Told]]]] = []

        def add(told: Told, run: Callable[[Told], Awaitable[Told]]) -> None:
            calls.append((told, lambda: run(told)))

        async def raw_update(told: Told) -> Told:
            try:
                told.outcome = await handle.execute_update("decide", _payload(told))
                told.kind = "won"
            except WorkflowUpdateFailedError as error:
                cause = error.cause
                assert isinstance(cause, ApplicationError), error
                assert cause.type == "DiffAlreadyDecided", cause
                told.kind, told.text = "lost", cause.message
                told.outcome = cause.details[0] if cause.details else None
            except (RPCError, WorkflowUpdateRPCTimeoutOrCancelledError) as error:
                # The plain SDK's answer to an Update that reached the turn after it ended
                # (or while it was ending): no outcome, and so no false one.
                told.kind, told.text = "ended", str(error)
            return told

        async def raw_signal(told: Told) -> Told:
            await handle.signal(told.decision, _payload(told))
            told.kind = "sent"
            return told

        for n, diff in enumerate(diffs):

            def told(door: str, decision: str, k: int, diff: PendingDiff = diff) -> Told:
                name = f"{door}-{decision}-{diff.label[:8]}-{k}"  # the decider, by name
                return Told(name, decision, diff.id, door, "")

            for k in range(4):
                add(told("client", "approve", k), lambda t: _client_update(rig.client, t))
            for k in range(2):
                add(told("client", "reject", k), lambda t: _client_update(rig.client, t))
            if diff.label in ("student", "human"):
                edited = _edited(rig.stack, diff)
                add(
                    told("edit", "approve", 0),
                    lambda t, e=edited: _client_update(rig.client, t, e),  # type: ignore[misc]
                )
            else:
                add(told("client", "approve", 4), lambda t: _client_update(rig.client, t))
            add(told("cli", "approve" if n % 2 else "reject", 0), lambda t: _cli(env, t))
            if n < 2:
                add(told("cli", "reject" if n % 2 else "approve", 1), lambda t: _cli(env, t))
            add(told("signal", "approve", 0), raw_signal)
            add(told("signal", "reject", 0), raw_signal)
            add(told("update", "approve", 0), raw_update)
            add(told("update", "reject", 0), raw_update)
        assert len(calls) == 50
        rng.shuffle(calls)
        answers = await asyncio.wait_for(asyncio.gather(*(run() for _, run in calls)), 300)
        outcome = await asyncio.wait_for(turn_outcome(rig.client, USER, "storm"), 120)

    kinds = Counter(f"{a.door}:{a.kind}" for a in answers)
    print("answers by door and kind:", dict(sorted(kinds.items())))
    lost = sum(n for k, n in kinds.items() if k.endswith(":lost"))
    busy = sum(n for k, n in kinds.items() if k.endswith(":busy"))
    # A storm, not a queue: callers raced each other (lost) or met Temporal's Update limit
    # (busy: the client's bounded backoff ran out, which a loaded machine turns some losers
    # into); how they split moves with load. And the losers' answer was exercised.
    assert lost + busy >= 10
    assert lost >= 4
    assert outcome.status is TurnStatus.DONE
    final = {d.id: rig.stack.review.get(d.id, USER) for d in diffs}
    repo = rig.stack.git.repo_path(USER)
    for diff_id, diff in final.items():
        assert diff.status in (DiffStatus.APPROVED, DiffStatus.REJECTED), diff
        commits = subprocess.run(
            ["git", "-C", str(repo), "log", "--format=%H", f"--grep=Diff-Id: {diff_id}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if diff.status is DiffStatus.APPROVED:
            assert commits == [diff.commit_sha]
        else:
            assert commits == []
        deciders = [a for a in answers if a.diff_id == diff_id]
        assert diff.decided_by in {a.approver for a in deciders}
        winner = next(a for a in deciders if a.approver == diff.decided_by)
        assert winner.decision == ("approve" if diff.status is DiffStatus.APPROVED else "reject")
        for answer in deciders:
            _assert_told_the_truth(answer, diff)
    decided = {o.diff_id: o for o in outcome.decisions}
    assert {k: v.status for k, v in decided.items()} == {k: v.status for k, v in final.items()}
    assert_fsck_clean(repo)


def _assert_told_the_truth(answer: Told, diff: PendingDiff) -> None:
    """`answer` agrees with the diff's final state in the store."""
    where = f"{answer.door} {answer.decision} by {answer.approver} on {diff.label}"
    if answer.kind == "won":
        assert diff.decided_by == answer.approver, f"{where} was told it won: {answer}"
        if answer.door == "cli":
            verb = "approved" if answer.decision == "approve" else "rejected"
            assert answer.text.startswith(f"{verb} {diff.id}"), answer.text
        elif isinstance(answer.outcome, DecisionOutcome):
            assert answer.outcome.status is diff.status
            assert answer.outcome.commit_sha == diff.commit_sha
        else:
            assert isinstance(answer.outcome, dict), answer
            assert answer.outcome["status"] == diff.status.value
            assert answer.outcome["commit_sha"] == diff.commit_sha
    elif answer.kind == "lost":
        assert diff.decided_by != answer.approver, f"{where} was told it lost but won"
        assert f"already {diff.status.value} by {diff.decided_by}" in answer.text, answer.text
        if isinstance(answer.outcome, DecisionOutcome):
            assert answer.outcome.status is diff.status
            assert answer.outcome.decided_by == diff.decided_by
            assert answer.outcome.commit_sha == diff.commit_sha
        elif isinstance(answer.outcome, dict):
            assert answer.outcome["status"] == diff.status.value
            assert answer.outcome["decided_by"] == diff.decided_by
    elif answer.kind in ("busy", "ended"):
        assert diff.decided_by != answer.approver, f"{where} was told {answer.kind} but decided"
    else:
        assert answer.kind == "sent", answer
