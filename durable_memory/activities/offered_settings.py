"""The turn settings each worker in this process offers for its task queue: the options of a
turn's first activity, which the turn needs before it has recorded the deployment's
settings (that activity returns them). Worker state, kept beside the activities that the
worker builds with the same settings and outside the workflow modules on purpose: those hold
no mutable state (tests/test_workflow_sandbox.py), and this is read by a workflow only for
activity options, which replay does not check (docs/temporal.md, "The first step")."""

from temporalio import workflow

from durable_memory.models.turn import WorkerTurnSettings

_OFFERED: dict[str, WorkerTurnSettings] = {}
"""Task queue -> the turn settings of the worker polling it in this process."""


def offer_turn_settings(task_queue: str, settings: WorkerTurnSettings) -> None:
    """A worker's turn settings, for the options of the turns' first activity (`build_worker`
    offers them for its task queue)."""
    _OFFERED[task_queue] = settings


def offered_turn_settings() -> WorkerTurnSettings | None:
    """The settings offered for the running workflow's task queue in this process, if any.

    Only for activity options: a turn's first activity (`dmem.start_turn`) needs a timeout
    and retry policy before the turn has recorded the deployment's settings. An activity's
    options are not part of what replay checks (Temporal lets timeouts and retry policies
    change under running workflows), so a replay in a process with other settings, or none,
    issues the same commands. Everything that steers the turn (step limit, approval TTL,
    later steps' options) comes from the recorded result."""
    return _OFFERED.get(workflow.info().task_queue)
