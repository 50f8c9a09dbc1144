"""`RemoteGitBlockStore`: the distributed mode's block repository. The git remote
(memory.git_remote) is the source of truth, user U's repository being `{remote}/{U}.git`; each
host keeps a disposable clone per user under `<data_dir>/clones/` as a cache.

Every transaction takes the local per-user lock (threads and processes of this host), repairs
what a crash left in the clone (recovery.py), fetches, and points the clone's main at the
remote's: a local commit a kill left unpushed is dropped, never pushed later, so the caller's
retry (an approved diff in the database, say) is the only way the change reaches the remote.
A commit is pushed at once. The push is the compare-and-set between hosts: it is leased on
the main it was made on (`--force-with-lease`: a main moved or absent is refused), and the
remote only accepts a fast-forward (`receive.denyNonFastForwards`, and git's own ref lock),
so a writer that lost a race gets `GitRemoteContended`; the callers that write are
wrapped in `compare_and_set` (store/block_repository.py), which re-runs their whole
read-check-write on fresh history (a Diff-Id already on the remote then means done), a bounded
number of times.

Network failures are `GitRemoteUnavailable` (retried), refusals that need a person (a wrong
token, a pre-receive hook) `GitRemoteRefused`. The token travels in git's environment
(`http.extraHeader`), never on a command line or in a URL.
"""

import contextlib
import logging
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import git

from durable_memory.faults import AFTER_PUSH, BEFORE_PUSH, crash_point
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    GitRemoteContended,
    GitRemoteRefused,
    GitRemoteUnavailable,
    UnknownUser,
)
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.bare_repos import (
    EXISTING_REPOSITORY_HEADER,
    delete_bare_repository,
    ensure_bare_repository,
    existing_bare_repository,
)
from durable_memory.memory.store.git.advertisement import (
    git_remote_errors,
    remote_main,
    served_main,
)
from durable_memory.memory.store.git.commits import RepoOpener, git_process, run_git
from durable_memory.memory.store.git.refs import (
    BRANCH_REF,
    FULL_SHA,
    Unreadable,
    read_git_file,
    read_head,
)
from durable_memory.memory.store.git.repository import GitBlockStore
from durable_memory.memory.store.git.snapshots import SnapshotCache
from durable_memory.memory.store.git.transaction import RepoTransaction
from durable_memory.memory.store.redaction.history import (
    HISTORY_REWRITE_HEADER,
    move_main,
    prune_repository,
    purge,
)
from durable_memory.models.history import Author

log = logging.getLogger(__name__)

CLONES_DIR = "clones"
REMOTE_REF = "refs/remotes/origin/main"
NETWORK_TIMEOUT_S = 120.0
"""A fetch or push that has not finished by then is killed: the remote is unavailable."""
_NETWORK_CONFIG = (
    # A server that stops sending (but keeps the connection) fails the request in 30 s.
    ("http.lowSpeedLimit", "1"),
    ("http.lowSpeedTime", "30"),
    # Only the transports memory.git_remote may name: never `ext::` or a helper program.
    ("protocol.allow", "never"),
    ("protocol.file.allow", "always"),
    ("protocol.http.allow", "always"),
    ("protocol.https.allow", "always"),
)

_UNAVAILABLE = (
    "could not resolve host",
    "failed to connect",
    "connection refused",
    "connection reset",
    "connection timed out",
    "operation timed out",
    "empty reply from server",
    "the remote end hung up unexpectedly",
    "rpc failed",
    "returned error: 5",
    "couldn't connect to server",
    "recv failure",
    "send failure",
)
_REFUSED = (
    "returned error: 401",
    "returned error: 403",
    "authentication failed",
    "could not read username",
    "could not read password",
)
_MISSING = ("returned error: 404", "does not appear to be a git repository", "not found")
_MOVED = ("fetch first", "non-fast-forward", "stale info", "failed to update ref", "cannot lock")


@dataclass
class RemoteTransaction(RepoTransaction):
    """A transaction on a clone whose commits are pushed as they are made."""

    push: Callable[["RemoteTransaction", str, str | None], None] | None = None
    """Pushes the new commit, given the main it was made on (None: the user's first)."""

    def commit(
        self,
        files: Mapping[str, str],
        message: str,
        author: Author,
        *,
        allow_empty: bool = False,
        overwrite_hand_edits: bool = False,
        profile: str | None = None,
        policies: str | None = None,
    ) -> str:
        before = self.head
        new = super().commit(
            files,
            message,
            author,
            allow_empty=allow_empty,
            overwrite_hand_edits=overwrite_hand_edits,
            profile=profile,
            policies=policies,
        )
        if new != before and self.push is not None:
            crash_point(BEFORE_PUSH)
            self.push(self, new, before)
            crash_point(AFTER_PUSH)
        return new


