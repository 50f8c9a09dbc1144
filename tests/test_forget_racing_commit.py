"""An approved edit whose commit runs while its user is forgotten commits and archives nothing,
on SQLite and PostgreSQL: not into the memory the forget is erasing, and not into the new
memory of a user started afresh meanwhile (the edit is of the memory that forget erased).

A commit waits longest where it clears a task into the archive: the task's text is embedded
(seconds) before the commit. Every path that commits goes through that wait: a person's
approval, a standing approval at the proposal, and a backend's direct `clear_task`. The forget
(and a fresh start) is run from inside the embedding; and, for an edit with no archive, from
between the approval's first check and its commit, where the last check, made under the
user's repository lock, is what refuses it."""

from collections.abc import Callable, Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.core.errors import UserBeingForgotten, UserForgotten
from durable_memory.memory.rotation.task_sink import ArchiveTaskSink
from durable_memory.models.diffs import DiffStatus, Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddContext, ClearTask
from tests.support.forgetting import EmbeddingAcrossAForget, forget_begins, rows_of
from tests.support.git_checks import git_output
from tests.support.memory import MemoryRig, memory_rig

BACKEND = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
TEACHER = "ms.lee@school"


@pytest.fixture
def archive(tmp_path: Path) -> Iterator[SqliteArchive]:
    with closing(SqliteArchive(tmp_path / "archive.db", default_embedder())) as store:
        yield store


@pytest.fixture
def rig(engine: Engine, data_dir: Path, archive: SqliteArchive) -> MemoryRig:
    """Alice and Bob, each with a task under way and one passage archived."""
    memory = memory_rig(engine, data_dir, "default", ArchiveTaskSink(archive))
    for user in ("alice", "bob"):
        memory.blocks.ensure_user(user)
        memory.edits.set_task(user, f"{user}'s essay on identity", BACKEND, context="drafted")
        memory.edits.clear_task(user, BACKEND, archive=True)
        memory.edits.set_task(user, f"{user}'s second essay", BACKEND, context="outlined")
    return memory


class Forgetting:
    """Alice's whole forget (rows, archive, repository), then, if `afresh`, a caller starting
    her afresh: what her new memory is then (rows, HEAD) is kept to compare with after."""

    def __init__(
        self, memory: MemoryRig, engine: Engine, archive: SqliteArchive, afresh: bool
    ) -> None:
        self.memory, self.engine, self.archive, self.afresh = memory, engine, archive, afresh
        self.rows: dict[str, int] = {}
        self.head: str | None = None
        self.bob = (rows_of(engine, "bob"), archive.count("bob"), memory.git.head("bob"))

    def __call__(self) -> None:
        forget_begins(self.engine, "completed", self.archive, self.memory.git)()
        if self.afresh:
            self.memory.blocks.ensure_user("alice", fresh=True)
            self.rows, self.head = rows_of(self.engine, "alice"), self.memory.git.head("alice")

    def during_the_embedding(self) -> None:
        self.archive.embedder = EmbeddingAcrossAForget(self.archive.embedder, self)

    def refused(self, error: pytest.ExceptionInfo[UserForgotten]) -> None:
        assert error.value.started_afresh is self.afresh

    def assert_nothing_of_the_old_memory(self) -> None:
        assert self.archive.count("alice") == 0
        assert rows_of(self.engine, "alice") == self.rows
        repo = self.memory.git.repo_path("alice")
        if self.afresh:
            # Her new repository: its one creation commit, nothing of the edit.
            assert self.memory.git.head("alice") == self.head
            assert git_output(repo, "log", "--format=%s").splitlines() == [
                "Create memory: persona, human, notes"
            ]
            assert self.memory.blocks.read_block("alice", "human").fields["current_task"] is None
        else:
            assert not repo.exists()
        bob = (rows_of(self.engine, "bob"), self.archive.count("bob"), self.memory.git.head("bob"))
        assert bob == self.bob


