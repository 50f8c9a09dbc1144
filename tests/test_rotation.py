"""Rotation: the strategies of the seed 000_d8598551964ab573.txt, the adaptive threshold, and nothing lost across a crash."""

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from durable_memory.activities.rotation import RotationActivities
from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.memory.archive.embedders import default_embedder
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.core.errors import UserBeingForgotten, UserForgotten
from durable_memory.memory.core.profiles import load_profile
from durable_memory.memory.rotation.planner import archive_header, utc_now
from durable_memory.memory.rotation.steps import Rotator
from durable_memory.memory.rotation.strategies import (
    AdaptiveRotation,
    AggressiveRotation,
    PreservativeRotation,
    line_score,
)
from durable_memory.memory.rotation.task_sink import ArchiveTaskSink
from durable_memory.memory.service import MemoryFaces
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.memory.store.erasure import ErasureLedger
from durable_memory.memory.store.git import CLOCK_SKEW, GitBlockStore
from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.rotation_state import RotationStateStore
from durable_memory.models.archive import ArchiveSearch, PassageSource
from durable_memory.models.blocks import RotationStrategyName
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.turn import RotationCommit, RotationInput
from tests.support.memory import MemoryRig, memory_rig

BACKEND = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
ALICE = Author(name="alice", kind=AuthorKind.USER)

SEED_HUMAN = (
    "[USER] Alice | High school senior\n"
    "[TASK] Brainstorm essay topics\n"
    "[STATE] active_task\n"
    "[PREFS] Prefers Socratic questions\n"
    "[CONTEXT] Discussed identity; Explored challenges\n"
    "Free note without a tag"
)


# -- the strategies on the examples of the seed 000_d8598551964ab573.txt ---------------------------


def test_aggressive_keeps_the_most_recent_content() -> None:
    strategy = AggressiveRotation()
    assert strategy.threshold == 0.7
    out = strategy.compress(SEED_HUMAN, 60)
    assert out == "..." + SEED_HUMAN[-57:]
    assert len(out) == 60
    assert strategy.compress("short", 60) == "short"


def test_preservative_keeps_tagged_lines_first() -> None:
    strategy = PreservativeRotation()
    assert strategy.threshold == 0.9
    out = strategy.compress("plain one\n[TASK] Essay\nplain two\n[USER] Alice", 30)
    assert out == "[TASK] Essay\n[USER] Alice"
    assert strategy.compress(SEED_HUMAN, 1000).split("\n")[-1] == "Free note without a tag"


def test_adaptive_scores_lines_like_the_seed() -> None:
    assert [line_score(line) for line in SEED_HUMAN.split("\n")] == [90, 100, 50, 50, 80, 10]
    strategy = AdaptiveRotation()
    assert strategy.threshold == 0.8
    out = strategy.compress(SEED_HUMAN, 115)
    # TASK (100), USER (90) and CONTEXT (80) fit; they keep their order in the block.
    assert out == (
        "[USER] Alice | High school senior\n[TASK] Brainstorm essay topics\n"
        "[CONTEXT] Discussed identity; Explored challenges"
    )
    assert len(out) <= 115
    assert strategy.compress(SEED_HUMAN, 90).endswith("[STATE] active_task")  # next best that fits


def test_adaptive_threshold_moves_both_ways_within_bounds() -> None:
    strategy = AdaptiveRotation()
    for _ in range(3):
        strategy.observe(0.3)  # the block stays small: rotating too often
    assert strategy.threshold == 0.85
    for _ in range(5):
        strategy.observe(0.3)
    assert strategy.threshold == 0.95  # capped
    falling = AdaptiveRotation()
    for _ in range(12):
        falling.observe(0.97)  # the block sits near full: rarely rotating
    assert falling.threshold == 0.6  # floored
    steady = AdaptiveRotation()
    for _ in range(10):
        steady.observe(0.7)
    assert steady.threshold == 0.8
    assert len(steady.history) == 10


# -- rotating real blocks ------------------------------------------------------------------


