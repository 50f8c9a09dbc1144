"""Agent profiles: the bundled ones load; bad ones are refused naming the file, block, problem."""

from pathlib import Path

import pytest

from durable_memory.memory.core.errors import ProfileError
from durable_memory.memory.core.profiles import load_profile
from durable_memory.models.blocks import BlockKind, FieldType, RotationStrategyName

HEAD = """
name = "t"
[persona]
name = "T"
role = "tester"
instructions = "Test things."
"""


def test_bundled_profiles_load() -> None:
    coach = load_profile("essay_coach")
    assert [b.label for b in coach.blocks] == [
        "persona",
        "student",
        "journey",
        "engagement_strategy",
        "human",
    ]
    student = coach.block("student")
    assert student is not None
    assert student.kind is BlockKind.FIELDS
    strengths = student.field("strengths")
    assert strengths is not None
    assert strengths.type is FieldType.LIST
    assert strengths.max_items == 6
    journey = coach.block("journey")
    assert journey is not None
    assert journey.rotation is RotationStrategyName.ADAPTIVE
    default = load_profile("default")
    assert default.persona.name == "Assistant"
    assert default.model.name
    assert default.model.max_tokens > 0


def _write(tmp_path: Path, blocks: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(HEAD + blocks, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("blocks", "problem"),
    [
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\nkind = "fields"\n'
            '[[blocks.fields]]\nname = "x"\ntype = "dict"\n',
            "block 'a': field 'x' has unknown type 'dict'",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\n'
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\n',
            "block 'a': label declared twice",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 0\n',
            "block 'a': limit: Input should be greater than 0",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = -5\n',
            "block 'a': limit: Input should be greater than 0",
        ),
        ('[[blocks]]\nlabel = "a"\nlimit = 10\n', "block 'a': description: Field required"),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\nkind = "graph"\n',
            "block 'a': unknown kind 'graph'",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\nkind = "fields"\n',
            "block 'a': kind 'fields' needs at least one",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\nkind = "fields"\n'
            '[[blocks.fields]]\nname = "x"\ntype = "enum"\n',
            "block 'a': enum field 'x' needs non-empty 'choices'",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\nkind = "fields"\n'
            '[[blocks.fields]]\nname = "x"\ntype = "str"\n[[blocks.fields]]\nname = "x"\ntype = "str"\n',
            "block 'a': field 'x' is declared twice",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 5\n[blocks.default]\nvalue = "too long"\n',
            "block 'a': its default is invalid: block 'a' would be 8 characters, over its limit of 5",
        ),
        (
            '[[blocks]]\nlabel = "Bad Label"\ndescription = "d"\nlimit = 5\n',
            "block 'Bad Label': label: String should match pattern",
        ),
        (
            '[[blocks]]\nlabel = "p"\ndescription = "d"\nlimit = 1500\nkind = "persona"\n',
            "block 'p': its default is invalid: block 'p': field 'role' is required",
        ),
        (
            '[[blocks]]\nlabel = "p"\ndescription = "d"\nlimit = 1500\nkind = "persona"\n'
            'preset = "pirate"\n',
            "block 'p': preset 'pirate' is not one of",
        ),
        (
            '[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\ncolour = "red"\n',
            "block 'a': colour: Extra inputs are not permitted",
        ),
        ("", "declares no memory blocks"),
        ("[[blocks]\n", "not valid TOML"),
    ],
)
def test_bad_profiles_name_file_block_and_problem(
    tmp_path: Path, blocks: str, problem: str
) -> None:
    path = _write(tmp_path, blocks)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: ")
    assert problem in str(info.value)


def test_missing_persona_and_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        'name = "x"\n[[blocks]]\nlabel = "a"\ndescription = "d"\nlimit = 10\n', encoding="utf-8"
    )
    with pytest.raises(ProfileError, match="persona: Field required"):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.toml")
