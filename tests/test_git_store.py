"""The git store: history, restore, concurrency, crash recovery, hand edits, hostile ids."""

import itertools
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import pytest

from durable_memory.bootstrap import open_stack
from durable_memory.memory.core.errors import (
    DamagedRepository,
    DurableMemoryError,
    FormatError,
    HandEditPending,
    InvalidIdentifier,
    UnknownCommit,
    UnknownUser,
)
from durable_memory.memory.store.block_repository import BlockRepository
from durable_memory.memory.store.git import (
    CLOCK_SKEW,
    GitBlockStore,
    Snapshot,
    format_message,
)
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddContext
from tests.support.git_checks import assert_fsck_clean, git_output
from tests.support.memory import MemoryRig

ALICE = Author(name="alice", kind=AuthorKind.USER)
BACKEND = Author(name="tutor-backend", kind=AuthorKind.SERVICE)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its content (the .git internals included)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock")
    }


@pytest.fixture
def svc(sqlite_memory: MemoryRig) -> MemoryRig:
    sqlite_memory.blocks.ensure_user("alice")
    return sqlite_memory


def test_repository_layout_and_authors(svc: MemoryRig, data_dir: Path) -> None:
    repo = data_dir / "users" / "alice"
    assert sorted(p.name for p in (repo / "blocks").iterdir()) == [
        "engagement_strategy.toml",
        "human.toml",
        "journey.toml",
        "persona.toml",
        "student.toml",
    ]
    svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    svc.edits.set_task("alice", "Outline", BACKEND)
    log = _git(repo, "log", "--format=%an <%ae>|%s").splitlines()
    assert log == [
        "tutor-backend <service+tutor-backend@localhost>|Set task in human: Outline",
        "alice <user+alice@localhost>|Edit student",
        "durable-memory <system+durable-memory@localhost>|Create memory: persona, student, "
        "journey, engagement_strategy, human",
    ]
    assert _git(repo, "status", "--porcelain") == ""
    assert svc.blocks.ensure_user("alice") == svc.git.head("alice")  # idempotent


def test_history_read_at_diff_and_restore(svc: MemoryRig) -> None:
    first = svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    second = svc.edits.edit_block("alice", "student", {"name": "Alicia"}, ALICE)
    svc.edits.set_task("alice", "Outline", BACKEND)  # another block: not in student's history
    history = svc.history.history("alice", "student", 10)
    assert [c.sha for c in history[:2]] == [second, first]
    assert [c.author for c in history] == ["alice", "alice", "durable-memory"]
    assert svc.history.history("alice", "student", 1) == history[:1]
    assert svc.history.read_at("alice", "student", first)["name"] == "Alice"
    assert '-name = "Alice"\n+name = "Alicia"' in svc.history.diff(
        "alice", "student", first, second
    )

    restored = svc.history.restore("alice", "student", first[:10], ALICE)
    assert svc.blocks.read_block("alice", "student").fields["name"] == "Alice"
    after = svc.history.history("alice", "student", 10)
    assert [c.sha for c in after[:3]] == [restored, second, first]  # nothing rewritten
    assert after[0].trailers == {"Restored-From": first[:10]}


def test_the_git_store_is_the_domains_block_repository(svc: MemoryRig) -> None:
    """The domain sees the store through `BlockRepository` (mypy checks that the git store and
    its transactions satisfy it): through it, a commit is made and found by its trailer."""
    repository: BlockRepository = svc.git
    with repository.transaction("alice") as tx:
        message = format_message("Mark", "", {"Diff-Id": "d1"})
        sha = tx.commit({}, message, BACKEND, allow_empty=True)
        assert tx.head == sha
        assert tx.find_trailer("Diff-Id", "d1") == sha
    info = repository.head_info("alice")
    assert info is not None
    assert (info.sha, info.trailers) == (sha, {"Diff-Id": "d1"})
    assert repository.users() == ["alice"]


