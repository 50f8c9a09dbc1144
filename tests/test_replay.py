"""Determinism: recorded histories of a turn (approval, rejection, expiry) and of a rotation
replay against today's workflow code, in the sandbox, with the pydantic converter."""

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from durable_memory.workers.worker import WORKFLOWS

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_there_are_histories_to_replay() -> None:
    assert {h.name for h in HISTORIES} >= {"turn_approve_reject_expire.json", "rotation.json"}


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text(encoding="utf-8"))
    replayer = Replayer(workflows=list(WORKFLOWS), data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history)
    assert result.replay_failure is None
