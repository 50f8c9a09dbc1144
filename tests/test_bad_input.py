"""Bad-input suite: property-based attacks on every in-process entry point. For each case:
one clear error (a DurableMemoryError, a tool error result, or exit status 2 with one line),
and a snapshot of the SQL stores and of every git repository taken before equals the one
taken after. Signals, Updates and MemoryClient calls are attacked against a real Temporal
server in test_bad_decisions.py."""

import json
import string
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.cli import main
from durable_memory.memory.agent.tool_specs import TOOL_DOCS
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.formats import from_markdown
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.core.profiles import parse_profile
from durable_memory.models.diffs import Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.operations import AddItem
from tests.support.snapshots import hostile_ids, snapshot

CASES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=60),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> MemoryStack:
    root = tmp_path_factory.mktemp("bad-input")
    stack = open_stack(root / "data", profile="essay_coach")
    stack.blocks.ensure_user("alice")
    stack.edits.edit_block(
        "alice",
        "student",
        {"name": "Alice", "strengths": ["Wit"]},
        Author(name="alice", kind=AuthorKind.USER),
    )
    stack.review.propose(
        "alice", "student", AddItem(field="strengths", value="Grit"), "r", Proposer.turn("seed")
    )
    return stack


# -- tool calls from the model -------------------------------------------------------------

TOOLS = [*TOOL_DOCS, "no_such_tool"]


@CASES
@given(name=st.sampled_from(TOOLS), arguments=anything, user=hostile_ids)
def test_tool_calls_with_garbage_arguments(
    stack: MemoryStack, name: str, arguments: Any, user: str
) -> None:
    before = snapshot(stack)
    outcome = stack.tools.execute(user, "t-bad", name, arguments, call_id="toolu_bad")
    try:
        validate_user_id(user)
    except DurableMemoryError:
        assert outcome.is_error  # a hostile user id never reaches a store
    if outcome.is_error:
        assert outcome.content
        assert snapshot(stack) == before


@CASES
@given(
    label=hostile_ids, field=st.text(max_size=20), value=anything, operation=st.text(max_size=12)
)
def test_typed_edits_with_hostile_fields(
    stack: MemoryStack, label: str, field: str, value: Any, operation: str
) -> None:
    before = snapshot(stack)
    outcome = stack.tools.execute(
        "alice",
        "t-bad",
        "edit_memory_block",
        {"label": label, "field": field, "operation": operation, "value": value, "reasoning": "r"},
    )
    assert outcome.is_error
    assert snapshot(stack) == before


def _with_front_matter(body: str) -> str:
    return "---\nblock: student\n---\n" + body


# -- the service API (what MemoryClient calls) ---------------------------------------------


@CASES
@given(
    user=hostile_ids,
    label=hostile_ids,
    sha=st.text(max_size=45),
    diff_id=st.one_of(st.text(max_size=40), st.just("0" * 32)),
    who=st.text(max_size=120),
)
def test_service_calls_with_hostile_arguments(
    stack: MemoryStack, user: str, label: str, sha: str, diff_id: str, who: str
) -> None:
    before = snapshot(stack)
    person = Author(name=who or "x", kind=AuthorKind.USER)
    calls: list[Callable[[], object]] = [
        lambda: stack.blocks.read_block(user, label),
        lambda: stack.history.restore(user, label, sha, person),
        lambda: stack.review.approve(diff_id, who),
        lambda: stack.review.reject(diff_id, who, "no"),
        lambda: stack.edits.edit_markdown(user, label, "---\nblock: x\n---\n", person),
        lambda: stack.history.history(user, label, 5),
    ]
    for call in calls:
        with pytest.raises(DurableMemoryError):
            call()
    assert snapshot(stack) == before


@CASES
@given(
    markdown=st.text(max_size=300)
    | st.builds(
        _with_front_matter,
        st.lists(
            st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
            | st.sampled_from(["## Name\n", "## Strengths\n", "- ", "\n"]),
            max_size=20,
        ).map("".join),
    )
)
def test_block_markdown_edits(stack: MemoryStack, markdown: str) -> None:
    """A person's edit: either valid (then committed) or refused with line and reason."""
    spec = stack.blocks.spec("alice", "student")
    try:
        from_markdown(spec, markdown)
    except DurableMemoryError as error:
        before = snapshot(stack)
        with pytest.raises(DurableMemoryError):
            stack.edits.edit_markdown(
                "alice", "student", markdown, Author(name="alice", kind=AuthorKind.USER)
            )
        assert snapshot(stack) == before
        assert str(error)


