"""The seeded random-kill campaign (issue 12's first proof).

Several users hold conversations at once (turns whose edits are approved, rejected, edited then
approved, or approved by signal, with rotations of the human block when it fills up) while a
real `dmem worker` process is killed with SIGKILL at random instants: a seeded RNG chooses how
long each worker lives and how long it stays dead, so kills land anywhere, not only at activity
boundaries. Afterwards, with a final worker up, the campaign checks what the product promises:
every turn ended (completed, or failed with a short clean error), exactly one commit per
approved diff and none for any other, no diff approved without its commit, every caller's
answer true, each message in recall exactly once, `git fsck --strict` clean, and the next turn
of every user succeeds.

The random seed is printed; `DMEM_KILL_SEED=<seed>` replays the same choices (the interleaving with
the scheduler still varies, so a failure is reproduced by rerunning that seed a few times).
"""

import asyncio
import functools
import os
import random
import re
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import DecisionNotApplied, MemoryClient
from durable_memory.config import Settings
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import (
    DecisionOutcome,
    RotationOutcome,
    TurnReply,
    rotation_workflow_id,
    turn_workflow_id,
)
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workflows.turn import TurnWorkflow
from tests.support.agent_helpers import edit_block, said_texts
from tests.support.temporal_helpers import turn_outcome
from tests.support.worker_process import address, crash_settings, spawn_worker, stop_worker

T = TypeVar("T")

SEED_VARIABLE = "DMEM_KILL_SEED"
USERS = [f"kc{n}" for n in range(4)]
KILLS = 20
MIN_TURNS_PER_USER = 4
ALIVE_S = (0.3, 4.0)
"""How long a worker lives once it polls, before its SIGKILL (uniform, seeded)."""
DEAD_S = (0.0, 1.0)
"""How long no worker runs between a kill and the next start."""
PAUSE_S = (0.0, 0.5)
"""A user's pause between a reply and its decision, and between turns."""
CALL_TIMEOUT_S = 75.0
"""Bound on any one call of the campaign once the kills are over: a hang fails the test instead
of stalling CI. While workers are still being killed a call has no bound of its own (the kills
are bounded): each kill costs the turns whose workflow task the worker held that task's 10 s
timeout, and those whose activity it ran the activity's 4 s and a backoff, and a worker is up
for a third of the time, less on a busy machine, so a turn can take most of the campaign
(113 s once, with another test process on the two cores)."""
DECISIONS = ["approve", "reject", "edit", "signal"]
"""approve and reject by Update, edit-then-approve by Update, approve by signal."""
APPROVER = "ms-rivera"
FILLER = "the robotics club rebuilt the arm after the regional qualifier " * 7
"""Pads each note: the human block shows its last three notes, and three such notes take it
over its rotation threshold, so approvals keep starting rotations."""
REVIEWED_TASK = re.compile(r"(## Current Task\n)[^#]*")
TAG = re.compile(r"«([a-z0-9]+)/([a-z0-9]+)»")


def tag(user_id: str, turn_id: str) -> str:
    return f"«{user_id}/{turn_id}»"


def proposed_note(user_id: str, turn_id: str) -> str:
    return f"Session {tag(user_id, turn_id)}: {FILLER}".strip()


def reviewed_task(user_id: str, turn_id: str) -> str:
    return f"Outline the robot arm essay {tag(user_id, turn_id)}"


def expected_reply(user_id: str, turn_id: str) -> str:
    return f"Noted {tag(user_id, turn_id)}."


