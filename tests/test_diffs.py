"""Pending diffs on SQLite and PostgreSQL: propose, supersede, decide, conflict, commit."""

import pytest

from durable_memory.memory.core.errors import (
    DiffAlreadyDecided,
    FormatError,
    InvalidIdentifier,
    OperationNotApplicable,
    ReadOnlyBlock,
    UnknownDiff,
)
from durable_memory.memory.core.formats import to_markdown
from durable_memory.models.diffs import DiffStatus, Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import (
    AddItem,
    AppendText,
    LearnPreference,
    RemoveItem,
    SetField,
    SetTask,
)
from tests.support.memory import MemoryRig

ALICE = Author(name="alice", kind=AuthorKind.USER)
TURN = Proposer.turn("t1")


@pytest.fixture
def svc(memory: MemoryRig) -> MemoryRig:
    memory.blocks.ensure_user("alice")
    memory.edits.edit_block(
        "alice", "student", {"name": "Alice", "strengths": ["Creativity"]}, ALICE
    )
    return memory


def test_proposal_does_not_touch_memory(svc: MemoryRig) -> None:
    head = svc.git.head("alice")
    diff = svc.review.propose(
        "alice", "student", AddItem(field="strengths", value="Grit"), "why", TURN
    )
    assert diff.status is DiffStatus.PENDING
    assert diff.base_sha == head
    assert svc.git.head("alice") == head
    assert svc.blocks.read_block("alice", "student").fields["strengths"] == ["Creativity"]
    assert [d.id for d in svc.review.pending("alice")] == [diff.id]


def test_approve_commits_with_proposer_and_approver(svc: MemoryRig) -> None:
    diff = svc.review.propose(
        "alice", "student", AddItem(field="strengths", value="Grit"), "she said so", TURN
    )
    approved = svc.review.approve(diff.id, "ms-rivera")
    assert approved.status is DiffStatus.APPROVED
    assert approved.commit_sha == svc.git.head("alice")
    assert svc.blocks.read_block("alice", "student").fields["strengths"] == ["Creativity", "Grit"]
    commit = svc.history.history("alice", "student", 1)[0]
    assert commit.author == "ms-rivera"
    assert commit.author_kind == "approver"
    assert commit.trailers == {
        "Diff-Id": diff.id,
        "Proposed-By": "turn:t1",
        "Approved-By": "ms-rivera",
        "Reason": "she said so",
    }


def test_reject_records_reason_and_leaves_memory(svc: MemoryRig) -> None:
    head = svc.git.head("alice")
    diff = svc.review.propose(
        "alice", "journey", SetField(field="stage", value="drafting"), "r", TURN
    )
    rejected = svc.review.reject(diff.id, "ms-rivera", "too early")
    assert rejected.status is DiffStatus.REJECTED
    assert (rejected.decided_by, rejected.decision_reason) == ("ms-rivera", "too early")
    assert svc.git.head("alice") == head


def test_decisions_are_final(svc: MemoryRig) -> None:
    diff = svc.review.propose(
        "alice", "journey", SetField(field="stage", value="drafting"), "r", TURN
    )
    svc.review.reject(diff.id, "bob", "no")
    head = svc.git.head("alice")
    with pytest.raises(DiffAlreadyDecided, match="already rejected by bob"):
        svc.review.approve(diff.id, "carol")
    with pytest.raises(DiffAlreadyDecided):
        svc.review.reject(diff.id, "carol", "again")
    assert svc.diffs.get(diff.id, "alice").decided_by == "bob"
    assert svc.git.head("alice") == head


def test_foreign_and_unknown_diffs_are_refused(svc: MemoryRig) -> None:
    svc.blocks.ensure_user("bob")
    diff = svc.review.propose(
        "alice", "journey", SetField(field="stage", value="drafting"), "r", TURN
    )
    with pytest.raises(UnknownDiff, match="for user 'bob'"):
        svc.review.approve(diff.id, "bob", user_id="bob")
    with pytest.raises(UnknownDiff):
        svc.review.approve("0" * 32, "bob")
    with pytest.raises(InvalidIdentifier):
        svc.review.approve("../../etc", "bob")
    assert svc.diffs.get(diff.id, "alice").status is DiffStatus.PENDING


def test_newer_proposal_supersedes_older_for_same_block(svc: MemoryRig) -> None:
    first = svc.review.propose(
        "alice", "journey", SetField(field="stage", value="drafting"), "a", TURN
    )
    other = svc.review.propose(
        "alice", "student", AddItem(field="goals", value="Study CS"), "b", TURN
    )
    second = svc.review.propose(
        "alice", "journey", SetField(field="stage", value="revising"), "c", TURN
    )
    old = svc.diffs.get(first.id, "alice")
    assert old.status is DiffStatus.SUPERSEDED
    assert old.superseded_by == second.id
    assert {d.id for d in svc.review.pending("alice")} == {other.id, second.id}
    with pytest.raises(DiffAlreadyDecided, match="superseded"):
        svc.review.approve(first.id, "bob")


