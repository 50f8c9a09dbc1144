"""Hostile-repository suite: a user's repository is untrusted input. Symlinks (out of the data
dir, to /etc/passwd, to another user's block; a symlinked user dir, blocks dir or .git), FIFOs,
devices, directories, invalid UTF-8, unknown files, and symlinks or submodules committed into
the tree: each is refused with one line naming the path, through the service's read path, the
import path, `dmem edit` / `dmem import` / `dmem blocks` and a real turn. Nothing is read,
committed or shown to the model, every store is byte-identical, and nothing hangs."""

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.cli import main
from durable_memory.memory.core.errors import DurableMemoryError, UnsafeFile
from durable_memory.memory.service.history import EditedDirectory
from durable_memory.models.history import Author, AuthorKind
from tests.support.git_checks import git_output
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import rig_settings, running_rig, turn_outcome

ALICE = Author(name="alice", kind=AuthorKind.USER)
SECRET = "Bob-the-secret"


@contextlib.contextmanager
def no_hang(seconds: int = 20) -> Iterator[None]:
    """A FIFO opened for reading blocks until a writer comes: fail instead of hanging."""

    def timeout(_signum: int, _frame: FrameType | None) -> None:
        raise TimeoutError(f"hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[MemoryStack]:
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    for user in ("alice", "bob"):
        stack.blocks.ensure_user(user)
    stack.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE)
    stack.edits.edit_block("bob", "student", {"name": SECRET}, ALICE)
    yield stack
    stack.close()


def _cli(stack: MemoryStack, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["--data-dir", str(stack.git.data_dir), "--profile", "essay_coach", *args])
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    return code, err


def _assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert err.startswith("dmem: error: ")
    assert err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err


# -- the working tree: what a person (or an attacker) left in blocks/ ---------------------------


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def _mknod_null(path: Path) -> None:
    try:
        os.mknod(path, 0o644 | 0o020000, os.makedev(1, 3))  # a character device: /dev/null's
    except PermissionError:
        pytest.skip("creating device nodes needs privileges this run does not have")


def _symlink_outside(path: Path, tmp: Path) -> None:
    """A valid block outside the data dir: importing through the link would commit it."""
    (tmp / "outside.toml").write_text(f'name = "{SECRET}"\n', encoding="utf-8")
    _replace(path, lambda link: link.symlink_to(tmp / "outside.toml"))


def _invalid_utf8(path: Path, _tmp: Path) -> None:
    path.write_bytes(b'name = "Al\xffice"\n')


def _symlinked_blocks(path: Path, _tmp: Path) -> None:
    os.rename(path.parent, path.parent.with_name("blocks-moved"))
    path.parent.symlink_to(Path("../bob/blocks"))


WORKING_TREE: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "symlink out of the data dir": (_symlink_outside, "is a symbolic link"),
    "symlink to /etc/passwd": (
        lambda p, _tmp: _replace(p, lambda q: q.symlink_to("/etc/passwd")),
        "is a symbolic link",
    ),
    "symlink to another user's block": (
        lambda p, _tmp: _replace(p, lambda q: q.symlink_to(Path("../../bob/blocks/student.toml"))),
        "is a symbolic link",
    ),
    "symlink to /dev/null": (
        lambda p, _tmp: _replace(p, lambda q: q.symlink_to("/dev/null")),
        "is a symbolic link",
    ),
    "FIFO": (lambda p, _tmp: _replace(p, lambda q: os.mkfifo(q)), "is a FIFO"),
    "device node": (lambda p, _tmp: _replace(p, _mknod_null), "is a character device"),
    "directory": (lambda p, _tmp: _replace(p, lambda q: q.mkdir()), "is a directory"),
    "invalid UTF-8": (
        _invalid_utf8,
        "is not valid UTF-8 (byte 10",
    ),
    "symlinked blocks dir": (
        _symlinked_blocks,
        "users/alice/blocks is a symbolic link, not a directory",
    ),
}