# -- block files edited by hand in the repository -------------------------------------------


@CASES
@given(
    content=st.binary(max_size=200)
    | st.text(max_size=200).map(str.encode)
    | st.sampled_from(
        [
            b"name = 3\n",
            b'strengths = "x"\n',
            b"age = 1\n",
            b'name = "' + b"x" * 2000 + b'"\n',
            b"[table]\n",
            b"\xff\xfe",
            b'name = "a\\u0000b"\n',
        ]
    )
)
def test_hand_edited_block_files(stack: MemoryStack, content: bytes) -> None:
    repo = stack.git.repo_path("alice")
    path = repo / "blocks" / "journey.toml"
    path.write_bytes(content)
    before = snapshot(stack)
    alice = Author(name="alice", kind=AuthorKind.USER)
    try:
        sha = stack.history.commit_hand_edits("alice", alice)
    except DurableMemoryError as error:
        assert "journey.toml" in str(error)
        assert "\n" not in str(error)
        assert snapshot(stack) == before  # refused: nothing committed, the file left as is
        subprocess.run(
            ["git", "-C", str(repo), "checkout", "--", "blocks/journey.toml"], check=True
        )
    else:  # a valid hand edit is committed (or was no change at all)
        assert sha is None or stack.git.head("alice") == sha


# -- profile files ---------------------------------------------------------------------------


@CASES
@given(
    text_=st.text(max_size=400)
    | st.builds(
        lambda label, kind, limit: (
            f'name = "x"\n[persona]\nname = "x"\nrole = "y"\n'
            f'instructions = "z"\n[[blocks]]\nlabel = {json.dumps(label)}\ndescription = "d"\n'
            f"limit = {limit}\nkind = {json.dumps(kind)}\n"
        ),
        hostile_ids,
        st.text(string.ascii_letters, max_size=8),
        st.integers(-5, 5),
    )
)
def test_profile_files(text_: str) -> None:
    try:
        profile = parse_profile(text_, "agent.toml")
    except DurableMemoryError as error:
        assert str(error).startswith("agent.toml")
        assert "\n" not in str(error)
    else:
        assert profile.blocks


# -- the command line ------------------------------------------------------------------------

COMMANDS = [
    ["blocks", "{u}", "{l}"],
    ["history", "{u}", "{l}"],
    ["restore", "{u}", "{l}", "{s}", "--as", "{w}"],
    ["diffs", "{u}"],
    ["recall", "{u}", "{s}"],
    ["import", "{u}", "--as", "{w}"],
    ["archive", "search", "{u}", "{s}"],
    ["context", "{u}"],
    ["init", "{u}"],
    ["approve", "{s}", "--as", "{w}"],
    ["reject", "{s}", "--as", "{w}", "--reason", "{s}"],
]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    command=st.sampled_from(COMMANDS),
    user=hostile_ids,
    label=hostile_ids,
    other=st.text(max_size=50),
    who=st.text(max_size=50),
)
def test_cli_with_hostile_arguments(
    stack: MemoryStack,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
    user: str,
    label: str,
    other: str,
    who: str,
) -> None:
    monkeypatch.setenv("DMEM_TEMPORAL_ADDRESS", "127.0.0.1:1")
    argv = [a.format(u=user, l=label, s=other, w=who) for a in command]
    if "\x00" in "".join(argv):
        return  # a NUL cannot be passed on a real command line
    before = snapshot(stack)
    data_dir = str(stack.git.data_dir)
    try:
        code = main(["--data-dir", data_dir, "--profile", "essay_coach", *argv])
    except SystemExit as exit_:  # argparse: usage errors exit 2 with its own message
        code = exit_.code if isinstance(exit_.code, int) else 2
    _out, err = capsys.readouterr()
    assert code in (0, 2)
    if code == 2:
        assert err.strip()
        assert "Traceback" not in err
    if argv[0] != "init" or code == 2:
        assert snapshot(stack) == before
