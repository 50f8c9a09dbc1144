"""The distributed mode's block repository (store/git/remote.py): the git remote is the truth,
each host's clones are a disposable cache, a push is the compare-and-set between hosts.

Every test runs on both kinds of remote: a shared directory (`file://`) and `dmem git-serve`
(smart HTTP with a token). Hosts are stores with separate data dirs sharing one database."""

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from durable_memory.bootstrap import stack_from_settings
from durable_memory.config import ConfigError, MemorySettings
from durable_memory.faults import AFTER_PUSH, BEFORE_PUSH
from durable_memory.memory.core.errors import (
    GitRemoteContended,
    GitRemoteRefused,
    GitRemoteUnavailable,
    UnknownUser,
    UnsafeFile,
)
from durable_memory.memory.core.profiles import load_profile
from durable_memory.memory.store.bare_repos import discard_tree, ensure_bare_repository
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.memory.store.git import RemoteGitBlockStore
from durable_memory.memory.store.git.advertisement import main_of_advertisement
from durable_memory.memory.store.git.locking import user_lock
from durable_memory.memory.store.git.refs import Unreadable
from durable_memory.memory.store.recall import RecallStore
from durable_memory.models.diffs import DiffStatus, Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddContext, LearnFact
from tests.support.distributed import (
    GIT_TOKEN,
    distributed_settings,
    git_server,
    remote_log,
    restart_git_server,
)
from tests.support.memory import MemoryRig
from tests.support.postgres import fresh_schema_url

SERVICE = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
PROFILE = load_profile("essay_coach")


class Remote:
    """A git remote of either kind, and where its bare repositories are on disk."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        self.root = root / "remote"
        self._server = None
        self.url = f"file://{self.root}"
        if kind == "http":
            self._context = git_server(self.root)
            self._server = self._context.__enter__()
            self.url = self._server.url

    def bare(self, user: str) -> Path:
        return self.root / f"{user}.git"

    def commits(self, user: str) -> list[str]:
        return remote_log(self.bare(user), "--format=%H", "main").split()

    def stop(self) -> None:
        assert self._server is not None
        self._server.stop()

    def restart(self) -> None:
        assert self._server is not None
        self._server = restart_git_server(self._server, self.root)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()


@pytest.fixture(params=["file", "http"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    found = Remote(request.param, tmp_path)
    yield found
    found.close()


def host(remote: Remote, engine: Engine, data_dir: Path, token: str = GIT_TOKEN) -> MemoryRig:
    store = RemoteGitBlockStore(data_dir, remote.url, token)
    return MemoryRig.open(PROFILE, store, DiffStore(engine), RecallStore(engine))


def note(rig: MemoryRig, user: str, text: str) -> str:
    return rig.edits.apply_direct(user, "human", AddContext(note=text), SERVICE)


def notes(rig: MemoryRig, user: str) -> list[str]:
    value = rig.blocks.read_block(user, "human").fields.get("context_notes") or []
    assert isinstance(value, list)
    return [str(item) for item in value]


def diff_id_commits(remote: Remote, user: str, diff_id: str) -> list[str]:
    return remote_log(
        remote.bare(user), "--format=%H", "--fixed-strings", f"--grep=Diff-Id: {diff_id}", "main"
    ).split()


def test_a_fresh_host_serves_what_another_host_wrote(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    a, b = host(remote, engine, tmp_path / "a"), host(remote, engine, tmp_path / "b")
    created = a.blocks.ensure_user("alice")
    assert remote.commits("alice") == [created]
    assert notes(b, "alice") == []  # b's data dir was empty: it cloned
    written = note(b, "alice", "written on b")
    assert notes(a, "alice") == ["written on b"]  # a fetched
    assert remote.commits("alice") == [written, created]
    assert [c.sha for c in a.history.history("alice", "human")] == [written, created]
    # A host's data dir holds its clones and nothing else; no token is written anywhere.
    for data_dir in (tmp_path / "a", tmp_path / "b"):
        assert sorted(p.name for p in data_dir.iterdir()) == ["clones"]
        config = (data_dir / "clones" / "alice" / ".git" / "config").read_text()
        assert GIT_TOKEN not in config
        assert "remote" not in config


def test_racing_writers_on_two_hosts_all_land_in_a_linear_history(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    hosts = [host(remote, engine, tmp_path / name) for name in ("a", "b", "c")]
    base = hosts[0].blocks.ensure_user("alice")
    errors: list[BaseException] = []

    def write(index: int) -> None:
        try:
            for round_ in range(3):
                note(hosts[index % 3], "alice", f"note {index}.{round_}")
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    commits = remote.commits("alice")
    assert len(commits) == 1 + 18
    assert commits[-1] == base
    assert remote_log(remote.bare("alice"), "--merges", "--format=%H", "main") == ""
    # Each write is one commit of its own (the block keeps only its newest notes).
    subjects = remote_log(remote.bare("alice"), "--format=%s", "main").splitlines()
    expected = sorted(f"Add context to human: note {i}.{r}" for i in range(6) for r in range(3))
    assert sorted(subjects[:-1]) == expected
    assert notes(hosts[1], "alice")[-1] in {s.split(": ", 1)[1] for s in subjects[:1]}


def _approve_in_a_process(data_dir: Path, remote: Remote, db: Path, diff_id: str, at: str) -> int:
    """Approve `diff_id` on a host that is SIGKILLed at crash point `at`; its exit status."""
    code = f"""