@pytest.mark.parametrize("case", WORKING_TREE)
def test_hostile_working_tree_files_are_refused(
    stack: MemoryStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    make, why = WORKING_TREE[case]
    memory = stack
    make(memory.git.repo_path("alice") / "blocks" / "student.toml", tmp_path)
    before = snapshot(stack)
    shown = "users/alice/blocks" if "blocks dir" in case else "users/alice/blocks/student.toml"
    editor = tmp_path / "editor.sh"
    editor.write_text("#!/bin/sh\nsed -i 's/^Alice$/Alicia/' \"$1\"\n", encoding="utf-8")
    editor.chmod(0o755)
    monkeypatch.setenv("EDITOR", str(editor))
    with no_hang():
        # Reads come from HEAD: the file in the working tree is neither read nor followed.
        assert memory.blocks.read_block("alice", "student").fields["name"] == "Alice"
        writes: list[Callable[[], object]] = [
            lambda: memory.history.commit_hand_edits("alice", ALICE),
            lambda: memory.edits.edit_block("alice", "student", {"name": "Eve"}, ALICE),
        ]
        for write in writes:
            with pytest.raises(UnsafeFile) as refused:
                write()
            assert shown in str(refused.value)
            assert why in str(refused.value)
            assert "\n" not in str(refused.value)
        for command in (("import", "alice", "--as", "alice"), ("edit", "alice", "student")):
            _assert_one_line_error(*_cli(stack, capsys, *command), shown, why)
    assert snapshot(stack) == before
    assert memory.blocks.read_block("bob", "student").fields["name"] == SECRET  # bob untouched


@pytest.mark.parametrize("case", WORKING_TREE)
def test_hostile_files_in_an_import_directory_are_refused(
    stack: MemoryStack, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """`dmem import USER DIR` (a thin client's import) reads DIR as it reads a working tree."""
    make, why = WORKING_TREE[case]
    why = why.removeprefix("users/alice/blocks ")  # the directory is named as given
    checkout = tmp_path / "checkout"
    (checkout / "blocks").mkdir(parents=True)
    (checkout / "blocks" / "student.toml").write_text('name = "Alicia"\n', encoding="utf-8")
    make(checkout / "blocks" / "student.toml", tmp_path)
    before = snapshot(stack)
    shown = f"{checkout}/blocks" if "blocks dir" in case else f"{checkout}/blocks/student.toml"
    with no_hang():
        with pytest.raises(UnsafeFile) as refused:
            stack.history.commit_hand_edits("alice", ALICE, EditedDirectory(checkout))
        assert shown in str(refused.value)
        assert why in str(refused.value)
        assert "\n" not in str(refused.value)
        command = ("import", "alice", str(checkout), "--as", "alice")
        _assert_one_line_error(*_cli(stack, capsys, *command), shown, why)
    assert snapshot(stack) == before


def test_editor_output_that_is_not_utf8_is_refused(
    stack: MemoryStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = snapshot(stack)
    editor = tmp_path / "editor.sh"
    editor.write_text("#!/bin/sh\nprintf '\\377\\376 bad' >> \"$1\"\n", encoding="utf-8")
    editor.chmod(0o755)
    monkeypatch.setenv("EDITOR", str(editor))
    _assert_one_line_error(*_cli(stack, capsys, "edit", "alice", "student"), "not valid UTF-8")
    assert snapshot(stack) == before


# -- the user's directory itself ------------------------------------------------------------


def _symlinked_user(users: Path) -> None:
    (users / "carol").symlink_to("bob")


def _symlinked_git(users: Path) -> None:
    (users / "carol").mkdir()
    (users / "carol" / ".git").symlink_to(Path("../bob/.git"))


def _gitdir_file(users: Path) -> None:
    (users / "carol").mkdir()
    (users / "carol" / ".git").write_text("gitdir: ../bob/.git\n", encoding="utf-8")


USER_DIRS = {
    "symlinked user dir": (_symlinked_user, "users/carol is a symbolic link, not a directory"),
    "symlinked .git": (_symlinked_git, "users/carol/.git is a symbolic link, not a directory"),
    "gitdir file": (_gitdir_file, "users/carol/.git is a regular file, not a directory"),
}


@pytest.mark.parametrize("case", USER_DIRS)
def test_a_user_directory_leading_elsewhere_is_refused(
    stack: MemoryStack, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make, message = USER_DIRS[case]
    make(stack.git.users_dir)
    before = snapshot(stack)
    for call in (
        lambda: stack.blocks.read_blocks("carol"),
        lambda: stack.blocks.ensure_user("carol"),
        lambda: stack.history.commit_hand_edits("carol", ALICE),
    ):
        with pytest.raises(UnsafeFile, match=message):
            call()
    for command in (("blocks", "carol"), ("import", "carol", "--as", "carol")):
        _assert_one_line_error(*_cli(stack, capsys, *command), message)
    assert snapshot(stack) == before
    assert "carol" not in stack.git.users()


# -- what was committed: HEAD's tree --------------------------------------------------------


def _commit_entry(repo: Path, path: str, mode: str, sha: str) -> None:
    """Commit `path` as the given tree entry with plain git, as a person could."""
    git_output(repo, "update-index", "--force-remove", path)
    git_output(repo, "update-index", "--add", "--cacheinfo", f"{mode},{sha},{path}")
    git_output(repo, "commit", "-q", "-m", "by hand")


def _blob(repo: Path, data: bytes) -> str:
    return (
        subprocess.run(
            ["git", "-C", str(repo), "hash-object", "-w", "--stdin"],
            input=data,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
    )


def _committed_blocks_symlink(repo: Path) -> None:
    git_output(repo, "rm", "-rq", "--cached", "blocks")
    _commit_entry(repo, "blocks", "120000", _blob(repo, b"/etc"))


COMMITTED: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "symlink blob": (
        lambda repo: _commit_entry(
            repo, "blocks/student.toml", "120000", _blob(repo, b"../../bob/blocks/student.toml")
        ),
        "blocks/student.toml",
        "is a symbolic link",
    ),
    "submodule": (
        lambda repo: _commit_entry(
            repo, "blocks/student.toml", "160000", git_output(repo, "rev-parse", "HEAD").strip()
        ),
        "blocks/student.toml",
        "is a submodule",
    ),
    "invalid UTF-8": (
        lambda repo: _commit_entry(
            repo, "blocks/student.toml", "100644", _blob(repo, b'name = "\xc3("\n')
        ),
        "blocks/student.toml",
        "is not valid UTF-8",
    ),
    "symlinked blocks dir": (
        _committed_blocks_symlink,
        "blocks",
        "is a symbolic link, not a directory",
    ),
}


@pytest.mark.parametrize("case", COMMITTED)
def test_symlinks_submodules_and_bad_bytes_committed_in_the_tree_are_refused(
    stack: MemoryStack, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make, path, why = COMMITTED[case]
    repo = stack.git.repo_path("alice")
    make(repo)
    head = git_output(repo, "rev-parse", "HEAD").strip()
    before = snapshot(stack)
    message = f"users/alice/{path} at {head[:12]} {why}"
    for call in (
        lambda: stack.blocks.read_blocks("alice"),
        lambda: stack.blocks.read_block("alice", "student"),
        lambda: stack.history.commit_hand_edits("alice", ALICE),
        lambda: stack.edits.edit_block("alice", "student", {"name": "Eve"}, ALICE),
        lambda: stack.compile("alice"),
    ):
        with pytest.raises(UnsafeFile) as refused:
            call()
        assert message in str(refused.value)
    for command in (("blocks", "alice"), ("import", "alice", "--as", "alice")):
        _assert_one_line_error(*_cli(stack, capsys, *command), message)
    assert snapshot(stack) == before


# -- files that are not blocks --------------------------------------------------------------


def test_unknown_files_in_blocks_are_reported_not_ignored(
    stack: MemoryStack, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Import refuses while blocks/ holds anything but the profile's `<label>.toml` files (the
    person meant something by them); a commit made by hand that added one is logged on read."""
    blocks = stack.git.repo_path("alice") / "blocks"
    (blocks / "student.toml").write_text('name = "Alicia"\n', encoding="utf-8")
    (blocks / "notes.txt").write_text("remember", encoding="utf-8")
    (blocks / "diary.toml").write_text('value = "x"\n', encoding="utf-8")
    (blocks / "old").mkdir()
    before = snapshot(stack)
    with pytest.raises(UnsafeFile) as refused:
        stack.history.commit_hand_edits("alice", ALICE)
    listed = "'diary.toml', 'notes.txt', 'old'"
    assert "users/alice/blocks holds files that are not blocks of profile" in str(refused.value)
    assert listed in str(refused.value)
    _assert_one_line_error(*_cli(stack, capsys, "import", "alice", "--as", "alice"), listed)
    assert snapshot(stack) == before

    repo = blocks.parent
    git_output(repo, "add", "blocks/notes.txt")
    git_output(repo, "commit", "-q", "-m", "notes by hand")
    (blocks / "student.toml").write_text('name = "Alice"\n', encoding="utf-8")
    fresh = open_stack(stack.git.data_dir, profile="essay_coach")  # nothing cached
    with caplog.at_level("WARNING", logger="durable_memory.memory.store.git"):
        assert fresh.blocks.read_block("alice", "student").fields["name"] == "Alice"
    assert "blocks/notes.txt is not a block file (blocks/<label>.toml): not read" in caplog.text
    fresh.close()


# -- a real turn ----------------------------------------------------------------------------


async def test_a_turn_on_a_hostile_repository_fails_cleanly_and_the_next_succeeds(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A symlink committed as a block: the turn fails with one clear error before the model is
    called, stores untouched; the worker lives on, and once the repository is fixed the next
    turn of that user succeeds."""
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, [{"text": "Hello again."}]) as rig:
        memory = rig.stack
        memory.blocks.ensure_user("alice")
        repo = memory.git.repo_path("alice")
        _commit_entry(repo, "blocks/student.toml", "120000", _blob(repo, b"/etc/passwd"))
        before = snapshot(rig.stack)
        with pytest.raises(DurableMemoryError) as told:
            await rig.client.send_message("alice", "hi", turn_id="h1")
        assert "dmem.start_turn failed: UnsafeFile: users/alice/blocks/student.toml" in str(
            told.value
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await turn_outcome(rig.client, "alice", "h1")
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError)
        assert cause.type == "TurnFailed"
        assert cause.non_retryable
        assert "users/alice/blocks/student.toml at " in cause.message
        assert "is a symbolic link" in cause.message
        assert cause.message.count("failed") == 1  # named once, not once per layer
        assert rig.model_server.requests == []
        assert snapshot(rig.stack) == before

        good = git_output(repo, "rev-parse", "HEAD~1:blocks/student.toml").strip()
        _commit_entry(repo, "blocks/student.toml", "100644", good)  # the repository fixed
        reply = await rig.client.send_message("alice", "hi", turn_id="h2")
        assert reply.reply == "Hello again."
        assert "root:" not in str(rig.model_server.requests)
