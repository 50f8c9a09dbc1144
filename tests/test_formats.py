"""Block formats: TOML <-> Markdown is lossless; bad Markdown is refused with line and reason;
the prompt rendering is Letta's."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_memory.memory.core.blocks import default_fields, render_value, validate_fields
from durable_memory.memory.core.errors import BlockValidationError, CharLimitExceeded, FormatError
from durable_memory.memory.core.formats import (
    from_markdown,
    from_toml,
    render_memory,
    render_prompt,
    to_markdown,
    to_toml,
)
from durable_memory.memory.core.profiles import load_profile
from durable_memory.models.blocks import BlockFields, BlockKind, BlockSpec, FieldSpec, FieldType

PROFILE = load_profile("essay_coach")
TEXT_SPEC = load_profile("default").block("notes")
assert TEXT_SPEC is not None
SPECS = [*PROFILE.blocks, TEXT_SPEC]

# Any unicode but control characters and surrogates, mixed with what a format must escape.
_unicode = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=12)
_tricky = st.sampled_from(
    ["#", "\\", "-", " ", "\t", "\n", "## ", "---", "- ", ":", '"', "'''", '"""', "\u2028"]
)
_text = st.lists(_unicode | _tricky, max_size=8).map("".join)
_line = st.lists(_unicode | _tricky.filter(lambda t: "\n" not in t), max_size=5).map("".join)


def _value(field: FieldSpec) -> st.SearchStrategy[object]:
    if field.type is FieldType.LIST:
        item = _line.map(str.strip).filter(bool)
        return st.lists(item, max_size=field.max_items or 5)
    if field.type is FieldType.ENUM:
        assert field.choices
        return st.sampled_from(field.choices)
    return _text


@st.composite
def valid_block(draw: st.DrawFn) -> tuple[BlockSpec, BlockFields]:
    spec = draw(st.sampled_from(SPECS))
    raw = {f.name: draw(_value(f)) for f in spec.fields}
    for field in spec.fields:  # required strings need content
        if field.required and field.type is FieldType.STR and not str(raw[field.name]).strip():
            raw[field.name] = "x"
    try:
        return spec, validate_fields(spec, raw)
    except BlockValidationError:
        return spec, default_fields(spec)


@settings(max_examples=400, deadline=None)
@given(valid_block())
def test_toml_markdown_toml_is_lossless(block: tuple[BlockSpec, BlockFields]) -> None:
    spec, fields = block
    stored = to_toml(spec, fields)
    loaded = from_toml(spec, stored, "test")
    assert loaded == fields
    markdown = to_markdown(spec, loaded)
    assert from_markdown(spec, markdown) == fields
    assert to_toml(spec, from_markdown(spec, markdown)) == stored


def test_markdown_is_the_seed_shape() -> None:
    spec = PROFILE.block("student")
    assert spec is not None
    fields = validate_fields(
        spec,
        {
            "name": "Alice",
            "background": "Computer science student",
            "strengths": ["Creativity", "Communication"],
        },
    )
    assert to_markdown(spec, fields) == (
        "---\nblock: student\n---\n\n"
        "## Name\nAlice\n\n"
        "## Background\nComputer science student\n\n"
        "## Strengths\n- Creativity\n- Communication\n\n"
        "## Goals\n"
    )
    assert to_toml(spec, fields) == (
        'name = "Alice"\nbackground = "Computer science student"\n'
        'strengths = [\n    "Creativity",\n    "Communication",\n]\n'
    )


def test_value_lines_cannot_forge_headings() -> None:
    assert TEXT_SPEC is not None
    fields = validate_fields(TEXT_SPEC, {"value": "## Value\n\\## not a heading\n# h1"})
    markdown = to_markdown(TEXT_SPEC, fields)
    assert "\n\\## Value\n\\\\## not a heading\n\\# h1\n" in markdown
    assert from_markdown(TEXT_SPEC, markdown) == fields


