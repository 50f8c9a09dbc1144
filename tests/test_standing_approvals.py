"""Standing approvals (issue 20, section 3): a person approves ahead of time the agent's edits
of some kinds to one block, as a commit of the user's `policies.toml`. A matching proposal is
approved and committed at once, naming the policy (`Approved-By: standing:<id>`) and the
person who set it; anything else waits for a person as before; a block the profile marks
`never_pre_approved` is refused; a revocation counts for the next proposal; an expired policy
approves nothing; a policies record pushed by hand that is not trusted is one error and
changes nothing. Turns on a real Temporal dev server show an edit approved this way, and
committed exactly once by a worker restarted after it was killed in the middle of the commit.
With a git remote, a policy set or revoked on one host counts on another. Claude's memory tool
is told when its edit was committed this way."""

import asyncio
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, open_stack, stack_from_settings
from durable_memory.cli import main
from durable_memory.client import MemoryClient
from durable_memory.faults import MID_COMMIT
from durable_memory.memory.core.errors import DurableMemoryError, HandEditPending
from durable_memory.memory.core.policies import (
    PolicyError,
    StandingApproval,
    format_policies,
    parse_expiry,
)
from durable_memory.models.diffs import DiffStatus, PendingDiff, Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddContext, AppendText, EditOperation, LearnFact
from durable_memory.models.turn import RotationOutcome
from durable_memory.scripted_model import ScriptedModelServer
from durable_memory.workflows.turn import TurnWorkflow
from tests.support.agent_helpers import edit_block, git_status, run_scripted_turn, tool_results
from tests.support.git_checks import git_output
from tests.support.memory import memory_rig
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import (
    current_details,
    rig_settings,
    running_rig,
    turn_outcome,
    workflow_result,
)
from tests.support.worker_process import address, crash_settings, worker_process
from tests.test_memory_tool import NOTES, NOTES_MARKDOWN, claude_profile, memory_call
from tests.test_remote_store import Remote, host

TEACHER = "ms-rivera"
IN_A_MONTH = timedelta(days=30)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[MemoryStack]:
    stack = open_stack(tmp_path / "data", profile="default")  # persona, human, notes
    stack.blocks.ensure_user("ann")
    yield stack
    stack.close()


def _propose(
    stack: MemoryStack, label: str, op: EditOperation, diff_id: str | None = None
) -> PendingDiff:
    return stack.review.propose("ann", label, op, "r", Proposer.turn("t1"), diff_id=diff_id)


def _notes_policy(stack: MemoryStack) -> StandingApproval:
    """Context notes on `human` are approved ahead of time."""
    return stack.policies.set(
        "ann", "human", ["add_context"], TEACHER, datetime.now(UTC) + IN_A_MONTH, "small notes"
    )


def _log(stack: MemoryStack, *args: str) -> str:
    return git_output(stack.git.repo_path("ann"), "log", *args)


def test_a_matching_edit_is_committed_at_once_naming_the_policy_and_others_wait(
    stack: MemoryStack,
) -> None:
    policy = _notes_policy(stack)
    diff = _propose(stack, "human", AddContext(note="prefers mornings"), diff_id="a" * 32)
    assert diff.status is DiffStatus.APPROVED
    assert diff.commit_sha is not None
    assert diff.standing_approval == policy.id
    assert "prefers mornings" in stack.blocks.read_block("ann", "human").value
    [commit] = stack.history.log("ann", limit=1)
    assert commit.sha == diff.commit_sha
    assert commit.author == TEACHER  # the person who set the policy
    assert commit.trailers["Approved-By"] == f"standing:{policy.id}"
    assert commit.trailers["Standing-Approval-Set-By"] == TEACHER
    assert commit.trailers["Diff-Id"] == diff.id
    # Exactly once: the same tool call proposed again (a retried activity) commits nothing.
    again = _propose(stack, "human", AddContext(note="prefers mornings"), diff_id="a" * 32)
    assert again.commit_sha == diff.commit_sha
    assert _log(stack, "--format=%H").split()[0] == diff.commit_sha

    # Another operation on the same block, and the same operation on another block, wait.
    other_op = _propose(stack, "human", LearnFact(fact="likes chess"))
    other_block = _propose(stack, "notes", AppendText(content="a note"))
    assert [d.status for d in (other_op, other_block)] == [DiffStatus.PENDING] * 2
    assert stack.history.log("ann", limit=1)[0].sha == diff.commit_sha


