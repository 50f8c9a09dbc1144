"""Activities of a rotation: plan, archive, commit. The ticket carries only the base sha and
the plan's time; each step re-derives the plan from them, and each step is idempotent
(see memory/rotation/steps.py)."""

import logging

from temporalio import activity

from durable_memory.activities.errors import classified_errors
from durable_memory.bootstrap import MemoryStack
from durable_memory.faults import AFTER_ARCHIVE, crash_point
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.rotation.planner import RotationPlan
from durable_memory.models.turn import (
    RotationCandidate,
    RotationCommit,
    RotationInput,
    RotationTicket,
)

log = logging.getLogger(__name__)


class RotationActivities:
    def __init__(self, stack: MemoryStack) -> None:
        self.stack = stack

    def _plan(self, ticket: RotationTicket) -> RotationPlan:
        plan = self.stack.rotator.plan(
            ticket.user_id,
            ticket.label,
            force=True,
            at_sha=ticket.base_sha,
            planned_at=ticket.planned_at,
        )
        if plan is None:
            raise DurableMemoryError(f"nothing to rotate in {ticket.label}@{ticket.base_sha}")
        return plan

    @activity.defn(name="dmem.plan_rotation")
    def plan_rotation(self, request: RotationInput) -> RotationTicket | None:
        with classified_errors(), self.stack.git.pinned():
            plan = self.stack.rotator.plan(request.user_id, request.label, force=request.force)
            if plan is None:
                return None
            return RotationTicket(
                user_id=plan.user_id,
                label=plan.label,
                base_sha=plan.base_sha,
                strategy=plan.strategy,
                chars_before=plan.chars_before,
                chars_after=plan.chars_after,
                planned_at=plan.planned_at,
            )

    @activity.defn(name="dmem.archive_rotation")
    def archive_rotation(self, ticket: RotationTicket) -> list[str]:
        with classified_errors(), self.stack.git.pinned():
            ids = self.stack.rotator.archive_step(self._plan(ticket))
            crash_point(AFTER_ARCHIVE)
            return ids

    @activity.defn(name="dmem.commit_rotation")
    def commit_rotation(self, commit: RotationCommit) -> str | None:
        with classified_errors(), self.stack.git.pinned():
            return self.stack.rotator.commit_step(self._plan(commit.ticket), commit.passage_ids)

    @activity.defn(name="dmem.rotation_candidates")
    def rotation_candidates(self) -> list[RotationCandidate]:
        """Every user's blocks over their threshold (the adaptive strategy learns from it).

        The users are the database's list, not this worker's disk. A listed user whose
        repository is not on this worker's disk (made on another host) is skipped and logged:
        without a shared git remote, only the worker that holds it can check it."""
        with classified_errors(), self.stack.git.pinned():
            found = []
            for user_id in self.stack.blocks.users():
                if not self.stack.git.exists(user_id):
                    log.warning("rotation sweep: no repository for %s on this worker", user_id)
                    continue
                for spec in self.stack.blocks.profile(user_id).blocks:
                    if self.stack.rotator.check(user_id, spec.label).should_rotate:
                        found.append(RotationCandidate(user_id=user_id, label=spec.label))
            return found
