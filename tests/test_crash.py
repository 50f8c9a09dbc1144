"""Crash tests: the worker process is killed with SIGKILL right after the model call and in
the middle of a commit; a restarted worker completes the turn with one commit per approved
diff and no message lost. The dev server restarted (with its database file) during an
approval wait still delivers the approval."""

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import DevServerSettings
from durable_memory.faults import AFTER_MODEL_CALL, MID_COMMIT
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.models.diffs import DiffStatus
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.dev_server import start_dev_server
from durable_memory.workers.worker import ACTIVITY_THREADS, build_worker
from tests.support.agent_helpers import edit_block, git_status
from tests.support.git_checks import assert_fsck_clean
from tests.support.temporal_helpers import rig_settings, turn_outcome
from tests.support.worker_process import address as _address
from tests.support.worker_process import crash_settings, worker_process

SCRIPT: list[dict[str, Any]] = [
    {
        "content": [
            edit_block("student", "she said so", field="name", operation="set", value="Alice")
        ]
    },
    {"text": "Welcome, Alice."},
]


async def test_worker_killed_right_after_the_model_call(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = crash_settings(tmp_path)
    settings.memory.data_dir.mkdir(parents=True)
    stack = stack_from_settings(settings)
    client = MemoryClient(temporal_env.client, settings, stack)
    with ScriptedModelServer(SCRIPT) as model:
        with worker_process(
            settings, _address(temporal_env), model.url, AFTER_MODEL_CALL, tmp_path / "crashed"
        ) as first:
            sending = asyncio.create_task(
                client.send_message("alice", "Hi, I'm Alice", turn_id="k1")
            )
            assert await asyncio.to_thread(first.wait, 60) == -9  # SIGKILL at the crash point
        assert (tmp_path / "crashed").exists()
        with worker_process(settings, _address(temporal_env), model.url):
            reply = await asyncio.wait_for(sending, 90)
            assert reply.reply == "Welcome, Alice."
            # The reply stored before the crash was reused: one model request per step.
            assert len(model.requests) == 2
            await client.approve(reply.diffs[0].id, "ms-rivera")
            outcome = await turn_outcome(client, "alice", "k1")
    assert [d.status for d in outcome.decisions] == [DiffStatus.APPROVED]
    messages = stack.recall.turn("alice", "k1")
    assert [m.role.value for m in messages] == ["user", "tool_call", "tool_result", "assistant"]
    assert len(stack.history.history("alice", "student", 10)) == 2  # creation + one approval
    assert_fsck_clean(stack.git.repo_path("alice"))
    stack.close()


async def test_worker_killed_in_the_middle_of_a_commit(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = crash_settings(tmp_path)
    settings.memory.data_dir.mkdir(parents=True)
    stack = stack_from_settings(settings)
    stack.blocks.ensure_user("alice")  # so the first commit in the worker is the approval
    client = MemoryClient(temporal_env.client, settings, stack)
    with ScriptedModelServer(SCRIPT) as model:
        with worker_process(
            settings, _address(temporal_env), model.url, MID_COMMIT, tmp_path / "crashed"
        ) as first:
            reply = await client.send_message("alice", "Hi, I'm Alice", turn_id="k2")
            diff_id = reply.diffs[0].id
            approving = asyncio.create_task(client.approve(diff_id, "ms-rivera"))
            assert await asyncio.to_thread(first.wait, 60) == -9
        repo = stack.git.repo_path("alice")
        assert (repo / ".git" / "dmem-journal").exists()  # died between stage and commit
        with worker_process(settings, _address(temporal_env), model.url):
            outcome = await asyncio.wait_for(approving, 90)
            assert outcome is not None
            assert outcome.status is DiffStatus.APPROVED
            await turn_outcome(client, "alice", "k2")
    commits = [
        c
        for c in stack.history.history("alice", "student", 10)
        if c.trailers.get("Diff-Id") == diff_id
    ]
    assert [c.sha for c in commits] == [outcome.commit_sha]  # exactly one commit
    assert stack.blocks.read_block("alice", "student").fields["name"] == "Alice"
    assert git_status(repo) == ""
    assert_fsck_clean(repo)
    assert [m.role.value for m in stack.recall.turn("alice", "k2")] == [
        "user",
        "tool_call",
        "tool_result",
        "assistant",
    ]
    stack.close()


async def test_dev_server_restart_during_the_approval_wait(tmp_path: Path) -> None:
    from durable_memory.demo import free_port

    settings = rig_settings(tmp_path / "data").model_copy(
        update={
            "dev_server": DevServerSettings(
                port=free_port(), ui_port=free_port(), log_level="error"
            )
        }
    )
    stack = stack_from_settings(settings)
    with (
        ScriptedModelServer(SCRIPT) as model_server,
        concurrent.futures.ThreadPoolExecutor(ACTIVITY_THREADS) as pool,
    ):
        model = AnthropicModel(base_url=model_server.url)
        env = await start_dev_server(settings)
        client = MemoryClient(env.client, settings, stack)
        async with build_worker(env.client, settings, stack, model, pool):
            reply = await client.send_message("alice", "Hi, I'm Alice", turn_id="r1")
        await env.shutdown()  # the server goes down while the turn awaits approval

        env = await start_dev_server(settings)  # same database file, same port
        client = MemoryClient(env.client, settings, stack)
        # A signal is accepted while no worker runs; the turn applies it when one starts.
        assert await client.approve(reply.diffs[0].id, "ms-rivera", wait=False) is None
        async with build_worker(env.client, settings, stack, model, pool):
            outcome = await turn_outcome(client, "alice", "r1")
        await env.shutdown()
    assert [d.status for d in outcome.decisions] == [DiffStatus.APPROVED]
    assert stack.blocks.read_block("alice", "student").fields["name"] == "Alice"
    stack.close()