from pathlib import Path
from durable_memory.memory.store.db import make_engine
from tests.test_remote_store import host, Remote
remote = Remote.__new__(Remote); remote.url = {remote.url!r}
rig = host(remote, make_engine("sqlite:///{db}"), Path({str(data_dir)!r}))
rig.review.approve({diff_id!r}, "ann")
"""
    env = {**os.environ, "DMEM_CRASH_AT": at, "DMEM_CRASH_MARKER": str(data_dir / "crashed")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[1], timeout=120
    )
    return done.returncode


@pytest.mark.parametrize("crash_at", [BEFORE_PUSH, AFTER_PUSH])
def test_a_host_killed_around_the_push_leaves_exactly_one_commit(
    remote: Remote, tmp_path: Path, crash_at: str
) -> None:
    from durable_memory.memory.store.db import make_engine

    db = tmp_path / "memory.db"
    engine = make_engine(f"sqlite:///{db}")
    a = host(remote, engine, tmp_path / "a")
    a.blocks.ensure_user("alice")
    diff = a.review.propose(
        "alice", "human", LearnFact(fact="likes tea"), "said so", Proposer.turn("t1")
    )
    assert _approve_in_a_process(tmp_path / "killed", remote, db, diff.id, crash_at) == -9
    assert a.review.get(diff.id, "alice").status is DiffStatus.APPROVED  # recorded, not finished
    pushed = diff_id_commits(remote, "alice", diff.id)
    assert len(pushed) == (0 if crash_at == BEFORE_PUSH else 1)
    # Another host finishes it: the retry of the activity, wherever it runs.
    finished = a.review.finish_approvals("alice")
    assert [d.status for d in finished] == [DiffStatus.APPROVED]
    assert diff_id_commits(remote, "alice", diff.id) == [finished[0].commit_sha]
    # The killed host's clone held a commit it never pushed (before_push): using it again
    # drops that commit and serves the remote's history.
    killed = host(remote, engine, tmp_path / "killed")
    history = [c.sha for c in killed.git.history("alice", None, limit=50)]
    assert history == remote.commits("alice")
    assert "likes tea" in str(killed.blocks.read_block("alice", "human").fields)


def test_a_remote_that_is_down_fails_cleanly_and_the_retry_lands_once(
    engine: Engine, tmp_path: Path
) -> None:
    remote = Remote("http", tmp_path)
    try:
        a = host(remote, engine, tmp_path / "a")
        a.blocks.ensure_user("alice")
        diff = a.review.propose("alice", "human", LearnFact(fact="x"), "r", Proposer.turn("t"))
        before = remote.commits("alice")
        remote.stop()
        with pytest.raises(GitRemoteUnavailable, match="unavailable") as raised:
            a.review.approve(diff.id, "ann")
        assert raised.value.retryable
        assert GIT_TOKEN not in str(raised.value)
        with pytest.raises(GitRemoteUnavailable):
            notes(a, "alice")
        remote.restart()
        assert remote.commits("alice") == before
        approved = a.review.get(diff.id, "alice")
        if approved.status is DiffStatus.PENDING:  # refused before it was recorded
            approved = a.review.approve(diff.id, "ann")
        else:
            [approved] = a.review.finish_approvals("alice")
        assert diff_id_commits(remote, "alice", diff.id) == [approved.commit_sha]
    finally:
        remote.close()


def test_a_wrong_token_is_refused_for_good_and_leaks_nothing(
    engine: Engine, tmp_path: Path
) -> None:
    remote = Remote("http", tmp_path)
    try:
        host(remote, engine, tmp_path / "a").blocks.ensure_user("alice")
        intruder = host(remote, engine, tmp_path / "b", token="wrong-token")
        with pytest.raises(GitRemoteRefused, match="refused the token") as raised:
            notes(intruder, "alice")
        assert not raised.value.retryable
        assert "wrong-token" not in str(raised.value)
        assert len(remote.commits("alice")) == 1
    finally:
        remote.close()


def test_an_approval_on_a_host_the_remote_refuses_stays_approved_not_conflicted(
    engine: Engine, tmp_path: Path
) -> None:
    remote = Remote("http", tmp_path)
    try:
        good = host(remote, engine, tmp_path / "good")
        good.blocks.ensure_user("alice")
        diff = good.review.propose("alice", "human", LearnFact(fact="f"), "r", Proposer.turn("t"))
        misconfigured = host(remote, engine, tmp_path / "bad", token="stale-token")
        with pytest.raises(GitRemoteRefused):
            misconfigured.review.approve(diff.id, "ann")
        assert good.review.get(diff.id, "alice").status is DiffStatus.PENDING  # checked first
        good.review.approve(diff.id, "ann")  # a well-configured host decides it
        good_diff = good.review.get(diff.id, "alice")
        assert diff_id_commits(remote, "alice", diff.id) == [good_diff.commit_sha]
        # An approval recorded before the refusal is finished later, never marked conflicted.
        other = good.review.propose("alice", "human", LearnFact(fact="g"), "r", Proposer.turn("t"))
        good.review.approve(other.id, "ann")  # committed; now record one the bad host finishes
        third = good.review.propose("alice", "human", LearnFact(fact="h"), "r", Proposer.turn("t"))
        DiffStore(engine).transition(
            third.id, "alice", DiffStatus.PENDING, DiffStatus.APPROVED, decided_by="ann"
        )
        with pytest.raises(GitRemoteRefused):
            misconfigured.review.finish_approvals("alice")
        assert good.review.get(third.id, "alice").status is DiffStatus.APPROVED
        [finished] = good.review.finish_approvals("alice")
        assert diff_id_commits(remote, "alice", third.id) == [finished.commit_sha]
    finally:
        remote.close()


def test_an_unknown_user_is_unknown_and_creates_nothing(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    a = host(remote, engine, tmp_path / "a")
    with pytest.raises(UnknownUser):
        notes(a, "nobody")
    assert not remote.bare("nobody").exists()
    assert not (tmp_path / "a" / "clones" / "nobody").exists()


def test_a_push_after_a_forget_deleted_the_remote_repository_brings_nothing_back(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    """Host a's transaction fetched alice's main; host b forgets her (the remote repository
    deleted) before a pushes. The push is refused, not made into a new repository holding
    her forgotten history; her first commit once started afresh still makes one."""
    a, b = host(remote, engine, tmp_path / "a"), host(remote, engine, tmp_path / "b")
    a.blocks.ensure_user("alice")
    note(a, "alice", "before the forget")
    with a.git.transaction("alice") as tx:
        assert b.git.forget_user("alice") >= 1
        with pytest.raises(UnknownUser, match="any more"):
            tx.commit({}, "late", SERVICE, allow_empty=True)
    assert not remote.bare("alice").exists()
    with pytest.raises(UnknownUser):
        notes(a, "alice")  # a's clone, and its unpushed commit, are dropped
    fresh = a.blocks.ensure_user("alice")
    assert remote.commits("alice") == [fresh]
    assert notes(b, "alice") == []


def test_a_rewrite_pushed_after_a_forget_deleted_the_repository_makes_none(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    """`dmem redact`'s force push of a rewritten history, after a forget on another host
    deleted the repository: refused, and no repository (not even an empty one) is made."""
    a, b = host(remote, engine, tmp_path / "a"), host(remote, engine, tmp_path / "b")
    a.blocks.ensure_user("alice")
    note(a, "alice", "to be redacted")
    with a.git.transaction("alice") as tx:
        assert tx.head is not None
        tree = tx.repo.commit(tx.head).tree.hexsha
        rewritten = tx.repo.git.commit_tree(tree, "-m", "rewritten")
        b.git.forget_user("alice")
        with pytest.raises(UnknownUser, match="any more"):
            a.git.replace_history(tx, tx.head, rewritten)
    assert not remote.bare("alice").exists()


def test_a_push_answered_not_found_for_a_repository_that_is_there_is_retried(
    remote: Remote, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push answered "no such repository" while the remote has the user's main (a proxy's
    404, a server restarted on another directory) is "unavailable", retried: not the user
    forgotten, and an approval it carried stays approved, not conflicted."""
    a = host(remote, engine, tmp_path / "a")
    a.blocks.ensure_user("alice")
    diff = a.review.propose("alice", "human", AddContext(note="x"), "r", Proposer.turn("t1"))
    head = remote.commits("alice")
    network = RemoteGitBlockStore._network

    def not_found_on_push(
        self: RemoteGitBlockStore, lock: int | None, *args: str, **kw: Any
    ) -> Any:
        if args[0] == "push":
            return None  # what a "not found" answer gives a push onto a fetched main
        return network(self, lock, *args, **kw)

    monkeypatch.setattr(RemoteGitBlockStore, "_network", not_found_on_push)
    with pytest.raises(GitRemoteUnavailable, match="did not confirm"):
        a.review.approve(diff.id, "ms.lee@school", user_id="alice")
    assert remote.commits("alice") == head
    left = a.review.get(diff.id, "alice")
    assert (left.status, left.commit_sha) == (DiffStatus.APPROVED, None)
    monkeypatch.undo()
    assert a.review.commit_approved(diff.id, "alice").commit_sha == remote.commits("alice")[0]


