"""Redacting a version (issue 20 §2): a fact approved three versions ago is redacted; afterwards
no git object (after gc), no SQL row (SQLite with secure_delete, PostgreSQL), no archival
passage and no byte of the data dir holds it; the history keeps its length (plus the record),
authors, dates and trailers; the rewritten commit ids are mapped in the diffs; the next turn
works. The distributed mode's remote (a shared directory, `dmem git-serve`) and another
host's clone keep nothing of it either. Hostile requests get one clear error and change
nothing.
"""

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, open_stack, stack_from_settings
from durable_memory.client import MemoryClient, connect_temporal
from durable_memory.config import Settings
from durable_memory.memory.archive.redaction import count_passages_holding, redact_passages
from durable_memory.memory.core.errors import (
    DurableMemoryError,
    OperationNotApplicable,
    UnknownBlock,
)
from durable_memory.memory.service.redaction import Redactions, redaction_id
from durable_memory.memory.store.redaction.history import REDACTED, rewrite_history
from durable_memory.memory.store.redaction.rows import redact_user_rows
from durable_memory.memory.store.redaction.rows import rows_holding as user_rows_holding
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.diffs import DiffStatus, PendingDiff, Proposer
from durable_memory.models.history import Author, AuthorKind, RedactInput, RedactionRecord
from durable_memory.models.operations import LearnFact, SetField
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.models.turn import turn_workflow_id
from durable_memory.review.app import build_app
from durable_memory.review.server import review_link
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.agent_helpers import edit_block
from tests.support.distributed import two_hosts
from tests.support.postgres import fresh_schema_url
from tests.support.review import open_session, with_review
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import running_rig
from tests.support.worker_process import address, crash_settings, worker_process
from tests.test_forget import all_git_objects, files_holding, rows_holding, tree_bytes
from tests.test_payload_codec import encrypted_settings, event_bytes, raw_history

REVIEW_BASE = "http://review.test"
SECRET = "zqsecret4k"
"""Lower case letters and digits: one token to the full-text indexes."""
FACT = f"lives at {SECRET} st"


def approved(stack: MemoryStack, user_id: str, label: str, operation: object) -> str:
    diff = stack.review.propose(user_id, label, operation, "why", Proposer.turn("t1"))  # type: ignore[arg-type]
    return stack.review.approve(diff.id, "ms-rivera", user_id=user_id).commit_sha or ""


def plant(stack: MemoryStack, user_id: str) -> None:
    """The secret approved into `human`, then three more versions; a pending diff, messages,
    a summary and a passage holding it too."""
    stack.blocks.ensure_user(user_id)
    approved(stack, user_id, "human", LearnFact(fact=FACT))
    approved(stack, user_id, "human", LearnFact(fact="likes chess"))
    approved(stack, user_id, "student", SetField(field="name", value="Alice"))
    approved(stack, user_id, "human", LearnFact(fact="plays the oboe"))
    stack.review.propose(
        user_id, "human", LearnFact(fact=f"moved from {SECRET}"), "fact", Proposer.turn("t2")
    )
    stack.recall.append(
        user_id,
        "t1",
        [
            NewMessage(role=MessageRole.USER, content=f"I live at {SECRET} st"),
            NewMessage(role=MessageRole.ASSISTANT, content=f"noted, {SECRET}"),
        ],
    )
    stack.summaries.add(user_id, 1, f"the student lives at {SECRET}")
    stack.archive.insert(
        NewPassage(user_id=user_id, text=f"address: {SECRET}", source=PassageSource.AGENT)
    )


def facts(stack: MemoryStack, user_id: str) -> list[str]:
    value = stack.blocks.read_block(user_id, "human").fields["facts"]
    assert isinstance(value, list)
    return value


def request(user_id: str = "alice", label: str = "human", text: str = SECRET) -> RedactInput:
    return RedactInput(
        user_id=user_id,
        label=label,
        text=text,
        requested_by="dpo@school",
        reason="a home address approved by mistake",
        redaction_id=redaction_id(user_id, label, text),
    )


