"""A redaction meets the user's running turn (issue 20 §2: "a concurrent turn or approval
either completes before the redaction or rebases after it, never resurrects the text").

A turn's model call, held open by the scripted model, answers with the text after the
redaction was requested: the redaction waits for it (the turn completes before it, and its
stored reply is redacted with the rest), a turn started meanwhile waits at its first step and
then works on the redacted memory; no store, row, git object or passage holds the text after,
and the held turn replied exactly once. A redaction facing a turn that never ends gives up
with one clear error and changes nothing. A kill at the record's opening or closing is
finished by the retry. Passages naming a rewritten commit are mapped, and
an approval after the redaction commits the redacted proposal.
"""

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import MemoryStack, open_stack, stack_from_settings
from durable_memory.client import MemoryClient
from durable_memory.config import Settings
from durable_memory.memory.archive.redaction import count_passages_holding
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.store.redaction.gate import RedactionGate, RedactionUnderWayRow
from durable_memory.memory.store.redaction.history import REDACTED
from durable_memory.models.activity_settings import (
    ActivitiesSettings,
    ActivitySettings,
    RetrySettings,
)
from durable_memory.models.archive import NewPassage, PassageSource
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import turn_workflow_id
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.snapshots import snapshot
from tests.support.temporal_helpers import rig_settings, running_rig
from tests.support.worker_process import address, crash_settings, worker_process
from tests.test_forget import all_git_objects, files_holding, rows_holding
from tests.test_redact import SECRET, facts, plant, redact_everywhere, request

HELD = "please hold"
"""The message of the turn whose model call the scripted model holds open. The turns here
are h1, h2: `plant` stores messages of a turn t1."""


def settings_waiting(tmp_path: Path, attempts: int) -> Settings:
    """Quick retries of the memory steps (a turn at the gate, the redaction waiting for
    writers), `attempts` of them in all; the model call keeps its long timeout (held open)."""
    memory = ActivitySettings(
        start_to_close_s=10,
        retry=RetrySettings(
            initial_interval_s=0.2, maximum_interval_s=1, maximum_attempts=attempts
        ),
    )
    activities = ActivitiesSettings(memory=memory)
    return rig_settings(tmp_path / "data").model_copy(update={"activities": activities})


