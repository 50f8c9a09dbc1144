"""PersonaBlock and HumanBlock of the seed 000_d8598551964ab573.txt: fields, limits, serialization,
operations."""

from datetime import UTC, datetime

import pytest

from durable_memory.memory.core.blocks import default_fields, render_value, validate_fields
from durable_memory.memory.core.errors import BlockValidationError, OperationNotApplicable
from durable_memory.memory.core.operations import apply_operation, format_task_archive
from durable_memory.memory.core.personas import (
    CODING_ASSISTANT_PERSONA,
    DEFAULT_PERSONA,
    RESEARCH_ASSISTANT_PERSONA,
)
from durable_memory.memory.core.profiles import load_profile
from durable_memory.models.blocks import BlockFields, BlockSpec
from durable_memory.models.operations import (
    AddContext,
    AppendText,
    ClearTask,
    InsertText,
    LearnFact,
    LearnPreference,
    ReplaceText,
    SetTask,
)

PROFILE = load_profile("default")


def _spec(label: str) -> BlockSpec:
    spec = PROFILE.block(label)
    assert spec is not None
    return spec


PERSONA, HUMAN, NOTES = _spec("persona"), _spec("human"), _spec("notes")


def test_persona_serialization_is_the_seeds() -> None:
    fields = validate_fields(
        PERSONA,
        {
            "name": "YouLab Essay Coach",
            "role": "AI tutor for college essays",
            "capabilities": ["Guide self-discovery", "Brainstorm topics", "Provide feedback"],
            "expertise": ["College admissions", "Personal narrative", "Reflective writing"],
            "tone": "warm",
            "verbosity": "adaptive",
            "constraints": ["Never write essays", "Ask clarifying questions first"],
        },
    )
    assert render_value(PERSONA, fields) == (
        "[IDENTITY] YouLab Essay Coach | AI tutor for college essays\n"
        "[CAPABILITIES] Guide self-discovery, Brainstorm topics, Provide feedback\n"
        "[EXPERTISE] College admissions, Personal narrative, Reflective writing\n"
        "[STYLE] warm, adaptive\n"
        "[CONSTRAINTS] Never write essays; Ask clarifying questions first"
    )


def test_human_serialization_is_the_seeds() -> None:
    fields = validate_fields(
        HUMAN,
        {
            "name": "Alice",
            "role": "High school senior",
            "current_task": "Brainstorm essay topics about identity",
            "session_state": "active_task",
            "preferences": ["Prefers Socratic questions", "Likes detailed feedback"],
            "facts": ["Planning to study CS", "Has published poetry"],
            "context_notes": [
                "Old note",
                "Discussed identity",
                "Explored challenges",
                "Wants curiosity",
            ],
        },
    )
    assert render_value(HUMAN, fields) == (
        "[USER] Alice | High school senior\n"
        "[TASK] Brainstorm essay topics about identity\n"
        "[STATE] active_task\n"
        "[PREFS] Prefers Socratic questions; Likes detailed feedback\n"
        "[FACTS] Planning to study CS; Has published poetry\n"
        "[CONTEXT] Discussed identity; Explored challenges; Wants curiosity"
    )


def test_human_defaults() -> None:
    fields = default_fields(HUMAN)
    assert fields == {
        "name": None,
        "role": None,
        "current_task": None,
        "session_state": "idle",
        "preferences": [],
        "context_notes": [],
        "facts": [],
    }
    assert render_value(HUMAN, fields) == "[STATE] idle"
    assert HUMAN.limit == 1500


@pytest.mark.parametrize(
    ("field", "limit"), [("capabilities", 5), ("expertise", 4), ("constraints", 3)]
)
def test_persona_list_limits(field: str, limit: int) -> None:
    base = dict(DEFAULT_PERSONA)
    validate_fields(PERSONA, {**base, field: [f"x{i}" for i in range(limit)]})
    with pytest.raises(BlockValidationError, match=f"more than its maximum of {limit}"):
        validate_fields(PERSONA, {**base, field: [f"x{i}" for i in range(limit + 1)]})


def test_preset_personas() -> None:
    for preset in (DEFAULT_PERSONA, CODING_ASSISTANT_PERSONA, RESEARCH_ASSISTANT_PERSONA):
        validate_fields(PERSONA, preset)
    fields = validate_fields(PERSONA, CODING_ASSISTANT_PERSONA)
    assert render_value(PERSONA, fields).startswith(
        "[IDENTITY] CodeHelper | Software development assistant\n"
    )
    assert default_fields(PERSONA)["name"] == "Assistant"


