"""Forgetting a user (issue 20 §1): a canary string planted everywhere a user's content goes
(a message, a reply, a block value, an approved and a pending diff, an archived passage, a
summary, a tool result) is found nowhere afterwards: not in any store, not in any byte of the
data dir (our SQLite files included), not on the git remote, not in PostgreSQL, and no
Temporal execution of the user is left. Another user's memory is byte-identical. A forget
killed half-way and run again ends the same; a turn while a forget is under way is refused.
"""

import asyncio
import concurrent.futures
import contextlib
import hashlib
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from durable_memory.activities.forget import user_workflows_query
from durable_memory.bootstrap import MemoryStack, open_stack, stack_from_settings
from durable_memory.client import MemoryClient, TurnFailed
from durable_memory.config import Settings
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    UnknownUser,
    UserBeingForgotten,
    UserForgotten,
)
from durable_memory.memory.store.bare_repos import bare_repository_path
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.diffs import Proposer
from durable_memory.models.operations import LearnFact, SetField
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.models.turn import ForgetStore, StepInput, TurnInput, turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workers.worker import drop_forgotten_clones_until
from tests.support.agent_helpers import edit_block, tool_use
from tests.support.distributed import (
    GIT_TOKEN,
    distributed_settings,
    git_server,
    restart_git_server,
    start_git_server,
    two_hosts,
)
from tests.support.postgres import fresh_schema_url
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import rig_settings, running_rig
from tests.support.worker_process import address, crash_settings, worker_process

CANARY = "zqcanary7x"
"""Lower case letters and digits: one token to the full-text indexes, which fold case."""

