"""Determinism: recorded histories of a turn (approval, rejection, expiry), of a rotation and
of a rotation sweep and of a redaction (up to its last step, which deletes it) replay against
today's workflow code, in the sandbox, with the pydantic converter. Each patch keeps a history
recorded before it (`*_unpatched.json`, `*_before_<patch>.json`) next to one recorded after."""

import base64
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from durable_memory.activities.offered_settings import offer_turn_settings
from durable_memory.config import Settings
from durable_memory.models.activity_settings import (
    ActivitiesSettings,
    ActivitySettings,
    RetrySettings,
)
from durable_memory.workers.worker import WORKFLOWS
from durable_memory.workflows.redact import WAIT_FOR_WRITERS
from durable_memory.workflows.rotation import (
    SWEEP_STARTS_ROTATIONS_IN_ACTIVITY,
    WORKER_ROTATION_SETTINGS,
)
from durable_memory.workflows.turn import (
    ANSWER_BEFORE_ROTATION_CHECK,
    GIT_REMOTE_WAIT,
    LOCAL_TURN_STEPS,
    ONE_ACTIVITY_START,
    OPERATOR_SEARCH_ATTRIBUTES,
    PROFILE_WITH_STATUS,
    ROTATION_CHECK_AFTER_STANDING_APPROVALS,
    SETTLED_PATCHES,
    STARTER_ATTRIBUTES,
    TOOLS_IN_MODEL_STEP,
    WORKER_TURN_SETTINGS,
)

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def _patches(path: Path) -> set[str]:
    """The patch ids a recorded history took (its core_patch markers)."""
    found = set()
    for event in json.loads(path.read_text(encoding="utf-8"))["events"]:
        marker = event.get("markerRecordedEventAttributes", {})
        if marker.get("markerName") == "core_patch":
            data = marker["details"]["patch-data"]["payloads"][0]["data"]
            found.add(json.loads(base64.b64decode(data))["id"])
    return found