@pytest.mark.parametrize(
    ("markdown", "error"),
    [
        ("", "line 1: expected '---'"),
        ("---\nblock: student\n", "not closed"),
        ("---\nblock: journey\n---\n", "front matter says block 'journey'"),
        ("---\nblock: student\nowner: x\n---\n", "line 3: unexpected front matter"),
        ("---\nblock: student\n---\nhello\n", "line 4: text before the first"),
        ("---\nblock: student\n---\n## Nickname\nAl\n", "line 4: unknown section 'Nickname'"),
        (
            "---\nblock: student\n---\n## Name\nA\n## Name\nB\n",
            "line 6: section 'Name' appears twice",
        ),
        ("---\nblock: student\n---\n## Strengths\nbrave\n", "line 5: field 'strengths' is a list"),
        ("---\nblock: student\n---\n## Strengths\n- \n", "line 5: field 'strengths' is a list"),
        (
            "---\nblock: student\n---\n## Goals\n" + "- g\n" * 5,
            "line 4 (section 'Goals'): block 'student': field 'goals' has 5 items, more than its maximum of 4",
        ),
        (
            "---\nblock: student\n---\n## Name\n" + "x" * 1600 + "\n",
            "1607 characters, over its limit of 1500",
        ),
        (
            "---\nblock: student\n---\n## Name\nA\x00B\n",
            "line 4 (section 'Name'): block 'student': field 'name' contains the control character U+0000",
        ),
    ],
)
def test_bad_markdown_is_refused_with_line_and_reason(markdown: str, error: str) -> None:
    spec = PROFILE.block("student")
    assert spec is not None
    with pytest.raises(FormatError, match=re.escape(error)):
        from_markdown(spec, markdown)


def test_enum_section_takes_one_allowed_value() -> None:
    spec = PROFILE.block("journey")
    assert spec is not None
    with pytest.raises(FormatError, match="must be one of exploring"):
        from_markdown(spec, "---\nblock: journey\n---\n## Stage\nsleeping\n")
    with pytest.raises(FormatError, match="required"):
        from_markdown(spec, "---\nblock: journey\n---\n## Stage\n\n")


def test_bad_toml_names_the_source_and_line() -> None:
    spec = PROFILE.block("student")
    assert spec is not None
    with pytest.raises(FormatError, match=r"users/a/blocks/student.toml: not valid TOML: .*line 2"):
        from_toml(spec, 'name = "A"\nbad line\n', "users/a/blocks/student.toml")
    with pytest.raises(FormatError, match="must be a list of strings"):
        from_toml(spec, "strengths = 3\n", "f")
    with pytest.raises(FormatError, match="has no field 'age'"):
        from_toml(spec, "age = 3\n", "f")


def test_char_limit_error_names_block_size_and_limit() -> None:
    assert TEXT_SPEC is not None
    with pytest.raises(CharLimitExceeded) as info:
        validate_fields(TEXT_SPEC, {"value": "y" * 2001})
    assert str(info.value) == "block 'notes' would be 2001 characters, over its limit of 2000"


def test_prompt_rendering_is_lettas() -> None:
    spec = BlockSpec(
        label="human",
        description="What I know about the user.",
        limit=5000,
        kind=BlockKind.TEXT,
        fields=(FieldSpec(name="value", type=FieldType.TEXT),),
    )
    fields: BlockFields = {"value": "Name: Chad\nLikes: hiking"}
    assert render_prompt(spec, fields) == (
        "<human>\n"
        "<description>\nWhat I know about the user.\n</description>\n"
        "<metadata>\n- chars_current=24\n- chars_limit=5000\n</metadata>\n"
        "<value>\nName: Chad\nLikes: hiking\n</value>\n"
        "</human>"
    )
    persona = PROFILE.block("persona")
    assert persona is not None
    rendered = render_prompt(persona, default_fields(persona))
    assert (
        "<metadata>\n- chars_current=291\n- chars_limit=1500\n- read_only=true\n</metadata>"
        in rendered
    )
    memory = render_memory({"human": (spec, fields)})
    assert memory == (
        "<memory_blocks>\nThe following memory blocks are currently engaged in your core "
        "memory unit:\n\n" + render_prompt(spec, fields) + "\n\n</memory_blocks>"
    )


def test_value_rendering_of_typed_blocks() -> None:
    spec = PROFILE.block("student")
    assert spec is not None
    fields = validate_fields(spec, {"name": "Alice", "strengths": ["Wit", "Grit"]})
    assert render_value(spec, fields) == "[NAME] Alice\n[STRENGTHS] Wit; Grit"


@pytest.mark.parametrize("name", ["name", "current_task", "x1", "a_b_c"])
def test_markdown_headings_map_back_to_field_names(name: str) -> None:
    spec = BlockSpec(
        label="b",
        description="d",
        limit=100,
        kind=BlockKind.FIELDS,
        fields=(FieldSpec(name=name, type=FieldType.STR),),
    )
    fields = validate_fields(spec, {name: "v"})
    assert f"## {spec.fields[0].title}\n" in to_markdown(spec, fields)
    assert from_markdown(spec, to_markdown(spec, fields)) == fields
