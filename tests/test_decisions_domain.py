"""Truthful decisions at the domain layer, without Temporal: approvals, rejections, reviewer
edits and expiry racing on the same diffs from threads, on SQLite and PostgreSQL. Exactly one
decision wins; approved if and only if exactly one commit carries the diff's Diff-Id; every
caller is told the truth (the winner its outcome, a loser DiffAlreadyDecided carrying the
winner's, a refused approval an error while the diff stays pending)."""

import itertools
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_memory.memory.core.errors import (
    BlockValidationError,
    DecisionRefused,
    DiffAlreadyDecided,
    FormatError,
)
from durable_memory.memory.core.formats import to_markdown
from durable_memory.models.diffs import DiffStatus, PendingDiff, Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddItem, LearnPreference
from tests.support.memory import MemoryRig

ACTIONS = ["approve", "reject", "edit_approve", "bad_edit_approve", "expire"]
EXPIRER = "durable-memory"
REFUSED = (DecisionRefused, BlockValidationError, FormatError)
"""What an approval with an invalid reviewer edit may raise: the diff stays pending."""

_users = itertools.count()


@dataclass
class Call:
    action: str
    diff: int
    approver: str
    result: PendingDiff | Exception | None = None


def _edited(memory: MemoryRig, diff: PendingDiff, *, valid: bool) -> str:
    """The whole block as a reviewer would send it back: edited, or far over its limit."""
    block = memory.blocks.read_block(diff.user_id, diff.label)
    fields = dict(block.fields)
    if diff.label == "student":
        fields["strengths"] = [*(fields.get("strengths") or []), "Edited"]
    else:
        fields["preferences"] = [*(fields.get("preferences") or []), "Edited"]
    if not valid:
        fields["current_task" if diff.label == "human" else "name"] = "x" * 5000
    return to_markdown(block.spec, fields)


def _decide(memory: MemoryRig, call: Call, diff: PendingDiff) -> PendingDiff:
    user = diff.user_id
    if call.action == "approve":
        return memory.review.approve(diff.id, call.approver, user_id=user)
    if call.action == "reject":
        return memory.review.reject(diff.id, call.approver, "no", user_id=user)
    if call.action == "expire":
        return memory.review.expire(diff.id, user)
    markdown = _edited(memory, diff, valid=call.action == "edit_approve")
    return memory.review.approve(diff.id, call.approver, user_id=user, edited_markdown=markdown)