def redact_everywhere(stack: MemoryStack, asked: RedactInput) -> RedactionRecord:
    """The workflow's steps, in its order (workflows/redact.py), without Temporal."""
    redactions = Redactions(stack.blocks, stack.git, stack.engine)
    redactions.preflight(asked)
    record = redactions.redact_repository(asked)
    redactions.redact_rows(asked, record.commits)
    redact_passages(stack.archive, asked.user_id, asked.text, record.commits)
    return record


def git_log(repository: Path) -> list[str]:
    """Author, dates and message of every commit, oldest first."""
    return subprocess.run(
        ["git", "-C", str(repository), "log", "--reverse", "--format=%an|%ae|%ad|%cd|%B%x00"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")[:-1]


def check_redacted(stack: MemoryStack, repository: Path, before: list[str]) -> RedactionRecord:
    """Run the redaction and check everything the issue asks of it."""
    record = redact_everywhere(stack, request())
    after = git_log(repository)
    assert len(after) == len(before) + 1  # every version kept, and the record
    assert [entry.replace(SECRET, REDACTED) for entry in before] == after[:-1]
    assert f"Redaction-Id: {record.redaction_id}" in after[-1]
    assert SECRET not in after[-1]
    assert "dpo@school" in after[-1]
    assert SECRET.encode() not in all_git_objects(repository)
    assert user_rows_holding(stack.engine, "alice", SECRET) == 0
    assert count_passages_holding(stack.archive, "alice", SECRET) == 0
    assert stack.archive.count("alice") == 1  # the passage, redacted and embedded again
    assert facts(stack, "alice") == [f"lives at {REDACTED} st", "likes chess", "plays the oboe"]
    # The approved diffs point at the rewritten commits, which exist.
    new_shas = set(record.commits.values())
    decided = stack.review.proposals("alice", "human", [DiffStatus.APPROVED], 50)
    assert decided
    assert all(diff.commit_sha in new_shas for diff in decided)
    # Done is done: run again, it finds its record and changes nothing.
    assert redact_everywhere(stack, request()) == record
    return record


def test_a_fact_approved_three_versions_ago_is_gone_from_every_store(tmp_path: Path) -> None:
    data = tmp_path / "data"
    stack = open_stack(data, profile="essay_coach")
    try:
        plant(stack, "alice")
        plant(stack, "bob")
        bob = tree_bytes(data / "users" / "bob"), all_git_objects(data / "users" / "bob")
        repository = data / "users" / "alice"
        record = check_redacted(stack, repository, git_log(repository))
        assert (tree_bytes(data / "users" / "bob"), all_git_objects(data / "users" / "bob")) == bob
        assert user_rows_holding(stack.engine, "bob", SECRET) > 0  # only alice's were asked
        # The next edit works, on the new history; the text approved again later is redacted
        # by the same request made again (its record found, but a version holds the text).
        approved(stack, "alice", "human", LearnFact(fact=f"back at {SECRET}"))
        again = redact_everywhere(stack, request())
        assert again.record_commit != record.record_commit
        assert SECRET.encode() not in all_git_objects(repository)
        redact_everywhere(stack, request("bob"))
        assert rows_holding(stack, SECRET) == []
    finally:
        stack.close()
    assert files_holding(data, SECRET) == []  # SQLite's free pages, FTS segments, WAL too


@pytest.mark.postgres
def test_postgres_rows_and_passages_are_redacted(tmp_path: Path, postgres_url: str) -> None:
    url = fresh_schema_url(postgres_url)
    stack = open_stack(tmp_path / "data", url, "essay_coach", archive_backend="postgres")
    try:
        plant(stack, "alice")
        repository = tmp_path / "data" / "users" / "alice"
        check_redacted(stack, repository, git_log(repository))
    finally:
        stack.close()


@pytest.mark.parametrize("served", [False, True], ids=["file", "git-serve"])
def test_the_remote_and_every_clone_lose_the_text(tmp_path: Path, served: bool) -> None:
    with two_hosts(tmp_path, served) as (here, there):
        shared = tmp_path / "shared"
        plant(here, "alice")
        there.blocks.read_block("alice", "human")  # the other host clones her memory
        clone = tmp_path / "there" / "clones" / "alice"
        assert SECRET.encode() in all_git_objects(clone)
        bare = shared / "alice.git"
        before = git_log(bare)
        check_redacted(here, tmp_path / "here" / "clones" / "alice", before)
        assert git_log(bare)[:-1] == [entry.replace(SECRET, REDACTED) for entry in before]
        assert SECRET.encode() not in all_git_objects(bare)
        # The other host's clone: reset to the new history before its next read or write,
        # and nothing of the old left in it.
        assert REDACTED in facts(there, "alice")[0]
        assert SECRET.encode() not in all_git_objects(clone)
        approved(there, "alice", "human", LearnFact(fact="reads a lot"))  # writes go on
        assert SECRET.encode() not in all_git_objects(bare)


def test_a_lost_lease_reruns_on_the_new_history_and_redacts_it_too(tmp_path: Path) -> None:
    """Another host approves a diff holding the text while the redaction is being built: the
    redaction's push loses its lease, runs again on the new history, and that commit is
    redacted too: the approval cannot resurrect the text."""
    shared = tmp_path / "shared"
    database = f"sqlite:///{tmp_path / 'shared.db'}"  # the hosts share their database
    here, there = (
        open_stack(tmp_path / h, database, "essay_coach", git_remote=f"file://{shared}")
        for h in ("here", "there")
    )
    try:
        plant(here, "alice")
        pending = here.review.pending("alice")[0]
        redactions = Redactions(here.blocks, here.git, here.engine)
        replace = here.git.replace_history
        raced: list[PendingDiff] = []

        def approve_first(tx: object, old: str, new: str) -> None:
            if not raced:  # the other host's approval lands between the read and the push
                raced.append(there.review.approve(pending.id, "ms-rivera", user_id="alice"))
            replace(tx, old, new)  # type: ignore[arg-type]

        here.git.replace_history = approve_first  # type: ignore[method-assign]
        record = redactions.redact_repository(request())
        assert raced
        assert raced[0].commit_sha in record.commits
        assert SECRET.encode() not in all_git_objects(shared / "alice.git")
        assert facts(there, "alice")[-1] == f"moved from {REDACTED}"
    finally:
        here.close()
        there.close()


def test_a_kill_mid_rewrite_leaves_the_old_history_and_a_rerun_finishes(tmp_path: Path) -> None:
    """New objects written, main not moved (a kill before the compare-and-swap): memory still
    reads the old history; running the redaction again ends exactly as an uninterrupted one."""
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    try:
        plant(stack, "alice")
        head = stack.git.head("alice")
        with stack.git.transaction("alice") as tx:
            assert tx.head is not None
            rewrite_history(
                tx.repo,
                tx.lock,
                tx.head,
                label="human",
                text=SECRET,
                check=lambda _sha, _text: None,
                record=lambda _commits, _n: ("Redact\n", Author(name="x", kind=AuthorKind.USER)),
            )
        assert stack.git.head("alice") == head
        assert FACT in facts(stack, "alice")
        repository = tmp_path / "data" / "users" / "alice"
        check_redacted(stack, repository, git_log(repository))
    finally:
        stack.close()


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[tuple[MemoryStack, Path]]:
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    try:
        plant(stack, "alice")
        stack.blocks.ensure_user("bob")
        yield stack, tmp_path / "data"
    finally:
        stack.close()


@pytest.mark.parametrize(
    ("asked", "error", "message"),
    [
        (request(text="not in any version"), OperationNotApplicable, "no version"),
        (request(user_id="bob"), OperationNotApplicable, "no version"),  # another user's block
        (request(label="student"), OperationNotApplicable, "no version"),
        (request(label="nosuch"), UnknownBlock, "no block 'nosuch'"),
        (request(text=f'{SECRET} st"'), OperationNotApplicable, "invalid"),  # breaks the TOML
        (request(text="redact"), OperationNotApplicable, "marker"),
    ],
    ids=["not-found", "other-user", "other-block", "unknown-block", "breaks-format", "marker"],
)
def test_a_hostile_request_changes_nothing(
    planted: tuple[MemoryStack, Path], asked: RedactInput, error: type[Exception], message: str
) -> None:
    stack, data = planted
    before = snapshot(stack), all_git_objects(data / "users" / "alice"), tree_bytes(data)
    redactions = Redactions(stack.blocks, stack.git, stack.engine)
    for step in (redactions.preflight, redactions.redact_repository):
        with pytest.raises(error, match=message):
            step(asked)
    assert (snapshot(stack), all_git_objects(data / "users" / "alice"), tree_bytes(data)) == before


@pytest.mark.parametrize("text", ["", "   "])
def test_a_blank_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="text"):
        request(text=text)


# -- through Temporal: the client, the workflow, the next turn --------------------------------

SCRIPT: list[dict[str, Any]] = [
    {"content": [edit_block("human", "a fact", operation="learn_fact", value=FACT)]},
    {"text": "Noted."},
    {"text": "Hello again."},
]


async def deleted_soon(env: WorkflowEnvironment, workflow_id: str) -> bool:
    """Whether the execution is gone within a minute: the server deletes in the background
    after DeleteWorkflowExecution returns (a closed execution's, in tens of seconds)."""
    for _ in range(600):
        try:
            await env.client.get_workflow_handle(workflow_id).describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return True
            raise
        await asyncio.sleep(0.1)
    return False


async def test_redact_through_the_client_and_the_next_turn_works(
    temporal_env: WorkflowEnvironment, host: tuple[Settings, Path | None], tmp_path: Path
) -> None:
    """Local repositories, or the distributed mode (PostgreSQL, `dmem git-serve`)."""
    settings = with_review(host[0], tmp_path, REVIEW_BASE)
    remote = host[1]
    data = settings.memory.data_dir
    repositories = [data / ("users" if remote is None else "clones") / "alice"]
    if remote is not None:
        repositories.append(remote / "alice.git")
    async with running_rig(temporal_env.client, settings, SCRIPT) as rig:
        reply = await rig.client.send_message("alice", f"I live at {SECRET} st", turn_id="a1")
        await rig.client.approve(reply.diffs[0].id, "ms-rivera")
        await temporal_env.client.get_workflow_handle(turn_workflow_id("alice", "a1")).result()
        before = snapshot(rig.stack)
        with pytest.raises(DurableMemoryError, match="no version"):
            await rig.client.redact("alice", "human", "absent", "dpo@school", "r")
        with pytest.raises(DurableMemoryError, match="invalid"):
            await rig.client.redact("alice", "human", SECRET, "dpo@school", " ")
        assert snapshot(rig.stack) == before  # refused before anything started

        record = await rig.client.redact(
            "alice", "human", SECRET, "dpo@school", "by mistake", delete_executions=True
        )

        assert record.requested_by == "dpo@school"
        assert record.label == "human"
        assert rows_holding(rig.stack, SECRET) == []
        with pytest.raises(LookupError):  # an ended turn keeps no context to rewrite
            rig.stack.turns.context("alice", "a1")
        for repository in repositories:
            assert SECRET.encode() not in all_git_objects(repository)
        # Its own execution is deleted, and the ended turn whose history held the text.
        for deleted in ("redact:alice", turn_workflow_id("alice", "a1")):
            assert await deleted_soon(temporal_env, deleted), deleted
        # The review page's history of the block shows the record, never the text.
        assert settings.review is not None
        transport = httpx.ASGITransport(app=build_app(rig.client, settings.review))
        async with httpx.AsyncClient(transport=transport, base_url=REVIEW_BASE) as http:
            await open_session(http, review_link(settings.review, "alice"))
            page = (await http.get("/blocks/human")).text
        assert f"redaction-{record.record_commit[:12]}" in page
        assert "by mistake" in page
        assert "dpo@school" in page
        assert SECRET not in page
        again = await rig.client.send_message("alice", "hello", turn_id="a2")
        assert again.reply == "Hello again."
        assert rows_holding(rig.stack, SECRET) == []


async def test_a_redaction_killed_mid_way_is_finished_by_its_retry(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """The worker dies once the history is rewritten and its completion is not yet reported:
    the retry finds the record on main (by its Redaction-Id), the rows and the archive are
    redacted after, and the caller gets the record; running it again changes nothing."""
    settings = crash_settings(tmp_path)
    data = settings.memory.data_dir
    data.mkdir(parents=True)
    stack = stack_from_settings(settings)
    client = MemoryClient(temporal_env.client, settings, stack)
    plant(stack, "alice")
    repository = data / "users" / "alice"
    before = git_log(repository)
    with ScriptedModelServer([]) as model:
        with worker_process(
            settings,
            address(temporal_env),
            model.url,
            "after:dmem.redact_repository",
            tmp_path / "crashed",
        ) as first:
            redacting = asyncio.create_task(
                client.redact("alice", "human", SECRET, "dpo@school", "by mistake")
            )
            assert await asyncio.to_thread(first.wait, 60) == -9
        assert (tmp_path / "crashed").exists()
        assert rows_holding(stack, SECRET)  # the repository done, the rows not yet
        with worker_process(settings, address(temporal_env), model.url):
            record = await asyncio.wait_for(redacting, 120)
            again = await client.redact("alice", "human", SECRET, "dpo@school", "by mistake")
    stack.close()
    assert again == record
    assert len(git_log(repository)) == len(before) + 1
    assert files_holding(data, SECRET) == []


async def test_with_per_user_encryption_the_histories_are_searched_through_the_codec(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """The redaction's own payloads are encrypted with the user's key (its input holds the
    text), and `delete_executions` finds the ended turn holding the text through the codec,
    since its raw history holds only ciphertext."""
    settings = encrypted_settings(tmp_path)
    address = temporal_env.client.service_client.config.target_host
    settings = settings.model_copy(
        update={"temporal": settings.temporal.model_copy(update={"address": address})}
    )
    client = await connect_temporal(settings)
    async with running_rig(client, settings, SCRIPT) as rig:
        reply = await rig.client.send_message("alice", f"I live at {SECRET} st", turn_id="a1")
        await rig.client.approve(reply.diffs[0].id, "ms-rivera")
        await client.get_workflow_handle(turn_workflow_id("alice", "a1")).result()
        assert SECRET.encode() not in event_bytes(
            await raw_history(temporal_env, turn_workflow_id("alice", "a1"))
        )
        await rig.client.redact(
            "alice", "human", SECRET, "dpo@school", "by mistake", delete_executions=True
        )
        assert await deleted_soon(temporal_env, turn_workflow_id("alice", "a1"))
        assert rows_holding(rig.stack, SECRET) == []


@pytest.mark.parametrize("text", ["pending", "fact", "learn_fact", "op", "t2", "human", "turn"])
def test_a_text_that_is_also_an_id_a_status_or_a_key_edits_only_content(
    planted: tuple[MemoryStack, Path], text: str
) -> None:
    """Statuses, ids, labels and JSON keys are never edited, so every row reads back."""
    stack, _ = planted
    pending = stack.review.pending("alice")
    redact_user_rows(stack.engine, "alice", text, {})
    after = stack.review.pending("alice")
    assert [(d.id, d.status, d.label, d.proposed_by) for d in after] == [
        (d.id, d.status, d.label, d.proposed_by) for d in pending
    ]
    assert stack.recall.count("alice") == 2