def respond(request: dict[str, Any]) -> dict[str, Any]:
    """The scripted model, as a function of the conversation (turns run concurrently and are
    retried after kills, so no fixed order of requests exists): the first step of a turn
    proposes one note about the user's message; the step after its tool result replies."""
    messages: list[dict[str, Any]] = request["messages"]
    tags = [
        found
        for m in messages
        if m["role"] == "user"
        for text in said_texts(m)
        for found in TAG.findall(text)
    ]
    if not tags:
        return {"text": "I cannot tell which conversation this is."}
    user_id, turn_id = tags[-1]
    last = messages[-1].get("content")
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return {"text": expected_reply(user_id, turn_id)}
    note = proposed_note(user_id, turn_id)
    return {"content": [edit_block("human", "campaign", operation="add_context", value=note)]}


async def bounded(call: Awaitable[T], killing: asyncio.Task[None] | None = None) -> T:
    """`call`'s result, or TimeoutError if it has not ended CALL_TIMEOUT_S after `killing`
    (the kills, if still going) is over."""
    running = asyncio.ensure_future(call)
    if killing is not None and not killing.done():
        await asyncio.wait({running, killing}, return_when=asyncio.FIRST_COMPLETED)
    return await asyncio.wait_for(running, CALL_TIMEOUT_S)


class KillingSupervisor:
    """Runs `dmem worker` processes and SIGKILLs them at seeded random instants; after the
    last kill it starts the final worker, which stays up."""

    def __init__(
        self, settings: Settings, temporal: str, model_url: str, rng: random.Random, log: Path
    ):
        self.start = functools.partial(spawn_worker, settings, temporal, model_url, log=log)
        self.rng = rng
        self.process = self.start()
        self.kills = 0

    async def run(self, kills: int) -> None:
        for _ in range(kills):
            await asyncio.sleep(self.rng.uniform(*ALIVE_S))
            self.process.kill()
            await asyncio.to_thread(self.process.wait, 30)
            self.kills += 1
            await asyncio.sleep(self.rng.uniform(*DEAD_S))
            self.process = await asyncio.to_thread(self.start)

    def stop(self) -> None:
        stop_worker(self.process)


@dataclass
class Decision:
    """What the campaign decided on a diff and what it was told."""

    user_id: str
    turn_id: str
    kind: str
    outcome: DecisionOutcome | None = None


