"""The turn's steps driven directly, without Temporal: where each step puts its messages in
recall, and that a retried step (the activity run again after a crash) reuses what the first
attempt stored instead of calling the model again or adding rows or diffs."""

from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DataError

from durable_memory.memory.agent.steps import TurnPositions
from durable_memory.memory.core.errors import UserBeingRedacted
from durable_memory.memory.store.erasure import ErasureLedger
from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.redaction.gate import RedactionGate
from durable_memory.memory.store.turns import TurnStore
from durable_memory.memory.store.users import UserDirectory
from durable_memory.models.context import CompiledContext
from durable_memory.models.diffs import DiffStatus, Proposer
from durable_memory.models.llm import ModelReply, TextBlock
from durable_memory.models.operations import LearnPreference
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import StepInput, TurnInput
from tests.support.agent_helpers import (
    edit_block,
    run_scripted_turn,
    run_turn_steps,
    scripted_steps,
    tool_use,
)
from tests.support.memory import MemoryRig, memory_rig, statements_sent
from tests.test_memory_tool import NOTES, NOTES_MARKDOWN, claude_profile, memory_call

SEARCH = tool_use("conversation_search", query="essay")
PROPOSE = edit_block("human", operation="learn_preference", value="Socratic questions")


def _positions(memory: MemoryRig, turn_id: str) -> list[tuple[int, MessageRole]]:
    return [(m.seq, m.role) for m in memory.recall.turn("alice", turn_id)]


def test_each_step_writes_at_its_positions(memory: MemoryRig, engine: Engine) -> None:
    script: list[dict[str, Any]] = [
        {"content": [{"type": "text", "text": "Let me look."}, SEARCH]},
        {"text": "Found nothing."},
    ]
    result, _ = run_scripted_turn(memory, engine, script, "hello")
    assert (result.reply, result.steps) == ("Found nothing.", 2)
    assert _positions(memory, "t1") == [
        (TurnPositions.USER, MessageRole.USER),
        (1000, MessageRole.ASSISTANT),
        (1001, MessageRole.TOOL_CALL),
        (1500, MessageRole.TOOL_RESULT),
        (2000, MessageRole.ASSISTANT),
    ]
    assert (TurnPositions.reply_seq(2), TurnPositions.results_seq(1)) == (2000, 1500)


def test_a_first_attempt_calls_the_model_yet_answers_the_reply_stored_first(
    memory: MemoryRig, engine: Engine
) -> None:
    """An activity's first attempt looks up no stored reply (`retried=False`): there is none
    to find, unless the workflow was reset or a turn id used again. Then the model is called
    once more, and the reply stored first is still the step's, in recall once."""
    turn = TurnInput(user_id="alice", turn_id="t1", message="hello")
    step = StepInput(user_id="alice", turn_id="t1", step=1)
    script: list[dict[str, Any]] = [{"text": "First."}, {"text": "Second."}]
    with scripted_steps(memory, engine, script) as (steps, server):
        first = steps.call_model(step, steps.prepare_context(turn)[1], retried=False)
        assert len(server.requests) == 1
        assert steps.call_model(step, retried=True) == first
        assert len(server.requests) == 1  # a retry finds the stored reply
        # start_turn's first attempt again, as after a reset: prepare, then the model call
        again = steps.call_model(step, steps.prepare_context(turn)[1], retried=False)
        assert len(server.requests) == 2  # looked up nothing: the model was called
    assert again == first
    assert first.text == "First."
    assert TurnStore(engine).reply("alice", "t1", 1) is not None
    assert [m.content for m in memory.recall.turn("alice", "t1")] == ["hello", "First."]


