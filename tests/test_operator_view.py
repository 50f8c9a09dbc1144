"""What an operator sees of a turn with Temporal alone, on a real dev server: the current
details follow every change of every diff (pending, approved with its commit, rejected,
superseded, conflicted, expired: who and when), the list filters of docs/operations.md find
the turns they name, and the `diff` query and the turn's result tell a diff's story."""

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from durable_memory.memory.core.limits import CUT_MARK, cut_at_word
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.turn import DecisionOutcome, DiffPreview, ProposedDiff
from durable_memory.workflows.common import DIFF_IDS, FAILED_STEP, PROFILE
from durable_memory.workflows.turn import TurnWorkflow
from durable_memory.workflows.turn_details import (
    DETAILS_LIMIT,
    PREVIEW_LEFT_OUT,
    TurnDetails,
    render_details,
)
from tests.support.agent_helpers import edit_block
from tests.support.temporal_helpers import (
    current_details,
    listed_workflow_ids,
    rig_settings,
    running_rig,
    turn_outcome,
)

WHEN = r"at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
"""How details say when a diff was decided (the value itself is the clock's)."""

FOUR_EDITS: dict[str, Any] = {
    "content": [
        {"type": "text", "text": "Noting."},
        edit_block(
            "student", "She said her name is Alice.", field="name", operation="set", value="Alice"
        ),
        edit_block("journey", field="stage", operation="set", value="drafting"),
        edit_block("human", operation="set_task", value="Outline"),
        edit_block("engagement_strategy", field="approach", operation="set", value="Socratic"),
    ]
}


async def _details_until(handle: WorkflowHandle[Any, Any], pattern: str) -> str:
    """The turn's current details once they match `pattern` (a signal is applied after the
    call that sent it returns)."""
    details = ""
    for _ in range(100):
        details = await current_details(handle)
        if re.search(pattern, details):
            return details
        await asyncio.sleep(0.1)
    raise AssertionError(f"details never matched {pattern!r}:\n{details}")


def _entry(details: str, diff_id: str) -> str:
    """The status line of one diff in the details."""
    line = next((ln for ln in details.splitlines() if ln.startswith(f"`{diff_id}`")), None)
    assert line is not None, f"{diff_id} not in details:\n{details}"
    return line


