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
from durable_memory.memory.service import MemoryService
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import (
    AddItem,
    AppendText,
    LearnPreference,
    RemoveItem,
    SetField,
    SetTask,
)

ALICE = Author(name="alice", kind=AuthorKind.USER)
TURN = "turn:t1"


@pytest.fixture
def svc(service: MemoryService) -> MemoryService:
    service.ensure_user("alice")
    service.edit_block("alice", "student", {"name": "Alice", "strengths": ["Creativity"]}, ALICE)
    return service


def test_proposal_does_not_touch_memory(svc: MemoryService) -> None:
    head = svc.git.head("alice")
    diff = svc.propose("alice", "student", AddItem(field="strengths", value="Grit"), "why", TURN)
    assert diff.status is DiffStatus.PENDING
    assert diff.base_sha == head
    assert svc.git.head("alice") == head
    assert svc.read_block("alice", "student").fields["strengths"] == ["Creativity"]
    assert [d.id for d in svc.pending("alice")] == [diff.id]


def test_approve_commits_with_proposer_and_approver(svc: MemoryService) -> None:
    diff = svc.propose(
        "alice", "student", AddItem(field="strengths", value="Grit"), "she said so", TURN
    )
    approved = svc.approve(diff.id, "ms-rivera")
    assert approved.status is DiffStatus.APPROVED
    assert approved.commit_sha == svc.git.head("alice")
    assert svc.read_block("alice", "student").fields["strengths"] == ["Creativity", "Grit"]
    commit = svc.history("alice", "student", 1)[0]
    assert commit.author == "ms-rivera"
    assert commit.author_kind == "approver"
    assert commit.trailers == {
        "Diff-Id": diff.id,
        "Proposed-By": TURN,
        "Approved-By": "ms-rivera",
        "Reason": "she said so",
    }


def test_reject_records_reason_and_leaves_memory(svc: MemoryService) -> None:
    head = svc.git.head("alice")
    diff = svc.propose("alice", "journey", SetField(field="stage", value="drafting"), "r", TURN)
    rejected = svc.reject(diff.id, "ms-rivera", "too early")
    assert rejected.status is DiffStatus.REJECTED
    assert (rejected.decided_by, rejected.decision_reason) == ("ms-rivera", "too early")
    assert svc.git.head("alice") == head


def test_decisions_are_final(svc: MemoryService) -> None:
    diff = svc.propose("alice", "journey", SetField(field="stage", value="drafting"), "r", TURN)
    svc.reject(diff.id, "bob", "no")
    head = svc.git.head("alice")
    with pytest.raises(DiffAlreadyDecided, match="already rejected by bob"):
        svc.approve(diff.id, "carol")
    with pytest.raises(DiffAlreadyDecided):
        svc.reject(diff.id, "carol", "again")
    assert svc.diffs.get(diff.id, "alice").decided_by == "bob"
    assert svc.git.head("alice") == head


def test_foreign_and_unknown_diffs_are_refused(svc: MemoryService) -> None:
    svc.ensure_user("bob")
    diff = svc.propose("alice", "journey", SetField(field="stage", value="drafting"), "r", TURN)
    with pytest.raises(UnknownDiff, match="for user 'bob'"):
        svc.approve(diff.id, "bob", user_id="bob")
    with pytest.raises(UnknownDiff):
        svc.approve("0" * 32, "bob")
    with pytest.raises(InvalidIdentifier):
        svc.approve("../../etc", "bob")
    assert svc.diffs.get(diff.id, "alice").status is DiffStatus.PENDING


def test_newer_proposal_supersedes_older_for_same_block(svc: MemoryService) -> None:
    first = svc.propose("alice", "journey", SetField(field="stage", value="drafting"), "a", TURN)
    other = svc.propose("alice", "student", AddItem(field="goals", value="Study CS"), "b", TURN)
    second = svc.propose("alice", "journey", SetField(field="stage", value="revising"), "c", TURN)
    old = svc.diffs.get(first.id, "alice")
    assert old.status is DiffStatus.SUPERSEDED
    assert old.superseded_by == second.id
    assert {d.id for d in svc.pending("alice")} == {other.id, second.id}
    with pytest.raises(DiffAlreadyDecided, match="superseded"):
        svc.approve(first.id, "bob")