@pytest.mark.parametrize("second", ["final", "asks_again"])
def test_a_first_attempt_that_cannot_ask_again_answers_the_stored_reply(
    memory: MemoryRig, engine: Engine, second: str
) -> None:
    """Step 2 run again as a first attempt (a reset) after its reply was stored: asking again
    fails, since the turn's context was dropped with its last reply ("final"), or the model
    refuses the request, now built with the step's own reply in it ("asks_again"). The
    stored reply is the answer, as a retry's lookup would have found it."""
    turn = TurnInput(user_id="alice", turn_id="t1", message="hello")
    step1 = StepInput(user_id="alice", turn_id="t1", step=1)
    step2 = StepInput(user_id="alice", turn_id="t1", step=2)
    answer: dict[str, Any] = (
        {"text": "Found nothing."}
        if second == "final"
        else {"content": [{"type": "text", "text": "Once more."}, SEARCH]}
    )
    refusal = {"status": 400, "error_type": "invalid_request_error", "message": "too long"}
    script: list[dict[str, Any]] = [{"content": [SEARCH]}, answer, refusal]
    with scripted_steps(memory, engine, script) as (steps, server):
        steps.call_model(step1, steps.prepare_context(turn)[1], retried=False)
        steps.run_tools(step1)
        stored = steps.call_model(step2, retried=False)
        rows = _positions(memory, "t1")
        assert steps.call_model(step2, retried=False) == stored
        asked = 3 if second == "asks_again" else 2  # a dropped context: nothing to ask with
        assert len(server.requests) == asked
    assert _positions(memory, "t1") == rows  # recorded once


def test_a_step_limit_note_goes_after_every_step(memory: MemoryRig, engine: Engine) -> None:
    result, _ = run_scripted_turn(memory, engine, [{"content": [SEARCH]}], "hi", max_steps=1)
    assert result.stopped_at_step_limit
    assert result.reply.startswith("[stopped after 1 model steps")
    assert _positions(memory, "t1")[-1] == (TurnPositions.STEP_LIMIT_NOTE, MessageRole.ASSISTANT)
    assert TurnPositions.STEP_LIMIT_NOTE == 999_000


def test_retried_steps_reuse_what_the_first_attempt_stored(
    memory: MemoryRig, engine: Engine
) -> None:
    turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
    step = StepInput(user_id="alice", turn_id="t1", step=1)
    with scripted_steps(memory, engine, [{"content": [PROPOSE]}]) as (steps, server):
        assert steps.prepare(turn) == steps.prepare(turn)
        context = TurnStore(engine).context("alice", "t1")
        first = steps.call_model(step)
        assert steps.call_model(step) == first
        assert len(server.requests) == 1  # the retry did not call the model again
        proposed = steps.run_tools(step)
        assert steps.run_tools(step) == proposed
        assert len(proposed.diff_ids) == 1
    assert TurnStore(engine).context("alice", "t1") == context
    assert len(memory.diffs.list("alice")) == 1
    assert _positions(memory, "t1") == [
        (0, MessageRole.USER),
        (1000, MessageRole.TOOL_CALL),
        (1500, MessageRole.TOOL_RESULT),
    ]


def test_a_retry_records_the_messages_of_a_reply_stored_without_them(
    memory: MemoryRig, engine: Engine
) -> None:
    """A reply stored without its messages in recall: a step's first attempt writes both at
    once, but the long way (a reply stored before) writes the reply first, and a process can
    die between. The retry finds the stored reply, calls no model, records its messages at
    the step's positions and, the loop's last reply, drops the context."""
    turn = TurnInput(user_id="alice", turn_id="t1", message="hello")
    step = StepInput(user_id="alice", turn_id="t1", step=1)
    with scripted_steps(memory, engine, [{"text": "Not asked."}]) as (steps, server):
        steps.prepare(turn)
        TurnStore(engine).save_reply("alice", "t1", 1, _reply_text("Stored first."))
        assert _positions(memory, "t1") == [(0, MessageRole.USER)]
        assert steps.call_model(step, retried=True).text == "Stored first."
        assert server.requests == []
    assert [m.content for m in memory.recall.turn("alice", "t1")] == ["hello", "Stored first."]
    assert TurnStore(engine).stored_context("alice", "t1") is None