@pytest.mark.parametrize("create", [False, True])
def test_a_transaction_that_waited_while_its_clone_was_dropped_makes_it_again(
    remote: Remote, engine: Engine, tmp_path: Path, create: bool
) -> None:
    """A clone dropped while a transaction waited for its lock (a forget's, or the sweep of
    forgotten users' clones reading a ledger from before a fresh start): the clone is
    disposable, so the transaction makes it again from the remote, create or not."""
    a = host(remote, engine, tmp_path / "a")
    created = a.blocks.ensure_user("alice")
    store = a.git
    assert isinstance(store, RemoteGitBlockStore)
    heads: list[str | None] = []

    def read_head() -> None:
        with store.transaction("alice", create=create) as tx:
            heads.append(tx.head)

    with user_lock(store.users_dir, "alice"):
        waiting = threading.Thread(target=read_head)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()
        discard_tree(store.repo_path("alice"))
    waiting.join(30)
    assert heads == [created]


def test_a_stale_push_onto_a_repository_made_anew_and_still_empty_is_refused(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    """Host a's transaction fetched alice's main; she is forgotten, and a fresh start has made
    her repository anew on the remote but not pushed its first commit yet. a's push is leased
    on the main it fetched: refused as contended (retried, and the retry finds her new
    memory), and her forgotten history does not become the new repository's main."""
    a, b = host(remote, engine, tmp_path / "a"), host(remote, engine, tmp_path / "b")
    a.blocks.ensure_user("alice")
    with a.git.transaction("alice") as tx:
        b.git.forget_user("alice")
        ensure_bare_repository(remote.root, "alice")  # the fresh start's, before its push
        with pytest.raises(GitRemoteContended):
            tx.commit({}, "late", SERVICE, allow_empty=True)
    bare = remote.bare("alice")
    assert not (bare / "refs" / "heads" / "main").exists()
    assert "refs/heads/main" not in (
        (bare / "packed-refs").read_text() if (bare / "packed-refs").exists() else ""
    )


def test_a_transaction_that_waited_while_the_user_was_forgotten_leaves_no_clone(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    """The remote's repository and this host's clone deleted (a forget) while a transaction
    waited for the clone's lock: no memory, and no empty clone is left behind."""
    a = host(remote, engine, tmp_path / "a")
    a.blocks.ensure_user("alice")
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            a.git.head("alice")
        except UnknownUser as error:
            outcome.append(error)

    with user_lock(a.git.users_dir, "alice"):
        waiting = threading.Thread(target=read)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()
        host(remote, engine, tmp_path / "b").git.forget_user("alice")
        discard_tree(a.git.repo_path("alice"))
    waiting.join(30)
    assert len(outcome) == 1
    assert not a.git.repo_path("alice").exists()
    assert not remote.bare("alice").exists()


def test_a_symlink_pushed_by_hand_is_refused_not_followed(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    a = host(remote, engine, tmp_path / "a")
    a.blocks.ensure_user("alice")
    work = tmp_path / "by-hand"
    url = remote.url + "/alice.git"
    env = {**os.environ, "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.extraHeader"}
    env["GIT_CONFIG_VALUE_0"] = f"Authorization: Bearer {GIT_TOKEN}"

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(work), *args], check=True, capture_output=True, env=env)

    subprocess.run(["git", "clone", "-q", url, str(work)], check=True, env=env)
    (work / "blocks" / "human.toml").unlink()
    (work / "blocks" / "human.toml").symlink_to("/etc/passwd")
    git("add", "-A")
    git("-c", "user.name=m", "-c", "user.email=m@x", "commit", "-qm", "by hand")
    git("push", "-q", "origin", "main")
    with pytest.raises(UnsafeFile, match="refused"):
        notes(a, "alice")


PG = "postgresql://dmem@127.0.0.1:5432/dmem"


def test_a_distributed_host_with_shared_stores_is_accepted() -> None:
    MemorySettings(git_remote="http://127.0.0.1:8418", database_url=PG, archive="postgres")
    MemorySettings(git_remote="file:///srv/git", database_url=PG, archive="weaviate")


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"git_remote": "file:///srv/git", "archive": "weaviate"}, "must be a PostgreSQL URL"),
        ({"git_remote": "file:///srv/git", "database_url": PG}, "needs a shared archive"),
        (
            {"git_remote": "http://u:secret@h:1", "database_url": PG, "archive": "postgres"},
            "no credentials in the URL",
        ),
        (
            {"git_remote": "ext::sh -c x", "database_url": PG, "archive": "postgres"},
            "is not a base URL",
        ),
    ],
)
def test_the_distributed_mode_refuses_a_host_it_cannot_share(
    values: dict[str, str], why: str
) -> None:
    with pytest.raises(ConfigError, match=why) as raised:
        MemorySettings(**values)
    assert "secret" not in str(raised.value)