def test_bad_history_arguments_are_clear_errors(svc: MemoryRig) -> None:
    head = svc.git.head("alice")
    with pytest.raises(UnknownCommit, match="no commit abcdef12"):
        svc.history.read_at("alice", "student", "abcdef12")
    # Full ids, which git takes on trust until used: none, and a block file's (not a commit).
    blob = git_output(svc.git.repo_path("alice"), "rev-parse", "HEAD:blocks/student.toml")
    for sha in ("0" * 40, blob.strip()):
        with pytest.raises(UnknownCommit, match=f"no commit {sha}"):
            svc.history.restore("alice", "student", sha, ALICE)
        with pytest.raises(UnknownCommit, match=f"no commit {sha}"):
            svc.history.diff("alice", "student", sha, head or "")
    with pytest.raises(InvalidIdentifier, match="invalid commit sha"):
        svc.history.restore("alice", "student", "HEAD~1", ALICE)
    with pytest.raises(UnknownUser, match="user 'bob' has no memory"):
        svc.history.history("bob", "student")
    with pytest.raises(DurableMemoryError, match="must be positive"):
        svc.history.history("alice", "student", 0)
    assert svc.git.head("alice") == head


HOSTILE_IDS = [
    "..",
    ".",
    "../x",
    "a/b",
    "a\\b",
    "/etc",
    "/",
    "a\x00b",
    ".hidden",
    "-rf",
    "_x",
    "",
    " alice",
    "alice ",
    "al ice",
    "a\nb",
    "x" * 65,
    "аlice",  # Cyrillic 'а'
    "ａｌｉｃｅ",
    "alice\u200b",
    "C:\\x",
    "~root",
    "$(id)",
    "a;b",
    "%2e%2e",
]


@pytest.mark.parametrize("user_id", HOSTILE_IDS)
def test_hostile_user_ids_are_refused_and_create_nothing(
    svc: MemoryRig, tmp_path: Path, user_id: str
) -> None:
    before = _tree(tmp_path)
    with pytest.raises(InvalidIdentifier, match="invalid user id"):
        svc.blocks.ensure_user(user_id)
    with pytest.raises(InvalidIdentifier):
        svc.blocks.read_blocks(user_id)
    with pytest.raises(InvalidIdentifier):
        svc.edits.edit_block(user_id, "student", {"name": "x"}, ALICE)
    assert _tree(tmp_path) == before
    assert not Path("/etc/blocks").exists()


@pytest.mark.parametrize(
    "label", ["..", "../human", "Human", "a/b", "", "x" * 49, "hümän", "human\n"]
)
def test_hostile_labels_are_refused(svc: MemoryRig, tmp_path: Path, label: str) -> None:
    before = _tree(tmp_path)
    with pytest.raises(InvalidIdentifier, match="invalid block label"):
        svc.blocks.read_block("alice", label)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("name", ["", " x", "a<b>", "a\nb", "x" * 101, "tab\there"])
def test_hostile_author_names_are_refused(svc: MemoryRig, tmp_path: Path, name: str) -> None:
    before = _tree(tmp_path)
    with pytest.raises(DurableMemoryError, match="invalid name"):
        svc.edits.edit_block(
            "alice", "student", {"name": "x"}, Author(name=name, kind=AuthorKind.USER)
        )
    assert _tree(tmp_path) == before


def test_concurrent_threads_never_lose_a_write(svc: MemoryRig) -> None:
    notes = [f"note {i}" for i in range(24)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda n: svc.edits.add_context("alice", n, BACKEND), notes))
    history = svc.history.history("alice", "human", 100)
    assert len(history) == 25  # 24 notes + creation
    added = {c.message.removeprefix("Add context to human: ") for c in history[:-1]}
    assert added == set(notes)
    repo = svc.git.repo_path("alice")
    assert _git(repo, "status", "--porcelain") == ""
    assert len(_git(repo, "rev-list", "--merges", "HEAD").split()) == 0  # linear


def _process_writer(data_dir: str, db_url: str, worker: int) -> None:
    memory = open_stack(data_dir, db_url, "essay_coach")
    for i in range(5):
        memory.edits.apply_direct("alice", "human", AddContext(note=f"w{worker}-{i}"), BACKEND)