def test_the_policy_change_itself_is_in_the_users_history(stack: MemoryStack) -> None:
    policy = _notes_policy(stack)
    revoked = stack.policies.revoke("ann", policy.id, "dr-okafor")
    assert revoked.revoked_by == "dr-okafor"
    newest, older = stack.history.log("ann", limit=2)
    assert (older.author, older.trailers["Policy-Action"]) == (TEACHER, "set")
    assert (newest.author, newest.trailers["Policy-Action"]) == ("dr-okafor", "revoke")
    assert {older.trailers["Policy-Id"], newest.trailers["Policy-Id"]} == {policy.id}
    assert "add_context on 'human'" in older.message
    [listed] = stack.policies.approvals("ann")
    assert listed == revoked  # kept, with who revoked it and when


def test_a_block_that_may_never_be_pre_approved_is_refused(stack: MemoryStack) -> None:
    before = snapshot(stack)
    later = datetime.now(UTC) + IN_A_MONTH
    refusals: list[tuple[Callable[[], object], str]] = [
        (lambda: stack.policies.set("ann", "persona", ["rethink"], TEACHER, later), "never be"),
        (lambda: stack.policies.set("ann", "human", ["erase"], TEACHER, later), "unknown op"),
        (lambda: stack.policies.set("ann", "nope", ["append"], TEACHER, later), "no block"),
        (
            lambda: stack.policies.set(
                "ann", "notes", ["append"], TEACHER, datetime.now(UTC) - timedelta(hours=1)
            ),
            "in the future",
        ),
        (
            lambda: stack.policies.set(
                "ann", "notes", ["append"], TEACHER, datetime.now(UTC) + timedelta(days=999)
            ),
            "at most",
        ),
        (lambda: stack.policies.set("ann", "notes", ["append"], "standing:x", later), "person"),
    ]
    for attempt, problem in refusals:
        with pytest.raises(DurableMemoryError, match=problem):
            attempt()
    assert stack.policies.approvals("ann") == []
    assert snapshot(stack) == before
    # A person's decision can never pass for a standing approval's.
    diff = _propose(stack, "notes", AppendText(content="x"))
    with pytest.raises(DurableMemoryError, match="names a standing approval"):
        stack.review.approve(diff.id, "standing:0123456789ab", user_id="ann")


def test_revocation_counts_for_the_next_proposal(stack: MemoryStack) -> None:
    policy = _notes_policy(stack)
    assert _propose(stack, "human", AddContext(note="one")).status is DiffStatus.APPROVED
    stack.policies.revoke("ann", policy.id, TEACHER)
    assert _propose(stack, "human", AddContext(note="two")).status is DiffStatus.PENDING
    with pytest.raises(PolicyError, match="already revoked"):
        stack.policies.revoke("ann", policy.id, TEACHER)


def _commit_policies_by_hand(stack: MemoryStack, text: str) -> None:
    repo = stack.git.repo_path("ann")
    (repo / "policies.toml").write_text(text, encoding="utf-8")
    git_output(repo, "add", "policies.toml")
    git_output(repo, "commit", "-q", "-m", "by hand")


def test_a_hand_edit_of_the_record_is_never_read_nor_overwritten(stack: MemoryStack) -> None:
    (stack.git.repo_path("ann") / "policies.toml").write_text(
        format_policies([_approval()]), encoding="utf-8"
    )
    assert stack.policies.approvals("ann") == []  # HEAD's record (none), not this file
    assert _propose(stack, "human", AddContext(note="x")).status is DiffStatus.PENDING
    before = snapshot(stack)
    with pytest.raises(HandEditPending, match=r"policies\.toml of user 'ann' has changes made"):
        _notes_policy(stack)
    assert snapshot(stack) == before


def _approval(**changes: object) -> StandingApproval:
    now = datetime.now(UTC)
    fields: dict[str, object] = {
        "id": "0123456789ab",
        "label": "human",
        "operations": ("add_context",),
        "set_by": TEACHER,
        "set_at": now - timedelta(days=2),
        "expires_at": now + IN_A_MONTH,
    }
    return StandingApproval.model_validate({**fields, **changes})


def test_an_expired_policy_approves_nothing(stack: MemoryStack) -> None:
    expired = _approval(expires_at=datetime.now(UTC) - timedelta(days=1))
    _commit_policies_by_hand(stack, format_policies([expired]))
    assert _propose(stack, "human", AddContext(note="late")).status is DiffStatus.PENDING
    assert main(["--data-dir", str(stack.git.data_dir), "policy", "list", "ann"]) == 0


