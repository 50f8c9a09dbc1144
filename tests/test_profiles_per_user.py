"""Profiles per user: the profile is chosen when a user is created (client, CLI or the first
turn), recorded in the user's repository (`profile.toml`) and used by every later turn; a
change is an explicit, committed operation whose author is recorded, refused unless the user's
blocks fit; an unknown name is one error listing the known ones; a hostile profile record is
one error and changes nothing. Two users with different profiles share one worker."""

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.cli import main
from durable_memory.client import TurnFailed
from durable_memory.memory.core.errors import DurableMemoryError, HandEditPending, ProfileError
from durable_memory.memory.core.profiles import BUNDLED_PROFILES, load_profile
from durable_memory.models.history import Author, AuthorKind
from tests.support.agent_helpers import said_texts
from tests.support.git_checks import git_output
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import rig_settings, running_rig

TEACHER = Author(name="ms-rivera", kind=AuthorKind.USER)

# The default profile with a tighter `notes` block and one more block: a profile a default
# user can move to only while their notes fit in it.
NOTES_PLUS = """
name = "notes-plus"

[persona]
name = "Assistant"
role = "Assistant with goals"
instructions = "Help."

[[blocks]]
label = "persona"
kind = "persona"
preset = "default"
description = "Who you are."
limit = 1500
read_only = true

[[blocks]]
label = "human"
kind = "human"
description = "The user."
limit = 1500

[[blocks]]
label = "notes"
kind = "text"
description = "Notes."
limit = 60

[[blocks]]
label = "goals"
kind = "text"
description = "The user's goals."
limit = 500
"""


def _labels(stack: MemoryStack, user: str) -> list[str]:
    return list(stack.blocks.read_blocks(user))


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[MemoryStack]:
    """A deployment whose configured profile (the default for new users) is a file."""
    path = tmp_path / "notes_plus.toml"
    path.write_text(NOTES_PLUS, encoding="utf-8")
    stack = open_stack(tmp_path / "data", profile=path)
    yield stack
    stack.close()


def test_the_catalog_serves_every_bundled_profile_and_the_configured_one(
    stack: MemoryStack,
) -> None:
    profiles = stack.blocks.profiles
    assert {"default", "essay_coach"} <= set(BUNDLED_PROFILES)
    assert profiles.names() == sorted({*BUNDLED_PROFILES, "notes_plus"})
    assert profiles.default_name == "notes_plus"
    assert "goals" in profiles.describe("notes_plus")


def test_profile_is_recorded_at_creation_and_reused(stack: MemoryStack, tmp_path: Path) -> None:
    stack.blocks.ensure_user("ann", "essay_coach")
    stack.blocks.ensure_user("ben")  # the deployment's default
    repo = stack.git.repo_path("ann")
    assert git_output(repo, "show", "HEAD:profile.toml") == 'name = "essay_coach"\n'
    assert "Profile: essay_coach" in git_output(repo, "log", "-1", "--format=%B")
    assert git_output(stack.git.repo_path("ben"), "show", "HEAD:profile.toml") == (
        'name = "notes_plus"\n'
    )
    head = stack.blocks.last_change("ann")
    assert stack.blocks.ensure_user("ann") == stack.blocks.ensure_user("ann", "essay_coach")
    assert stack.blocks.last_change("ann") == head  # nothing more was committed
    # Another deployment default changes nothing for users who have a profile.
    other = open_stack(tmp_path / "data", profile="default")
    assert _labels(other, "ann") == [b.label for b in load_profile("essay_coach").blocks]
    assert _labels(stack, "ben") == ["persona", "human", "notes", "goals"]
    with pytest.raises(ProfileError, match="unknown profile 'notes_plus'"):
        _labels(other, "ben")  # that deployment does not serve ben's profile: said, not guessed
    assert other.blocks.render("ann", "student", "markdown").startswith("---\nblock: student")
    other.close()


def test_a_later_choice_of_another_profile_is_refused(stack: MemoryStack) -> None:
    stack.blocks.ensure_user("ann", "essay_coach")
    before = snapshot(stack)
    with pytest.raises(ProfileError) as refused:
        stack.blocks.ensure_user("ann", "default")
    assert str(refused.value) == (
        "user 'ann' has profile 'essay_coach', not 'default'; a turn cannot change it: change "
        "it with `dmem profile set ann default` (MemoryClient.set_profile), which checks that "
        "their blocks fit"
    )
    assert snapshot(stack) == before