def test_session_states_are_the_seeds() -> None:
    with pytest.raises(
        BlockValidationError, match="idle, active_task, waiting_input, thinking, error_recovery"
    ):
        validate_fields(HUMAN, {"session_state": "sleeping"})


def test_set_task_and_clear_task() -> None:
    fields = apply_operation(
        HUMAN, default_fields(HUMAN), SetTask(task="Brainstorm", context="Start")
    )
    assert (fields["current_task"], fields["session_state"]) == ("Brainstorm", "active_task")
    assert fields["context_notes"] == ["Start"]
    cleared = apply_operation(HUMAN, fields, ClearTask())
    assert (cleared["current_task"], cleared["session_state"]) == (None, "idle")
    assert cleared["context_notes"] == ["Start"]


def test_context_notes_roll_over_a_window_of_ten_and_render_last_three() -> None:
    fields = default_fields(HUMAN)
    for i in range(12):
        fields = apply_operation(HUMAN, fields, AddContext(note=f"note {i}"))
    assert fields["context_notes"] == [f"note {i}" for i in range(2, 12)]
    assert render_value(HUMAN, fields).endswith("[CONTEXT] note 9; note 10; note 11")


def test_preferences_and_facts_keep_the_newest_within_their_limits() -> None:
    fields = default_fields(HUMAN)
    for i in range(6):
        fields = apply_operation(HUMAN, fields, LearnPreference(preference=f"p{i}"))
        fields = apply_operation(HUMAN, fields, LearnFact(fact=f"f{i}"))
    fields = apply_operation(HUMAN, fields, LearnFact(fact="f5"))  # already known: no change
    assert fields["preferences"] == ["p2", "p3", "p4", "p5"]
    assert fields["facts"] == ["f3", "f4", "f5"]


def test_task_archive_format_is_the_seeds() -> None:
    fields = validate_fields(
        HUMAN,
        {
            "current_task": "Brainstorm essay topics",
            "session_state": "active_task",
            "context_notes": ["Discussed identity themes", "Explored personal challenges"],
        },
    )
    text = format_task_archive(fields, datetime(2025, 12, 31, 10, 0, tzinfo=UTC))
    assert text == (
        "[TASK COMPLETED 2025-12-31T10:00:00]\nTask: Brainstorm essay topics\nContext:\n"
        "- Discussed identity themes\n- Explored personal challenges"
    )


def test_text_operations_like_letta() -> None:
    fields: BlockFields = {"value": "line one\nline two"}
    assert (
        apply_operation(NOTES, fields, AppendText(content="three"))["value"]
        == "line one\nline two\nthree"
    )
    assert (
        apply_operation(NOTES, fields, InsertText(new_string="zero", insert_line=0))["value"]
        == "zero\nline one\nline two"
    )
    assert (
        apply_operation(NOTES, fields, InsertText(new_string="end", insert_line=-1))["value"]
        == "line one\nline two\nend"
    )
    assert (
        apply_operation(NOTES, fields, ReplaceText(old_content="two", new_content="2"))["value"]
        == "line one\nline 2"
    )
    with pytest.raises(
        OperationNotApplicable, match=r"appears 2 times in block 'notes' \(lines 1, 2\)"
    ):
        apply_operation(NOTES, fields, ReplaceText(old_content="line", new_content="x"))
    with pytest.raises(OperationNotApplicable, match="old_content not found"):
        apply_operation(NOTES, fields, ReplaceText(old_content="four", new_content="x"))
    with pytest.raises(OperationNotApplicable, match="insert_line 5 is past the end"):
        apply_operation(NOTES, fields, InsertText(new_string="x", insert_line=5))
    with pytest.raises(BlockValidationError, match="over its limit of 2000"):
        apply_operation(NOTES, fields, AppendText(content="x" * 2000))


def test_human_operations_need_a_human_block() -> None:
    with pytest.raises(OperationNotApplicable, match="free text"):
        apply_operation(NOTES, {"value": ""}, SetTask(task="x"))
    with pytest.raises(OperationNotApplicable, match="typed fields"):
        apply_operation(HUMAN, default_fields(HUMAN), AppendText(content="x"))