HOSTILE = {
    "not TOML": ("[[approval]\nid = ", "not valid TOML"),
    "a forbidden block": (format_policies([_approval(label="persona")]), "never be"),
    "an unknown block": (format_policies([_approval(label="diary")]), "no block 'diary'"),
    "an unknown operation": (format_policies([_approval()]).replace("add_context", "wipe"), "wipe"),
    "an unknown key": (format_policies([_approval()]) + "sneaky = 1\n", "sneaky"),
    "a name that is no identity": (
        format_policies([_approval()]).replace(TEACHER, "x <evil@example.com>"),
        "set_by",
    ),
    "a duplicate id": (format_policies([_approval(), _approval()]), "appears twice"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_policies_record_is_one_error_and_changes_nothing(
    stack: MemoryStack, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, problem = HOSTILE[case]
    _commit_policies_by_hand(stack, text)
    before = snapshot(stack)
    attempts: list[Callable[[], object]] = [
        lambda: _propose(stack, "human", AddContext(note="x")),
        lambda: stack.policies.approvals("ann"),
        lambda: stack.policies.set(
            "ann", "human", ["add_context"], TEACHER, datetime.now(UTC) + IN_A_MONTH
        ),
        lambda: stack.policies.revoke("ann", "0123456789ab", TEACHER),
    ]
    for attempt in attempts:
        with pytest.raises(PolicyError) as refused:
            attempt()
        assert problem in str(refused.value)
        assert "users/ann/policies.toml" in str(refused.value)
    code = main(["--data-dir", str(stack.git.data_dir), "policy", "list", "ann"])
    _, err = capsys.readouterr()
    assert (code, err.count("\n")) == (2, 1)
    assert problem in err
    assert snapshot(stack) == before


def test_cli_sets_lists_and_revokes(stack: MemoryStack, capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data-dir", str(stack.git.data_dir)]
    set_ = ["policy", "set", "ann", "--block", "human", "--operation", "add_context"]
    assert main([*data, *set_, "--expires", "30d", "--as", TEACHER]) == 0
    [policy] = stack.policies.approvals("ann")
    assert (policy.label, policy.operations, policy.set_by) == ("human", ("add_context",), TEACHER)
    out, _ = capsys.readouterr()
    assert f"{policy.id}  live" in out
    assert f"set by {TEACHER}" in out
    assert main([*data, *set_, "--expires", "tomorrow", "--as", TEACHER]) == 2
    assert main([*data, "policy", "revoke", "ann", policy.id, "--as", TEACHER]) == 0
    out, _ = capsys.readouterr()
    assert f"{policy.id}  revoked" in out
    assert parse_expiry("2027-01-31T00:00Z", datetime.now(UTC)).tzinfo is not None


async def test_a_turn_commits_an_edit_a_standing_approval_covers(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    script: list[dict[str, Any]] = [
        {
            "content": [
                {"type": "text", "text": "Noted."},
                edit_block("human", operation="add_context", value="prefers mornings"),
                edit_block("human", operation="learn_fact", value="plays chess"),
            ]
        },
        {"text": "See you tomorrow morning."},
    ]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        await rig.client.create_user("alice")
        policy = await rig.client.set_standing_approval(
            "alice", "human", ["add_context"], TEACHER, datetime.now(UTC) + IN_A_MONTH
        )
        reply = await rig.client.send_message("alice", "I work best in the mornings", turn_id="t1")
        noted, fact = reply.diffs
        assert (noted.status, fact.status) == (DiffStatus.APPROVED, DiffStatus.PENDING)
        assert noted.outcome is not None
        assert noted.outcome.standing_approval == policy.id
        assert "prefers mornings" in rig.stack.blocks.read_block("alice", "human").value
        handle = temporal_env.client.get_workflow_handle(reply.workflow_id)
        details = await current_details(handle)
        assert f"within standing approval {policy.id} set by {TEACHER}" in details
        assert "1 pending · 1 approved" in details
        # The other edit still waits for a person; the turn ends once it is decided.
        await rig.client.reject(fact.id, TEACHER, "not now")
        outcome = await turn_outcome(rig.client, "alice", "t1")
        approved = {d.diff_id: d for d in outcome.decisions}[noted.id]
        assert approved.standing_approval == policy.id
        assert approved.commit_sha is not None
        assert await handle.query(TurnWorkflow.status) == "done"


async def test_a_block_a_standing_approval_fills_is_rotated_after_the_reply(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Nobody decides an edit a standing approval covers, so the turn checks its block for
    rotation itself, as after a person's approval: the block does not stay over its limit
    until the next scheduled sweep. A block no edit of the turn touched is not checked."""
    long_note = "Talked through the robotics competition " + "r" * 420
    script: list[dict[str, Any]] = [
        {"content": [edit_block("human", operation="add_context", value=long_note)]},
        {"text": "Noted."},
    ]
    async with running_rig(temporal_env.client, rig_settings(tmp_path / "data"), script) as rig:
        rig.stack.blocks.ensure_user("sam")
        backend = Author(name="tutor-backend", kind=AuthorKind.SERVICE)
        for i in range(2):
            rig.stack.edits.add_context("sam", f"note {i} " + "y" * 420, backend)
        await rig.client.set_standing_approval(
            "sam", "human", ["add_context"], TEACHER, datetime.now(UTC) + IN_A_MONTH
        )
        sent_at = datetime.now(UTC)
        reply = await rig.client.send_message("sam", "we talked a lot", turn_id="s1")
        [diff] = reply.diffs
        assert diff.status is DiffStatus.APPROVED  # committed at once, nobody waits on it
        rotated = await workflow_result(
            rig.client, "rotation-sam-human", RotationOutcome, started_after=sent_at
        )
        assert rotated.rotated
        assert "Talked through the robotics competition" in " ".join(
            p.text for p in rig.stack.archive.page("sam")
        )
        assert (await turn_outcome(rig.client, "sam", "s1")).status == "done"
        history = await temporal_env.client.get_workflow_handle(reply.workflow_id).fetch_history()
        checked = [
            e.activity_task_scheduled_event_attributes.activity_type.name
            for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
        ]
        assert checked.count("dmem.needs_rotation") == 1  # the one block it changed


async def test_a_worker_killed_mid_commit_of_a_standing_approval_commits_it_once(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = crash_settings(tmp_path)
    settings.memory.data_dir.mkdir(parents=True)
    stack = stack_from_settings(settings)
    stack.blocks.ensure_user("alice")
    policy = stack.policies.set(
        "alice", "human", ["add_context"], TEACHER, datetime.now(UTC) + IN_A_MONTH
    )
    client = MemoryClient(temporal_env.client, settings, stack)
    script: list[dict[str, Any]] = [
        {"content": [edit_block("human", operation="add_context", value="prefers mornings")]},
        {"text": "Noted."},
    ]
    with ScriptedModelServer(script) as model:
        with worker_process(
            settings, address(temporal_env), model.url, MID_COMMIT, tmp_path / "crashed"
        ) as first:
            sending = asyncio.create_task(client.send_message("alice", "mornings", turn_id="k1"))
            assert await asyncio.to_thread(first.wait, 60) == -9  # in the standing commit
        with worker_process(settings, address(temporal_env), model.url):
            reply = await asyncio.wait_for(sending, 90)
            outcome = await turn_outcome(client, "alice", "k1")
    [diff] = reply.diffs
    assert diff.status is DiffStatus.APPROVED
    [decision] = outcome.decisions
    assert decision.standing_approval == policy.id
    commits = [c for c in stack.history.log("alice", 20) if c.trailers.get("Diff-Id") == diff.id]
    assert [c.sha for c in commits] == [decision.commit_sha]  # exactly one commit
    assert commits[0].trailers["Approved-By"] == f"standing:{policy.id}"
    assert git_status(stack.git.repo_path("alice")) == ""
    stack.close()


def test_on_two_hosts_a_policy_set_or_revoked_on_one_counts_on_the_other(
    engine: Engine, tmp_path: Path
) -> None:
    remote = Remote("http", tmp_path)
    try:
        a, b = host(remote, engine, tmp_path / "a"), host(remote, engine, tmp_path / "b")
        a.blocks.ensure_user("alice")
        later = datetime.now(UTC) + IN_A_MONTH
        policy = a.policies.set("alice", "human", ["add_context"], TEACHER, later)
        note = AddContext(note="one")
        first = b.review.propose("alice", "human", note, "r", Proposer.turn("t"))
        assert first.status is DiffStatus.APPROVED
        assert remote.commits("alice")[0] == first.commit_sha  # pushed by b
        a.policies.revoke("alice", policy.id, TEACHER)
        note = AddContext(note="two")
        second = b.review.propose("alice", "human", note, "r", Proposer.turn("t"))
        assert second.status is DiffStatus.PENDING
    finally:
        remote.close()


def test_a_memory_tool_edit_a_standing_approval_covers_is_committed_and_the_model_told(
    engine: Engine, data_dir: Path
) -> None:
    svc = memory_rig(engine, data_dir, claude_profile())
    svc.blocks.ensure_user("alice")
    later = datetime.now(UTC) + IN_A_MONTH
    policy = svc.policies.set("alice", "notes", ["rethink"], TEACHER, later)
    coffee = NOTES_MARKDOWN.replace("tea", "coffee")
    create = memory_call(command="create", path=NOTES, file_text=coffee)
    _, requests = run_scripted_turn(svc, engine, [{"content": [create]}, {"text": "ok"}], "hi")
    [result] = tool_results(requests[1])
    assert f"within standing approval {policy.id}" in str(result["content"])
    assert "in memory now" in str(result["content"])
    assert "Likes coffee" in svc.blocks.read_block("alice", "notes").value
    assert svc.history.log("alice", 1)[0].trailers["Approved-By"] == f"standing:{policy.id}"