@pytest.fixture
def rig(tmp_path: Path) -> tuple[MemoryRig, Rotator, SqliteArchive]:
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    archive = SqliteArchive(tmp_path / "archive.db", default_embedder())
    memory = memory_rig(engine, tmp_path / "data", "default", ArchiveTaskSink(archive))
    memory.blocks.ensure_user("alice")
    rotator = Rotator(memory.blocks, memory.git, archive, RotationStateStore(engine))
    return memory, rotator, archive


def _fill_notes(memory: MemoryFaces) -> str:
    text = "\n".join(
        f"Session {i}: talked about robots and essay idea number {i}." for i in range(28)
    )
    memory.edits.edit_block("alice", "notes", {"value": text}, ALICE)
    return text


def test_text_block_rotation_archives_then_commits(
    rig: tuple[MemoryRig, Rotator, SqliteArchive],
) -> None:
    memory, rotator, archive = rig
    full = _fill_notes(memory)
    base = memory.git.head("alice")
    assert base is not None
    check = rotator.check("alice", "notes")
    assert check.should_rotate
    assert check.strategy is RotationStrategyName.AGGRESSIVE
    result = rotator.rotate("alice", "notes")
    assert result is not None
    assert result.commit_sha is not None
    compressed = memory.blocks.read_block("alice", "notes").value
    assert len(compressed) <= 1000  # half of the 2000 limit
    assert compressed.startswith("...")
    assert full.endswith(compressed[3:])
    (passage,) = archive.page("alice")
    assert re.fullmatch(r"\[ARCHIVED \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\]", passage.text.split("\n")[0])
    assert passage.text.split("\n", 1)[1] == full
    assert (passage.source, passage.label, passage.commit_sha) == (
        PassageSource.ROTATION,
        "notes",
        base,
    )
    commit = memory.history.history("alice", "notes", 1)[0]
    assert commit.author == "rotation"
    assert commit.trailers["Rotation-Of"] == f"notes@{base}"
    assert commit.trailers["Archived-Passages"] == passage.id
    assert memory.history.read_at("alice", "notes", base)["value"] == full  # and in git history
    assert rotator.rotate("alice", "notes") is None  # now under its threshold


def test_crash_between_archive_and_commit_loses_and_duplicates_nothing(
    rig: tuple[MemoryRig, Rotator, SqliteArchive],
) -> None:
    memory, rotator, archive = rig
    full = _fill_notes(memory)
    plan = rotator.plan("alice", "notes")
    assert plan is not None
    rotator.archive_step(plan)  # ... and the worker dies here, before commit_step
    assert archive.count("alice") == 1
    assert memory.blocks.read_block("alice", "notes").value == full  # memory untouched so far

    result = rotator.rotate("alice", "notes")  # run again from the start
    assert result is not None
    assert result.commit_sha is not None
    assert archive.count("alice") == 1  # exactly one archived copy
    rotations = [c for c in memory.history.history("alice", "notes", 50) if c.author == "rotation"]
    assert len(rotations) == 1  # exactly one rotation commit
    hits = archive.search("alice", ArchiveSearch(query="essay idea number 3", alpha=0.0))
    assert hits[0].passage.text.endswith(full)  # the full text is searchable
    # A retry of the commit step with the old plan returns the same commit.
    assert rotator.commit_step(plan, result.passage_ids) == result.commit_sha


def test_block_changed_after_plan_is_not_overwritten(
    rig: tuple[MemoryRig, Rotator, SqliteArchive],
) -> None:
    memory, rotator, _ = rig
    _fill_notes(memory)
    plan = rotator.plan("alice", "notes")
    assert plan is not None
    ids = rotator.archive_step(plan)
    memory.edits.edit_block("alice", "notes", {"value": "Rewritten by Alice"}, ALICE)
    assert rotator.commit_step(plan, ids) is None
    assert memory.blocks.read_block("alice", "notes").value == "Rewritten by Alice"


