"""The N-host proof of issue 15 §5, on loopback.

A Temporal dev server, PostgreSQL, the git server (`dmem git-serve`'s, in this process), and
`dmem worker` processes that share nothing else: host A and host B, each with its own data
dir, then host C with an empty one. The client has its own empty data dir too. Users hold
conversations (each turn proposes a task for the user's human block, which the user approves
by Update, approves by signal, or rejects) while host B is SIGKILLed: at seeded random
instants, and at named crash points (between the local commit and the push, after the push
before the database records it, after a decision before its activity reports, in the middle of
a local commit). Then the git server is
stopped during an approval (its turn's details say it waits for the git remote, its Update is
not answered, nothing reaches the remote) and restarted. Then host C joins with an empty data
dir, A and B stop, and C serves every old user a turn whose context holds the task another
host committed.

Afterwards, read from the shared stores themselves (the bare repositories with git, recall on
the database): every turn completed; exactly one commit per approved diff on the remote and
none for any other; each user's history linear and `git fsck` clean; every turn's messages in
recall once; both A and B ran turns' activities (the workflow histories name the worker of
each); every crash point was reached; every data dir holds nothing but disposable clones.

The random seed is printed; `DMEM_MANY_HOSTS_SEED=<seed>` replays the same choices (the scheduler's
interleaving still varies, so rerun a failing seed a few times).
"""

import asyncio
import contextlib
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import Settings
from durable_memory.faults import AFTER_PUSH, BEFORE_PUSH, MID_COMMIT
from durable_memory.gitserver.server import GitServer
from durable_memory.memory.agent.context import MEMORY_UPDATE_START
from durable_memory.memory.store.diffs import DiffStore
from durable_memory.memory.store.git.remote import CLONES_DIR
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import TurnOutcome, TurnReply, turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workflows.turn import TurnWorkflow
from tests.support.agent_helpers import edit_block
from tests.support.distributed import distributed_settings, git_server, restart_git_server
from tests.support.git_checks import assert_fsck_clean
from tests.support.many_hosts import (
    Host,
    Killer,
    KillPlan,
    activity_runs,
    bare_repository,
    block_file,
    merge_commits,
    remote_commits,
    waiting_for_git_remote,
)
from tests.support.postgres import fresh_schema_url
from tests.support.temporal_helpers import turn_outcome
from tests.support.worker_process import address, with_fast_activities

T = TypeVar("T")

pytestmark = pytest.mark.postgres

SEED_VARIABLE = "DMEM_MANY_HOSTS_SEED"
USERS = [f"mh{n}" for n in range(3)]
MIN_TURNS_PER_USER = 3
CRASH_POINTS = (BEFORE_PUSH, AFTER_PUSH, "after:dmem.decide", MID_COMMIT)
"""Where host B's armed lives kill themselves: between the local commit and the push; after the
push, before the database records the commit; after a decision is recorded, before its activity
reports; in the middle of a local commit."""
RANDOM_KILLS = 3
ALIVE_S = (0.5, 4.0)
"""How long a randomly killed life of host B lives once it polls (uniform, seeded)."""
DEAD_S = (0.0, 1.0)
"""How long host B stays down after each kill."""
CRASH_WAIT_S = 40.0
"""How long an armed life may take to reach its crash point before it is killed from outside
(and the proof fails, naming the point): the campaign always ends."""
PAUSE_S = (0.0, 0.3)
"""A user's pause between a reply and its decision, and between turns."""
CALL_TIMEOUT_S = 75.0
"""Bound on any one call: a hang fails the proof instead of stalling CI."""
OUTAGE_SEEN_S = 60.0
"""How long the approval may take to run into the stopped git server."""
DECISIONS = ("approve", "signal", "reject")
"""Approve by Update, approve by signal (fire-and-forget), reject by Update."""
APPROVER = "ms-rivera"
TAG = re.compile(r"«([a-z0-9]+)/([a-z0-9]+)»")


def tag(user_id: str, turn_id: str) -> str:
    return f"«{user_id}/{turn_id}»"


def proposed_task(user_id: str, turn_id: str) -> str:
    return f"Essay {tag(user_id, turn_id)}"