def _diff_id_commits(memory: MemoryRig, user_id: str, diff_id: str) -> list[str]:
    out = subprocess.run(
        [
            *("git", "-C", str(memory.git.repo_path(user_id)), "log", "--format=%H"),
            *("--fixed-strings", f"--grep=Diff-Id: {diff_id}"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def _check_truth(memory: MemoryRig, diff: PendingDiff, calls: list[Call]) -> None:
    final = memory.diffs.get(diff.id, diff.user_id)
    commits = _diff_id_commits(memory, diff.user_id, diff.id)
    if final.status is DiffStatus.APPROVED:
        assert commits == [final.commit_sha]
    else:
        assert commits == []
        assert final.commit_sha is None
    winners = [c for c in calls if isinstance(c.result, PendingDiff)]
    if final.status is DiffStatus.PENDING:
        assert winners == []
    else:
        [winner] = winners
        assert final.decided_by == (EXPIRER if winner.action == "expire" else winner.approver)
        assert winner.result == final
    for call in calls:
        if isinstance(call.result, DiffAlreadyDecided):
            assert call.result.diff is not None
            assert call.result.diff.status is final.status
            assert call.result.diff.decided_by == final.decided_by
        elif isinstance(call.result, Exception):
            assert call.action == "bad_edit_approve", repr(call.result)
            assert isinstance(call.result, REFUSED), repr(call.result)


plans = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(ACTIONS)), min_size=2, max_size=6)


@given(plan=plans)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_racing_decisions_have_one_winner_and_every_caller_is_told_the_truth(
    memory: MemoryRig, plan: list[tuple[int, str]]
) -> None:
    user = f"u{next(_users)}"
    memory.blocks.ensure_user(user)
    memory.edits.edit_block(
        user,
        "student",
        {"name": "Ann", "strengths": ["Grit"]},
        Author(name=user, kind=AuthorKind.USER),
    )
    diffs = [
        memory.review.propose(
            user, "student", AddItem(field="strengths", value="Wit"), "r", Proposer.turn("t1")
        ),
        memory.review.propose(
            user, "human", LearnPreference(preference="Socratic"), "r", Proposer.turn("t1")
        ),
    ]
    calls = [Call(action, index, f"reviewer-{n}") for n, (index, action) in enumerate(plan)]
    start = threading.Barrier(len(calls))

    def run(call: Call) -> None:
        start.wait()
        try:
            call.result = _decide(memory, call, diffs[call.diff])
        except Exception as error:  # every outcome is checked against the final state
            call.result = error

    with ThreadPoolExecutor(len(calls)) as pool:
        list(pool.map(run, calls))
    for index, diff in enumerate(diffs):
        _check_truth(memory, diff, [c for c in calls if c.diff == index])
    assert memory.diffs.unfinished_approvals(user) == []


def test_an_approval_recorded_but_not_committed_is_finished(memory: MemoryRig) -> None:
    """A crash between recording an approval and committing it: the next turn of the user
    (finish_approvals) commits it, once, even if its commit had in fact been made."""
    memory.blocks.ensure_user("alice")
    diff = memory.review.propose(
        "alice", "human", LearnPreference(preference="Socratic"), "r", Proposer.parse("t")
    )
    memory.review.approve(diff.id, "ms-rivera", user_id="alice")
    with memory.diffs.engine.begin() as conn:  # the crash lost the sha's write
        conn.exec_driver_sql("UPDATE pending_diffs SET commit_sha = NULL")
    other = memory.review.propose(
        "alice", "student", AddItem(field="strengths", value="Grit"), "r", Proposer.parse("t")
    )
    memory.diffs.transition(
        other.id, "alice", DiffStatus.PENDING, DiffStatus.APPROVED, decided_by="ms-rivera"
    )  # the crash came before the commit
    finished = {d.id: d for d in memory.review.finish_approvals("alice")}
    assert set(finished) == {diff.id, other.id}
    for done in finished.values():
        assert done.status is DiffStatus.APPROVED
        assert _diff_id_commits(memory, "alice", done.id) == [done.commit_sha]
    assert memory.review.finish_approvals("alice") == []


def test_an_approval_that_cannot_apply_leaves_the_diff_pending_or_conflicted(
    memory: MemoryRig,
) -> None:
    memory.blocks.ensure_user("alice")
    diff = memory.review.propose(
        "alice", "student", AddItem(field="strengths", value="Wit"), "r", Proposer.parse("t")
    )
    head = memory.git.head("alice")
    with pytest.raises(REFUSED, match="limit"):
        memory.review.approve(
            diff.id,
            "ms-rivera",
            user_id="alice",
            edited_markdown=_edited(memory, diff, valid=False),
        )
    # Edited by hand in the working tree: refused, still pending, nothing committed.
    block_file = memory.git.repo_path("alice") / "blocks" / "student.toml"
    original = block_file.read_bytes()
    block_file.write_bytes(original + b"\n# a note\n")
    with pytest.raises(DecisionRefused, match="by hand"):
        memory.review.approve(diff.id, "ms-rivera", user_id="alice")
    block_file.write_bytes(original)
    assert memory.diffs.get(diff.id, "alice").status is DiffStatus.PENDING
    assert memory.git.head("alice") == head

    # The block changed so that the edit no longer applies: conflicted with the reason.
    memory.edits.edit_block(
        "alice",
        "student",
        {"strengths": ["a", "b", "c", "d", "e", "f"]},
        Author(name="alice", kind=AuthorKind.USER),
    )
    conflicted = memory.review.approve(diff.id, "ms-rivera", user_id="alice")
    assert conflicted.status is DiffStatus.CONFLICTED
    assert conflicted.commit_sha is None
    assert "not applied" in (conflicted.decision_reason or "")
    assert _diff_id_commits(memory, "alice", diff.id) == []


def test_an_approval_that_stops_applying_after_its_check_becomes_conflicted(
    memory: MemoryRig,
) -> None:
    """A change staged by hand (`git add`) is met only by the commit itself, after the
    approval is recorded: the diff ends conflicted with the reason, never approved alone."""
    memory.blocks.ensure_user("alice")
    diff = memory.review.propose(
        "alice", "human", LearnPreference(preference="Socratic"), "r", Proposer.parse("t")
    )
    repo = memory.git.repo_path("alice")
    block_file = repo / "blocks" / "human.toml"
    original = block_file.read_bytes()
    block_file.write_bytes(original + b"\n# a note\n")
    subprocess.run(["git", "-C", str(repo), "add", "blocks/human.toml"], check=True)
    block_file.write_bytes(original)
    head = memory.git.head("alice")
    conflicted = memory.review.approve(diff.id, "ms-rivera", user_id="alice")
    assert conflicted.status is DiffStatus.CONFLICTED
    assert "staged by hand" in (conflicted.decision_reason or "")
    assert memory.git.head("alice") == head
    assert memory.diffs.unfinished_approvals("alice") == []