def test_unknown_profile_is_one_error_listing_the_known(stack: MemoryStack) -> None:
    stack.blocks.ensure_user("ann")
    before = snapshot(stack)
    known = ", ".join(sorted({*BUNDLED_PROFILES, "notes_plus"}))
    attempts: list[Callable[[], object]] = [
        lambda: stack.blocks.ensure_user("cat", "ghost"),
        lambda: stack.edits.set_profile("ann", "ghost", TEACHER),
    ]
    unknown = f"^unknown profile 'ghost'; the known profiles are {known}$"
    for attempt in attempts:
        with pytest.raises(ProfileError, match=unknown):
            attempt()
    assert snapshot(stack) == before
    assert stack.blocks.users() == ["ann"]


def test_change_is_committed_with_its_author_only_when_the_blocks_fit(
    stack: MemoryStack,
) -> None:
    stack.blocks.ensure_user("ann", "default")
    stack.edits.edit_block("ann", "notes", {"value": "x" * 100}, TEACHER)
    before = snapshot(stack)
    for name, why in (
        ("notes_plus", "notes"),  # 100 characters, over the new limit of 60
        ("essay_coach", "block 'notes' is not in it"),
    ):
        with pytest.raises(ProfileError, match=f"cannot change to profile '{name}'") as refused:
            stack.edits.set_profile("ann", name, TEACHER)
        assert why in str(refused.value)
        assert str(refused.value).endswith("nothing was changed")
    assert snapshot(stack) == before

    stack.edits.edit_block("ann", "notes", {"value": "short"}, TEACHER)
    sha = stack.edits.set_profile("ann", "notes_plus", TEACHER)
    repo = stack.git.repo_path("ann")
    assert (
        git_output(repo, "log", "-1", "--format=%an|%s", sha)
        == "ms-rivera|Set profile notes_plus\n"
    )
    assert "Profile: notes_plus" in git_output(repo, "log", "-1", "--format=%B", sha)
    assert git_output(repo, "show", f"{sha}:profile.toml") == 'name = "notes_plus"\n'
    assert _labels(stack, "ann") == ["persona", "human", "notes", "goals"]
    assert stack.blocks.read_block("ann", "notes").value == "short"
    assert stack.edits.set_profile("ann", "notes_plus", TEACHER) == sha  # already: no commit
    with pytest.raises(ProfileError, match="block 'goals' is not in it"):
        stack.edits.set_profile("ann", "default", TEACHER)


def _commit_by_hand(repo: Path, make: Any) -> None:
    make(repo / "profile.toml")
    git_output(repo, "add", "profile.toml")
    git_output(repo, "commit", "-q", "-m", "by hand")


def _symlink(path: Path) -> None:
    path.unlink()
    path.symlink_to("/etc/passwd")


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "x").write_text("x", encoding="utf-8")