def test_concurrent_processes_never_lose_a_write(svc: MemoryRig, data_dir: Path) -> None:
    url = str(svc.diffs.engine.url)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_process_writer, args=(str(data_dir), url, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    history = svc.history.history("alice", "human", 100)
    assert len(history) == 21
    assert _git(svc.git.repo_path("alice"), "fsck", "--no-progress").strip() == ""


def test_write_interrupted_before_commit_is_rolled_back(svc: MemoryRig) -> None:
    """A crash between writing the file and committing leaves a journal; the next writer
    puts the working tree back to HEAD and proceeds."""
    repo = svc.git.repo_path("alice")
    head = svc.git.head("alice")
    (repo / ".git" / "dmem-journal").write_text("student", encoding="utf-8")
    (repo / "blocks" / "student.toml").write_text('name = "half written', encoding="utf-8")
    _git(repo, "add", "blocks/student.toml")
    assert svc.blocks.read_block("alice", "student").sha == head  # reads come from HEAD
    svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    assert svc.blocks.read_block("alice", "student").fields["name"] == "Alice"
    assert _git(repo, "status", "--porcelain") == ""
    assert not (repo / ".git" / "dmem-journal").exists()


def test_a_first_commit_interrupted_after_staging_is_rolled_back(svc: MemoryRig) -> None:
    """A crash between `git add` and `git commit` of a user's first commit (no HEAD to reset
    the index to): the next writer unstages what the write staged, and the user's memory is
    created. (The kill campaign found this: every later turn refused the staged files as
    staged by hand.)"""
    repo = svc.git.repo_path("bob")
    _git(repo.parent, "init", "--quiet", "--initial-branch=main", "bob")
    (repo / ".git" / "dmem-journal").write_text("student\nprofile.toml", encoding="utf-8")
    (repo / "blocks").mkdir()
    (repo / "blocks" / "student.toml").write_text('name = ""\n', encoding="utf-8")
    (repo / "profile.toml").write_text('profile = "default"\n', encoding="utf-8")
    _git(repo, "add", "blocks/student.toml", "profile.toml")
    head = svc.blocks.ensure_user("bob")
    assert svc.git.head("bob") == head
    assert _git(repo, "status", "--porcelain") == ""
    assert not (repo / ".git" / "dmem-journal").exists()


def test_hand_edits_are_never_overwritten_and_import_validates(svc: MemoryRig) -> None:
    repo = svc.git.repo_path("alice")
    path = repo / "blocks" / "student.toml"
    head = svc.git.head("alice")
    path.write_text('name = "Alice"\nstrengths = ["Grit", 3]\n', encoding="utf-8")
    with pytest.raises(
        HandEditPending, match=re.escape("blocks/student.toml of user 'alice' has changes")
    ):
        svc.edits.edit_block("alice", "student", {"name": "Bob"}, ALICE)
    with pytest.raises(
        FormatError,
        match=re.escape(
            "users/alice/blocks/student.toml: block 'student': "
            "field 'strengths' must be a list of strings"
        ),
    ):
        svc.history.commit_hand_edits("alice", ALICE)
    assert svc.git.head("alice") == head
    assert path.read_text(encoding="utf-8") == 'name = "Alice"\nstrengths = ["Grit", 3]\n'

    path.write_text('name = "  Alice  "\nstrengths = ["Grit"]\n', encoding="utf-8")
    sha = svc.history.commit_hand_edits("alice", ALICE)
    assert sha is not None
    assert sha != head
    assert svc.blocks.read_block("alice", "student").fields["name"] == "Alice"
    assert _git(repo, "status", "--porcelain") == ""
    assert svc.history.commit_hand_edits("alice", ALICE) is None


def test_invalid_committed_block_is_a_clear_error(svc: MemoryRig) -> None:
    """Someone committed a broken block with plain git: reads say which file and why."""
    repo = svc.git.repo_path("alice")
    (repo / "blocks" / "journey.toml").write_text('stage = "sleeping"\n', encoding="utf-8")
    _git(repo, "-c", "user.name=x", "-c", "user.email=x@y", "commit", "-qam", "oops")
    with pytest.raises(
        FormatError,
        match=r"users/alice/blocks/journey.toml at [0-9a-f]{12}: "
        "block 'journey': field 'stage' must be one of",
    ):
        svc.blocks.read_block("alice", "journey")


def test_user_repositories_are_separate(svc: MemoryRig, data_dir: Path) -> None:
    svc.blocks.ensure_user("bob")
    svc.edits.edit_block(
        "bob", "student", {"name": "Bob"}, Author(name="bob", kind=AuthorKind.USER)
    )
    assert svc.blocks.read_block("alice", "student").fields["name"] is None
    assert sorted(os.listdir(data_dir / "users")) == ["alice", "bob"]
    assert svc.git.users() == ["alice", "bob"]


def test_concurrent_threads_on_different_users_never_collide(svc: MemoryRig) -> None:
    """Regression: GitPython's IndexFile.add chdirs the whole process, so two threads staging
    in different users' repositories resolved each other's paths. Staging is `git add` now."""
    users = [f"user{i}" for i in range(8)]
    for user in users:
        svc.blocks.ensure_user(user)

    def write(user: str) -> None:
        for n in range(5):
            svc.edits.add_context(user, f"{user} note {n}", BACKEND)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(write, users))
    for user in users:
        assert len(svc.history.history(user, "human", 50)) == 6
        assert _git(svc.git.repo_path(user), "status", "--porcelain") == ""