def expected_reply(user_id: str, turn_id: str) -> str:
    return f"Noted {tag(user_id, turn_id)}."


def conversation_of(request: dict[str, Any]) -> tuple[str, str] | None:
    """The (user, turn) a model request belongs to: the last tag the user side of its
    messages holds (the current message comes after the recalled ones), the memory update
    left out (it quotes an earlier turn's task)."""
    said = [
        [b for b in m["content"] if not _is_memory_update(b)]
        if isinstance(m["content"], list)
        else m["content"]
        for m in request["messages"]
        if m["role"] == "user"
    ]
    tags = TAG.findall(json.dumps(said, ensure_ascii=False))
    return (tags[-1][0], tags[-1][1]) if tags else None


def respond(request: dict[str, Any]) -> dict[str, Any]:
    """The scripted model, as a function of the conversation (turns run concurrently and are
    retried after kills, so requests come in no fixed order): a turn's first step proposes the
    user's task; the step after its tool result replies."""
    conversation = conversation_of(request)
    if conversation is None:
        return {"text": "I cannot tell which conversation this is."}
    last = request["messages"][-1].get("content")
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return {"text": expected_reply(*conversation)}
    task = proposed_task(*conversation)
    edit = edit_block("human", "the essay", field="current_task", operation="set", value=task)
    return {"content": [edit]}


def _is_memory_update(block: dict[str, Any]) -> bool:
    return block.get("type") == "text" and block["text"].startswith(MEMORY_UPDATE_START)


def memory_text(request: dict[str, Any]) -> str:
    """What a request shows of memory: its system prompt and the memory update (blocks
    changed since the user's prompt base) in its newest user turn."""
    system = request.get("system") or ""
    texts = [system] if isinstance(system, str) else [b.get("text", "") for b in system]
    newest = request["messages"][-1].get("content")
    if isinstance(newest, list):
        texts += [b["text"] for b in newest if _is_memory_update(b)]
    return "".join(texts)


async def bounded(call: Awaitable[T]) -> T:
    return await asyncio.wait_for(call, CALL_TIMEOUT_S)


@dataclass
class Turn:
    """One turn the proof ran, and what it was told."""

    user_id: str
    turn_id: str
    kind: str
    reply: TurnReply | None = None
    outcome: TurnOutcome | None = None

    @property
    def message(self) -> str:
        return f"{tag(self.user_id, self.turn_id)} let us work on the essay"

    @property
    def where(self) -> str:
        return f"{self.user_id}/{self.turn_id}"