HOSTILE: dict[str, tuple[Any, str, bool]] = {
    # what is committed as profile.toml, the error, whether `profile set` can replace it
    "not TOML": (lambda p: p.write_text("name = [", encoding="utf-8"), "not valid TOML", True),
    "other keys": (
        lambda p: p.write_text('name = "default"\nextra = 1\n', encoding="utf-8"),
        "holds the key(s) extra, name",
        True,
    ),
    "a path as name": (
        lambda p: p.write_text('name = "../../etc/passwd"\n', encoding="utf-8"),
        "which is not a profile name",
        True,
    ),
    "an unknown profile": (
        lambda p: p.write_text('name = "ghost"\n', encoding="utf-8"),
        "unknown profile 'ghost'",
        True,
    ),
    "invalid UTF-8": (
        lambda p: p.write_bytes(b'name = "d\xffefault"\n'),
        "is not valid UTF-8",
        False,
    ),
    "a symlink": (_symlink, "is a symbolic link, not a regular file", False),
    "a directory": (_directory, "is a directory, not a regular file", False),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_profile_record_is_one_error_and_changes_nothing(
    stack: MemoryStack, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make, problem, repairable = HOSTILE[case]
    stack.blocks.ensure_user("ann", "default")
    _commit_by_hand(stack.git.repo_path("ann"), make)
    before = snapshot(stack)
    attempts: list[Callable[[], object]] = [
        lambda: stack.blocks.ensure_user("ann"),
        lambda: stack.blocks.read_blocks("ann"),
        lambda: stack.blocks.read_block("ann", "notes"),
        lambda: stack.edits.edit_block("ann", "notes", {"value": "x"}, TEACHER),
    ]
    if not repairable:
        attempts.append(lambda: stack.edits.set_profile("ann", "default", TEACHER))
    for attempt in attempts:
        with pytest.raises(DurableMemoryError) as refused:
            attempt()
        assert problem in str(refused.value)
        assert "users/ann/profile.toml" in str(refused.value)
    code = main(["--data-dir", str(stack.git.data_dir), "blocks", "ann"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1
    assert problem in err
    assert snapshot(stack) == before
    if repairable:  # the explicit change replaces the bad record
        stack.edits.set_profile("ann", "default", TEACHER)
        assert _labels(stack, "ann") == ["persona", "human", "notes"]


def test_a_hand_edit_of_the_record_is_never_read_nor_overwritten(stack: MemoryStack) -> None:
    stack.blocks.ensure_user("ann", "default")
    (stack.git.repo_path("ann") / "profile.toml").write_text('name = "essay_coach"\n')
    assert _labels(stack, "ann") == ["persona", "human", "notes"]  # HEAD's record, not this
    before = snapshot(stack)
    with pytest.raises(HandEditPending, match=r"profile\.toml of user 'ann' has changes made"):
        stack.edits.set_profile("ann", "notes_plus", TEACHER)
    assert snapshot(stack) == before


def test_cli_lists_profiles_creates_users_with_one_and_changes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--data-dir", str(tmp_path / "data")]
    assert main([*base, "profiles"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("default ")
    assert out[0].endswith("(default)")
    assert any(line.startswith("essay_coach  AI tutor for college essays") for line in out)
    assert main([*base, "init", "ann", "essay_coach"]) == 0
    assert "(profile essay-coach)" in capsys.readouterr().out
    assert main([*base, "init", "ann", "default"]) == 2
    assert "has profile 'essay_coach', not 'default'" in capsys.readouterr().err
    assert main([*base, "profile", "set", "ann", "default", "--as", "ms-rivera"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dmem: error: user 'ann' cannot change to profile 'default'")
    assert "block 'student' is not in it" in err
    assert main([*base, "init", "ann", "nope"]) == 2
    assert "unknown profile 'nope'; the known profiles are" in capsys.readouterr().err


def _system(request: dict[str, Any]) -> str:
    return json.dumps(request.get("system"))


def _last_user_text(request: dict[str, Any]) -> str:
    return "".join(said_texts([m for m in request["messages"] if m["role"] == "user"][-1]))


async def test_two_users_with_their_own_profiles_share_one_worker(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data", profile="default")
    script = [{"text": f"reply {n}"} for n in range(3)]
    async with running_rig(temporal_env.client, settings, script) as rig:
        coach, plain = await asyncio.gather(
            rig.client.send_message("ann", "I am Ann, a student", profile="essay_coach"),
            rig.client.send_message("ben", "I am Ben"),
        )
        assert {coach.reply, plain.reply} == {"reply 0", "reply 1"}
        with pytest.raises(TurnFailed, match="has profile 'essay_coach', not 'default'"):
            await rig.client.send_message("ann", "switch me", profile="default")
        await rig.client.send_message("ann", "Ann again")  # no profile named: hers
        prompts = {_last_user_text(r): _system(r) for r in rig.model_server.requests}
        assert len(prompts) == 3, prompts.keys()
        for message, system in prompts.items():
            ann = message.startswith(("I am Ann", "Ann again"))
            assert ("<student>" in system) is ann, message
            assert ("<notes>" in system) is not ann, message
            assert ("YouLab Essay Coach" in system) is ann
        assert (await rig.client.profile_of("ann")).name == "essay-coach"
        assert (await rig.client.profile_of("ben")).name == "default"


def test_a_profile_change_interrupted_before_its_commit_is_rolled_back(
    stack: MemoryStack,
) -> None:
    """A crash between writing `profile.toml` and committing leaves a journal naming it; the
    next transaction puts the record (file and index) back to HEAD's, so no later commit of a
    block carries an unfinished profile change along."""
    stack.blocks.ensure_user("ann", "default")
    repo = stack.git.repo_path("ann")
    head = stack.git.head("ann")
    (repo / ".git" / "dmem-journal").write_text(f"base={head}\nprofile.toml", encoding="utf-8")
    (repo / "profile.toml").write_text('name = "notes_plus"\n', encoding="utf-8")
    git_output(repo, "add", "profile.toml")
    sha = stack.edits.edit_block("ann", "notes", {"value": "after"}, TEACHER)
    assert git_output(repo, "show", f"{sha}:profile.toml") == 'name = "default"\n'
    assert git_output(repo, "status", "--porcelain") == ""
    assert not (repo / ".git" / "dmem-journal").exists()
    assert _labels(stack, "ann") == ["persona", "human", "notes"]