def test_changes_staged_by_hand_are_never_committed_with_ours(svc: MemoryRig) -> None:
    """A hand edit staged with `git add` would ride along in the index with our next commit of
    any block: the write is refused, and nothing changes, until it is imported or unstaged."""
    repo = svc.git.repo_path("alice")
    (repo / "blocks" / "journey.toml").write_text('stage = "sleeping"\n', encoding="utf-8")
    _git(repo, "add", "blocks/journey.toml")
    head, status = svc.git.head("alice"), _git(repo, "status", "--porcelain")
    with pytest.raises(
        HandEditPending,
        match=re.escape("blocks/journey.toml of user 'alice' has changes staged by hand"),
    ):
        svc.edits.edit_block("alice", "student", {"name": "Bob"}, ALICE)
    assert svc.git.head("alice") == head
    assert _git(repo, "status", "--porcelain") == status
    _git(repo, "reset", "-q", "blocks/journey.toml")
    _git(repo, "checkout", "--", "blocks/journey.toml")
    svc.edits.edit_block("alice", "student", {"name": "Bob"}, ALICE)
    assert _git(repo, "show", "--stat", "--format=", "HEAD").split()[0] == "blocks/student.toml"


def test_cached_reads_match_git_after_every_kind_of_write(svc: MemoryRig, data_dir: Path) -> None:
    """Blocks are cached per commit: what the cache holds after our own commits, a restore and
    a commit made with plain git must equal what a cold store reads from the repository."""
    first = svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    svc.edits.set_task("alice", "Outline", BACKEND)
    svc.history.restore("alice", "student", first, ALICE)
    repo = svc.git.repo_path("alice")
    (repo / "blocks" / "persona.toml").write_text(
        (repo / "blocks" / "persona.toml").read_text(encoding="utf-8"), encoding="utf-8"
    )
    _git(
        repo,
        "-c",
        "user.name=x",
        "-c",
        "user.email=x@y",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "by hand",
    )
    cold = GitBlockStore(data_dir)  # a new process would start with an empty cache
    shas = _git(repo, "rev-list", "HEAD").split()

    def snapshots(store: GitBlockStore) -> tuple[str | None, list[Snapshot]]:
        with store.transaction("alice") as tx:  # one at a time: each holds the user's lock
            return tx.head, [tx.snapshot(sha) for sha in shas]

    assert snapshots(svc.git) == snapshots(cold) == (shas[0], snapshots(cold)[1])
    assert svc.git.head_info("alice") == cold.head_info("alice")