def meanwhile(call: Callable[..., Any], run: Callable[[], None], *, first: bool) -> Any:
    """`call`, with `run` (a forget) run just before it (`first`) or just after it."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if first:
            run()
        result = call(*args, **kwargs)
        if not first:
            run()
        return result

    return wrapped


AFRESH = pytest.mark.parametrize("afresh", [False, True], ids=["forgotten", "started-afresh"])


def _proposed_clear(memory: MemoryRig) -> str:
    diff = memory.review.propose(
        "alice", "human", ClearTask(archive=True), "she finished", Proposer.turn("t1")
    )
    assert diff.status is DiffStatus.PENDING
    return diff.id


@AFRESH
def test_an_approval_whose_task_archive_embeds_across_a_forget_leaves_nothing(
    rig: MemoryRig, engine: Engine, archive: SqliteArchive, afresh: bool
) -> None:
    """A person approves the model's clear_task(archive=True); while the task's text embeds,
    alice is forgotten (and started afresh). The passage is not written, nor the commit made:
    one clear refusal."""
    diff_id = _proposed_clear(rig)
    forgetting = Forgetting(rig, engine, archive, afresh)
    forgetting.during_the_embedding()
    with pytest.raises(UserForgotten) as refused:
        rig.review.approve(diff_id, TEACHER, user_id="alice")
    forgetting.refused(refused)
    forgetting.assert_nothing_of_the_old_memory()


@AFRESH
def test_a_standing_approval_whose_task_archive_embeds_across_a_forget_leaves_nothing(
    rig: MemoryRig, engine: Engine, archive: SqliteArchive, afresh: bool
) -> None:
    """A standing approval commits the model's clear_task(archive=True) at its proposal (in a
    turn's tool step); the forget runs while the task's text embeds."""
    rig.policies.set(
        "alice", "human", ["clear_task"], TEACHER, datetime.now(UTC) + timedelta(days=30)
    )
    forgetting = Forgetting(rig, engine, archive, afresh)
    forgetting.during_the_embedding()
    with pytest.raises(UserForgotten) as refused:
        _proposed_clear(rig)
    forgetting.refused(refused)
    forgetting.assert_nothing_of_the_old_memory()


@AFRESH
def test_a_direct_clear_task_whose_archive_embeds_across_a_forget_leaves_nothing(
    rig: MemoryRig, engine: Engine, archive: SqliteArchive, afresh: bool
) -> None:
    """A backend clears alice's task into the archive (`clear_task(archive=True)`) as she is
    forgotten: the old task is not archived into her new memory, nor cleared there."""
    forgetting = Forgetting(rig, engine, archive, afresh)
    forgetting.during_the_embedding()
    with pytest.raises(UserForgotten) as refused:
        rig.edits.clear_task("alice", BACKEND, archive=True)
    forgetting.refused(refused)
    forgetting.assert_nothing_of_the_old_memory()


@AFRESH
def test_an_approval_committed_after_a_forget_began_is_refused_under_the_lock(
    rig: MemoryRig,
    engine: Engine,
    archive: SqliteArchive,
    afresh: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No archive to wait on: the forget (and a fresh start) comes between the approval's
    first check and its commit. The check made under the repository's lock refuses it."""
    diff = rig.review.propose(
        "alice", "human", AddContext(note="prefers mornings"), "she said", Proposer.turn("t1")
    )
    forgetting = Forgetting(rig, engine, archive, afresh)
    monkeypatch.setattr(
        rig.review, "_commit", meanwhile(rig.review._commit, forgetting, first=True)
    )
    with pytest.raises(UserForgotten) as refused:
        rig.review.approve(diff.id, TEACHER, user_id="alice")
    forgetting.refused(refused)
    forgetting.assert_nothing_of_the_old_memory()


@pytest.mark.parametrize("stage", ["opened", "emptied"])
def test_a_commit_for_a_user_being_forgotten_is_refused_and_writes_nothing(
    rig: MemoryRig, engine: Engine, archive: SqliteArchive, stage: str
) -> None:
    """While alice's forget is under way an approval's commit (a decision, or a retry
    finishing one) is refused before anything is archived or committed: what it would write
    the forget may already have emptied."""
    diff_id = _proposed_clear(rig)
    head, passages = rig.git.head("alice"), archive.count("alice")
    # Recorded approved, as an approval killed before its commit leaves it.
    rig.review._diffs.transition(
        diff_id, "alice", DiffStatus.PENDING, DiffStatus.APPROVED, decided_by=TEACHER
    )
    forget_begins(engine, stage)()  # rows emptied, not the archive or repository: a forget mid-way
    with pytest.raises(UserBeingForgotten):
        rig.review.commit_approved(diff_id, "alice")
    assert archive.count("alice") == passages
    assert rig.git.head("alice") == head