def test_approval_on_changed_block_conflicts_and_changes_nothing(svc: MemoryService) -> None:
    diff = svc.propose("alice", "student", SetField(field="name", value="Ally"), "nick", TURN)
    svc.edit_block("alice", "student", {"name": "Alicia", "strengths": ["Creativity"]}, ALICE)
    head = svc.git.head("alice")
    result = svc.approve(diff.id, "bob")
    assert result.status is DiffStatus.CONFLICTED
    assert result.decision_reason is not None
    assert "field 'name' of block 'student' changed" in result.decision_reason
    assert svc.git.head("alice") == head
    assert svc.read_block("alice", "student").fields["name"] == "Alicia"


def test_commutative_edit_applies_on_changed_block(svc: MemoryService) -> None:
    diff = svc.propose("alice", "student", AddItem(field="strengths", value="Grit"), "r", TURN)
    svc.edit_block("alice", "student", {"name": "Alicia", "strengths": ["Creativity"]}, ALICE)
    assert svc.approve(diff.id, "bob").status is DiffStatus.APPROVED
    assert svc.read_block("alice", "student").fields == {
        "name": "Alicia",
        "background": None,
        "strengths": ["Creativity", "Grit"],
        "goals": [],
    }


def test_removed_item_gone_since_proposal_conflicts(svc: MemoryService) -> None:
    diff = svc.propose(
        "alice", "student", RemoveItem(field="strengths", value="Creativity"), "r", TURN
    )
    svc.edit_block("alice", "student", {"name": "Alice", "strengths": []}, ALICE)
    result = svc.approve(diff.id, "bob")
    assert result.status is DiffStatus.CONFLICTED
    assert "not in student.strengths" in (result.decision_reason or "")


def test_reviewer_edit_replaces_proposal(svc: MemoryService) -> None:
    diff = svc.propose("alice", "student", AddItem(field="strengths", value="grit"), "r", TURN)
    block = svc.read_block("alice", "student")
    edited = to_markdown(
        block.spec, {**block.fields, "strengths": ["Creativity", "Grit, shown twice"]}
    )
    result = svc.approve(diff.id, "alice", edited_markdown=edited)
    assert result.status is DiffStatus.APPROVED
    assert result.edited_operation is not None
    assert svc.read_block("alice", "student").fields["strengths"] == [
        "Creativity",
        "Grit, shown twice",
    ]
    commit = svc.history("alice", "student", 1)[0]
    assert commit.trailers["Edited-By-Approver"] == "yes"
    assert commit.trailers["Proposed-By"] == TURN


def test_invalid_reviewer_edit_changes_nothing(svc: MemoryService) -> None:
    diff = svc.propose("alice", "student", AddItem(field="strengths", value="grit"), "r", TURN)
    head = svc.git.head("alice")
    with pytest.raises(FormatError, match="line 1"):
        svc.approve(diff.id, "alice", edited_markdown="no front matter")
    assert svc.diffs.get(diff.id, "alice").status is DiffStatus.PENDING
    assert svc.git.head("alice") == head


def test_model_errors_are_refused_at_proposal(svc: MemoryService) -> None:
    with pytest.raises(ReadOnlyBlock):
        svc.propose("alice", "persona", SetField(field="tone", value="cold"), "r", TURN)
    with pytest.raises(OperationNotApplicable, match="typed fields"):
        svc.propose("alice", "student", AppendText(content="x"), "r", TURN)
    with pytest.raises(OperationNotApplicable, match="has no field 'age'"):
        svc.propose("alice", "student", SetField(field="age", value="17"), "r", TURN)
    assert svc.pending("alice") == []


def test_commit_approved_is_idempotent_after_crash(svc: MemoryService) -> None:
    """A crash after the git commit but before the DB learnt its sha: the retry finds it."""
    diff = svc.propose("alice", "human", LearnPreference(preference="Socratic"), "r", TURN)
    approved = svc.approve(diff.id, "bob")
    assert approved.commit_sha is not None
    commits_before = len(svc.history("alice", "human", 100))
    # Simulate the lost DB write: forget the sha, then run the commit step again.
    with svc.diffs.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE pending_diffs SET commit_sha = NULL")
    again = svc.commit_approved(diff.id, "alice")
    assert again.commit_sha == approved.commit_sha
    assert len(svc.history("alice", "human", 100)) == commits_before


def test_expire_and_preview(svc: MemoryService) -> None:
    diff = svc.propose("alice", "human", SetTask(task="Outline essay"), "r", TURN)
    preview = svc.preview(diff.id)
    assert "+Outline essay" in preview
    assert preview.startswith("--- a/human.md\n+++ b/human.md\n")
    assert svc.expire(diff.id, "alice").status is DiffStatus.EXPIRED
    with pytest.raises(DiffAlreadyDecided):
        svc.approve(diff.id, "bob")