@dataclass
class Ledger:
    """Everything the campaign did, to check the stores against, and every problem seen."""

    seed: int
    sent: dict[tuple[str, str], str] = field(default_factory=dict)
    replies: dict[tuple[str, str], TurnReply] = field(default_factory=dict)
    decisions: dict[str, Decision] = field(default_factory=dict)
    turn_said: dict[str, DecisionOutcome] = field(default_factory=dict)
    """What each turn's outcome says of its diffs."""
    problems: list[str] = field(default_factory=list)
    slowest_turn_s: float = 0.0

    def problem(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")


class Campaign:
    def __init__(self, client: MemoryClient, ledger: Ledger, supervisor: KillingSupervisor):
        self.client = client
        self.ledger = ledger
        self.supervisor = supervisor
        self.killing: asyncio.Task[None] | None = None

    def keep_going(self, turns: int) -> bool:
        return turns < MIN_TURNS_PER_USER or (self.killing is not None and not self.killing.done())

    async def drive_user(self, user_id: str, rng: random.Random) -> None:
        """One user's turns, one after another, until the kills are over. Any failed call is
        written down and the user goes on with a new turn, as a backend would."""
        kinds: list[str] = []
        turns = 0
        while self.keep_going(turns):
            if not kinds:  # every kind of decision in each round of four turns
                kinds = rng.sample(DECISIONS, len(DECISIONS))
            began = time.monotonic()
            await self.turn(user_id, f"t{turns}", kinds.pop(), rng)
            self.ledger.slowest_turn_s = max(self.ledger.slowest_turn_s, time.monotonic() - began)
            turns += 1
            await asyncio.sleep(rng.uniform(*PAUSE_S))

    async def turn(self, user_id: str, turn_id: str, kind: str, rng: random.Random) -> None:
        where = f"{user_id}/{turn_id}"
        message = f"{tag(user_id, turn_id)} we talked about the robot arm again"
        self.ledger.sent[(user_id, turn_id)] = message
        try:
            reply = await bounded(
                self.client.send_message(user_id, message, turn_id=turn_id), self.killing
            )
        except Exception as error:
            self.ledger.problem(where, f"send_message raised {error!r}")
            return
        self.ledger.replies[(user_id, turn_id)] = reply
        if reply.reply != expected_reply(user_id, turn_id):
            self.ledger.problem(where, f"got the reply {reply.reply!r} to another message")
        await asyncio.sleep(rng.uniform(*PAUSE_S))
        for diff in reply.diffs:
            decision = Decision(user_id, turn_id, kind)
            self.ledger.decisions[diff.id] = decision
            try:
                decision.outcome = await bounded(
                    self.decide(user_id, turn_id, diff.id, kind), self.killing
                )
            except DecisionNotApplied as error:
                # An approval that no longer applies (a rotation of the block committed since
                # the proposal, which a reviewer's whole-block edit would overwrite) is
                # conflicted, and the caller is told so: the truth, checked against the store.
                if error.outcome is None or error.outcome.status is not DiffStatus.CONFLICTED:
                    self.ledger.problem(where, f"{kind} of {diff.id} raised {error!r}")
                decision.outcome = error.outcome
            except Exception as error:
                self.ledger.problem(where, f"{kind} of {diff.id} raised {error!r}")
        try:
            await bounded(self.turn_result(user_id, turn_id), self.killing)
        except Exception as error:
            self.ledger.problem(where, f"waiting for the turn's end raised {error!r}")

    async def decide(
        self, user_id: str, turn_id: str, diff_id: str, kind: str
    ) -> DecisionOutcome | None:
        client = self.client
        if kind == "reject":
            return await client.reject(diff_id, APPROVER, "not worth keeping", user_id=user_id)
        if kind == "signal":
            return await client.approve(diff_id, APPROVER, user_id=user_id, wait=False)
        edited = None
        if kind == "edit":  # the reviewer writes the task instead of the proposed note
            current = await asyncio.to_thread(
                client.stack.blocks.render, user_id, "human", "markdown"
            )
            task = reviewed_task(user_id, turn_id)
            edited = REVIEWED_TASK.sub(lambda m: f"{m[1]}{task}\n\n", current, count=1)
        return await client.approve(diff_id, APPROVER, user_id=user_id, edited_markdown=edited)

    async def turn_result(self, user_id: str, turn_id: str) -> None:
        """Wait for the turn's end and keep what its outcome says of each diff. A failed turn
        is clean only with a short ApplicationError (an operator must see what failed)."""
        try:
            outcome = await turn_outcome(self.client, user_id, turn_id)
        except WorkflowFailureError as error:
            cause = error.cause
            if not isinstance(cause, ApplicationError) or len(cause.message) >= 1024:
                self.ledger.problem(f"{user_id}/{turn_id}", f"failed uncleanly: {cause!r}")
            return
        for decided in outcome.decisions:
            self.ledger.turn_said[decided.diff_id] = decided


async def settle(campaign: Campaign) -> None:
    """With the final worker up: decide what still awaits a decision (a turn whose decision
    call failed), then wait for every turn to end."""
    ledger = campaign.ledger
    for user_id, turn_id in ledger.sent:
        handle = campaign.client.client.get_workflow_handle(turn_workflow_id(user_id, turn_id))
        where = f"{user_id}/{turn_id} (settling)"
        try:
            description = await bounded(handle.describe())
            if description.status is WorkflowExecutionStatus.RUNNING:
                for diff_id in await bounded(handle.query(TurnWorkflow.open_diffs)):
                    decision = ledger.decisions.setdefault(
                        diff_id, Decision(user_id, turn_id, "approve")
                    )
                    decision.kind = "approve"
                    decision.outcome = await bounded(
                        campaign.client.approve(diff_id, APPROVER, user_id=user_id)
                    )
            await bounded(campaign.turn_result(user_id, turn_id))
        except Exception as error:
            ledger.problem(where, repr(error))


async def settle_rotations(ledger: Ledger, client: MemoryClient) -> None:
    """Wait for the rotations the last approvals started (each user's latest run)."""
    for user_id in USERS:
        workflow_id = rotation_workflow_id(user_id, "human")
        handle = client.client.get_workflow_handle(workflow_id, result_type=RotationOutcome)
        try:
            await bounded(handle.result())
        except RPCError as error:
            if error.status is not RPCStatusCode.NOT_FOUND:  # no rotation ever started
                ledger.problem(workflow_id, repr(error))
        except Exception as error:
            ledger.problem(workflow_id, repr(error))


def git(ledger: Ledger, repo: Path, *args: str) -> list[str]:
    """The output lines of a git command in a user's repository; a failure is a problem."""
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0 or done.stderr.strip():
        ledger.problem(repo.name, f"git {' '.join(args)}: {(done.stdout + done.stderr).strip()}")
    return [line for line in done.stdout.splitlines() if line]


def check_repository(ledger: Ledger, repo: Path) -> None:
    git(ledger, repo, "fsck", "--strict", "--no-progress")
    if status := git(ledger, repo, "status", "--porcelain"):
        ledger.problem(repo.name, f"working tree not clean: {status}")
    locks = sorted(
        str(path.relative_to(repo))
        for path in (repo / ".git").rglob("*.lock")
        if path.name != "dmem-write.lock"  # the store's flock file, there by design
    )
    if locks:
        ledger.problem(repo.name, f"git lock files left behind: {locks}")


def check_diffs(ledger: Ledger, client: MemoryClient, user_id: str) -> Counter[str]:
    """One commit per approved diff, none for any other; every caller told the truth."""
    repo = client.stack.git.repo_path(user_id)
    commits_of: dict[str, list[str]] = {}
    for line in git(ledger, repo, "log", "--format=%H %(trailers:key=Diff-Id,valueonly)", "HEAD"):
        sha, *named = line.split()
        for diff_id in named:
            commits_of.setdefault(diff_id, []).append(sha)
    diffs = DiffStore(client.stack.engine).list(user_id, None, limit=10_000)
    statuses: Counter[str] = Counter()
    for diff in diffs:
        where = f"{user_id} diff {diff.id} ({diff.status.value})"
        statuses[diff.status.value] += 1
        commits = commits_of.get(diff.id, [])
        if diff.status is DiffStatus.APPROVED:
            if diff.commit_sha is None:
                ledger.problem(where, "approved without a commit")
            elif commits != [diff.commit_sha]:
                ledger.problem(where, f"commits {commits} carry its Diff-Id, not {diff.commit_sha}")
        elif commits:
            ledger.problem(where, f"commits {commits} carry its Diff-Id")
        if diff.status is DiffStatus.PENDING:
            ledger.problem(where, "still pending after every turn was settled")
        truth = (diff.status, diff.commit_sha)
        turn_said = ledger.turn_said.get(diff.id)
        if turn_said is None and diff.status is not DiffStatus.PENDING:
            ledger.problem(where, "no turn outcome tells what became of it")
        decision = ledger.decisions.get(diff.id)
        if decision is None:
            ledger.problem(where, "proposed but never shown in a reply")
            continue
        if decision.user_id != user_id:
            ledger.problem(where, f"was shown to {decision.user_id}")
        for teller, told in (("the decision", decision.outcome), ("the turn", turn_said)):
            if told is not None and (told.status, told.commit_sha) != truth:
                ledger.problem(
                    where,
                    f"after {decision.kind}, {teller} said {told.status.value} "
                    f"{told.commit_sha} but the diff is {diff.status.value} {diff.commit_sha}",
                )
        expected = (
            {DiffStatus.REJECTED}
            if decision.kind == "reject"
            else {DiffStatus.APPROVED, DiffStatus.CONFLICTED}
        )
        if diff.status not in expected:
            ledger.problem(where, f"after {decision.kind} it is {diff.status.value}")
        elif diff.status is DiffStatus.APPROVED and diff.commit_sha:
            try:
                committed = client.stack.history.read_at(user_id, "human", diff.commit_sha)
            except Exception as error:  # a broken repository is a finding, not a test crash
                ledger.problem(where, f"its commit cannot be read: {error!r}")
                continue
            if decision.kind == "edit":
                wanted = reviewed_task(user_id, decision.turn_id)
                if committed.get("current_task") != wanted:
                    ledger.problem(
                        where, f"the reviewer's edit is not what {diff.commit_sha} holds"
                    )
            else:
                notes = committed.get("context_notes") or []
                if proposed_note(user_id, decision.turn_id) not in notes:
                    ledger.problem(where, f"the proposed note is not in {diff.commit_sha}")
    shown = {d for d, decision in ledger.decisions.items() if decision.user_id == user_id}
    if missing := shown - {d.id for d in diffs}:
        ledger.problem(user_id, f"diffs shown in replies but not stored: {sorted(missing)}")
    return statuses


def check_recall(ledger: Ledger, client: MemoryClient, user_id: str) -> None:
    """Each message sent is in recall exactly once, and each turn that replied holds its own
    messages: the user's, the note proposed, its result and the reply, once each."""
    recall = client.stack.recall
    sent = {turn: text for (user, turn), text in ledger.sent.items() if user == user_id}
    for turn_id, text in sent.items():
        where = f"{user_id}/{turn_id} recall"
        messages = recall.turn(user_id, turn_id)
        seqs = Counter(m.seq for m in messages)
        if duplicated := [s for s, n in seqs.items() if n > 1]:
            ledger.problem(where, f"seq used more than once: {duplicated}")
        users = [m.content for m in messages if m.role is MessageRole.USER]
        if users != [text]:
            ledger.problem(where, f"user messages {users!r}, sent {text!r}")
        if (user_id, turn_id) not in ledger.replies:
            continue
        roles = [m.role.value for m in messages]
        if roles != ["user", "tool_call", "tool_result", "assistant"]:
            ledger.problem(where, f"roles {roles}")
        replies = [m.content for m in messages if m.role is MessageRole.ASSISTANT]
        if replies != [expected_reply(user_id, turn_id)]:
            ledger.problem(where, f"assistant messages {replies!r}")
        leaked = {u for m in messages for u, _ in TAG.findall(m.content)} - {user_id}
        if leaked:
            ledger.problem(where, f"holds messages about {sorted(leaked)}")
    if extra := {m.turn_id for m in recall.recent(user_id, 100_000)} - set(sent):
        ledger.problem(user_id, f"recall holds turns never sent: {sorted(extra)}")


async def check_workflows(ledger: Ledger, client: MemoryClient) -> Counter[str]:
    """No workflow of the campaign is still running, and each rotation committed once."""
    temporal = client.client
    query = f"TaskQueue = '{client.settings.temporal.task_queue}'"
    kinds: Counter[str] = Counter()
    async for execution in temporal.list_workflows(query):
        ended = (WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.FAILED)
        found = execution.status
        if found not in ended:  # visibility lags: ask the execution itself
            handle = temporal.get_workflow_handle(execution.id, run_id=execution.run_id)
            found = (await bounded(handle.describe())).status
        status = found.name.lower() if found else "unknown"
        kinds[f"{execution.workflow_type} {status}"] += 1
        if found not in ended:
            ledger.problem(execution.id, f"{status} after settling")
    for user_id in USERS:
        rotated: list[str] = []
        query = f"WorkflowId = '{rotation_workflow_id(user_id, 'human')}'"
        async for run in temporal.list_workflows(query):
            handle = temporal.get_workflow_handle(
                run.id, run_id=run.run_id, result_type=RotationOutcome
            )
            run_status = run.status
            if run_status is not WorkflowExecutionStatus.COMPLETED:  # visibility may lag
                run_status = (await bounded(handle.describe())).status
            if run_status is not WorkflowExecutionStatus.COMPLETED:
                continue
            outcome: RotationOutcome = await bounded(handle.result())
            if outcome.rotated and outcome.commit_sha:
                rotated.append(outcome.commit_sha)
        repo = client.stack.git.repo_path(user_id)
        commits = git(ledger, repo, "log", "--format=%H %(trailers:key=Rotation-Of,valueonly)")
        rotation_commits = [line.split()[0] for line in commits if len(line.split()) > 1]
        if sorted(rotation_commits) != sorted(rotated):
            ledger.problem(
                user_id,
                f"rotation commits {rotation_commits} but completed rotations {rotated}",
            )
        kinds["rotation commits"] += len(rotation_commits)
    return kinds


async def next_turn_succeeds(campaign: Campaign, user_id: str) -> None:
    """With the final worker up and no more kills, a user's next turn and its approval."""
    turn_id = "after"
    await campaign.turn(user_id, turn_id, "approve", random.Random(campaign.ledger.seed))
    reply = campaign.ledger.replies.get((user_id, turn_id))
    told = [campaign.ledger.decisions[d.id].outcome for d in reply.diffs] if reply else []
    if not told or any(t is None or t.status is not DiffStatus.APPROVED for t in told):
        campaign.ledger.problem(f"{user_id}/{turn_id}", f"the turn after the campaign: {told}")


def campaign_seed() -> int:
    chosen = os.environ.get(SEED_VARIABLE)
    return int(chosen) if chosen else random.SystemRandom().randrange(2**32)


async def test_random_kill_campaign(temporal_env: WorkflowEnvironment, tmp_path: Path) -> None:
    seed = campaign_seed()
    print(f"kill campaign seed {seed}: replay with {SEED_VARIABLE}={seed}")
    started = time.monotonic()
    settings = crash_settings(tmp_path)
    settings.memory.data_dir.mkdir(parents=True)
    stack = stack_from_settings(settings)
    client = MemoryClient(temporal_env.client, settings, stack)
    ledger = Ledger(seed)
    log = tmp_path / "workers.log"
    with ScriptedModelServer([], respond=respond) as model:
        supervisor = KillingSupervisor(
            settings, address(temporal_env), model.url, random.Random(f"{seed}-kills"), log
        )
        campaign = Campaign(client, ledger, supervisor)
        try:
            campaign.killing = asyncio.create_task(supervisor.run(KILLS))
            await asyncio.gather(
                *(campaign.drive_user(u, random.Random(f"{seed}-{u}")) for u in USERS)
            )
            await campaign.killing
            await settle(campaign)
            await asyncio.gather(*(next_turn_succeeds(campaign, u) for u in USERS))
            await settle_rotations(ledger, client)
            workflows = await check_workflows(ledger, client)
        finally:
            supervisor.stop()
    statuses: Counter[str] = Counter()
    for user_id in USERS:
        check_repository(ledger, stack.git.repo_path(user_id))
        statuses += check_diffs(ledger, client, user_id)
        check_recall(ledger, client, user_id)
    stack.close()
    print(
        f"seed {seed}: {supervisor.kills} kills, {len(ledger.sent)} turns, "
        f"{len(model.requests)} model requests, diffs {dict(statuses)}, "
        f"workflows {dict(workflows)}, slowest turn {ledger.slowest_turn_s:.0f}s, "
        f"{time.monotonic() - started:.0f}s in all"
    )
    assert supervisor.kills == KILLS
    assert not ledger.problems, (
        f"seed {seed} ({SEED_VARIABLE}={seed}), the workers' stderr in {log}:\n"
        + "\n".join(ledger.problems)
    )
