"""The `decide` activity answers the truth, run with the SDK's ActivityEnvironment (no server):
a loser is told the winner's outcome and that its own decision was not applied; a retry of the
winner gets its own outcome back; an approval left uncommitted by a crash is finished by
whoever comes next; a diff of another user fails exactly like a missing one."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from durable_memory.activities.turn import TurnActivities
from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.config import Settings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.models.diffs import DiffStatus, PendingDiff, Proposer
from durable_memory.models.operations import LearnPreference
from durable_memory.models.turn import DecisionOutcome, DiffDecision


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[MemoryStack]:
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    stack.blocks.ensure_user("alice")
    yield stack
    stack.close()


@pytest.fixture
def activities(stack: MemoryStack) -> Iterator[TurnActivities]:
    model = AnthropicModel(base_url="http://127.0.0.1:9")  # never called by `decide`
    yield TurnActivities(stack, stack.turn_steps(model), Settings().turn_settings())
    model.close()


def _proposed(stack: MemoryStack) -> PendingDiff:
    op = LearnPreference(preference="Socratic")
    return stack.review.propose("alice", "human", op, "she asked", Proposer.turn("t1"))


def _decide(activities: TurnActivities, diff_id: str, kind: str, who: str) -> DecisionOutcome:
    decision = DiffDecision(
        diff_id=diff_id, user_id="alice", decision=kind, approver=who, reason="r"
    )
    outcome: DecisionOutcome = ActivityEnvironment().run(activities.decide, decision)
    return outcome


def test_the_loser_is_told_the_winners_outcome(
    stack: MemoryStack, activities: TurnActivities
) -> None:
    diff = _proposed(stack)
    won = _decide(activities, diff.id, "approve", "ann")
    assert won.status is DiffStatus.APPROVED
    assert won.commit_sha is not None
    assert won.decided_by == "ann"
    assert "not applied" not in won.message

    lost = _decide(activities, diff.id, "reject", "bob")
    assert (lost.status, lost.commit_sha, lost.decided_by) == (
        DiffStatus.APPROVED,
        won.commit_sha,
        "ann",
    )
    assert lost.decided_at == won.decided_at
    assert lost.message.startswith("not applied: bob's reject lost; diff")
    assert "already approved by ann" in lost.message
    # The winner's activity, retried after its result was lost, gets its own outcome again.
    assert _decide(activities, diff.id, "approve", "ann") == won


def test_an_uncommitted_approval_is_finished_by_the_next_decider(
    stack: MemoryStack, activities: TurnActivities
) -> None:
    diff = _proposed(stack)
    DiffStore(stack.engine).transition(  # a crash came between recording and committing
        diff.id, "alice", DiffStatus.PENDING, DiffStatus.APPROVED, decided_by="ann"
    )
    lost = _decide(activities, diff.id, "reject", "bob")
    assert lost.status is DiffStatus.APPROVED
    assert lost.commit_sha == stack.git.head("alice")
    assert lost.message.startswith("not applied")


def test_a_diff_of_another_user_fails_like_a_missing_one(
    stack: MemoryStack, activities: TurnActivities
) -> None:
    stack.blocks.ensure_user("bob")
    bobs = stack.review.propose(
        "bob", "human", LearnPreference(preference="Brief"), "r", Proposer.turn("t1")
    )
    refusals = []
    for diff_id in (bobs.id, "f" * 32):
        with pytest.raises(ApplicationError) as caught:
            _decide(activities, diff_id, "approve", "ann")
        assert caught.value.non_retryable
        assert caught.value.type == "UnknownDiff"
        refusals.append(caught.value.message.replace(diff_id, "<id>"))
    assert refusals[0] == refusals[1]
    assert stack.review.get(bobs.id, "bob").status is DiffStatus.PENDING