def test_typed_human_block_rotation_keeps_required_and_best_lines(
    rig: tuple[MemoryRig, Rotator, SqliteArchive],
) -> None:
    memory, rotator, archive = rig
    memory.edits.set_task("alice", "Outline the robotics essay", BACKEND)
    long = "x" * 120
    for i in range(4):
        memory.edits.learn_preference("alice", f"preference {i} {long}", BACKEND)
    for i in range(3):
        memory.edits.learn_fact("alice", f"fact {i} {long}", BACKEND)
    for i in range(3):
        memory.edits.add_context("alice", f"context {i} {long}", BACKEND)
    before = memory.blocks.read_block("alice", "human")
    assert len(before.value) / 1500 >= 0.8
    result = rotator.rotate("alice", "human")
    assert result is not None
    assert result.commit_sha is not None
    after = memory.blocks.read_block("alice", "human")
    assert len(after.value) <= 750
    assert after.fields["session_state"] == "active_task"  # required: always kept
    assert after.fields["current_task"] == "Outline the robotics essay"  # [TASK] scores 100
    assert after.fields["preferences"] == []
    assert after.fields["facts"] == []
    assert archive.page("alice")[0].text.endswith(before.value)


def test_adaptive_state_persists_per_user_and_block(
    rig: tuple[MemoryRig, Rotator, SqliteArchive],
) -> None:
    _, rotator, _ = rig
    for _ in range(3):
        rotator.check("alice", "human")  # an almost empty block: usage ~0.01
    assert rotator.strategy("alice", rotator.blocks.spec("alice", "human")).threshold == 0.85