def test_an_approval_whose_users_forget_began_before_its_commit_commits_nothing(
    rig: MemoryRig, engine: Engine, archive: SqliteArchive, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forget's record opens between the approval's first check and its commit (its
    repository not yet deleted): the check under the repository's lock refuses the commit,
    and the approval stays recorded for the forget to delete."""
    diff = rig.review.propose(
        "alice", "human", AddContext(note="prefers mornings"), "she said", Proposer.turn("t1")
    )
    head, log = rig.git.head("alice"), rig.history.log("alice", 50)
    opened = forget_begins(engine, "opened")
    monkeypatch.setattr(rig.review, "_commit", meanwhile(rig.review._commit, opened, first=True))
    with pytest.raises(UserBeingForgotten):
        rig.review.approve(diff.id, TEACHER, user_id="alice")
    assert rig.git.head("alice") == head
    assert rig.history.log("alice", 50) == log
    left = rig.review.get(diff.id, "alice")
    assert (left.status, left.commit_sha) == (DiffStatus.APPROVED, None)
    assert archive.count("alice") == 1  # her earlier task only


EDITS: dict[str, Callable[[MemoryRig, str], object]] = {
    "edit_block": lambda m, _: m.edits.edit_block("alice", "notes", {"value": "x"}, BACKEND),
    "set_task": lambda m, _: m.edits.set_task("alice", "a third essay", BACKEND),
    "clear_task": lambda m, _: m.edits.clear_task("alice", BACKEND, archive=True),
    "restore": lambda m, head: m.history.restore("alice", "human", head, BACKEND),
}
"""Each direct edit, given the user's HEAD before the forget."""


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("stage", ["opened", "completed"])
def test_a_direct_edit_for_a_user_closed_to_memory_is_refused_as_such(
    rig: MemoryRig, engine: Engine, archive: SqliteArchive, edit: str, stage: str
) -> None:
    """A backend's or a person's direct edit, or a restore, for alice while her forget is
    under way or after it: the forget's own refusal (not "no memory yet" once the repository
    is gone), and nothing written."""
    head = rig.git.head("alice") or ""
    passages = archive.count("alice")
    forget_begins(engine, stage, git=rig.git if stage == "completed" else None)()
    with pytest.raises(UserBeingForgotten if stage == "opened" else UserForgotten):
        EDITS[edit](rig, head)
    if stage == "opened":
        assert rig.git.head("alice") == head
        assert archive.count("alice") == passages
    else:
        assert not rig.git.repo_path("alice").exists()


@AFRESH
def test_a_restore_read_before_a_forget_is_not_committed_after_it(
    rig: MemoryRig,
    engine: Engine,
    archive: SqliteArchive,
    afresh: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restore reads the old version, then alice is forgotten (and started afresh) before
    it commits: the old version is not brought back into her new memory."""
    old = rig.history.history("alice", "human", 50)[-1].sha
    forgetting = Forgetting(rig, engine, archive, afresh)
    monkeypatch.setattr(
        rig.history, "read_at", meanwhile(rig.history.read_at, forgetting, first=False)
    )
    with pytest.raises(UserForgotten) as refused:
        rig.history.restore("alice", "human", old, BACKEND)
    forgetting.refused(refused)
    forgetting.assert_nothing_of_the_old_memory()


@AFRESH
def test_a_direct_clear_task_archived_before_a_forget_is_not_committed_after_it(
    rig: MemoryRig,
    engine: Engine,
    archive: SqliteArchive,
    afresh: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The task is archived, then alice is forgotten (the passage with her) and started
    afresh, before the clear is committed: it is not committed into her new memory."""
    forgetting = Forgetting(rig, engine, archive, afresh)
    archived = meanwhile(ArchiveTaskSink.archive_task, forgetting, first=False)
    monkeypatch.setattr(ArchiveTaskSink, "archive_task", archived)
    with pytest.raises(UserForgotten) as refused:
        rig.edits.clear_task("alice", BACKEND, archive=True)
    forgetting.refused(refused)
    forgetting.assert_nothing_of_the_old_memory()
