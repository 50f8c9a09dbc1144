"""examples/ts, the TypeScript caller of docs/integration.md, run as written against the real
dev server and a real worker (the scripted model at its HTTP boundary): update-with-start ->
reply -> approve by signal -> a late decision refused -> reject by Update -> result and the
diff query, and a bad input refused with a named error. It is compiled with its own pinned
TypeScript and run with Node; `scripts/ensure-node` (the Makefile's unit target) installs
both, this test nothing."""

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import rig_settings, running_rig
from tests.support.worker_process import address

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ts"
INSTALL = "run scripts/ensure-node (Debian's nodejs and npm, then `npm ci` in examples/ts)"
RUN_TIMEOUT_S = 180

TWO_EDITS: list[dict[str, Any]] = [
    {
        "content": [
            {"type": "text", "text": "Noting."},
            edit_block("student", field="name", operation="set", value="Alice"),
            edit_block("journey", field="stage", operation="set", value="drafting"),
        ]
    },
    {"text": "Welcome, Alice."},
]


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        if os.environ.get("DMEM_REQUIRE_NODE") or os.environ.get("CI"):
            pytest.fail(f"node is not installed: {INSTALL}")
        pytest.skip(f"node is not installed: {INSTALL}")
    if not (EXAMPLE / "node_modules" / "@temporalio" / "client").is_dir():
        pytest.fail(f"examples/ts has no node_modules: {INSTALL}")
    return node


async def _run(*command: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run a command without blocking the event loop the in-process worker runs on."""
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=EXAMPLE,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_typescript_example_runs_a_turn_end_to_end(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    node = _node()
    code, out, err = await _run(node, "node_modules/typescript/bin/tsc", "-p", ".")
    assert code == 0, f"tsc failed:\n{out}{err}"

    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, TWO_EDITS) as rig:
        env = {
            **os.environ,
            "TEMPORAL_ADDRESS": address(temporal_env),
            "TEMPORAL_NAMESPACE": temporal_env.client.namespace,
            "DMEM_TASK_QUEUE": settings.temporal.task_queue,
            "DMEM_USER": "alice",
            "DMEM_TURN": "ts1",
        }
        code, out, err = await _run(node, "dist/main.js", env=env)
        assert code == 0, f"the example failed:\n{out}{err}"

        steps = {line["step"]: line["value"] for line in map(json.loads, out.splitlines())}
        assert steps["reply"]["reply"] == "Welcome, Alice."
        assert steps["reply"]["workflow_id"] == "turn:alice:ts1"
        name, stage = (diff["id"] for diff in steps["reply"]["diffs"])
        late = steps["late decide"]
        assert late["type"] == "DiffAlreadyDecided"
        assert late["details"][0]["decided_by"] == "ms-rivera"
        assert steps["decide"]["status"] == "rejected"
        result = steps["result"]
        assert result["status"] == "done"
        assert {d["diff_id"]: d["status"] for d in result["decisions"]} == {
            name: "approved",
            stage: "rejected",
        }
        assert steps["diff query"]["status"] == "approved"
        assert steps["diff query"]["workflow_id"] == "turn:alice:ts1"
        assert steps["bad input"]["type"] == "InvalidInput"
        assert "colour" in steps["bad input"]["message"]

        # What the TypeScript caller decided is what memory holds.
        assert rig.stack.blocks.read_block("alice", "student").fields["name"] == "Alice"
        assert rig.stack.blocks.read_block("alice", "journey").fields["stage"] == "exploring"
        assert rig.model_server.remaining == 0
