"""The floors: bare workflows with the same number and kind of activities as ours, on the
same server, worker settings and data converter. (A module of workflows, passed through the
floors' sandbox as ours are (`FLOOR_WORKFLOW_RUNNER`); of ours it imports only that sandbox
runner (durable_memory/workers/sandbox.py, temporalio alone), so the memory floor carries
nothing else of ours; the activities that do real work, a model call and a commit, are in
floor_activities.py and named here by their type.)

- `FloorTurnWorkflow`, `FloorDecisionWorkflow`: no-op activities in the shape the turn had
  before its cheap steps became local (three activities), for the memory benchmark;
- `FloorModelCallWorkflow`: the floor a skeptic picks for a turn: update-with-start, only the
  model call(s) as regular activities against the same scripted model, then the reply;
- `FloorCommitWorkflow`: an Update running one activity that commits (and pushes, in the
  distributed mode): the floor of approval -> commit.
"""

import os
import subprocess
from datetime import timedelta
from pathlib import Path

from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.worker.workflow_sandbox import SandboxRestrictions

from durable_memory.workers.sandbox import sandboxed_runner

TIMEOUT = timedelta(seconds=30)

FLOOR_WORKFLOW_RUNNER = sandboxed_runner(
    SandboxRestrictions.default.with_passthrough_modules("bench")
)
"""The floors' sandbox passes this module through, as ours passes durable_memory
(durable_memory/workers/worker.py, WORKFLOW_RUNNER): otherwise each floor run imports this
module afresh and builds its pydantic models again, ~10 ms a turn on a slow machine, and the
floor is not the limit a skeptic would take. It compiles the sandbox's snippets once, as ours
does (durable_memory/workers/sandbox.py, which imports nothing else of ours)."""


class FloorInput(BaseModel):
    user_id: str
    message: str


MODEL_CALL = "floor.model_call"
"""floor_activities.FloorActivities.model_call: one request to the scripted model."""
COMMIT = "floor.commit"
"""floor_activities.FloorActivities.commit: a plain git commit (and push)."""


class FloorCallsInput(BaseModel):
    message: str
    model_calls: int = 1
    """A plain reply makes one; a tool-using turn (model -> tool -> model) two."""


class FloorCommit(BaseModel):
    repo: str
    content: str
    push_token: str | None = None
    """Given in the distributed mode: push the commit to the clone's origin with it."""


@activity.defn(name="floor.noop")
def noop(step: int) -> int:
    return step


@workflow.defn
class FloorTurnWorkflow:
    """prepare, one model call, finish: three activities, then the reply via an Update."""

    def __init__(self) -> None:
        self._reply: str | None = None

    @workflow.run
    async def run(self, request: FloorInput) -> str:
        for step in range(3):
            await workflow.execute_activity(noop, step, start_to_close_timeout=TIMEOUT)
        self._reply = request.message
        return self._reply

    @workflow.update
    async def reply(self) -> str:
        await workflow.wait_condition(lambda: self._reply is not None)
        assert self._reply is not None
        return self._reply


@workflow.defn
class FloorDecisionWorkflow:
    """Waits for one decision Update; applies it with one activity doing nothing."""

    def __init__(self) -> None:
        self._decided = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._decided)

    @workflow.update
    async def decide(self, step: int) -> int:
        result = await workflow.execute_activity(noop, step, start_to_close_timeout=TIMEOUT)
        self._decided = True
        return int(result)


@workflow.defn
class FloorModelCallWorkflow:
    """Only the model call(s), each a regular activity, then the reply via an Update."""

    def __init__(self) -> None:
        self._reply: str | None = None

    @workflow.run
    async def run(self, request: FloorCallsInput) -> str:
        text = ""
        for _ in range(request.model_calls):
            text = await workflow.execute_activity(
                MODEL_CALL, request.message, result_type=str, start_to_close_timeout=TIMEOUT
            )
        self._reply = text
        return text

    @workflow.update
    async def reply(self) -> str:
        await workflow.wait_condition(lambda: self._reply is not None)
        assert self._reply is not None
        return self._reply


@workflow.defn
class FloorCommitWorkflow:
    """Waits for one decision Update; applies it with one activity that commits (+ pushes)."""

    def __init__(self) -> None:
        self._decided = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._decided)

    @workflow.update
    async def decide(self, commit: FloorCommit) -> None:
        await workflow.execute_activity(COMMIT, commit, start_to_close_timeout=TIMEOUT)
        self._decided = True


def plain_git_commit(repo: Path, content: str) -> None:
    """The floor of a commit: write the same file and `git commit` it, nothing else."""
    (repo / "blocks" / "student.toml").write_text(content, encoding="utf-8")
    subprocess.run(["git", "-C", str(repo), "add", "blocks/student.toml"], check=True)
    subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "-c",
            "user.name=floor",
            "-c",
            "user.email=floor@localhost",
            "commit",
            "-q",
            "-m",
            "floor",
        ],
        check=True,
    )


def plain_git_push(repo: Path, token: str) -> None:
    """The floor of a push: the new commit to the same git server, with the same token header,
    and nothing else (no fetch first)."""
    env = os.environ | {
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "http.extraHeader",
        "GIT_CONFIG_VALUE_0": f"Authorization: Bearer {token}",
    }
    push = ["git", "-C", str(repo), "push", "-q", "origin", "HEAD:main"]
    subprocess.run(push, check=True, env=env)