class RemoteGitBlockStore(GitBlockStore):
    """Users' repositories on a git remote, with disposable clones under `<data_dir>/clones/`."""

    def __init__(
        self,
        data_dir: str | Path,
        remote: str,
        token: str | None = None,
        cache: SnapshotCache | None = None,
    ) -> None:
        super().__init__(data_dir, cache)
        self.users_dir = self.data_dir / CLONES_DIR
        self.remote = remote.rstrip("/")
        self._token = token
        self._pins = threading.local()
        parts = urlsplit(self.remote)
        self._shared_dir = Path(unquote(parts.path)) if parts.scheme == "file" else None
        self._env = {"GIT_TERMINAL_PROMPT": "0", "GIT_ALLOW_PROTOCOL": "file:http:https"}
        settings = list(_NETWORK_CONFIG)
        if token is not None:
            settings.append(("http.extraHeader", f"Authorization: Bearer {token}"))
        self._env["GIT_CONFIG_COUNT"] = str(len(settings))
        for index, (key, value) in enumerate(settings):
            self._env[f"GIT_CONFIG_KEY_{index}"] = key
            self._env[f"GIT_CONFIG_VALUE_{index}"] = value

    def remote_url(self, user_id: str) -> str:
        return f"{self.remote}/{validate_user_id(user_id)}.git"

    def users(self) -> list[str]:
        """No user lives on this host's disk: the shared database lists them."""
        return []

    def exists(self, user_id: str) -> bool:
        """Whether the remote holds the user's memory (a main branch)."""
        if self._remote_tip(user_id) is not None:
            return True
        if self._shared_dir is not None and not existing_bare_repository(self._shared_dir, user_id):
            return False
        listed = self._network(
            None, "ls-remote", self.remote_url(user_id), BRANCH_REF, missing_ok=True
        )
        return listed is not None and bool(listed.strip())

    def forget_user(self, user_id: str) -> int:
        """Delete the user's repository on the remote, then this host's clone; idempotent (how
        many of the two were there). A shared directory's bare repository is renamed out of
        place and deleted; `dmem git-serve` is asked to do the same (DELETE on the
        repository's URL). Another host's clone is dropped there when that host next meets the
        user and finds no repository on the remote (`transaction`, `_fetch_and_reset`)."""
        if self._shared_dir is not None:
            removed = delete_bare_repository(self._shared_dir, user_id)
        else:
            removed = self._delete_on_server(user_id)
        return int(removed) + super().forget_user(user_id)

    def drop_clones(self, closed: Callable[[list[str]], list[str]]) -> list[str]:
        """Delete this host's clones of the users `closed` picks among those it holds: a
        forget's own step reaches only the clone of the host that ran it, so every worker
        runs this now and then (workers/worker.py). Each under its user's lock, so no
        transaction of this host is mid-way in it; the users dropped."""
        dropped = []
        for user_id in closed(super().users()):  # the clones on this host's disk
            if super().forget_user(user_id):
                dropped.append(user_id)
        return dropped

    def _delete_on_server(self, user_id: str) -> bool:
        request = urllib.request.Request(self.remote_url(user_id), method="DELETE")
        if self._token is not None:
            request.add_header("Authorization", f"Bearer {self._token}")
        where = f"deleting {self.remote_url(user_id)}"
        try:
            with (
                git_remote_errors(where),
                urllib.request.urlopen(request, timeout=NETWORK_TIMEOUT_S) as reply,
            ):
                reply.read()
                return True
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return False  # gone already (an earlier attempt)
            if error.code == 405:
                raise GitRemoteRefused(
                    f"{where}: the git server does not delete repositories (not `dmem "
                    "git-serve`?): delete the bare repository on its disk by hand, then run "
                    "the forget again"
                ) from None
            raise GitRemoteUnavailable(f"{where}: HTTP {error.code}") from None

    @contextlib.contextmanager
    def transaction(self, user_id: str, *, create: bool = False) -> Iterator[RemoteTransaction]:
        """Hold the user's local lock with the clone at the remote's main (see the module)."""
        if self._shared_dir is not None:
            if create:
                ensure_bare_repository(self._shared_dir, user_id)
            elif existing_bare_repository(self._shared_dir, user_id) is None:
                super().forget_user(user_id)  # a clone left from before a forget: stale
                raise UnknownUser(f"user '{user_id}' has no memory yet")
        with contextlib.ExitStack() as held:
            opener, lock, _recovered = self._hold(held, user_id, create)
            head = self._sync(opener, lock, user_id)
            if head is None and not create:
                raise UnknownUser(f"user '{user_id}' has no memory yet")
            yield RemoteTransaction(
                open_repo=opener,
                lock=lock,
                user_id=user_id,
                users_dir=self.users_dir,
                head=head,
                cache=self.cache,
                push=self._push,
            )

    def _make(self, user_id: str, create: bool, gone: bool) -> None:
        """A missing clone, also one dropped while this waited for its lock (a forget's, or
        `drop_clones`'s): made again, empty (the fetch fills it), since the remote says
        whether the user has memory; unless it says plainly that they have none (then no
        empty clone is left behind)."""
        if not create:
            if self._shared_dir is None:
                self._refuse_unknown(user_id)
            elif existing_bare_repository(self._shared_dir, user_id) is None:
                raise UnknownUser(f"user '{user_id}' has no memory {'any more' if gone else 'yet'}")
        self._create(user_id)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Within this block (on this thread), each user's remote is asked for its main once:
        later transactions read the clone as it was then, as of the block's start. For one
        activity's reads, which then see one consistent state of memory at a fraction of the
        cost. A push refused as stale (or any write) asks the remote again."""
        outer = getattr(self._pins, "users", None)
        self._pins.users = {} if outer is None else outer
        try:
            yield
        finally:
            self._pins.users = outer

    def _sync(self, repo: RepoOpener, lock: int, user_id: str) -> str | None:
        """Make the clone's main, index and files exactly the remote's main; return it (None
        while the user has none). Asks the remote for its tip first (no git process) and
        fetches only when the clone does not have it (the one case that opens `repo`)."""
        pins: dict[str, str | None] | None = getattr(self._pins, "users", None)
        git_dir = repo.git_dir
        if pins is not None and user_id in pins and read_head(git_dir) == pins[user_id]:
            return pins[user_id]
        tip = self._remote_tip(user_id)
        if tip is not None and tip == read_head(git_dir):
            if pins is not None:
                pins[user_id] = tip
            return tip
        head = self._fetch_and_reset(repo(), lock, user_id)
        if pins is not None:
            pins[user_id] = head
        return head

    def _refuse_unknown(self, user_id: str) -> None:
        """UnknownUser if the server says plainly that the user has no main."""
        with contextlib.suppress(Unreadable):  # an odd server: git's fetch will say
            if remote_main(self.remote_url(user_id), self._token) is None:
                raise UnknownUser(f"user '{user_id}' has no memory yet")

    def _remote_tip(self, user_id: str) -> str | None:
        """The remote's main as it is now, if it can be read without git (a shared directory's
        ref file; `dmem git-serve`'s `dmem-main`, another smart HTTP server's ref advertisement);
        None when not known this way."""
        try:
            if self._shared_dir is not None:
                bare = existing_bare_repository(self._shared_dir, user_id)
                return None if bare is None else read_head(bare)
            return remote_main(self.remote_url(user_id), self._token)
        except Unreadable:
            return None  # git's fetch says what is wrong

    def _fetch_and_reset(self, repo: git.Repo, lock: int, user_id: str) -> str | None:
        fetched = self._network(
            lock,
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            self.remote_url(user_id),
            f"+{BRANCH_REF}:{REMOTE_REF}",
            repo=repo,
            missing_ok=True,
            unborn_ok=True,
        )
        git_dir = Path(repo.git_dir)
        remote_head = None
        if fetched is not None:  # fetch writes the ref as a file of its own (never packed)
            remote_head = (read_git_file(git_dir, REMOTE_REF) or "").strip() or None
            if remote_head is not None and not FULL_SHA.fullmatch(remote_head):
                raise GitRemoteUnavailable(f"the fetched {REMOTE_REF} reads {remote_head[:60]!r}")
        # Recovery (above) put back any file a killed write left: the clone holds its HEAD.
        if read_head(git_dir) == remote_head:
            return remote_head
        if remote_head is None:  # the remote has nothing (yet): neither has the clone
            stale = read_head(git_dir) is not None
            run_git(repo, lock, "update-ref", "-d", BRANCH_REF)
            run_git(repo, lock, "read-tree", "--empty")
            if stale:  # the user was forgotten (or a first commit never pushed): no trace
                run_git(repo, lock, "update-ref", "-d", REMOTE_REF)
                run_git(repo, lock, "reflog", "expire", "--expire=now", "--all")
                run_git(repo, lock, "gc", "--prune=now", "--quiet")
        else:
            local_head = read_head(git_dir)
            run_git(repo, lock, "reset", "--hard", "--quiet", remote_head)
            if local_head is not None and not self._is_ancestor(repo, local_head, remote_head):
                # The remote's history was rewritten (`dmem redact`): the clone keeps nothing
                # of the old one, in its objects, reflogs or its snapshots in memory.
                self.cache.forget(user_id)
                purge(repo, lock, extra_refs=("ORIG_HEAD",))
        run_git(repo, lock, "clean", "-ffdxq")
        return remote_head

    @staticmethod
    def _is_ancestor(repo: git.Repo, ancestor: str, descendant: str) -> bool:
        result = git_process(
            "merge-base", "--is-ancestor", ancestor, descendant, cwd=repo.git_dir, lock=None
        )
        return result.returncode == 0

    def replace_history(self, tx: RepoTransaction, old: str, new: str) -> None:
        """Replace the remote's main `old` by the rewritten history `new` with a lease-protected
        force push (GitRemoteContended if another writer moved it first), prune the old
        objects there, then make the clone the same (`dmem redact`, store/redaction/history.py).
        A shared directory's repository is pushed to by a receive-pack run here, told to
        accept this one non-fast-forward update, and garbage-collected here; `dmem git-serve`
        is asked by a header (with the token) and collects its own garbage at once."""
        rewrite: tuple[str, ...] = (
            "--receive-pack=git -c receive.denyNonFastForwards=false receive-pack",
        )
        env: dict[str, str] = {}
        if self._shared_dir is None:
            rewrite = ()
            # Never onto a repository made anew: a forget may have deleted it meanwhile.
            env = self._headers({HISTORY_REWRITE_HEADER: old, EXISTING_REPOSITORY_HEADER: "yes"})
        pins: dict[str, str | None] | None = getattr(self._pins, "users", None)
        if pins is not None:
            pins.pop(tx.user_id, None)
        pushed = self._network(
            tx.lock,
            "push",
            "--porcelain",
            "--quiet",
            f"--force-with-lease={BRANCH_REF}:{old}",
            *rewrite,
            self.remote_url(tx.user_id),
            f"{new}:{BRANCH_REF}",
            repo=tx.repo,
            env=env,
            missing_ok=True,
        )
        if pushed is None:
            self._refuse_gone(tx.user_id, f"the rewritten history of user '{tx.user_id}'")
        move_main(tx.repo, tx.lock, new, old)
        self.purge_history(tx)

    def purge_history(self, tx: RepoTransaction) -> None:
        """Drop the old history's objects from the clone and from a shared directory's bare
        repository (idempotent; `dmem git-serve` drops its own when it accepts the rewrite)."""
        if self._shared_dir is not None:
            bare = existing_bare_repository(self._shared_dir, tx.user_id)
            if bare is not None:
                prune_repository(bare)
        self.cache.forget(tx.user_id)
        purge(tx.repo, tx.lock, extra_refs=("ORIG_HEAD", REMOTE_REF))

    def _headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """The environment that has git send these HTTP headers too (to `dmem git-serve`)."""
        count = int(self._env["GIT_CONFIG_COUNT"])
        env = {"GIT_CONFIG_COUNT": str(count + len(headers))}
        for index, (name, value) in enumerate(headers.items(), start=count):
            env[f"GIT_CONFIG_KEY_{index}"] = "http.extraHeader"
            env[f"GIT_CONFIG_VALUE_{index}"] = f"{name}: {value}"
        return env

    def _refuse_gone(self, user_id: str, where: str) -> None:
        """After a push onto a main this host fetched was answered "no such repository":
        UnknownUser if the remote itself says it has no main for the user now (a forget
        deleted the repository): a shared directory's, or `dmem git-serve`'s own `dmem-main`
        answer. Any other answer (a proxy's 404, a server that is not `dmem git-serve`) is
        GitRemoteUnavailable, retried; a refused token stays GitRemoteRefused."""
        try:
            if self._shared_dir is not None:
                gone = existing_bare_repository(self._shared_dir, user_id) is None
            else:
                gone = served_main(self.remote_url(user_id), self._token) is None
        except GitRemoteRefused:
            raise
        except (Unreadable, DurableMemoryError, OSError):
            gone = False
        if gone:
            raise UnknownUser(
                f"user '{user_id}' has no memory on the git remote any more (forgotten while "
                "this transaction ran): nothing was pushed"
            )
        raise GitRemoteUnavailable(
            f"{where}: the git remote answered that the repository does not exist, and did not "
            "confirm it when asked for the user's main"
        )

    def _push(self, tx: RemoteTransaction, sha: str, onto: str | None) -> None:
        """Push `sha`, made on `onto` (the remote's main as fetched; None for the user's first
        commit), to the remote's main. Onto a main, the push is leased on it: a main that
        moved is GitRemoteContended (compare-and-set), and so is one that is gone, e.g. a
        repository a forget deleted and a fresh start made anew, empty, meanwhile. And
        `dmem git-serve` is told not to make the repository: gone (a forget deleted it), the
        push is refused, not made into a new repository holding the forgotten history
        (UnknownUser). A shared directory's repository is never made by a push."""
        pins: dict[str, str | None] | None = getattr(self._pins, "users", None)
        if pins is not None:  # whatever happens, the next transaction asks the remote
            pins.pop(tx.user_id, None)
        lease = () if onto is None else (f"--force-with-lease={BRANCH_REF}:{onto}",)
        header = onto is not None and self._shared_dir is None
        out = self._network(
            tx.lock,
            "push",
            "--porcelain",
            "--quiet",
            *lease,
            self.remote_url(tx.user_id),
            f"{sha}:{BRANCH_REF}",
            repo=tx.repo,
            env=self._headers({EXISTING_REPOSITORY_HEADER: "yes"}) if header else None,
            missing_ok=onto is not None,
        )
        if out is None:
            self._refuse_gone(tx.user_id, f"git push of user '{tx.user_id}'")
        log.debug("user '%s': pushed %s (%s)", tx.user_id, sha[:12], (out or "").strip())

    def _network(
        self,
        lock: int | None,
        *args: str,
        repo: git.Repo | None = None,
        missing_ok: bool = False,
        unborn_ok: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> str | None:
        """Run a git command that talks to the remote; its output, or None when the
        repository (`missing_ok`) or its main (`unborn_ok`) does not exist there."""
        try:
            result = git_process(
                *args,
                cwd=repo.working_tree_dir if repo is not None else None,
                lock=lock,
                env={**self._env, **(env or {})},
                timeout=NETWORK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise GitRemoteUnavailable(
                f"git {args[0]} to {self.remote} did not finish in {NETWORK_TIMEOUT_S:.0f} s"
            ) from None
        output = (result.stdout + result.stderr).decode("utf-8", errors="replace")
        if result.returncode == 0:
            return result.stdout.decode("utf-8", errors="replace")
        said = output.lower()
        where = f"git {args[0]} of {self._shown(args)}"
        if unborn_ok and "couldn't find remote ref" in said:
            return None
        if any(sign in said for sign in _REFUSED):
            raise GitRemoteRefused(f"{where}: the git remote refused the token ({_tail(output)})")
        if any(sign in said for sign in _UNAVAILABLE):
            raise GitRemoteUnavailable(f"{where}: the git remote is unavailable: {_tail(output)}")
        if args[0] == "push" and any(sign in said for sign in _MOVED):
            raise GitRemoteContended(
                f"{where}: refused, another writer moved the branch first ({_tail(output)})"
            )
        if args[0] == "push" and "rejected" in said:
            raise GitRemoteRefused(f"{where}: the git remote refused the push: {_tail(output)}")
        if missing_ok and any(sign in said for sign in _MISSING):
            return None
        raise GitRemoteUnavailable(f"{where} failed: {_tail(output)}")

    def _shown(self, args: tuple[str, ...]) -> str:
        for arg in args:
            if arg.startswith(self.remote):
                return arg
        return self.remote


def _tail(output: str) -> str:
    """The last lines git printed, on one line, short."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return " / ".join(lines[-3:])[:400]