@pytest.mark.postgres
def test_settings_with_a_git_remote_build_a_stack_on_it(tmp_path: Path, postgres_url: str) -> None:
    with git_server(tmp_path / "remote") as server:
        database = fresh_schema_url(postgres_url)
        stacks = [
            stack_from_settings(
                distributed_settings(tmp_path / name, database_url=database, git_remote=server.url)
            )
            for name in ("worker", "client")
        ]
        try:
            worker, client = stacks
            assert isinstance(worker.git, RemoteGitBlockStore)
            worker.blocks.ensure_user("alice")
            note_sha = worker.edits.apply_direct(
                "alice", "human", AddContext(note="shared"), SERVICE
            )
            assert client.blocks.read_block("alice", "human").sha == note_sha
            assert client.blocks.users() == ["alice"]  # the shared database's list
        finally:
            for stack in stacks:
                stack.close()


def test_a_pinned_activity_reads_one_state_and_still_writes_on_the_newest(
    remote: Remote, engine: Engine, tmp_path: Path
) -> None:
    a, b = host(remote, engine, tmp_path / "a"), host(remote, engine, tmp_path / "b")
    a.blocks.ensure_user("alice")
    with a.git.pinned():
        assert notes(a, "alice") == []
        note(b, "alice", "from b")  # another host writes meanwhile
        assert notes(a, "alice") == []  # the activity's reads: as of its start
        note(a, "alice", "from a")  # its write: a refused push, then a retry on fresh history
        assert notes(a, "alice") == ["from b", "from a"]
    assert remote_log(remote.bare("alice"), "--merges", "--format=%H", "main") == ""
    assert len(remote.commits("alice")) == 3


def _pkt(text: str) -> bytes:
    return b"%04x" % (len(text) + 4) + text.encode()


MAIN = "a" * 40


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            _pkt("# service=git-upload-pack\n")
            + b"0000"
            + _pkt(f"{MAIN} HEAD\0caps\n")
            + _pkt(f"{MAIN} refs/heads/main\n")
            + b"0000",
            MAIN,
        ),
        (
            _pkt("# service=git-upload-pack\n")
            + b"0000"
            + _pkt(f"{'0' * 40} capabilities^{{}}\0x\n")
            + b"0000",
            None,
        ),
        (b"zzzz", Unreadable),
        (b"00ff" + b"x" * 10, Unreadable),
        (_pkt("../../etc refs/heads/main\n"), Unreadable),
    ],
    ids=["main", "empty repository", "not a pkt-line", "torn", "not a sha"],
)
def test_a_ref_advertisement_is_read_strictly(body: bytes, expected: object) -> None:
    if expected is Unreadable:
        with pytest.raises(Unreadable):
            main_of_advertisement(body)
    else:
        assert main_of_advertisement(body) == expected