class HeldModel:
    """The scripted model: the call of the turn saying HELD waits for `release` and answers
    with the secret; every other call answers at once."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        self.requests: list[dict[str, Any]] = []

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(request)
        if HELD in repr(request["messages"]) and not self.release.is_set():
            self.asked.set()
            assert self.release.wait(120)
            return {"text": f"Noted: you live at {SECRET} st."}
        return {"text": "Hello again."}


def redaction_open(stack: MemoryStack, user_id: str) -> bool:
    with Session(stack.engine) as session:
        return session.get(RedactionUnderWayRow, user_id) is not None


async def until(condition: Any, what: str) -> None:
    for _ in range(600):
        if await asyncio.to_thread(condition):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never: {what}")


async def test_a_turn_answering_with_the_text_during_a_redaction_completes_before_it(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = settings_waiting(tmp_path, attempts=60)
    model = HeldModel()
    async with running_rig(temporal_env.client, settings, [], respond=model) as rig:
        plant(rig.stack, "alice")
        gate = RedactionGate(rig.stack.engine)
        held = asyncio.create_task(rig.client.send_message("alice", HELD, turn_id="h1"))
        assert await asyncio.to_thread(model.asked.wait, 60)
        redacting = asyncio.create_task(
            rig.client.redact("alice", "human", SECRET, "dpo@school", "by mistake")
        )
        await until(lambda: redaction_open(rig.stack, "alice"), "the redaction has begun")
        later = asyncio.create_task(rig.client.send_message("alice", "hello", turn_id="h2"))
        # The redaction waits for h1; h2 waits at its first step, having compiled nothing.
        await asyncio.sleep(2)
        assert not redacting.done()
        assert not later.done()
        assert "h2" not in {turn.turn_id for turn in gate.turn_progress("alice")}
        assert SECRET in " ".join(facts(rig.stack, "alice"))  # nothing rewritten yet

        model.release.set()
        reply = await asyncio.wait_for(held, 60)
        record = await asyncio.wait_for(redacting, 120)
        after = await asyncio.wait_for(later, 120)

        assert SECRET in reply.reply  # the live answer, given before the redaction
        assert after.reply == "Hello again."
        assert record.requested_by == "dpo@school"
        assert not redaction_open(rig.stack, "alice")
        # Exactly one reply of h1, stored and in recall, redacted.
        stored = rig.stack.turns.reply("alice", "h1", 1)
        assert stored is not None
        assert REDACTED in stored.text
        assert rig.stack.turns.reply("alice", "h1", 2) is None
        said = [m for m in rig.stack.recall.turn("alice", "h1") if m.role is MessageRole.ASSISTANT]
        assert [m.content for m in said] == [f"Noted: you live at {REDACTED} st."]
        # h2 compiled its context from the redacted memory: the model was sent no secret.
        (h2_request,) = [r for r in model.requests if "hello" in json.dumps(r["messages"])]
        assert SECRET not in json.dumps(h2_request)
        assert rows_holding(rig.stack, SECRET) == []
        assert count_passages_holding(rig.stack.archive, "alice", SECRET) == 0
        assert SECRET.encode() not in all_git_objects(settings.memory.data_dir / "users" / "alice")
        await temporal_env.client.get_workflow_handle(turn_workflow_id("alice", "h2")).result()
    assert files_holding(settings.memory.data_dir / "users", SECRET) == []


async def test_a_redaction_facing_a_turn_that_never_ends_gives_up_and_changes_nothing(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    settings = settings_waiting(tmp_path, attempts=3)
    model = HeldModel()
    async with running_rig(temporal_env.client, settings, [], respond=model) as rig:
        plant(rig.stack, "alice")
        held = asyncio.create_task(rig.client.send_message("alice", HELD, turn_id="h1"))
        assert await asyncio.to_thread(model.asked.wait, 60)
        before = snapshot(rig.stack)

        with pytest.raises(DurableMemoryError) as refused:
            await rig.client.redact("alice", "human", SECRET, "dpo@school", "by mistake")

        message = str(refused.value)
        assert "gave up, nothing was changed" in message
        assert "turn h1 is replying" in message
        assert SECRET not in message
        assert snapshot(rig.stack) == before  # the record closed again: nothing changed
        model.release.set()
        await asyncio.wait_for(held, 60)
        # The user's turns go on; the redaction, run again, completes.
        assert (await rig.client.send_message("alice", "hello", turn_id="h2")).reply
        await rig.client.redact("alice", "human", SECRET, "dpo@school", "by mistake")
        assert rows_holding(rig.stack, SECRET) == []


@pytest.mark.parametrize("step", ["dmem.begin_redaction", "dmem.end_redaction"])
async def test_a_redaction_killed_at_its_record_is_finished_by_its_retry(
    temporal_env: WorkflowEnvironment, tmp_path: Path, step: str
) -> None:
    """The worker dies once the record is opened (the writers drained) or closed, before the
    step's completion is reported: the retry on the next worker finishes the redaction, and
    the record is closed at the end."""
    settings = crash_settings(tmp_path)
    data = settings.memory.data_dir
    data.mkdir(parents=True)
    stack = stack_from_settings(settings)
    client = MemoryClient(temporal_env.client, settings, stack)
    plant(stack, "alice")
    with ScriptedModelServer([]) as model:
        with worker_process(
            settings, address(temporal_env), model.url, f"after:{step}", tmp_path / "crashed"
        ) as first:
            redacting = asyncio.create_task(
                client.redact("alice", "human", SECRET, "dpo@school", "by mistake")
            )
            assert await asyncio.to_thread(first.wait, 60) == -9
        assert (tmp_path / "crashed").exists()
        with worker_process(settings, address(temporal_env), model.url):
            await asyncio.wait_for(redacting, 120)
    assert not redaction_open(stack, "alice")
    assert rows_holding(stack, SECRET) == []
    stack.close()
    assert files_holding(data, SECRET) == []


def test_passages_naming_a_rewritten_commit_are_mapped_and_a_later_approval_is_redacted(
    tmp_path: Path,
) -> None:
    """A passage holding no text but naming a rewritten commit points at its new id after;
    the pending proposal holding the text, approved after the redaction, commits it redacted."""
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    plant(stack, "alice")
    old = stack.git.head("alice")
    assert old is not None
    stack.archive.insert(
        NewPassage(
            user_id="alice",
            text="rotated notes",
            source=PassageSource.ROTATION,
            label="human",
            commit_sha=old,
        )
    )
    record = redact_everywhere(stack, request())
    mapped = [p for p in stack.archive.page("alice", limit=50) if p.text == "rotated notes"]
    assert [p.commit_sha for p in mapped] == [record.commits[old]]
    (diff,) = stack.review.pending("alice")
    approved = stack.review.approve(diff.id, "ms-rivera", user_id="alice")
    assert approved.commit_sha is not None
    assert f"moved from {REDACTED}" in facts(stack, "alice")
    assert SECRET.encode() not in all_git_objects(tmp_path / "data" / "users" / "alice")
    stack.close()