def _store_context(engine: Engine, context: CompiledContext) -> None:
    with engine.begin() as connection:
        connection.execute(
            text("UPDATE user_turn_contexts SET body = :body WHERE turn_id = 't1'"),
            {"body": context.model_dump_json()},
        )


def test_every_model_call_uses_the_model_settings_its_context_was_compiled_for(
    memory: MemoryRig, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stored context carries the profile's model settings: the turn's model calls use
    them and do not read the profile again (a profile changed mid-turn applies next turn). A
    context stored before it carried them: the profile is read."""
    turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
    script: list[dict[str, Any]] = [{"content": [SEARCH]}, {"text": "two"}]
    with scripted_steps(memory, engine, script) as (steps, server):
        steps.prepare(turn)
        compiled = TurnStore(engine).context("alice", "t1")
        profile_model = memory.blocks.profile("alice").model
        assert compiled.model == profile_model
        other = profile_model.model_copy(update={"name": "claude-compiled-for", "max_tokens": 77})
        _store_context(engine, compiled.model_copy(update={"model": other}))

        def no_profile_read(user_id: str) -> None:
            raise AssertionError(f"the model step read {user_id}'s profile")

        with monkeypatch.context() as patched:
            patched.setattr(steps.sources.blocks, "profile", no_profile_read)
            steps.call_model(StepInput(user_id="alice", turn_id="t1", step=1))
        steps.run_tools(StepInput(user_id="alice", turn_id="t1", step=1))
        assert (server.requests[0]["model"], server.requests[0]["max_tokens"]) == (
            "claude-compiled-for",
            77,
        )
        _store_context(engine, compiled.model_copy(update={"model": None}))  # stored before
        steps.call_model(StepInput(user_id="alice", turn_id="t1", step=2))
        assert server.requests[1]["model"] == profile_model.name


def _stored_contexts(engine: Engine) -> int:
    with engine.connect() as connection:
        counted: int = connection.execute(
            text("SELECT count(*) FROM user_turn_contexts")
        ).scalar_one()
    return counted


def test_a_turn_keeps_its_context_only_while_its_agent_loop_runs(
    memory: MemoryRig, engine: Engine
) -> None:
    """Each stored context holds the whole conversation window: kept for every turn, a
    user's rows would grow with the square of the conversation. It is kept while the model
    may be called again, and deleted after the last call (or the step-limit stop); a retry
    of that call answers from its stored reply without calling the model."""
    turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
    first, last = (StepInput(user_id="alice", turn_id="t1", step=s) for s in (1, 2))
    with scripted_steps(memory, engine, [{"content": [SEARCH]}, {"text": "done"}]) as (
        steps,
        server,
    ):
        steps.prepare(turn)
        steps.call_model(first)
        steps.run_tools(first)
        assert _stored_contexts(engine) == 1  # the model is called again
        answered = steps.call_model(last)
        assert _stored_contexts(engine) == 0
        assert steps.call_model(last) == answered  # a retry: the stored reply, no context
        assert len(server.requests) == 2
    for n in range(2, 5):  # a conversation: no turn leaves a context behind
        run_scripted_turn(memory, engine, [{"text": "ok"}], "more", turn_id=f"t{n}")
    assert _stored_contexts(engine) == 0
    stopped, _ = run_scripted_turn(
        memory, engine, [{"content": [SEARCH]}], "again", turn_id="t9", max_steps=1
    )
    assert stopped.stopped_at_step_limit
    assert _stored_contexts(engine) == 0


def test_a_turn_is_admitted_before_a_redaction_or_after_it_never_across_it(
    memory: MemoryRig, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The redaction gate, read with the erasure ledger at the two admissions of a turn's
    first step. A redaction under way when the turn arrives refuses it before anything is
    written (no message in recall, no stored context); one that opens while the turn compiles
    its context refuses it once the context is stored, and the context is forgotten, so the
    redaction has no stored turn to wait for (store/redaction/gate.py). Either way the
    refusal is UserBeingRedacted, retried: once the redaction closed, the same turn runs."""
    gate = RedactionGate(engine)
    turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
    with scripted_steps(memory, engine, [{"text": "Hello."}]) as (steps, _):
        run_turn_steps(steps, TurnInput(user_id="alice", turn_id="t0", message="hi"), 4)
        gate.open("alice", "r1", "editor@school")
        with pytest.raises(UserBeingRedacted, match="editor@school"):
            steps.prepare_context(turn)
        assert memory.recall.turn("alice", "t1") == []
        assert _stored_contexts(engine) == 0
        gate.close("alice")

        saved = steps.turns.save_context

        def redaction_opens_meanwhile(*args: Any) -> CompiledContext:
            stored = saved(*args)
            gate.open("alice", "r2", "editor@school")
            return stored

        monkeypatch.setattr(steps.turns, "save_context", redaction_opens_meanwhile)
        with pytest.raises(UserBeingRedacted):
            steps.prepare_context(turn)
        assert _stored_contexts(engine) == 0
        monkeypatch.undo()
        gate.close("alice")
        prepared, _ = steps.prepare_context(turn)  # the retry, once it closed
        assert prepared.profile is not None
        assert _stored_contexts(engine) == 1


def test_a_step_finds_the_diffs_of_its_editing_calls_and_asks_nothing_for_its_searches(
    memory: MemoryRig, engine: Engine
) -> None:
    """A step's diffs are those stored under the ids derived from its calls. Only a call of a
    tool that proposes can have one there (tool_specs.proposes_diffs; a call's id is unique in
    its turn), so a step that mixes searches with an edit reports the edit's diff, read back
    the same way, and a step of searches alone sends the diffs table no statement."""
    archive_search = tool_use("archival_memory_search", query="essay")
    script: list[dict[str, Any]] = [
        {"content": [SEARCH, PROPOSE, archive_search]},
        {"content": [SEARCH, archive_search]},
        {"text": "done"},
    ]
    turn = TurnInput(user_id="alice", turn_id="t1", message="I like Socratic questions")
    mixed, searches = (StepInput(user_id="alice", turn_id="t1", step=s) for s in (1, 2))
    with scripted_steps(memory, engine, script) as (steps, _):
        steps.prepare(turn)
        steps.call_model(mixed)
        proposed = steps.run_tools(mixed)
        assert proposed.diff_ids == [d.id for d in memory.diffs.list("alice")]
        assert len(proposed.diff_ids) == 1
        assert steps.step_diffs(mixed) == proposed
        steps.call_model(searches)
        with statements_sent(engine) as sent:
            found = steps.run_tools(searches)
            found_again = steps.step_diffs(searches)
        assert found.diff_ids == found_again.diff_ids == []
        assert found.superseded == found_again.superseded == []
        assert sent, "the tools and their results still read and write"
        assert not [statement for statement in sent if "pending_diffs" in statement]


@pytest.mark.parametrize("settled_by", ["a standing approval", "a person"])
def test_tools_run_again_after_their_edit_was_applied_answer_the_same_diffs(
    engine: Engine, data_dir: Path, settled_by: str
) -> None:
    """A step's tools run again (its activity retried: the model call after them failed once)
    after the edit they proposed was applied: Claude's memory tool now refuses the same
    command (the block already says it), yet the step's answer still names the diff, or the
    turn would never report it, check its block for rotation, nor tell a superseded turn."""
    svc = memory_rig(engine, data_dir, claude_profile())
    svc.blocks.ensure_user("alice")
    if settled_by == "a standing approval":  # commits the edit as it is proposed
        svc.policies.set("alice", "notes", ["rethink"], "ms-rivera", datetime.now(UTC) + MONTH)
    coffee = memory_call(
        command="create", path=NOTES, file_text=NOTES_MARKDOWN.replace("tea", "coffee")
    )
    turn = TurnInput(user_id="alice", turn_id="t1", message="I like coffee now")
    step = StepInput(user_id="alice", turn_id="t1", step=1)
    with scripted_steps(svc, engine, [{"content": [coffee]}]) as (steps, _):
        steps.prepare(turn)
        steps.call_model(step)
        first = steps.run_tools(step)
        assert len(first.diff_ids) == 1
        if settled_by == "a person":
            svc.review.approve(first.diff_ids[0], "ms-rivera", user_id="alice")
        assert "Likes coffee" in svc.blocks.read_block("alice", "notes").value
        assert steps.run_tools(step) == first
        assert steps.step_diffs(step) == first  # read only: what a failed step proposed
        # And the call's own answer, which the model sees if the first run's was never
        # recorded: the edit it proposed, not "changes nothing".
        [use] = TurnStore(engine).reply("alice", "t1", 1).tool_uses  # type: ignore[union-attr]
        again = steps.tools.execute("alice", "t1", use.name, use.input, call_id=use.id)
        assert (again.diff_id, again.is_error) == (first.diff_ids[0], False)
        assert again.content.startswith(f"Proposed edit {first.diff_ids[0]} to {NOTES}")
    assert [d.id for d in svc.diffs.list("alice")] == first.diff_ids


MONTH = timedelta(days=30)


def test_a_model_call_in_the_activity_that_read_its_context_asks_nothing_again(
    memory: MemoryRig, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_turn (prepare, then step 1's model call) and tools_then_model (a step's tools,
    then the next model call) each hand the context they read to the model call: it neither
    reads it again nor asks again whether the user is forgotten, which the same activity
    asked moments before, once the turn's rows were written (it asks once more after the
    model answered, before storing the reply: a forget meanwhile stores nothing). Step 1
    follows no step, so it reads none of the turn's step messages from recall; a later step
    does."""
    asked: Counter[str] = Counter()
    for owner, name, label in [
        (ErasureLedger, "refuse_if_forgotten", "refuse_if_forgotten"),  # reads the ledger
        (UserDirectory, "refuse_if_forgotten", "checks"),  # every check, on a read or its own
        (UserDirectory, "admission", "admission"),
        (RecallStore, "turn", "turn"),
        (TurnStore, "stored_context", "stored_context"),
        (TurnStore, "reply_and_context", "reply_and_context"),
    ]:
        original = getattr(owner, name)

        def counted(*args: Any, _original: Any = original, _name: str = label, **kw: Any) -> Any:
            asked[_name] += 1
            return _original(*args, **kw)

        monkeypatch.setattr(owner, name, counted)
    turn = TurnInput(user_id="alice", turn_id="t1", message="I write essays")
    script: list[dict[str, Any]] = [{"content": [SEARCH]}, {"text": "Nothing found."}]
    with scripted_steps(memory, engine, script) as (steps, _):
        _, context = steps.prepare_context(turn)
        # Before it wrote anything, and after: each with the redaction gate, one read.
        assert asked == {"admission": 2, "checks": 2}
        first = StepInput(user_id="alice", turn_id="t1", step=1)
        assert steps.call_model(first, context).tool_calls == 1
        # After the model answered.
        assert asked == {"admission": 2, "checks": 3, "refuse_if_forgotten": 1}
        asked.clear()
        stored = steps.run_tools_in_context(first).context
        assert stored == context
        # Before the tools, on the records read with the step's reply and context (one
        # round trip on PostgreSQL), and after them (before their results are recorded).
        assert asked == {"checks": 2, "refuse_if_forgotten": 1, "reply_and_context": 1}
        second = StepInput(user_id="alice", turn_id="t1", step=2)
        assert steps.call_model(second, stored).text == "Nothing found."
        assert asked == {
            "checks": 3,
            "refuse_if_forgotten": 2,
            "reply_and_context": 1,
            "turn": 1,
        }
    assert [role for _, role in _positions(memory, "t1")] == [
        MessageRole.USER,
        MessageRole.TOOL_CALL,
        MessageRole.TOOL_RESULT,
        MessageRole.ASSISTANT,
    ]


def test_a_turn_finishes_an_approval_left_uncommitted_when_its_admission_finds_one(
    memory: MemoryRig, engine: Engine
) -> None:
    """A turn's admission read says whether the user has an approval recorded but not
    committed (a crash between the two): only then does the turn read and finish them, before
    it compiles, so the context shows the approved edit. Another user's, even one whose id
    shares a prefix, is not the turn's to find; with none, no read of the approvals is sent."""
    memory.blocks.ensure_user("alice")
    memory.blocks.ensure_user("alicia")
    users = UserDirectory(engine)
    for user in ("alice", "alicia"):
        assert not users.admission(user).unfinished_approvals
    diff = memory.review.propose(
        "alicia", "human", LearnPreference(preference="Socratic"), "r", Proposer.turn("t0")
    )
    memory.diffs.transition(
        diff.id, "alicia", DiffStatus.PENDING, DiffStatus.APPROVED, decided_by="ms-rivera"
    )  # the crash came before the commit
    assert users.admission("alicia").unfinished_approvals
    assert not users.admission("alice").unfinished_approvals
    script: list[dict[str, Any]] = [{"text": "Hello."}, {"text": "Hello again."}]
    with scripted_steps(memory, engine, script) as (steps, server):
        with statements_sent(engine) as sent:
            steps.prepare(TurnInput(user_id="alice", turn_id="t1", message="hi"))
        reads_of_diffs = [s for s in sent if s.startswith("SELECT pending_diffs.")]
        assert not [s for s in reads_of_diffs if "commit_sha IS NULL" in s]
        assert len(reads_of_diffs) == 1  # the pending diffs the context lists, no other
        _, context = steps.prepare_context(TurnInput(user_id="alicia", turn_id="t1", message="hi"))
    finished = memory.diffs.get(diff.id, "alicia")
    assert finished.status is DiffStatus.APPROVED
    assert finished.commit_sha is not None
    assert "Socratic" in context.system
    assert not users.admission("alicia").unfinished_approvals
    assert server.requests == []


def _reply_text(text: str) -> ModelReply:
    return ModelReply(content=[TextBlock(text=text)], stop_reason="end_turn", model="m")


def test_a_reply_whose_messages_the_database_refuses_is_kept_and_asked_once(
    memory: MemoryRig, engine: Engine
) -> None:
    """A model reply PostgreSQL cannot store as recall text (a NUL byte): the step fails, but
    the reply is stored on its own, as before the one write, so the activity's retries find it
    and the model is asked once, not once per attempt. SQLite stores the text."""
    turn = TurnInput(user_id="alice", turn_id="t1", message="hello")
    step = StepInput(user_id="alice", turn_id="t1", step=1)
    postgres = engine.dialect.name == "postgresql"
    with scripted_steps(memory, engine, [{"text": "a\x00b"}, {"text": "Other."}]) as (
        steps,
        server,
    ):
        context = steps.prepare_context(turn)[1]
        for retried in (False, True, True):  # an activity's three attempts
            if postgres:
                with pytest.raises(DataError):
                    steps.call_model(step, context, retried=retried)
            else:
                assert steps.call_model(step, context, retried=retried).text == "a\x00b"
        assert len(server.requests) == 1
    stored = TurnStore(engine).reply("alice", "t1", 1)
    assert stored is not None
    assert stored.content == [TextBlock(text="a\x00b")]
    said = [m.content for m in memory.recall.turn("alice", "t1")]
    assert said == (["hello"] if postgres else ["hello", "a\x00b"])