def test_approval_on_changed_block_conflicts_and_changes_nothing(svc: MemoryRig) -> None:
    diff = svc.review.propose(
        "alice", "student", SetField(field="name", value="Ally"), "nick", TURN
    )
    svc.edits.edit_block("alice", "student", {"name": "Alicia", "strengths": ["Creativity"]}, ALICE)
    head = svc.git.head("alice")
    result = svc.review.approve(diff.id, "bob")
    assert result.status is DiffStatus.CONFLICTED
    assert result.decision_reason is not None
    assert "field 'name' of block 'student' changed" in result.decision_reason
    assert svc.git.head("alice") == head
    assert svc.blocks.read_block("alice", "student").fields["name"] == "Alicia"


def test_commutative_edit_applies_on_changed_block(svc: MemoryRig) -> None:
    diff = svc.review.propose(
        "alice", "student", AddItem(field="strengths", value="Grit"), "r", TURN
    )
    svc.edits.edit_block("alice", "student", {"name": "Alicia", "strengths": ["Creativity"]}, ALICE)
    assert svc.review.approve(diff.id, "bob").status is DiffStatus.APPROVED
    assert svc.blocks.read_block("alice", "student").fields == {
        "name": "Alicia",
        "background": None,
        "strengths": ["Creativity", "Grit"],
        "goals": [],
    }


def test_removed_item_gone_since_proposal_conflicts(svc: MemoryRig) -> None:
    diff = svc.review.propose(
        "alice", "student", RemoveItem(field="strengths", value="Creativity"), "r", TURN
    )
    svc.edits.edit_block("alice", "student", {"name": "Alice", "strengths": []}, ALICE)
    result = svc.review.approve(diff.id, "bob")
    assert result.status is DiffStatus.CONFLICTED
    assert "not in student.strengths" in (result.decision_reason or "")


def test_reviewer_edit_replaces_proposal(svc: MemoryRig) -> None:
    diff = svc.review.propose(
        "alice", "student", AddItem(field="strengths", value="grit"), "r", TURN
    )
    block = svc.blocks.read_block("alice", "student")
    edited = to_markdown(
        block.spec, {**block.fields, "strengths": ["Creativity", "Grit, shown twice"]}
    )
    result = svc.review.approve(diff.id, "alice", edited_markdown=edited)
    assert result.status is DiffStatus.APPROVED
    assert result.edited_operation is not None
    assert svc.blocks.read_block("alice", "student").fields["strengths"] == [
        "Creativity",
        "Grit, shown twice",
    ]
    commit = svc.history.history("alice", "student", 1)[0]
    assert commit.trailers["Edited-By-Approver"] == "yes"
    assert commit.trailers["Proposed-By"] == "turn:t1"


def test_invalid_reviewer_edit_changes_nothing(svc: MemoryRig) -> None:
    diff = svc.review.propose(
        "alice", "student", AddItem(field="strengths", value="grit"), "r", TURN
    )
    head = svc.git.head("alice")
    with pytest.raises(FormatError, match="line 1"):
        svc.review.approve(diff.id, "alice", edited_markdown="no front matter")
    assert svc.diffs.get(diff.id, "alice").status is DiffStatus.PENDING
    assert svc.git.head("alice") == head


def test_model_errors_are_refused_at_proposal(svc: MemoryRig) -> None:
    with pytest.raises(ReadOnlyBlock):
        svc.review.propose("alice", "persona", SetField(field="tone", value="cold"), "r", TURN)
    with pytest.raises(OperationNotApplicable, match="typed fields"):
        svc.review.propose("alice", "student", AppendText(content="x"), "r", TURN)
    with pytest.raises(OperationNotApplicable, match="has no field 'age'"):
        svc.review.propose("alice", "student", SetField(field="age", value="17"), "r", TURN)
    assert svc.review.pending("alice") == []


def test_commit_approved_is_idempotent_after_crash(svc: MemoryRig) -> None:
    """A crash after the git commit but before the DB learnt its sha: the retry finds it."""
    diff = svc.review.propose("alice", "human", LearnPreference(preference="Socratic"), "r", TURN)
    approved = svc.review.approve(diff.id, "bob")
    assert approved.commit_sha is not None
    commits_before = len(svc.history.history("alice", "human", 100))
    # Simulate the lost DB write: forget the sha, then run the commit step again.
    with svc.diffs.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE pending_diffs SET commit_sha = NULL")
    again = svc.review.commit_approved(diff.id, "alice")
    assert again.commit_sha == approved.commit_sha
    assert len(svc.history.history("alice", "human", 100)) == commits_before


def test_expire_and_preview(svc: MemoryRig) -> None:
    diff = svc.review.propose("alice", "human", SetTask(task="Outline essay"), "r", TURN)
    preview = svc.review.preview(diff.id)
    assert "+Outline essay" in preview
    assert preview.startswith("--- a/human.md\n+++ b/human.md\n")
    assert svc.review.expire(diff.id, "alice").status is DiffStatus.EXPIRED
    with pytest.raises(DiffAlreadyDecided):
        svc.review.approve(diff.id, "bob")