def test_lowered_limit_keeps_block_readable_and_rotation_fits_it(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    git = GitBlockStore(tmp_path / "data")
    profile = load_profile("default")
    memory = MemoryRig.open(profile, git, DiffStore(engine), RecallStore(engine))
    memory.blocks.ensure_user("alice")
    _fill_notes(memory)
    notes = profile.block("notes")
    assert notes is not None
    smaller = profile.model_copy(
        update={
            "blocks": tuple(
                b.model_copy(update={"limit": 800}) if b.label == "notes" else b
                for b in profile.blocks
            )
        }
    )
    shrunk = MemoryRig.open(smaller, git, DiffStore(engine), RecallStore(engine))
    assert len(shrunk.blocks.read_block("alice", "notes").value) > 800  # still readable
    archive = SqliteArchive(tmp_path / "a.db", default_embedder())
    rotator = Rotator(shrunk.blocks, git, archive, RotationStateStore(engine))
    result = rotator.rotate("alice", "notes")
    assert result is not None
    assert result.commit_sha is not None
    assert len(shrunk.blocks.read_block("alice", "notes").value) <= 400


def test_clear_task_with_archive_files_the_task(
    rig: tuple[MemoryRig, Rotator, SqliteArchive],
) -> None:
    memory, _, archive = rig
    memory.edits.set_task(
        "alice", "Brainstorm essay topics", BACKEND, context="Discussed identity themes"
    )
    memory.edits.add_context("alice", "Explored personal challenges", BACKEND)
    memory.edits.clear_task("alice", BACKEND, archive=True)
    (passage,) = archive.page("alice")
    assert re.fullmatch(
        r"\[TASK COMPLETED \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\]\nTask: Brainstorm essay topics\n"
        r"Context:\n- Discussed identity themes\n- Explored personal challenges",
        passage.text,
    )
    assert passage.source is PassageSource.TASK
    block = memory.blocks.read_block("alice", "human")
    assert (block.fields["current_task"], block.fields["session_state"]) == (None, "idle")


def test_metrics(rig: tuple[MemoryRig, Rotator, SqliteArchive]) -> None:
    memory, rotator, _ = rig
    metrics = rotator.metrics("alice")
    assert metrics.human_usage == pytest.approx(len("[STATE] idle") / 1500)
    assert metrics.persona_usage == pytest.approx(
        len(memory.blocks.read_block("alice", "persona").value) / 1500
    )
    assert 0 < metrics.total_usage < 1


def test_nothing_to_compress_is_no_rotation(
    rig: tuple[MemoryRig, Rotator, SqliteArchive],
) -> None:
    memory, rotator, archive = rig
    head = memory.git.head("alice")
    assert rotator.rotate("alice", "human", force=True) is None  # "[STATE] idle" fits already
    assert archive.count("alice") == 0
    assert memory.git.head("alice") == head


# -- the activities: every step re-derives the plan from the ticket ------------------------


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[MemoryStack]:
    stack = open_stack(tmp_path / "data", profile="default")
    stack.blocks.ensure_user("alice")
    yield stack
    stack.close()


def test_a_commit_rotation_retried_after_the_clock_moved_returns_its_commit(
    stack: MemoryStack,
) -> None:
    """Regression: the ticket did not carry the plan's time, so a step re-derived it from its
    own clock. A commit_rotation retried more than CLOCK_SKEW after the plan (its first
    attempt committed, then the worker died) bounded its trailer walk by the retry's clock,
    missed that commit, found the block changed since the plan and reported nothing rotated."""
    _fill_notes(stack)
    env = ActivityEnvironment()
    activities = RotationActivities(stack)
    ticket = env.run(activities.plan_rotation, RotationInput(user_id="alice", label="notes"))
    assert ticket is not None
    assert ticket.planned_at is not None
    ids = env.run(activities.archive_rotation, ticket)
    commit = RotationCommit(ticket=ticket, passage_ids=ids)
    sha = env.run(activities.commit_rotation, commit)  # ... and the worker dies before reporting
    assert sha is not None

    later = utc_now() + 2 * CLOCK_SKEW  # the retry runs on a worker whose clock reads later
    moved = Rotator(
        stack.blocks, stack.git, stack.archive, stack.rotator.states, clock=lambda: later
    )
    retrying = RotationActivities(replace(stack, rotator=moved))
    assert env.run(retrying.archive_rotation, ticket) == ids
    assert env.run(retrying.commit_rotation, commit) == sha
    rotations = [c for c in stack.history.history("alice", "notes", 50) if c.author == "rotation"]
    assert [c.sha for c in rotations] == [sha]  # exactly one rotation commit
    assert rotations[0].trailers == {
        "Rotation-Of": f"notes@{ticket.base_sha}",
        "Strategy": ticket.strategy.value,
        "Archived-Passages": ",".join(ids),
    }
    (passage,) = stack.archive.page("alice")  # exactly one archived copy
    assert passage.text.startswith(f"{archive_header(ticket.planned_at)}\n")


@pytest.mark.parametrize("afresh", [False, True], ids=["forgotten", "started-afresh"])
def test_a_rotation_archives_nothing_for_a_user_whose_forget_began_as_it_embedded(
    rig: tuple[MemoryRig, Rotator, SqliteArchive], afresh: bool
) -> None:
    """A rotation planned before alice's forget embeds her block's full text (seconds for a
    long block) while the forget empties her archive (and, in the second case, completes and
    a new turn starts her afresh): the insert checks the erasure ledger between its
    embedding and its write, against what the check before the text was read saw, so the
    old text is archived neither after the forget emptied her archive nor into her new
    memory (the forget terminates the rotation, but not an activity already running)."""
    memory, rotator, archive = rig
    _fill_notes(memory)
    seen = memory.blocks.refuse_if_forgotten("alice")  # as `dmem.archive_rotation` does
    plan = rotator.plan("alice", "notes")
    assert plan is not None
    engine = rotator.states.engine  # the one database of the rig: the ledger too
    embed = archive.embedder.embed_passages

    def embedding_during_the_forget(texts: list[str]) -> Any:
        ledger = ErasureLedger(engine)
        ledger.begin("alice", "dpo@school", "asked")
        archive.forget_user("alice")
        if afresh:
            ledger.complete("alice")
            ledger.readmit("alice")
        return embed(texts)

    archive.embedder = type(
        "EmbeddingDuringTheForget",
        (),
        {
            "name": archive.embedder.name,
            "dim": archive.embedder.dim,
            "embed_passages": staticmethod(embedding_during_the_forget),
            "embed_query": staticmethod(archive.embedder.embed_query),
        },
    )()
    with pytest.raises(UserForgotten if afresh else UserBeingForgotten):
        rotator.archive_step(plan, since=seen)
    assert archive.count("alice") == 0