@dataclass
class Proof:
    client: MemoryClient
    seed: int
    turns: list[Turn] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def problem(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")

    def handle(self, turn: Turn) -> WorkflowHandle[Any, TurnOutcome]:
        workflow_id = turn_workflow_id(turn.user_id, turn.turn_id)
        return self.client.client.get_workflow_handle(workflow_id, result_type=TurnOutcome)

    async def reply(self, turn: Turn) -> TurnReply | None:
        """Start the turn and keep its reply; a failure is written down."""
        self.turns.append(turn)
        try:
            turn.reply = await bounded(
                self.client.send_message(turn.user_id, turn.message, turn_id=turn.turn_id)
            )
        except Exception as error:
            self.problem(turn.where, f"send_message raised {error!r}")
            return None
        if turn.reply.reply != expected_reply(turn.user_id, turn.turn_id):
            self.problem(turn.where, f"got the reply {turn.reply.reply!r} to another message")
        if len(turn.reply.diffs) != 1:
            self.problem(turn.where, f"proposed {len(turn.reply.diffs)} diffs, not one")
        return turn.reply

    async def decide(self, turn: Turn, diff_id: str) -> None:
        client = self.client
        try:
            if turn.kind == "reject":
                await bounded(client.reject(diff_id, APPROVER, "not now", user_id=turn.user_id))
            else:
                wait = turn.kind == "approve"
                await bounded(client.approve(diff_id, APPROVER, user_id=turn.user_id, wait=wait))
        except Exception as error:
            self.problem(turn.where, f"{turn.kind} of {diff_id} raised {error!r}")

    async def finish(self, turn: Turn) -> None:
        """Wait for the turn's end and keep its outcome."""
        try:
            turn.outcome = await bounded(turn_outcome(self.client, turn.user_id, turn.turn_id))
        except Exception as error:
            self.problem(turn.where, f"the turn did not complete: {error!r}")

    async def run_turn(self, user_id: str, turn_id: str, kind: str, rng: random.Random) -> Turn:
        turn = Turn(user_id, turn_id, kind)
        reply = await self.reply(turn)
        if reply is not None:
            await asyncio.sleep(rng.uniform(*PAUSE_S))
            for diff in reply.diffs:
                await self.decide(turn, diff.id)
        await self.finish(turn)
        return turn

    async def drive_user(self, user_id: str, rng: random.Random, more: Callable[[], bool]) -> None:
        """One user's turns, one after another, until `more` says stop (and at least
        MIN_TURNS_PER_USER); each round of three turns decides in every way once."""
        kinds: list[str] = []
        turns = 0
        while turns < MIN_TURNS_PER_USER or more():
            kinds = kinds or rng.sample(DECISIONS, len(DECISIONS))
            await self.run_turn(user_id, f"t{turns}", kinds.pop(), rng)
            turns += 1
            await asyncio.sleep(rng.uniform(*PAUSE_S))

    async def settle(self) -> None:
        """With the kills over: approve what still waits (a decision call that failed), then
        wait for every turn's end."""
        for turn in self.turns:
            handle = self.handle(turn)
            try:
                description = await bounded(handle.describe())
                if description.status is WorkflowExecutionStatus.RUNNING:
                    for diff_id in await bounded(handle.query(TurnWorkflow.open_diffs)):
                        turn.kind = "approve"
                        await self.decide(turn, diff_id)
            except Exception as error:
                self.problem(f"{turn.where} (settling)", repr(error))
            if turn.outcome is None:
                await self.finish(turn)


async def approve_through_git_outage(proof: Proof, server: GitServer, root: Path) -> GitServer:
    """A turn's approval sent while the git server is down: it waits on the remote (retried,
    not answered), and completes once the server is back. Returns the restarted server."""
    turn = Turn(USERS[0], "outage", "approve")
    reply = await proof.reply(turn)
    if reply is None or not reply.diffs:
        return server
    diff_id = reply.diffs[0].id
    server.stop()
    approving = asyncio.create_task(proof.decide(turn, diff_id))
    deadline = time.monotonic() + OUTAGE_SEEN_S
    seen = False
    while not seen and time.monotonic() < deadline and not approving.done():
        seen = await waiting_for_git_remote(proof.handle(turn))
        await asyncio.sleep(0.2)
    if not seen:
        proof.problem(turn.where, "the approval never showed it was waiting for the git remote")
    if approving.done():
        proof.problem(turn.where, "the approval was answered while the git server was down")
    if on_remote := remote_commits(bare_repository(root, turn.user_id)).get(diff_id):
        proof.problem(turn.where, f"{on_remote} carry {diff_id} while the git server was down")
    server = restart_git_server(server, root)
    await approving
    await proof.finish(turn)
    return server


async def fresh_host_serves_old_users(
    proof: Proof, fresh: Host, old: list[Host], model: ScriptedModelServer, remote: Path
) -> None:
    """Host C, on an empty data dir, alone on the task queue: each old user's next turn
    reads the task that another host committed last (its context holds it) and commits."""
    data_dir = fresh.settings.memory.data_dir
    if data_dir.exists() and any(data_dir.iterdir()):
        proof.problem(fresh.name, f"its data dir {data_dir} is not empty before it starts")
    committed = {user_id: last_approved_task(proof, user_id) for user_id in USERS}
    await asyncio.to_thread(fresh.start)
    for host in old:
        await asyncio.to_thread(host.stop)
    for user_id in USERS:
        task = committed[user_id]
        where = f"{user_id}/fresh"
        if task is None or f'current_task = "{task}"' not in block_file(
            bare_repository(remote, user_id), "human"
        ):
            proof.problem(where, f"the remote's human block does not hold its last task {task!r}")
        turn = await proof.run_turn(user_id, "fresh", "approve", random.Random(proof.seed))
        seen = [memory_text(r) for r in model.requests if conversation_of(r) == (user_id, "fresh")]
        if not seen or any(f"[TASK] {task}" not in system for system in seen):
            proof.problem(where, f"host C's context does not hold the task {task!r}")
        runs = await activity_runs(proof.handle(turn))
        if not runs or not all(fresh.ran(identity) for _, identity in runs):
            proof.problem(where, f"its activities ran on {runs}, not on host C alone")


def last_approved_task(proof: Proof, user_id: str) -> str | None:
    """The task of the user's latest turn whose diff was approved (turns of one user run one
    after another, so the latest approval is what the block holds)."""
    approved = [
        turn
        for turn in proof.turns
        if turn.user_id == user_id
        and turn.outcome is not None
        and any(d.status is DiffStatus.APPROVED for d in turn.outcome.decisions)
    ]
    return proposed_task(user_id, approved[-1].turn_id) if approved else None


def check_remote(proof: Proof, remote: Path, user_id: str) -> None:
    """On the user's bare repository: exactly one commit per approved diff (the one the
    database names), none for any other diff, a linear main, a clean fsck."""
    bare = bare_repository(remote, user_id)
    try:
        assert_fsck_clean(bare)
    except AssertionError as error:
        proof.problem(user_id, str(error))
    if merges := merge_commits(bare):
        proof.problem(user_id, f"main is not linear: merge commits {merges}")
    commits_of = remote_commits(bare)
    diffs = DiffStore(proof.client.stack.engine).list(user_id, None, limit=10_000)
    kinds = {d.id: t.kind for t in proof.turns if t.reply for d in t.reply.diffs}
    for diff in diffs:
        where = f"{user_id} diff {diff.id} ({diff.status.value})"
        commits = commits_of.pop(diff.id, [])
        if diff.status is DiffStatus.APPROVED:
            if commits != [diff.commit_sha]:
                proof.problem(where, f"commits {commits} carry its Diff-Id, not {diff.commit_sha}")
        elif commits:
            proof.problem(where, f"commits {commits} carry its Diff-Id")
        kind = kinds.get(diff.id)
        wanted = DiffStatus.REJECTED if kind == "reject" else DiffStatus.APPROVED
        if kind is None:
            proof.problem(where, "proposed but never shown in a reply")
        elif diff.status is not wanted:
            proof.problem(where, f"after {kind} it is {diff.status.value}")
    if commits_of:
        proof.problem(user_id, f"commits of diffs the database does not know: {commits_of}")


def check_recall(proof: Proof, user_id: str) -> None:
    """Each turn's messages in recall, once each: the user's, the proposal, its result, the
    reply; and no turn that was never sent."""
    recall = proof.client.stack.recall
    turns = [turn for turn in proof.turns if turn.user_id == user_id]
    for turn in turns:
        messages = recall.turn(user_id, turn.turn_id)
        roles = [m.role.value for m in messages]
        if roles != ["user", "tool_call", "tool_result", "assistant"]:
            proof.problem(f"{turn.where} recall", f"roles {roles}")
        said = [m.content for m in messages if m.role is MessageRole.USER]
        replied = [m.content for m in messages if m.role is MessageRole.ASSISTANT]
        if said != [turn.message] or replied != [expected_reply(user_id, turn.turn_id)]:
            proof.problem(f"{turn.where} recall", f"user {said!r}, assistant {replied!r}")
    if extra := {m.turn_id for m in recall.recent(user_id, 100_000)} - {t.turn_id for t in turns}:
        proof.problem(user_id, f"recall holds turns never sent: {sorted(extra)}")


async def check_turns(proof: Proof, hosts: list[Host], spread_over: list[Host]) -> Counter[str]:
    """Every turn completed, and activities of turns ran on each host of `spread_over`.
    Returns how many activities of each type each host ran."""
    ran: Counter[str] = Counter()
    for turn in proof.turns:
        handle = proof.handle(turn)
        status = (await handle.describe()).status
        if status is not WorkflowExecutionStatus.COMPLETED:
            proof.problem(turn.where, f"the turn is {status.name if status else 'unknown'}")
        for activity, identity in await activity_runs(handle):
            runner = next((host.name for host in hosts if host.ran(identity)), identity)
            ran[f"{runner} {activity.removeprefix('dmem.')}"] += 1
    for host in spread_over:
        if not any(key.startswith(f"{host.name} ") for key in ran):
            proof.problem(host.name, "ran no activity of any turn: the turns did not spread")
    return ran


def check_crashes(proof: Proof, host: Host) -> None:
    for crash_at, marker in host.crashes:
        if not marker.exists():
            proof.problem(host.name, f"never reached the crash point {crash_at}")


def check_data_dirs(proof: Proof, data_dirs: dict[str, Path]) -> None:
    """A host's data dir holds nothing but its disposable clones: no state of its own."""
    for name, data_dir in data_dirs.items():
        if kept := sorted(p.name for p in data_dir.iterdir() if p.name != CLONES_DIR):
            proof.problem(name, f"its data dir {data_dir} holds {kept} besides the clones")


def seed() -> int:
    chosen = os.environ.get(SEED_VARIABLE)
    return int(chosen) if chosen else random.SystemRandom().randrange(2**32)


def host_settings(client_settings: Settings, data_dir: Path) -> Settings:
    """A host's settings: the client's shared stores and task queue, its own data dir, and
    short activity timeouts so a lost activity is retried soon."""
    memory = client_settings.memory.model_copy(update={"data_dir": data_dir})
    return with_fast_activities(client_settings.model_copy(update={"memory": memory}))


async def test_many_hosts(
    temporal_env: WorkflowEnvironment, postgres_url: str, tmp_path: Path
) -> None:
    chosen = seed()
    print(f"many hosts seed {chosen}: replay with {SEED_VARIABLE}={chosen}")
    rng = random.Random(chosen)
    started = time.monotonic()
    remote = tmp_path / "remote"
    with contextlib.ExitStack() as running:
        server = running.enter_context(git_server(remote))
        model = running.enter_context(ScriptedModelServer([], respond=respond))
        settings = distributed_settings(
            tmp_path / "client" / "data",
            database_url=fresh_schema_url(postgres_url),
            git_remote=server.url,
        )
        stack = stack_from_settings(settings)
        running.callback(stack.close)
        proof = Proof(MemoryClient(temporal_env.client, settings, stack), chosen)
        hosts = [
            Host(
                name,
                host_settings(settings, tmp_path / name / "data"),
                address(temporal_env),
                model.url,
                tmp_path / f"{name}.log",
            )
            for name in ("host-a", "host-b", "host-c")
        ]
        host_a, host_b, host_c = hosts
        for host in hosts:
            running.callback(host.stop)
        plans = [KillPlan(point, 0.0) for point in CRASH_POINTS] + [
            KillPlan(None, rng.uniform(*ALIVE_S)) for _ in range(RANDOM_KILLS)
        ]
        rng.shuffle(plans)
        killer = Killer(host_b, plans, DEAD_S, CRASH_WAIT_S, rng)

        await asyncio.to_thread(host_a.start)
        killing = asyncio.create_task(killer.run())

        def killing_on() -> bool:
            return not killing.done()

        await asyncio.gather(
            *(
                proof.drive_user(user_id, random.Random(f"{chosen}-{user_id}"), killing_on)
                for user_id in USERS
            )
        )
        await killing
        await proof.settle()
        restarted = await approve_through_git_outage(proof, server, remote)
        if restarted is not server:
            running.callback(restarted.stop)
        await fresh_host_serves_old_users(proof, host_c, [host_a, host_b], model, remote)

        ran = await check_turns(proof, hosts, [host_a, host_b])
        check_crashes(proof, host_b)
        check_data_dirs(
            proof,
            {"the client": settings.memory.data_dir}
            | {host.name: host.settings.memory.data_dir for host in hosts},
        )
        for user_id in USERS:
            check_remote(proof, remote, user_id)
            check_recall(proof, user_id)
    print(
        f"seed {chosen}: host B's lives {killer.lives}, {len(proof.turns)} turns, "
        f"{len(model.requests)} model requests, activities {dict(sorted(ran.items()))}, "
        f"{time.monotonic() - started:.0f}s in all"
    )
    logs = ", ".join(str(host.log) for host in hosts)
    assert not proof.problems, (
        f"seed {chosen} ({SEED_VARIABLE}={chosen}), the hosts' stderr in {logs}:\n"
        + "\n".join(proof.problems)
    )