async def test_details_follow_every_decision_with_who_and_when(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    script: list[dict[str, Any]] = [
        FOUR_EDITS,
        {"text": "Welcome, Alice."},
        {
            "content": [
                edit_block("engagement_strategy", field="approach", operation="set", value="Direct")
            ]
        },
        {"text": "Noted."},
    ]
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        reply = await rig.client.send_message("alice", "Hi, I'm Alice", turn_id="t1")
        name, stage, task, strategy = reply.diffs
        handle = temporal_env.client.get_workflow_handle(reply.workflow_id)

        details = await current_details(handle)
        assert details.startswith("### Proposed memory edits\n\n4 pending")
        for diff in reply.diffs:
            assert _entry(details, diff.id).endswith("**pending**: awaiting a decision")
        # The reasoning renders as emphasis-labelled text, never as a literal quote marker.
        assert "*Why*: She said her name is Alice." in details
        assert "\n> " not in details
        assert not details.startswith(">")
        assert "```diff\n" in details
        assert "+Alice" in details

        approved = await rig.client.approve(stage.id, "ms-rivera")
        assert approved is not None
        assert approved.commit_sha is not None
        details = await current_details(handle)
        assert re.fullmatch(
            rf"`{stage.id}` · \*\*approved\*\* by ms-rivera {WHEN} · "
            rf"commit `{approved.commit_sha[:12]}`",
            _entry(details, stage.id),
        )

        await rig.client.reject(task.id, "ms-rivera", "too early")
        details = await current_details(handle)
        assert re.fullmatch(
            rf"`{task.id}` · \*\*rejected\*\* by ms-rivera {WHEN}: too early",
            _entry(details, task.id),
        )

        # The block changes by hand, so the approval of `name` no longer applies.
        rig.stack.edits.edit_block(
            "alice", "student", {"name": "Alicia"}, Author(name="alice", kind=AuthorKind.USER)
        )
        assert await rig.client.approve(name.id, "mr-chen", wait=False) is None  # a signal
        details = await _details_until(handle, rf"`{name.id}` · \*\*conflicted\*\*")
        assert re.match(
            rf"`{name.id}` · \*\*conflicted\*\*: approved by mr-chen {WHEN}, but the block had "
            r"changed and the edit no longer applied; memory unchanged: ",
            _entry(details, name.id),
        )

        newer = await rig.client.send_message("alice", "Be direct with me", turn_id="t2")
        details = await _details_until(handle, rf"`{strategy.id}` · \*\*superseded\*\*")
        assert re.fullmatch(
            rf"`{strategy.id}` · \*\*superseded\*\* {WHEN}: superseded by a newer proposal",
            _entry(details, strategy.id),
        )
        assert "1 approved · 1 rejected · 1 superseded · 1 conflicted" in details
        assert "```diff" not in details  # nothing pending: no preview left to review

        # The result names, per diff, the decision, who made it and the commit.
        outcome = await turn_outcome(rig.client, "alice", "t1")
        decided = {d.diff_id: d for d in outcome.decisions}
        assert (decided[stage.id].decision, decided[stage.id].decided_by) == (
            "approve",
            "ms-rivera",
        )
        assert decided[stage.id].commit_sha == approved.commit_sha
        assert (decided[task.id].decision, decided[task.id].decided_by) == ("reject", "ms-rivera")
        assert (decided[name.id].status, decided[name.id].decision) == (
            DiffStatus.CONFLICTED,
            "approve",
        )
        assert decided[name.id].decided_by == "mr-chen"
        assert decided[name.id].commit_sha is None
        assert decided[strategy.id].status is DiffStatus.SUPERSEDED
        assert decided[strategy.id].decision is None
        assert decided[strategy.id].decided_at is not None
        # A closed turn's details are rendered again from its history: the same text.
        assert await current_details(handle) == details

        await rig.client.reject(newer.diffs[0].id, "ms-rivera", "no")
        await turn_outcome(rig.client, "alice", "t2")


async def test_details_show_expiry(temporal_env: WorkflowEnvironment, tmp_path: Path) -> None:
    script: list[dict[str, Any]] = [
        {"content": [edit_block("journey", field="stage", operation="set", value="drafting")]},
        {"text": "ok"},
    ]
    settings = rig_settings(tmp_path / "data", ttl_s=0.5)
    async with running_rig(temporal_env.client, settings, script) as rig:
        reply = await rig.client.send_message("bea", "Hi", turn_id="e1")
        outcome = await turn_outcome(rig.client, "bea", "e1")
        assert outcome.decisions[0].status is DiffStatus.EXPIRED
        assert outcome.decisions[0].decision is None
        details = await current_details(temporal_env.client.get_workflow_handle(reply.workflow_id))
        assert re.fullmatch(
            rf"`{reply.diffs[0].id}` · \*\*expired\*\* {WHEN}: nobody decided it in time",
            _entry(details, reply.diffs[0].id),
        )


async def test_a_diff_id_finds_its_turn_and_preview_with_temporal_alone(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """The same script for two users: the same tool-call ids, so the only thing telling their
    diffs apart is the user in the diff id. Each diff id finds exactly its own turn."""
    edit = {
        **edit_block("student", "Her name.", field="name", operation="set", value="Kim"),
        "id": "toolu_same",
    }
    script: list[dict[str, Any]] = [{"content": [edit]}, {"text": "Hello."}] * 2
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        kim = await rig.client.send_message("kim", "Hi", turn_id="same")
        lee = await rig.client.send_message("lee", "Hi", turn_id="same")
        assert kim.diffs[0].id != lee.diffs[0].id
        for reply in (kim, lee):
            diff_id = reply.diffs[0].id
            found = await listed_workflow_ids(temporal_env.client, f"DmemDiffIds = '{diff_id}'")
            assert found == [reply.workflow_id]
            handle = temporal_env.client.get_workflow_handle(reply.workflow_id)
            view = await handle.query(TurnWorkflow.diff, diff_id)
            assert (view.user_id, view.turn_id, view.status) == (
                reply.user_id,
                "same",
                DiffStatus.PENDING,
            )
            assert view.outcome is None
            assert view.preview_markdown.startswith("#### Set student.name = Kim\n\n")
            assert "*Why*: Her name." in view.preview_markdown
            assert "+Kim" in view.preview_markdown
            attributes = (await handle.describe()).typed_search_attributes
            assert attributes.get(DIFF_IDS) == [diff_id]
            assert attributes.get(PROFILE) == "essay-coach"  # the profile's own name
        # Another user's turn does not know the diff.
        other = temporal_env.client.get_workflow_handle(lee.workflow_id)
        with pytest.raises(Exception, match="proposed no diff"):
            await other.query(TurnWorkflow.diff, kim.diffs[0].id)

        approved = await rig.client.approve(kim.diffs[0].id, "ms-rivera")
        assert approved is not None
        view = await temporal_env.client.get_workflow_handle(kim.workflow_id).query(
            TurnWorkflow.diff, kim.diffs[0].id
        )
        assert view.status is DiffStatus.APPROVED
        assert view.outcome is not None
        assert view.outcome.commit_sha == approved.commit_sha
        assert "**approved** by ms-rivera" in view.preview_markdown
        await rig.client.reject(lee.diffs[0].id, "ms-rivera", "no")
        await turn_outcome(rig.client, "kim", "same")
        await turn_outcome(rig.client, "lee", "same")


async def test_a_failed_turn_names_its_step(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A model that answers with an error the API says not to retry fails the turn at its
    first activity, `dmem.start_turn` (prepare and the first model call): the operator's
    filter `DmemFailedStep` finds it."""
    script: list[dict[str, Any]] = [{"status": 400, "error_type": "invalid_request_error"}]
    settings = rig_settings(tmp_path / "data")
    async with running_rig(temporal_env.client, settings, script) as rig:
        with pytest.raises(Exception, match="start_turn"):
            await rig.client.send_message("fay", "Hi", turn_id="f1")
        query = "DmemUserId = 'fay' AND DmemTurnStatus = 'failed' AND DmemFailedStep = 'dmem.start_turn'"
        found = await listed_workflow_ids(temporal_env.client, query)
        handle = temporal_env.client.get_workflow_handle(found[0])
        assert (await handle.describe()).typed_search_attributes.get(FAILED_STEP) == (
            "dmem.start_turn"
        )
        assert (await current_details(handle)).startswith("**Turn failed**: dmem.start\\_turn")


def test_summaries_are_cut_at_word_boundaries() -> None:
    text = "Discussed the robotics competition with her mentor at considerable length"
    cut = cut_at_word(text, 40)
    assert cut == "Discussed the robotics competition with" + CUT_MARK
    assert len(cut) <= 40
    assert cut_at_word("one\n  two", 40) == "one two"  # one line, always
    assert cut_at_word("x" * 50, 10) == "x" * 9 + CUT_MARK  # one word longer than the limit


def _documented_filters() -> list[str]:
    """The list filters of docs/operations.md's table, as an operator copies them."""
    text = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    section = text.split("## The list filters an operator uses")[1].split("\n## ")[0]
    cells = [row.split(" | ") for row in section.splitlines() if row.startswith("| ")]
    return [c[1].strip("`") for c in cells if c[1].startswith("`")]


async def test_every_documented_filter_runs_on_the_dev_server(
    temporal_env: WorkflowEnvironment,
) -> None:
    filters = _documented_filters()
    assert len(filters) == 7
    for query in filters:
        # The server refuses a filter it cannot parse or a search attribute it does not know.
        [w.id async for w in temporal_env.client.list_workflows(query)]


def test_details_stay_bounded_and_well_formed_with_many_large_diffs() -> None:
    """Every diff keeps its whole status line and no code fence is cut open, however many
    diffs and however long their previews: what does not fit is named, never cut mid-line."""
    diffs = [
        ProposedDiff(id=f"{n:032x}", label="notes", summary=f"Edit {n}", status=DiffStatus.PENDING)
        for n in range(300)
    ]
    previews = {
        d.id: DiffPreview(diff_id=d.id, reasoning="why " * 200, unified_diff="+line\n" * 800)
        for d in diffs
    }
    decided = DecisionOutcome(
        diff_id=diffs[1].id, status=DiffStatus.APPROVED, commit_sha="ab" * 20, decided_by="x"
    )
    text = render_details(
        TurnDetails(diffs=diffs, outcomes={decided.diff_id: decided}, previews=previews)
    )
    assert len(text) <= DETAILS_LIMIT
    assert text.count("```") % 2 == 0
    assert text.startswith("### Proposed memory edits\n\n299 pending · 1 approved")
    assert f"`{diffs[1].id}` · **approved** by x · commit `{'ab' * 6}`" in text
    assert "(preview left out here: the `diff` query shows it)" in text
    assert re.search(r"\n… and \d+ more \(`dmem diffs USER` lists them\)", text)
    # Fewer diffs: previews fill what the status lines leave, in order, each whole or not at all.
    text = render_details(TurnDetails(diffs=diffs[:3], outcomes={}, previews=previews))
    assert text.count("+line") == 800
    assert text.count(PREVIEW_LEFT_OUT) == 2
    assert "*Why*: why why" in text
    assert "why wh…" not in text  # the reasoning is cut at a word
