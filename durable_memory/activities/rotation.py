"""Activities of a rotation: plan, archive, commit. The ticket carries only the base sha and
the plan's time; each step re-derives the plan from them, and each step is idempotent
(see memory/rotation/steps.py). And the sweep's: list the blocks over their threshold, start
their rotations."""

import logging

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import WorkflowAlreadyStartedError

from durable_memory.activities.errors import classified_errors
from durable_memory.bootstrap import MemoryStack
from durable_memory.faults import AFTER_ARCHIVE, crash_point
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    UserBeingForgotten,
    UserForgotten,
)
from durable_memory.memory.rotation.planner import RotationPlan
from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.models.turn import (
    RotationCandidate,
    RotationCommit,
    RotationInput,
    RotationTicket,
    rotation_workflow_id,
)

log = logging.getLogger(__name__)

ROTATION_WORKFLOW = "RotationWorkflow"
"""workflows/rotation.py's RotationWorkflow, named: that module imports this one."""


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
        with classified_errors(), self.stack.pinned():
            # Plans nothing while a redaction of the user is under way (retried): it waits.
            RedactionGate(self.stack.engine).refuse_if_open(request.user_id)
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
        with classified_errors(), self.stack.pinned():
            # Before the plan's text is read: a forget and a fresh start of the user while it
            # embeds archives nothing of the memory that forget erased (Rotator.archive_step).
            seen = self.stack.blocks.refuse_if_forgotten(ticket.user_id)
            ids = self.stack.rotator.archive_step(self._plan(ticket), since=seen)
            crash_point(AFTER_ARCHIVE)
            return ids

    @activity.defn(name="dmem.commit_rotation")
    def commit_rotation(self, commit: RotationCommit) -> str | None:
        with classified_errors(), self.stack.pinned():
            return self.stack.rotator.commit_step(self._plan(commit.ticket), commit.passage_ids)

    @activity.defn(name="dmem.rotation_candidates")
    def rotation_candidates(self) -> list[RotationCandidate]:
        """Every user's blocks over their threshold (the adaptive strategy learns from it).

        The users are the database's list, not this worker's disk, without those being
        forgotten or forgotten (UserDirectory.users). A listed user whose
        repository is not on this worker's disk (made on another host) is skipped and logged:
        without a shared git remote, only the worker that holds it can check it."""
        with classified_errors(), self.stack.pinned():
            found = []
            for user_id in self.stack.blocks.users():
                if not self.stack.git.exists(user_id):
                    log.warning("rotation sweep: no repository for %s on this worker", user_id)
                    continue
                for spec in self.stack.blocks.profile(user_id).blocks:
                    if self.stack.rotator.check(user_id, spec.label).should_rotate:
                        found.append(RotationCandidate(user_id=user_id, label=spec.label))
            return found


class SweepActivities:
    """The sweep's start of the rotations it found, with the deployment's Temporal client."""

    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn(name="dmem.start_rotations")
    async def start_rotations(self, candidates: list[RotationCandidate]) -> int:
        """Start each block's rotation on this worker's task queue; how many were started.

        A block whose rotation is running is left to it. A user forgotten, or whose forget
        began, since the listing is skipped and logged: with payload encryption their start
        is refused as its input is encrypted (no key is made for them again), and the other
        users' rotations must not wait for their forget."""
        task_queue = activity.info().task_queue
        with classified_errors():
            started = 0
            for candidate in candidates:
                try:
                    await self.client.start_workflow(
                        ROTATION_WORKFLOW,
                        RotationInput(user_id=candidate.user_id, label=candidate.label),
                        id=rotation_workflow_id(candidate.user_id, candidate.label),
                        task_queue=task_queue,
                        static_summary=f"Rotate {candidate.label} of {candidate.user_id}",
                    )
                except WorkflowAlreadyStartedError:
                    continue
                except (UserBeingForgotten, UserForgotten) as refused:
                    log.warning("rotation sweep: skipped %s: %s", candidate.user_id, refused)
                    continue
                started += 1
            return started
