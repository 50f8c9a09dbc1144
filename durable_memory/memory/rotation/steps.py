"""The two steps of a rotation, each idempotent, in this order so nothing is ever lost:
1. archive the full pre-rotation text (`[ARCHIVED <time>]` + the block's value); the passage
   id derives from the block's content at its commit, so a repeat stores nothing new;
2. commit the compressed block, with a `Rotation-Of: <label>@<base sha>` trailer; a repeat
   finds that commit and returns it; a block changed since the plan is left alone.
The pre-rotation text is also in git history (the base commit) before step 2 runs.
"""

from collections.abc import Callable, Sequence
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from durable_memory.memory.archive.protocol import ArchiveStore
from durable_memory.memory.core.formats import from_toml, to_toml
from durable_memory.memory.rotation.planner import (
    DEFAULT_TARGET_RATIO,
    RotationPlan,
    RotationPlanner,
    utc_now,
)
from durable_memory.memory.service.blocks import Blocks
from durable_memory.memory.store.block_repository import BlockRepository, compare_and_set
from durable_memory.memory.store.git import format_message
from durable_memory.memory.store.rotation_state import RotationStateStore
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.history import Author, AuthorKind

ROTATION_AUTHOR = Author(name="rotation", kind=AuthorKind.ROTATION)


class RotationResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    plan: RotationPlan
    passage_ids: list[str]
    commit_sha: str | None
    """None when the block changed after the plan: nothing was committed (the archive keeps
    the text, and a later check rotates the new version if it is still over threshold)."""


class Rotator(RotationPlanner):
    """Plans rotations (the planner) and carries them out, step by step or at once."""

    def __init__(
        self,
        blocks: Blocks,
        git: BlockRepository,
        archive: ArchiveStore,
        states: RotationStateStore,
        target_ratio: float = DEFAULT_TARGET_RATIO,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        super().__init__(blocks, states, target_ratio, clock)
        self.git = git
        self.archive = archive

    def archive_step(self, plan: RotationPlan, since: int | None = None) -> list[str]:
        """Step 1: the full text into archival memory. Idempotent. Checked between its
        embedding (seconds for a long block) and its write: nothing is archived for a user
        whose forget began meanwhile (UserBeingForgotten, UserForgotten), nor, given `since`
        (what the erasure check before the plan's text was read returned), for one who was
        forgotten since and started afresh: the text is of the memory that forget erased."""
        return self.archive.insert(
            NewPassage(
                user_id=plan.user_id,
                text=plan.archive_text,
                tags=("rotation", plan.label),
                source=PassageSource.ROTATION,
                label=plan.label,
                commit_sha=plan.base_sha,
                created_at=plan.planned_at,
                dedupe_key=plan.dedupe_key,
            ),
            chunk=True,
            before_write=lambda: self.blocks.refuse_if_forgotten(plan.user_id, since),
        )

    @compare_and_set
    def commit_step(self, plan: RotationPlan, passage_ids: Sequence[str]) -> str | None:
        """Step 2: commit the compressed block. Idempotent; None if the block moved on."""
        spec = self.blocks.spec(plan.user_id, plan.label)
        marker = f"{plan.label}@{plan.base_sha}"
        with self.git.transaction(plan.user_id) as tx:
            done = tx.find_trailer("Rotation-Of", marker, since=plan.planned_at)
            if done is not None:
                return done
            if tx.read(plan.label) != tx.read(plan.label, plan.base_sha):
                return None
            fields = from_toml(spec, plan.compressed_toml, f"rotation plan for {marker}")
            message = format_message(
                f"Rotate {plan.label}: {plan.strategy.value} compression "
                f"{plan.chars_before} -> {plan.chars_after} chars",
                f"Usage {plan.usage:.0%} reached the threshold {plan.threshold:.0%}; the full "
                "text is in archival memory and in this commit's parent.",
                {
                    "Rotation-Of": marker,
                    "Strategy": plan.strategy.value,
                    "Archived-Passages": ",".join(passage_ids),
                },
            )
            return tx.commit({plan.label: to_toml(spec, fields)}, message, ROTATION_AUTHOR)

    def rotate(self, user_id: str, label: str, *, force: bool = False) -> RotationResult | None:
        """Plan, archive, commit. Safe to run again after a crash at any point."""
        seen = self.blocks.refuse_if_forgotten(user_id)
        plan = self.plan(user_id, label, force=force)
        if plan is None:
            return None
        ids = self.archive_step(plan, since=seen)
        return RotationResult(plan=plan, passage_ids=ids, commit_sha=self.commit_step(plan, ids))
