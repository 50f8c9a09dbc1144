"""Rotation of one block (archive, then commit), and the scheduled sweep that starts them.

One rotation per block at a time: the workflow id is `rotation-<user>-<label>`, and starting
one while another runs is refused by Temporal (WorkflowAlreadyStarted), not by a lock.

The activities' timeouts and retries are the worker's configuration (patch
`worker-rotation-settings`), as a turn's are; a rotation or sweep started before it runs on
with the options its input carried.

The sweep lists the blocks over their threshold of every user open to memory (not those
being forgotten or forgotten), then starts their rotations from an activity (patch
`sweep-starts-rotations-in-activity`), which skips a user whose start is refused.
"""

from temporalio import workflow
from temporalio.exceptions import WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from durable_memory.activities.rotation import RotationActivities, SweepActivities
    from durable_memory.models.activity_settings import ActivitiesSettings
    from durable_memory.models.turn import (
        RotationCandidate,
        RotationCommit,
        RotationInput,
        RotationOutcome,
        SweepInput,
        rotation_workflow_id,
    )
    from durable_memory.workflows.common import activity_options, worker_settings

WORKER_ROTATION_SETTINGS = "worker-rotation-settings"
"""Patch: a rotation's and a sweep's activity options are the worker's configuration, read by
the local activity `dmem.turn_settings`, not what the starter put in the input."""
SWEEP_STARTS_ROTATIONS_IN_ACTIVITY = "sweep-starts-rotations-in-activity"
"""Patch: the sweep starts its rotations from an activity (`dmem.start_rotations`), not as
child workflows. With payload encryption, starting a user's rotation encrypts its input with
the user's key, which is refused for a user being forgotten or forgotten; refused in the
workflow, that fails the sweep's workflow task again on every retry, stalling the sweep for
every user. The activity skips that user and starts the others."""


async def _activities(carried: ActivitiesSettings | None) -> ActivitiesSettings:
    """The activity options this rotation or sweep runs with (see the patch)."""
    if workflow.patched(WORKER_ROTATION_SETTINGS):
        return (await worker_settings("the deployment's activity settings")).activities
    return carried or ActivitiesSettings()


@workflow.defn
class RotationWorkflow:
    @workflow.run
    async def run(self, request: RotationInput) -> RotationOutcome:
        activities = await _activities(request.activities)
        memory = activity_options(activities.memory)
        archive = activity_options(activities.archive)
        commit = activity_options(activities.commit)
        ticket = await workflow.execute_activity_method(
            RotationActivities.plan_rotation, request, summary="plan the rotation", **memory
        )
        if ticket is None:
            workflow.set_current_details("Nothing to rotate: the block is under its threshold.")
            return RotationOutcome(user_id=request.user_id, label=request.label, rotated=False)
        workflow.set_current_details(
            f"Rotating **{ticket.label}** ({ticket.strategy.value}): "
            f"{ticket.chars_before} -> {ticket.chars_after} chars from `{ticket.base_sha[:12]}`"
        )
        passage_ids = await workflow.execute_activity_method(
            RotationActivities.archive_rotation,
            ticket,
            summary="archive the full text",
            **archive,
        )
        sha = await workflow.execute_activity_method(
            RotationActivities.commit_rotation,
            RotationCommit(ticket=ticket, passage_ids=passage_ids),
            summary="commit the compressed block",
            **commit,
        )
        return RotationOutcome(
            user_id=request.user_id,
            label=request.label,
            rotated=sha is not None,
            passage_ids=passage_ids,
            commit_sha=sha,
        )


async def start_rotation(request: RotationInput) -> bool:
    """Start the block's rotation as an abandoned child; False if one is already running."""
    try:
        await workflow.start_child_workflow(
            RotationWorkflow.run,
            request,
            id=rotation_workflow_id(request.user_id, request.label),
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            static_summary=f"Rotate {request.label} of {request.user_id}",
        )
    except WorkflowAlreadyStartedError:
        return False
    return True


@workflow.defn
class RotationSweepWorkflow:
    """Run by the Temporal Schedule: find every block over its threshold, rotate each."""

    @workflow.run
    async def run(self, sweep: SweepInput) -> int:
        activities = await _activities(sweep.activities)
        candidates = await workflow.execute_activity_method(
            RotationActivities.rotation_candidates,
            summary="find blocks over their rotation threshold",
            **activity_options(activities.archive),
        )
        if workflow.patched(SWEEP_STARTS_ROTATIONS_IN_ACTIVITY):
            started = 0
            if candidates:
                started = await workflow.execute_activity_method(
                    SweepActivities.start_rotations,
                    candidates,
                    summary="start the rotations",
                    **activity_options(activities.archive),
                )
        else:
            started = await _start_children(candidates, sweep)
        workflow.set_current_details(
            f"{len(candidates)} block(s) over threshold, {started} rotation(s) started"
        )
        return started


async def _start_children(candidates: list[RotationCandidate], sweep: SweepInput) -> int:
    """How a sweep started before the patch starts its rotations: as children, from the
    workflow (a start its codec refuses fails the sweep's workflow task, see the patch)."""
    started = 0
    for candidate in candidates:
        # The rotation reads its own worker's settings; an old sweep passes what it had.
        request = RotationInput(
            user_id=candidate.user_id, label=candidate.label, activities=sweep.activities
        )
        started += await start_rotation(request)
    return started