SCRIPT: list[dict[str, Any]] = [
    # bob's turn: memory of his own, approved, that the forget must leave byte-identical
    {"content": [edit_block("student", "he said so", field="name", operation="set", value="Bob")]},
    {"text": "Welcome, Bob."},
    # alice's turn: the canary in a block value (approved), a pending diff, a passage, a tool
    # result (the search finds the passage) and the reply
    {
        "content": [
            edit_block("student", "her name", field="name", operation="set", value=f"A {CANARY}"),
            edit_block("human", "a fact", operation="learn_fact", value=f"lives at {CANARY} st"),
            tool_use("archival_memory_insert", content=f"her secret is {CANARY}"),
        ]
    },
    {"content": [tool_use("archival_memory_search", query=f"secret {CANARY}")]},
    {"text": f"I will keep {CANARY} in mind."},
]


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under `root` whose bytes hold `needle` (as written, or in lower case)."""
    wanted = (needle.encode(), needle.lower().encode())
    return sorted(
        str(path.relative_to(root))
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink() and any(w in path.read_bytes() for w in wanted)
    )


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def rows_holding(stack: MemoryStack, needle: str) -> list[str]:
    """`table: row` for every SQL row (of our tables and the archive's) holding `needle`."""
    found = []
    with stack.engine.connect() as conn:
        for table in inspect(stack.engine).get_table_names():
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                if needle in repr(tuple(row)).lower():
                    found.append(f"{table}: {tuple(row)!r:.200}")
    return found


def user_rows(stack: MemoryStack, user_id: str) -> dict[str, list[str]]:
    """Every row of the user in every table keyed by user."""
    rows = {}
    with stack.engine.connect() as conn:
        for table in inspect(stack.engine).get_table_names():
            columns = {c["name"] for c in inspect(stack.engine).get_columns(table)}
            if "user_id" in columns:
                query = text(f'SELECT * FROM "{table}" WHERE user_id = :u')
                rows[table] = sorted(repr(tuple(r)) for r in conn.execute(query, {"u": user_id}))
    return rows


def plant(stack: MemoryStack, user_id: str) -> None:
    """The canary everywhere a user's content goes, without a turn: a block value and an
    approved diff, a pending diff, messages (a tool result among them), a passage, a summary."""
    stack.blocks.ensure_user(user_id)
    approved = stack.review.propose(
        user_id, "student", SetField(field="name", value=f"A {CANARY}"), "name", Proposer.turn("t1")
    )
    stack.review.approve(approved.id, "ms-rivera", user_id=user_id)
    stack.review.propose(
        user_id, "human", LearnFact(fact=f"lives at {CANARY} st"), "fact", Proposer.turn("t1")
    )
    stack.recall.append(
        user_id,
        "t1",
        [
            NewMessage(role=MessageRole.USER, content=f"my secret is {CANARY}"),
            NewMessage(role=MessageRole.TOOL_RESULT, content=f"found: {CANARY}", tool_call_id="x"),
            NewMessage(role=MessageRole.ASSISTANT, content=f"noted {CANARY}"),
        ],
    )
    stack.archive.insert(
        NewPassage(user_id=user_id, text=f"her secret is {CANARY}", source=PassageSource.AGENT)
    )
    stack.summaries.add(user_id, 1, f"the student told {CANARY}")


def forget_every_store(stack: MemoryStack, user_id: str) -> None:
    for store in ForgetStore:
        stack.forget_in(user_id, store)


# -- the store steps, without Temporal ---------------------------------------------------------


def test_every_store_forgets_the_user_and_nothing_else(tmp_path: Path) -> None:
    data = tmp_path / "data"
    stack = open_stack(data, profile="essay_coach")
    try:
        plant(stack, "alice")
        plant(stack, "alice-b")  # a user whose id starts with the other's
        stack.blocks.ensure_user("bob")
        before = tree_bytes(data / "users" / "bob"), user_rows(stack, "bob")
        assert files_holding(data, CANARY)
        forget_every_store(stack, "alice")
        forget_every_store(stack, "alice")  # idempotent: nothing left to do, no error
        assert not (data / "users" / "alice").exists()
        assert stack.archive.count("alice") == 0
        assert all(rows == [] for rows in user_rows(stack, "alice").values())
        assert stack.archive.count("alice-b") == 1  # the other user is untouched
        assert (tree_bytes(data / "users" / "bob"), user_rows(stack, "bob")) == before
        forget_every_store(stack, "alice-b")
        assert rows_holding(stack, CANARY) == []
    finally:
        stack.close()
    # Not one byte of the canary in the data dir: SQLite files (free pages, FTS segments,
    # WAL) included.
    assert files_holding(data, CANARY) == []


@pytest.mark.postgres
def test_postgres_stores_forget_the_user(tmp_path: Path, postgres_url: str) -> None:
    url = fresh_schema_url(postgres_url)
    stack = open_stack(tmp_path / "data", url, "essay_coach", archive_backend="postgres")
    try:
        plant(stack, "alice")
        plant(stack, "bob")
        bob = user_rows(stack, "bob"), [p.id for p in stack.archive.page("bob")]
        forget_every_store(stack, "alice")
        assert all(rows == [] for rows in user_rows(stack, "alice").values())
        assert stack.archive.count("alice") == 0
        assert (user_rows(stack, "bob"), [p.id for p in stack.archive.page("bob")]) == bob
        forget_every_store(stack, "bob")
        assert rows_holding(stack, CANARY) == []
    finally:
        stack.close()


def test_a_file_remote_loses_the_repository_and_keeps_the_others(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    stack = open_stack(tmp_path / "data", profile="essay_coach", git_remote=f"file://{shared}")
    try:
        plant(stack, "alice")
        stack.blocks.ensure_user("bob")
        bob = tree_bytes(bare_repository_path(shared, "bob"))
        assert files_holding(shared, CANARY) or (shared / "alice.git").is_dir()
        assert stack.forget_in("alice", ForgetStore.REPOSITORY) == 2  # the remote and the clone
        assert stack.forget_in("alice", ForgetStore.REPOSITORY) == 0
        assert sorted(p.name for p in shared.iterdir()) == ["bob.git"]
        assert not (tmp_path / "data" / "clones" / "alice").exists()
        assert tree_bytes(bare_repository_path(shared, "bob")) == bob
    finally:
        stack.close()


def all_git_objects(repository: Path) -> bytes:
    """Every object in a repository, uncompressed (loose and packed, reachable or not)."""
    return subprocess.run(
        ["git", "-C", str(repository), "cat-file", "--batch-all-objects", "--batch"],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout


@pytest.mark.parametrize("served", [False, True], ids=["file", "git-serve"])
def test_another_hosts_clone_keeps_nothing_once_it_meets_the_forgotten_user(
    tmp_path: Path, served: bool
) -> None:
    with two_hosts(tmp_path, served) as (here, there):
        plant(here, "alice")
        there.blocks.read_block("alice", "student")  # the other host clones her memory
        clone = tmp_path / "there" / "clones" / "alice"
        assert CANARY.encode() in all_git_objects(clone)
        forget_every_store(here, "alice")
        with pytest.raises(UnknownUser):  # the other host finds no memory of her, and drops it
            there.blocks.read_block("alice", "student")
        assert not clone.exists() or CANARY.encode() not in all_git_objects(clone)
        there.blocks.ensure_user("alice")  # a new user of that id starts empty
        assert CANARY.encode() not in all_git_objects(clone)


@pytest.mark.parametrize("served", [False, True], ids=["file", "git-serve"])
def test_every_hosts_clone_of_a_forgotten_user_is_dropped_by_its_own_sweep(
    tmp_path: Path, served: bool
) -> None:
    """The forget's repository step runs on one host; the other host's clone of the user is
    deleted by that host's periodic sweep (workers/worker.py), found through the shared
    erasure ledger, without anything of another user's clone changing."""
    shared_db = f"sqlite:///{tmp_path / 'shared.db'}"
    with two_hosts(tmp_path, served, shared_db) as (here, there):
        plant(here, "alice")
        here.blocks.ensure_user("bob")
        for user in ("alice", "bob"):
            there.blocks.read_block(user, "student")  # the other host clones both
        clones = tmp_path / "there" / "clones"
        bob = tree_bytes(clones / "bob")
        assert there.blocks.drop_forgotten_clones() == []  # nobody is forgotten yet
        here.erasures.begin("alice", "dpo@school", "asked")
        forget_every_store(here, "alice")
        here.erasures.complete("alice")
        assert CANARY.encode() in all_git_objects(clones / "alice")  # out of the forget's reach
        assert there.blocks.drop_forgotten_clones() == ["alice"]
        assert not (clones / "alice").exists()
        assert tree_bytes(clones / "bob") == bob
        assert there.blocks.drop_forgotten_clones() == []  # idempotent


async def test_a_worker_sweeps_its_clones_of_forgotten_users_until_stopped(tmp_path: Path) -> None:
    with two_hosts(tmp_path, False, f"sqlite:///{tmp_path / 'shared.db'}") as (here, there):
        plant(here, "alice")
        there.blocks.read_block("alice", "student")
        clone = tmp_path / "there" / "clones" / "alice"
        stop = asyncio.Event()
        sweeping = asyncio.create_task(drop_forgotten_clones_until(stop, there, 0.05))
        here.erasures.begin("alice", "dpo@school", "asked")  # a forget under way closes her
        for _ in range(600):
            if not clone.exists():
                break
            await asyncio.sleep(0.05)
        assert not clone.exists()
        stop.set()
        await asyncio.wait_for(sweeping, 30)


def test_a_kill_after_the_rename_is_finished_by_the_next_attempt(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    stack = open_stack(tmp_path / "data", profile="essay_coach", git_remote=f"file://{shared}")
    try:
        stack.blocks.ensure_user("alice")
        # What a kill between the rename and the delete leaves: the repository parked.
        (shared / "alice.git").rename(shared / ".forget.alice.git")
        assert stack.forget_in("alice", ForgetStore.REPOSITORY) == 2
        assert list(shared.iterdir()) == []
    finally:
        stack.close()


def test_git_serve_deletes_a_repository_only_with_the_token(tmp_path: Path) -> None:
    root = tmp_path / "served"
    with git_server(root) as server:
        stack = open_stack(
            tmp_path / "data", profile="essay_coach", git_remote=server.url, git_token=GIT_TOKEN
        )
        try:
            stack.blocks.ensure_user("alice")
            stack.blocks.ensure_user("bob")
            bob = tree_bytes(root / "bob.git")
            anonymous = urllib.request.Request(f"{server.url}/alice.git", method="DELETE")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(anonymous, timeout=30)
            assert refused.value.code == 401
            assert (root / "alice.git").is_dir()
            assert stack.forget_in("alice", ForgetStore.REPOSITORY) == 2
            assert stack.forget_in("alice", ForgetStore.REPOSITORY) == 0  # 404: gone already
            assert sorted(p.name for p in root.iterdir()) == ["bob.git"]
            assert tree_bytes(root / "bob.git") == bob
        finally:
            stack.close()


def test_a_user_being_forgotten_gets_no_memory_made_again(tmp_path: Path) -> None:
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    try:
        stack.erasures.begin("alice", "dpo", "request 12")
        with pytest.raises(UserBeingForgotten, match="being forgotten"):
            stack.blocks.ensure_user("alice")
        assert not (tmp_path / "data" / "users" / "alice").exists()
        stack.blocks.ensure_user("bob")  # others are served
        record = stack.erasures.complete("alice")
        assert record.user_hash == hashlib.sha256(b"alice").hexdigest()
        assert (record.requested_by, record.reason) == ("dpo", "request 12")
        assert record.completed_at is not None
        # Once completed, nothing is made for the user again unless a caller asks for a
        # fresh start.
        with pytest.raises(UserForgotten, match="fresh_user=True"):
            stack.blocks.ensure_user("alice")
        assert not (tmp_path / "data" / "users" / "alice").exists()
        stack.blocks.ensure_user("alice", fresh=True)
    finally:
        stack.close()


# -- the workflow, on a real Temporal dev server -----------------------------------------------


async def listed(env: WorkflowEnvironment, query: str) -> list[str]:
    return [w.id async for w in env.client.list_workflows(query)]


async def assert_no_execution_of(env: WorkflowEnvironment, user_id: str, known: str) -> None:
    for _ in range(100):  # visibility trails the deletion by a moment
        if not await listed(env, user_workflows_query(user_id)):
            break
        await asyncio.sleep(0.1)
    assert await listed(env, user_workflows_query(user_id)) == []
    with pytest.raises(RPCError) as missing:
        await env.client.get_workflow_handle(known).describe()
    assert missing.value.status == RPCStatusCode.NOT_FOUND


async def test_forget_leaves_no_trace_anywhere(
    temporal_env: WorkflowEnvironment, host: tuple[Settings, Path | None]
) -> None:
    settings, remote = host
    data = settings.memory.data_dir
    data.mkdir(parents=True, exist_ok=True)
    repositories = data / ("users" if remote is None else "clones")
    async with running_rig(temporal_env.client, settings, SCRIPT) as rig:
        client = rig.client
        bob = await client.send_message("bob", "Hi, I'm Bob", turn_id="b1")
        await client.approve(bob.diffs[0].id, "ms-rivera")
        reply = await client.send_message("alice", f"My secret is {CANARY}", turn_id="a1")
        assert CANARY in reply.reply
        assert len(reply.diffs) == 2
        await client.approve(reply.diffs[0].id, "ms-rivera")  # the other stays pending
        rig.stack.summaries.add("alice", 1, f"the student told {CANARY}")
        assert rows_holding(rig.stack, CANARY)
        assert (repositories / "alice").is_dir()
        bob_before = (
            tree_bytes(repositories / "bob"),
            user_rows(rig.stack, "bob"),
            tree_bytes(remote / "bob.git") if remote else {},
        )

        record = await client.forget_user("alice", "dpo@school", "erasure request 7")

        assert record.completed_at is not None
        assert record.requested_by == "dpo@school"
        await assert_no_execution_of(temporal_env, "alice", turn_workflow_id("alice", "a1"))
        assert not (repositories / "alice").exists()
        assert files_holding(data, CANARY) == []  # SQLite's files too, when they are here
        assert rows_holding(rig.stack, CANARY) == []  # every table, the archive's included
        if remote is not None:
            assert sorted(p.name for p in remote.iterdir()) == ["bob.git"]
        assert (
            tree_bytes(repositories / "bob"),
            user_rows(rig.stack, "bob"),
            tree_bytes(remote / "bob.git") if remote else {},
        ) == bob_before
        # What is left in Temporal (bob's turn) holds nothing of alice.
        queue = settings.temporal.task_queue
        for workflow_id in await listed(temporal_env, f"TaskQueue = '{queue}'"):
            history = await temporal_env.client.get_workflow_handle(workflow_id).fetch_history()
            # The events' own bytes: to_json would hide a payload's text in base64.
            assert not any(CANARY.encode() in e.SerializeToString() for e in history.events)


async def test_a_turn_is_refused_while_the_user_is_being_forgotten(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, [{"text": "hello"}]) as rig:
        before = snapshot(rig.stack)
        for user, who, why in (("../x", "dpo", "r"), ("carol", " ", "r"), ("carol", "dpo", "")):
            with pytest.raises(DurableMemoryError, match="invalid"):
                await rig.client.forget_user(user, who, why)
        assert snapshot(rig.stack) == before  # refused before anything started
        rig.stack.erasures.begin("carol", "dpo", "request 9")
        with pytest.raises(TurnFailed, match="being forgotten"):
            await rig.client.send_message("carol", "hi", turn_id="c1")
        assert not (settings.memory.data_dir / "users" / "carol").exists()
        await rig.client.forget_user("carol", "dpo", "request 9")  # finishes the one begun
        await assert_no_execution_of(temporal_env, "carol", turn_workflow_id("carol", "c1"))
        assert [r.reason for r in rig.stack.erasures.records("carol")] == ["request 9"]


async def retried_after(env: WorkflowEnvironment, workflow_id: str, failure: str) -> None:
    """Return once a step of the workflow failed saying `failure` and waits to be retried."""
    handle = env.client.get_workflow_handle(workflow_id)
    for _ in range(600):
        with contextlib.suppress(RPCError):  # not started yet
            for pending in (await handle.describe()).raw_description.pending_activities:
                if pending.attempt >= 2 and failure in pending.last_failure.message:
                    return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{workflow_id} never retried after {failure!r}")


@pytest.mark.postgres
async def test_a_forget_waits_out_a_git_remote_outage(
    temporal_env: WorkflowEnvironment, tmp_path: Path, postgres_url: str
) -> None:
    root = tmp_path / "served"
    server = start_git_server(root)
    try:
        settings = distributed_settings(
            tmp_path / "data", database_url=fresh_schema_url(postgres_url), git_remote=server.url
        )
        async with running_rig(temporal_env.client, settings, []) as rig:
            plant(rig.stack, "alice")
            server.stop()
            forgetting = asyncio.create_task(rig.client.forget_user("alice", "dpo", "request 5"))
            await retried_after(temporal_env, "forget:alice", "the git remote is unavailable")
            assert (root / "alice.git").is_dir()  # nothing is lost while it waits
            server = restart_git_server(server, root)
            record = await asyncio.wait_for(forgetting, 120)
            assert record.completed_at is not None
            assert not (root / "alice.git").exists()
            assert rows_holding(rig.stack, CANARY) == []
    finally:
        server.stop()


async def test_a_forget_killed_mid_way_ends_fully_forgotten_when_run_again(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = crash_settings(tmp_path)
    data = settings.memory.data_dir
    data.mkdir(parents=True)
    stack = stack_from_settings(settings)
    client = MemoryClient(temporal_env.client, settings, stack)
    plant(stack, "alice")
    stack.blocks.ensure_user("bob")
    bob = tree_bytes(data / "users" / "bob")
    with ScriptedModelServer([]) as model:
        with worker_process(
            settings,
            address(temporal_env),
            model.url,
            "after:dmem.forget_store",  # the archive emptied, the rest not yet
            tmp_path / "crashed",
        ) as first:
            forgetting = asyncio.create_task(client.forget_user("alice", "dpo", "request 3"))
            assert await asyncio.to_thread(first.wait, 60) == -9
        assert (tmp_path / "crashed").exists()
        assert stack.archive.count("alice") == 0
        assert (data / "users" / "alice").exists()
        with pytest.raises(UserBeingForgotten):  # half-forgotten: still closed to turns
            stack.blocks.ensure_user("alice")
        with worker_process(settings, address(temporal_env), model.url):
            record = await asyncio.wait_for(forgetting, 120)
            # Run again once it is done: it completes again, finding nothing.
            again = await client.forget_user("alice", "dpo", "request 3")
    stack.close()
    assert record.completed_at is not None
    assert again.completed_at is not None
    assert files_holding(data, CANARY) == []
    assert tree_bytes(data / "users" / "bob") == bob
    await assert_no_execution_of(temporal_env, "alice", "forget:alice")


def test_a_forgotten_user_stays_forgotten_until_a_caller_starts_them_afresh(
    tmp_path: Path,
) -> None:
    """A model call that began before the forget and answers after it stores nothing (its
    reply carries the canary); a later turn of the user is refused with UserForgotten, and
    makes nothing; a turn that asks for a fresh user starts one with an empty memory."""
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    asked, release = threading.Event(), threading.Event()

    def respond(_request: dict[str, Any]) -> dict[str, Any]:
        asked.set()
        assert release.wait(60)
        return {"text": f"a late reply {CANARY}"}

    with (
        ScriptedModelServer([], respond=respond) as server,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        model = AnthropicModel(base_url=server.url)
        steps = stack.turn_steps(model)
        steps.prepare(TurnInput(user_id="alice", turn_id="t1", message="hello"))
        late = pool.submit(steps.call_model, StepInput(user_id="alice", turn_id="t1", step=1))
        assert asked.wait(60)
        stack.erasures.begin("alice", "dpo@school", "request 12")
        for store in ForgetStore:
            stack.forget_in("alice", store)
        stack.erasures.complete("alice")
        release.set()
        with pytest.raises(UserForgotten, match="was forgotten"):
            late.result(60)
        after_forget = user_rows(stack, "alice")
        assert all(rows == [] for rows in after_forget.values()), after_forget
        assert files_holding(tmp_path / "data", CANARY) == []
        with pytest.raises(UserForgotten, match="fresh_user=True"):
            steps.prepare(TurnInput(user_id="alice", turn_id="t2", message="again"))
        assert user_rows(stack, "alice") == after_forget
        assert not stack.git.repo_path("alice").exists()
        steps.prepare(TurnInput(user_id="alice", turn_id="t3", message="again", fresh_user=True))
        assert stack.blocks.read_block("alice", "student").fields["name"] is None
        (record,) = stack.erasures.records("alice")
        assert record.readmitted_at is not None
        model.close()
    stack.close()