def test_another_writer_is_seen_at_once(svc: MemoryRig, data_dir: Path) -> None:
    """Two stores on one data dir (two worker processes): each reads the other's commits."""
    other = MemoryRig.open(svc.profile, GitBlockStore(data_dir), svc.diffs, svc.recall)
    for n in range(3):
        svc.edits.edit_block("alice", "student", {"name": f"A{n}"}, ALICE)
        assert other.blocks.read_block("alice", "student").fields["name"] == f"A{n}"
        other.edits.edit_block("alice", "student", {"name": f"B{n}"}, ALICE)
        assert svc.blocks.read_block("alice", "student").fields["name"] == f"B{n}"


def test_trailer_walk_is_bounded_by_the_time_given(svc: MemoryRig) -> None:
    svc.edits.add_context("alice", "a note", BACKEND)
    with svc.git.transaction("alice") as tx:
        tx.commit({}, format_message("Mark", "", {"Diff-Id": "d1"}), BACKEND, allow_empty=True)
    now = datetime.now(UTC)
    with svc.git.transaction("alice") as tx:
        assert tx.find_trailer("Diff-Id", "d1") == tx.head
        assert tx.find_trailer("Diff-Id", "d1", since=now - timedelta(minutes=5)) == tx.head
        # Decided after the commit by more than any clock skew: that commit cannot be its own.
        assert tx.find_trailer("Diff-Id", "d1", since=now + 2 * CLOCK_SKEW) is None
        assert tx.find_trailer("Diff-Id", "d2", since=now - timedelta(minutes=5)) is None


def _process_creator(data_dir: str, db_url: str, start: EventType) -> None:
    memory = open_stack(data_dir, db_url, "essay_coach")
    start.wait()
    for n in range(3):
        memory.blocks.ensure_user("newcomer")
        memory.edits.apply_direct(
            "newcomer", "human", AddContext(note=f"{os.getpid()}-{n}"), BACKEND
        )


def test_a_new_users_first_turns_racing_create_one_repository(
    svc: MemoryRig, data_dir: Path
) -> None:
    """Regression: concurrent `git init` of one new user failed ('could not lock config file')
    or opened a half-initialised repository. Creation is now an atomic rename."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    url = str(svc.diffs.engine.url)
    procs = [
        ctx.Process(target=_process_creator, args=(str(data_dir), url, start)) for _ in range(4)
    ]
    for p in procs:
        p.start()
    start.set()
    with ThreadPoolExecutor(max_workers=4) as pool:
        heads = list(pool.map(lambda _: svc.blocks.ensure_user("newcomer"), range(4)))
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert all(heads)
    repo = svc.git.repo_path("newcomer")
    log = _git(repo, "log", "--format=%s").splitlines()
    assert len(log) == 1 + 4 * 3
    assert log[-1].startswith("Create memory")
    assert sum(s.startswith("Create memory") for s in log) == 1
    assert sorted(p.name for p in (data_dir / "users").iterdir()) == ["alice", "newcomer"]
    assert svc.git.users() == ["alice", "newcomer"]


def test_a_user_directory_that_is_not_a_repository_is_a_clear_error(
    svc: MemoryRig, data_dir: Path
) -> None:
    (data_dir / "users" / "squatter").mkdir()
    (data_dir / "users" / "squatter" / "notes.txt").write_text("mine", encoding="utf-8")
    before = _tree(data_dir)
    with pytest.raises(DurableMemoryError, match="exists and is not a git repository"):
        svc.blocks.ensure_user("squatter")
    assert _tree(data_dir) == before


# -- crash safety: what a process killed at any instant leaves behind --------------------------


def _object_file(repo: Path, sha: str) -> Path:
    return repo / ".git" / "objects" / sha[:2] / sha[2:]


def _empty(path: Path) -> None:
    """What power lost before the data reached the disk leaves: the name, no content."""
    path.chmod(0o644)
    path.write_bytes(b"")


def _restarted(svc: MemoryRig, data_dir: Path) -> MemoryRig:
    """The service of a process started after the crash: nothing cached."""
    return MemoryRig.open(svc.profile, GitBlockStore(data_dir), svc.diffs, svc.recall)


GIT_LOCKS = [
    "index.lock",
    "HEAD.lock",
    "refs/heads/main.lock",
    "packed-refs.lock",
    "config.lock",
    "ORIG_HEAD.lock",
    "logs/refs/heads/main.lock",
    "logs/HEAD.lock",
]


@pytest.mark.parametrize("lock", GIT_LOCKS)
def test_stale_git_lock_files_of_a_killed_writer_are_removed(
    svc: MemoryRig, lock: str, caplog: pytest.LogCaptureFixture
) -> None:
    repo = svc.git.repo_path("alice")
    history = _git(repo, "rev-list", "HEAD").split()
    (repo / ".git" / lock).write_bytes(b"")  # git was killed holding it
    with caplog.at_level(logging.WARNING, logger="durable_memory.memory.store.git"):
        sha = svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    assert not (repo / ".git" / lock).exists()
    assert f"user 'alice': removed the stale git lock file .git/{lock}" in caplog.text
    assert _git(repo, "rev-list", "HEAD").split() == [sha, *history]
    assert_fsck_clean(repo)


def test_stale_lock_files_deep_in_refs_go_and_a_symlinked_directory_is_not_entered(
    svc: MemoryRig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The scan reaches a lock file at any depth under refs/ and logs/, and never follows a
    symlinked directory out of the repository: a lock file there is not ours to remove."""
    repo = svc.git.repo_path("alice")
    git_dir = repo / ".git"
    deep = git_dir / "refs" / "tags" / "a" / "b" / "v1.lock"
    deep.parent.mkdir(parents=True)
    deep.write_bytes(b"")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.lock").write_bytes(b"")
    (git_dir / "logs" / "elsewhere").symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="durable_memory.memory.store.git"):
        svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    assert not deep.exists()
    assert "removed the stale git lock file .git/refs/tags/a/b/v1.lock" in caplog.text
    assert (outside / "keep.lock").exists()
    assert "keep.lock" not in caplog.text


