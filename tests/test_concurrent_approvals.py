"""Twenty concurrent approvals for one user: every commit present, history linear, and no
lock error reaches anyone (the decide activities contend for the user's git lock). Nor does
any decision fail on its way and succeed on a retry: every activity of the twenty turns ran
once (a worker's sixteen activity threads each hold a database connection and take a second
for a transaction; a pool too small for that had each wave of them wait 30 s and fail)."""

import asyncio
import subprocess
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment

from durable_memory.models.diffs import DiffStatus
from durable_memory.models.turn import turn_workflow_id
from tests.support.temporal_helpers import activity_attempts, rig_settings, running_rig

COUNT = 20
ACTIVITY_FAILURES = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
}


def _profile(path: Path) -> Path:
    blocks = "".join(
        f'\n[[blocks]]\nlabel = "b{i:02d}"\ndescription = "block {i}"\nlimit = 500\n'
        for i in range(COUNT)
    )
    path.write_text(
        'name = "many-blocks"\n[persona]\nname = "T"\nrole = "tester"\n'
        'instructions = "Test."\n' + blocks,
        encoding="utf-8",
    )
    return path


def _script() -> list[dict[str, Any]]:
    script: list[dict[str, Any]] = []
    for i in range(COUNT):
        script.append(
            {
                "content": [
                    {
                        "type": "tool_use",
                        "name": "core_memory_append",
                        "input": {"label": f"b{i:02d}", "content": f"fact number {i}"},
                    }
                ]
            }
        )
        script.append({"text": f"noted {i}"})
    return script


async def test_twenty_concurrent_approvals(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    profile = _profile(tmp_path / "many.toml")
    settings = rig_settings(tmp_path / "data", profile=str(profile))
    async with running_rig(temporal_env.client, settings, _script()) as rig:
        diffs = []
        for i in range(COUNT):  # one after another, so each turn gets its own script entries
            reply = await rig.client.send_message("zoe", f"tell you fact {i}", turn_id=f"z{i}")
            diffs.append(reply.diffs[0].id)
        outcomes = await asyncio.gather(
            *(rig.client.approve(d, f"reviewer-{n}") for n, d in enumerate(diffs))
        )
        assert [o.status if o else None for o in outcomes] == [DiffStatus.APPROVED] * COUNT
        log = rig.stack.git.history("zoe", None, 100)
        assert {c.trailers.get("Diff-Id") for c in log} >= set(diffs)  # all present
        assert len(log) == COUNT + 1  # creation + one commit each
        repo = rig.stack.git.repo_path("zoe")
        merges = subprocess.run(
            ["git", "-C", str(repo), "rev-list", "--merges", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert merges == ""  # linear
        blocks = rig.stack.blocks.read_blocks("zoe")
        assert [blocks[f"b{i:02d}"].value for i in range(COUNT)] == [
            f"fact number {i}" for i in range(COUNT)
        ]
        retried = []
        for i in range(COUNT):
            handle = temporal_env.client.get_workflow_handle(turn_workflow_id("zoe", f"z{i}"))
            history = await handle.fetch_history()
            failed = [e.event_type for e in history.events if e.event_type in ACTIVITY_FAILURES]
            attempts = activity_attempts(history.events)  # regular and local
            if failed or any(attempt != 1 for _, attempt in attempts):
                retried.append((f"z{i}", [EventType.Name(t) for t in failed], attempts))
        assert retried == []
