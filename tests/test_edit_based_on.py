"""A person's whole-block edit never undoes a change they did not see: an edit made on the
version of a block they were shown is refused with BlockChanged (nothing committed) when the
block changed since (an approval or another edit landed while they edited), and accepted when
only other blocks changed. Before, `dmem edit` and `MemoryClient.edit_block` wrote the whole
block from what the person opened and silently dropped an approval committed meanwhile."""

import pytest

from durable_memory.memory.core.errors import BlockChanged, UnknownCommit
from durable_memory.models.diffs import Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import SetField
from tests.support.memory import MemoryRig

ALICE = Author(name="alice", kind=AuthorKind.USER)
RIVERA = Author(name="ms-rivera", kind=AuthorKind.USER)


@pytest.fixture
def alice(memory: MemoryRig) -> MemoryRig:
    memory.blocks.ensure_user("alice")
    return memory


def test_an_edit_on_a_version_overtaken_by_an_approval_is_refused(alice: MemoryRig) -> None:
    markdown, based_on = alice.blocks.for_editing("alice", "student")
    proposed = alice.review.propose(
        "alice", "student", SetField(field="name", value="Ally"), "her name", Proposer.turn("t1")
    )
    approved = alice.review.approve(proposed.id, "ms-rivera")  # lands while alice edits
    head = alice.git.head("alice")
    edited = markdown.replace("## Name\n", "## Name\nAlice\n")
    with pytest.raises(BlockChanged, match=r"changed since .* nothing was committed"):
        alice.edits.edit_markdown("alice", "student", edited, ALICE, based_on)
    assert alice.git.head("alice") == head == approved.commit_sha
    assert alice.blocks.read_block("alice", "student").fields["name"] == "Ally"
    # Opened again, on the current text, the same edit goes through.
    markdown, based_on = alice.blocks.for_editing("alice", "student")
    edited = markdown.replace("## Name\nAlly\n", "## Name\nAlice\n")
    alice.edits.edit_markdown("alice", "student", edited, ALICE, based_on)
    assert alice.blocks.read_block("alice", "student").fields["name"] == "Alice"


def test_a_change_to_another_block_does_not_refuse_the_edit(alice: MemoryRig) -> None:
    markdown, based_on = alice.blocks.for_editing("alice", "student")
    alice.edits.edit_block("alice", "journey", {"stage": "drafting"}, RIVERA)
    edited = markdown.replace("## Name\n", "## Name\nAlice\n")
    alice.edits.edit_markdown("alice", "student", edited, ALICE, based_on)
    assert alice.blocks.read_block("alice", "student").fields["name"] == "Alice"
    assert alice.blocks.read_block("alice", "journey").fields["stage"] == "drafting"


@pytest.mark.parametrize("based_on", ["0" * 40, "deadbeef", "not-a-sha", "HEAD~99", "a" * 400])
def test_a_based_on_that_names_no_commit_is_refused(alice: MemoryRig, based_on: str) -> None:
    head = alice.git.head("alice")
    with pytest.raises(UnknownCommit, match="no commit"):
        alice.edits.edit_block("alice", "student", {"name": "Alice"}, ALICE, based_on)
    assert alice.git.head("alice") == head