@pytest.mark.parametrize("lost", ["commit", "blob"])
def test_a_commit_whose_data_never_reached_the_disk_is_rolled_back(
    svc: MemoryRig, data_dir: Path, lost: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Power lost after the ref was updated but before the new commit's objects were on disk:
    the next process resets the branch to the newest readable commit and builds on that."""
    repo = svc.git.repo_path("alice")
    kept = svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    gone = svc.edits.edit_block("alice", "student", {"name": "Bob"}, ALICE)
    _empty(
        _object_file(
            repo,
            gone
            if lost == "commit"
            else _git(repo, "rev-parse", "HEAD:blocks/student.toml").strip(),
        )
    )
    restarted = _restarted(svc, data_dir)
    with caplog.at_level(logging.WARNING, logger="durable_memory.memory.store.git"):
        assert restarted.blocks.read_block("alice", "student").fields["name"] == "Alice"
    assert f"user 'alice': reset refs/heads/main to {kept}" in caplog.text
    new = restarted.edits.edit_block("alice", "student", {"name": "Carol"}, ALICE)
    assert _git(repo, "rev-parse", f"{new}^").strip() == kept
    assert len(restarted.history.history("alice", "student", 10)) == 3  # creation, Alice, Carol
    assert_fsck_clean(repo)


@pytest.mark.parametrize("ref_text", ["", "3f2a9c", "not a sha at all\n", "\udcff\x00\x00"])
def test_a_torn_ref_file_is_restored_from_the_reflog(
    svc: MemoryRig, data_dir: Path, ref_text: str
) -> None:
    repo = svc.git.repo_path("alice")
    head = svc.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    history = _git(repo, "rev-list", "HEAD")
    (repo / ".git" / "refs" / "heads" / "main").write_bytes(
        ref_text.encode("utf-8", errors="surrogateescape")
    )
    restarted = _restarted(svc, data_dir)
    assert restarted.git.head("alice") == head  # nothing lost: the commit itself is intact
    assert _git(repo, "rev-list", "HEAD") == history
    restarted.edits.edit_block("alice", "student", {"name": "Bob"}, ALICE)
    assert_fsck_clean(repo)


def test_a_corrupt_object_left_by_a_killed_write_is_never_reused(
    svc: MemoryRig, data_dir: Path
) -> None:
    """git never rewrites an object file that exists: an empty one left by a write that was
    killed would be reused by the next commit of the same content, and that commit broken."""
    svc.blocks.ensure_user("bob")
    svc.edits.edit_block("bob", "student", {"name": "Alice"}, ALICE)
    blob = _git(svc.git.repo_path("bob"), "rev-parse", "HEAD:blocks/student.toml").strip()
    repo = svc.git.repo_path("alice")
    head = svc.git.head("alice")
    stale = _object_file(repo, blob)
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"")
    (repo / ".git" / "dmem-journal").write_text(f"base={head}\nstudent", encoding="utf-8")
    sha = _restarted(svc, data_dir).edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    assert _git(repo, "rev-parse", f"{sha}:blocks/student.toml").strip() == blob
    assert _restarted(svc, data_dir).blocks.read_block("alice", "student").fields["name"] == "Alice"
    assert_fsck_clean(repo)


def test_a_repository_with_nothing_readable_left_is_a_clear_error(
    svc: MemoryRig, data_dir: Path
) -> None:
    repo = svc.git.repo_path("alice")
    (repo / ".git" / "refs" / "heads" / "main").write_text("garbage", encoding="utf-8")
    shutil.rmtree(repo / ".git" / "logs")
    with pytest.raises(DamagedRepository, match="the memory of user 'alice' is damaged"):
        _restarted(svc, data_dir).blocks.read_blocks("alice")


def _commit_forever(data_dir: str, started: EventType) -> None:
    """Commit to alice's repository as fast as possible, until killed."""
    store = GitBlockStore(data_dir)
    started.set()
    for n in itertools.count():
        with store.transaction("alice") as tx:
            tx.commit({"journey": f'stage = "child {n}"\n'}, f"child {n}\n", BACKEND)


KILLS = 40


def test_sigkill_at_random_instants_never_leaves_a_repository_unusable(
    svc: MemoryRig, data_dir: Path
) -> None:
    """A writer SIGKILLed anywhere (in our code, in `git add`, in `git commit`): after each
    kill the next commit succeeds, `git fsck --strict` is clean and no commit is lost."""
    seed = int(os.environ.get("DMEM_KILL_SEED", "1207"))
    print(f"kill seed {seed} (DMEM_KILL_SEED reproduces the instants)")
    chance = random.Random(seed)
    repo = svc.git.repo_path("alice")
    ours: list[str] = []
    interrupted = 0
    ctx = multiprocessing.get_context("fork")  # starts in microseconds: no import to wait for
    for kill in range(KILLS):
        started = ctx.Event()
        child = ctx.Process(target=_commit_forever, args=(str(data_dir), started))
        child.start()
        assert started.wait(30)
        time.sleep(chance.uniform(0, 0.12))
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        interrupted += (repo / ".git" / "dmem-journal").exists()
        with svc.git.transaction("alice") as tx:
            ours.append(tx.commit({"student": f'name = "parent {kill}"\n'}, "parent\n", ALICE))
        assert_fsck_clean(repo)
        assert set(ours) <= set(_git(repo, "rev-list", "HEAD").split()), f"kill {kill}"
        assert _git(repo, "status", "--porcelain") == ""
    print(f"{interrupted} of {KILLS} kills interrupted a write")
    assert interrupted > 0


def test_a_torn_head_file_is_pointed_back_at_the_branch(svc: MemoryRig, data_dir: Path) -> None:
    repo = svc.git.repo_path("alice")
    head = svc.git.head("alice")
    (repo / ".git" / "HEAD").write_bytes(b"ref: refs/he")
    assert _restarted(svc, data_dir).git.head("alice") == head
    assert (repo / ".git" / "HEAD").read_text(encoding="utf-8") == "ref: refs/heads/main\n"
    assert_fsck_clean(repo)