def test_there_are_histories_to_replay() -> None:
    assert {h.name for h in HISTORIES} >= {
        "turn_approve_reject_expire.json",
        "turn_approve_reject_expire_before_starter_attributes.json",
        "turn_approve_reject_expire_before_profile_with_status.json",
        "turn_approve_reject_expire_before_settled_patches.json",
        "turn_approve_reject_expire_before_tools_in_model_step.json",
        "turn_approve_reject_expire_before_one_activity_start.json",
        "turn_approve_reject_expire_before_local_turn_steps.json",
        "turn_approve_reject_expire_before_git_remote_wait.json",
        "turn_approve_reject_expire_before_worker_settings.json",
        "turn_approve_reject_expire_unpatched.json",
        "rotation.json",
        "rotation_before_worker_settings.json",
        "sweep.json",
        "sweep_before_start_activity.json",
        "redaction.json",
        "redaction_before_waiting_for_writers.json",
        "turn_standing_approval.json",
        "turn_standing_approval_before_rotation_check.json",
        "turn_standing_approval_before_one_activity_start.json",
        "turn_standing_approval_before_tools_in_model_step.json",
        "turn_standing_approval_before_settled_patches.json",
        "turn_standing_approval_before_profile_with_status.json",
        "turn_standing_approval_before_starter_attributes.json",
    }
    here = HISTORIES[0].parent
    # A turn under one-activity-start no longer asks for the two patches it replaces.
    one_activity_start = {
        ANSWER_BEFORE_ROTATION_CHECK,
        OPERATOR_SEARCH_ATTRIBUTES,
        GIT_REMOTE_WAIT,
        ONE_ACTIVITY_START,
    }
    # Under turn-patches-settled a turn asks no other patch: one marker where there were five;
    # turn-profile-with-status took its place as that one patch, then turn-starter-attributes.
    assert _patches(here / "turn_approve_reject_expire.json") == {STARTER_ATTRIBUTES}
    assert _patches(here / "turn_approve_reject_expire_before_starter_attributes.json") == {
        PROFILE_WITH_STATUS
    }
    assert _patches(here / "turn_approve_reject_expire_before_profile_with_status.json") == {
        SETTLED_PATCHES
    }
    assert _patches(here / "turn_approve_reject_expire_before_settled_patches.json") == {
        *one_activity_start,
        TOOLS_IN_MODEL_STEP,
    }
    assert (
        _patches(here / "turn_approve_reject_expire_before_tools_in_model_step.json")
        == one_activity_start
    )
    assert _patches(here / "turn_approve_reject_expire_before_one_activity_start.json") == {
        ANSWER_BEFORE_ROTATION_CHECK,
        OPERATOR_SEARCH_ATTRIBUTES,
        WORKER_TURN_SETTINGS,
        GIT_REMOTE_WAIT,
        LOCAL_TURN_STEPS,
    }
    assert _patches(here / "turn_approve_reject_expire_before_local_turn_steps.json") == {
        ANSWER_BEFORE_ROTATION_CHECK,
        OPERATOR_SEARCH_ATTRIBUTES,
        WORKER_TURN_SETTINGS,
        GIT_REMOTE_WAIT,
    }
    assert _patches(here / "turn_approve_reject_expire_before_git_remote_wait.json") == {
        ANSWER_BEFORE_ROTATION_CHECK,
        OPERATOR_SEARCH_ATTRIBUTES,
        WORKER_TURN_SETTINGS,
    }
    assert _patches(here / "turn_approve_reject_expire_before_worker_settings.json") == {
        ANSWER_BEFORE_ROTATION_CHECK
    }
    assert _patches(here / "turn_approve_reject_expire_unpatched.json") == set()
    assert _patches(here / "rotation.json") == {WORKER_ROTATION_SETTINGS}
    assert _patches(here / "rotation_before_worker_settings.json") == set()
    assert _patches(here / "sweep.json") == {
        WORKER_ROTATION_SETTINGS,
        SWEEP_STARTS_ROTATIONS_IN_ACTIVITY,
    }
    assert _patches(here / "sweep_before_start_activity.json") == {WORKER_ROTATION_SETTINGS}
    assert _patches(here / "redaction.json") == {WAIT_FOR_WRITERS}
    assert _patches(here / "redaction_before_waiting_for_writers.json") == set()
    standing_before = {OPERATOR_SEARCH_ATTRIBUTES, WORKER_TURN_SETTINGS, LOCAL_TURN_STEPS}
    assert _patches(here / "turn_standing_approval_before_rotation_check.json") == standing_before
    assert _patches(here / "turn_standing_approval_before_one_activity_start.json") == {
        *standing_before,
        ROTATION_CHECK_AFTER_STANDING_APPROVALS,
    }
    standing = {OPERATOR_SEARCH_ATTRIBUTES, ROTATION_CHECK_AFTER_STANDING_APPROVALS}
    assert _patches(here / "turn_standing_approval_before_tools_in_model_step.json") == {
        *standing,
        ONE_ACTIVITY_START,
    }
    assert _patches(here / "turn_standing_approval_before_settled_patches.json") == {
        *standing,
        ONE_ACTIVITY_START,
        TOOLS_IN_MODEL_STEP,
    }
    assert _patches(here / "turn_standing_approval_before_profile_with_status.json") == {
        SETTLED_PATCHES
    }
    assert _patches(here / "turn_standing_approval_before_starter_attributes.json") == {
        PROFILE_WITH_STATUS
    }
    assert _patches(here / "turn_standing_approval.json") == {STARTER_ATTRIBUTES}


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text(encoding="utf-8"))
    replayer = Replayer(workflows=list(WORKFLOWS), data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history)
    assert result.replay_failure is None


async def test_a_turn_replays_whatever_first_activity_options_its_worker_offers() -> None:
    """The first activity's options come from the settings the replaying process offers for
    the task queue (`one-activity-start`): a worker configured otherwise, or none, must
    replay the same history (activity options are not part of what replay checks)."""
    path = Path(__file__).parent / "histories" / "turn_approve_reject_expire.json"
    events = json.loads(path.read_text(encoding="utf-8"))["events"]
    started = events[0]["workflowExecutionStartedEventAttributes"]
    scheduled = next(e for e in events if "activityTaskScheduledEventAttributes" in e)
    recorded = scheduled["activityTaskScheduledEventAttributes"]
    assert recorded["activityType"]["name"] == "dmem.start_turn"
    assert recorded["startToCloseTimeout"] != "7s"
    odd = ActivitySettings(start_to_close_s=7, retry=RetrySettings(maximum_attempts=2))
    offered = Settings().turn_settings()
    offered = offered.model_copy(update={"activities": ActivitiesSettings(model_call=odd)})
    offer_turn_settings(started["taskQueue"]["name"], offered)
    history = WorkflowHistory.from_json(path.stem, path.read_text(encoding="utf-8"))
    replayer = Replayer(workflows=list(WORKFLOWS), data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None
