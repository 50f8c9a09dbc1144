"""`dmem`: commands work; user errors are one line on stderr and exit status 2."""

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.cli import build_parser, main
from durable_memory.client import TurnFailed
from durable_memory.config import Settings
from durable_memory.memory.agent.llm import AnthropicModel, ModelCallError
from durable_memory.models.turn import TurnInput
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.agent_helpers import run_turn_steps
from tests.support.interruptible import popen_interruptible
from tests.support.temporal_helpers import rig_settings, running_rig
from tests.test_model_adapter import HELLO, SETTINGS

Runner = Callable[..., tuple[int, str, str]]

ENV_KEYS = (
    "DMEM_DATA_DIR",
    "DMEM_DATABASE_URL",
    "DMEM_PROFILE",
    "DMEM_CONFIG",
    "DMEM_TEMPORAL_ADDRESS",
    "DMEM_TASK_QUEUE",
)


@pytest.fixture
def dmem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Runner:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DMEM_TEMPORAL_ADDRESS", "127.0.0.1:1")  # nothing listens there
    monkeypatch.chdir(tmp_path)
    base = ["--data-dir", str(tmp_path / "data"), "--profile", "essay_coach"]

    def run(*args: str) -> tuple[int, str, str]:
        code = main([*base, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_blocks_edit_history_restore(
    dmem: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert dmem("init", "alice")[0] == 0
    code, out, _ = dmem("blocks", "alice", "student", "--format", "markdown")
    assert code == 0
    assert out.startswith("---\nblock: student\n---\n")
    editor = tmp_path / "editor.sh"
    editor.write_text("#!/bin/sh\nsed -i 's/^## Name$/## Name\\nAlice/' \"$1\"\n", encoding="utf-8")
    editor.chmod(0o755)
    monkeypatch.setenv("EDITOR", str(editor))
    code, out, err = dmem("edit", "alice", "student")
    assert (code, err) == (0, "")
    assert out.startswith("committed ")
    code, out, _ = dmem("blocks", "alice", "student", "--json")
    assert json.loads(out)["student"]["fields"]["name"] == "Alice"
    code, out, _ = dmem("history", "alice", "student", "--json")
    commits = json.loads(out)
    assert [c["author"] for c in commits] == ["alice", "durable-memory"]
    code, out, _ = dmem("restore", "alice", "student", commits[1]["sha"], "--as", "alice")
    assert code == 0
    assert "restored student" in out
    assert (
        json.loads(dmem("blocks", "alice", "student", "--json")[1])["student"]["fields"]["name"]
        is None
    )


def test_editor_output_that_breaks_the_schema_changes_nothing(
    dmem: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dmem("init", "alice")
    before = dmem("history", "alice", "journey", "--json")[1]
    editor = tmp_path / "editor.sh"
    editor.write_text("#!/bin/sh\nsed -i 's/^exploring$/sleeping/' \"$1\"\n", encoding="utf-8")
    editor.chmod(0o755)
    monkeypatch.setenv("EDITOR", str(editor))
    code, _out, err = dmem("edit", "alice", "journey")
    assert code == 2
    assert err.count("\n") == 1
    assert "line 5 (section 'Stage')" in err
    assert "must be one of" in err
    assert dmem("history", "alice", "journey", "--json")[1] == before


def test_an_edit_overtaken_while_in_the_editor_is_refused_and_kept(
    dmem: Runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer (an approval, say) commits to the block while the person is in the
    editor: their edit is refused, the other change stays, their text is kept in a file."""
    assert dmem("init", "alice")[0] == 0
    other_writer = (
        "from pathlib import Path\n"
        "from durable_memory.bootstrap import open_stack\n"
        "from durable_memory.models.history import Author, AuthorKind\n"
        f"stack = open_stack(Path({str(tmp_path / 'data')!r}), profile='essay_coach')\n"
        "stack.edits.edit_block('alice', 'student', {'name': 'Ally'},"
        " Author(name='ms-rivera', kind=AuthorKind.USER))\n"
        "stack.close()\n"
    )
    (tmp_path / "other_writer.py").write_text(other_writer, encoding="utf-8")
    editor = tmp_path / "editor.sh"
    editor.write_text(
        f"#!/bin/sh\n{sys.executable} {tmp_path / 'other_writer.py'}\n"
        "sed -i 's/^## Name$/## Name\\nAlice/' \"$1\"\n",
        encoding="utf-8",
    )
    editor.chmod(0o755)
    monkeypatch.setenv("EDITOR", str(editor))
    code, _out, err = dmem("edit", "alice", "student")
    assert code != 0
    assert "changed since" in err
    kept = Path(err.rsplit("kept in ", 1)[1].strip())
    assert "Alice" in kept.read_text(encoding="utf-8")
    kept.unlink()
    fields = json.loads(dmem("blocks", "alice", "student", "--json")[1])["student"]["fields"]
    assert fields["name"] == "Ally"
    commits = json.loads(dmem("history", "alice", "student", "--json")[1])
    assert [c["author"] for c in commits] == ["ms-rivera", "durable-memory"]


def test_dmem_context_shows_the_cached_parts_and_the_latest_turn(
    dmem: Runner, tmp_path: Path
) -> None:
    from durable_memory.bootstrap import open_stack

    assert dmem("init", "alice")[0] == 0
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    with ScriptedModelServer([{"text": "hi"}]) as server:
        model = AnthropicModel(base_url=server.url)
        run_turn_steps(
            stack.turn_steps(model), TurnInput(user_id="alice", turn_id="t1", message="hello"), 8
        )
        model.close()
    stack.close()
    code, out, _ = dmem("context", "alice")
    assert code == 0
    assert "cache breakpoints after: tools + instructions" in out
    assert "latest turn t1: 1 model call(s)" in out
    assert "input-token equivalents" in out
    code, out, _ = dmem("context", "alice", "--json")
    assert json.loads(out)["latest_turn"]["calls"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("blocks", "../etc"), "invalid user id '../etc'"),
        (("blocks", "nobody"), "user 'nobody' has no memory yet"),
        (("blocks", "alice", "diary"), "no block 'diary' in profile 'essay-coach'"),
        (("approve", "not-a-diff", "--as", "bob"), "invalid diff id 'not-a-diff'"),
        (("reject", "0" * 32, "--as", "bob", "--reason", " "), "a rejection needs a reason"),
        (("approve", "0" * 32, "--as", "a<b>"), "invalid name"),
        (("rotate", "alice", "diary"), "no block 'diary' in profile 'essay-coach'"),
        (("chat", "../x", "hi"), "invalid user id"),
        (("restore", "alice", "student", "zzzz", "--as", "bob"), "invalid commit sha 'zzzz'"),
        (("history", "alice", "student", "--limit", "0"), "history limit must be positive"),
        (("recall", "alice", "x", "--limit", "1000"), "limit must be between 1 and 200"),
        (("approve", "0" * 32, "--as", "bob", "--edit", "/nonexistent.md"), "cannot read"),
        (("approve", "0" * 32, "--as", "bob"), "cannot reach Temporal"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(
    dmem: Runner, args: tuple[str, ...], message: str
) -> None:
    dmem("init", "alice")
    code, out, err = dmem(*args)
    assert code == 2
    assert out == ""
    assert err.startswith("dmem: error: ")
    assert err.count("\n") == 1
    assert message in err


def _cli_on(
    temporal_env: WorkflowEnvironment, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """Point `dmem` at the test's Temporal server and task queue, nothing from the caller's
    environment; returns the options naming the rig's data dir and profile."""
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(
        "DMEM_TEMPORAL_ADDRESS", temporal_env.client.service_client.config.target_host
    )
    monkeypatch.setenv("DMEM_TASK_QUEUE", settings.temporal.task_queue)
    return ["--data-dir", str(settings.memory.data_dir), "--profile", "essay_coach"]


async def test_chat_approve_reject_rotate_through_temporal(
    temporal_env: WorkflowEnvironment,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script: list[dict[str, Any]] = [
        {
            "content": [
                {
                    "type": "tool_use",
                    "name": "edit_memory_block",
                    "input": {
                        "label": "student",
                        "field": "strengths",
                        "operation": "add",
                        "value": "Grit",
                        "reasoning": "r",
                    },
                },
                {
                    "type": "tool_use",
                    "name": "edit_memory_block",
                    "input": {
                        "label": "journey",
                        "field": "stage",
                        "operation": "set",
                        "value": "drafting",
                        "reasoning": "r",
                    },
                },
            ]
        },
        {"text": "Noted both."},
    ]
    settings = rig_settings(tmp_path / "data")
    base = _cli_on(temporal_env, settings, monkeypatch)

    async def dmem(*args: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(main, [*base, *args])
        out, err = capsys.readouterr()
        return code, out, err

    async with running_rig(temporal_env.client, settings, script):
        code, out, _ = await dmem("chat", "alice", "I kept going", "--turn-id", "c1", "--json")
        assert code == 0
        reply = json.loads(out)
        assert reply["reply"] == "Noted both."
        grit, stage = (d["id"] for d in reply["diffs"])
        code, out, _ = await dmem("diffs", "alice")
        assert code == 0
        assert grit in out
        assert "+- Grit" in out
        code, out, _ = await dmem("approve", grit, "--as", "ms-rivera")
        assert code == 0
        assert out.startswith(f"approved {grit}: commit ")
        code, out, _ = await dmem("reject", stage, "--as", "ms-rivera", "--reason", "too early")
        assert (code, out.strip()) == (0, f"rejected {stage}: rejected (too early)")
        code, _, err = await dmem("approve", stage, "--as", "ms-rivera")
        assert code == 2
        assert "already rejected" in err
        assert err.count("\n") == 1
        code, out, _ = await dmem("rotate", "alice")
        assert (code, out.strip()) == (0, "no block is over its rotation threshold")
        code, out, _ = await dmem("blocks", "alice", "student", "--json")
        assert json.loads(out)["student"]["fields"]["strengths"] == ["Grit"]


def test_demo_runs_in_a_fresh_process() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (*ENV_KEYS, "ANTHROPIC_API_KEY")}
    result = subprocess.run(
        [sys.executable, "-m", "durable_memory.cli", "demo", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["model"] == "scripted model"
    assert summary["temporal_ui"].startswith("http://127.0.0.1:")
    assert sorted(summary["diffs"].values()) == ["approved", "approved", "approved", "rejected"]
    assert [t["turn_id"] for t in summary["turns"]] == ["demo-1", "demo-2"]
    assert summary["turns"][0]["workflow_id"] == "turn:alice:demo-1"
    assert summary["rotation"]["commit"] == summary["commits"][0]
    assert summary["search_hits"][0] in summary["rotation"]["passages"]


def test_context_and_archive_search(dmem: Runner, tmp_path: Path) -> None:
    from durable_memory.bootstrap import open_stack
    from durable_memory.models.archive import NewPassage, PassageSource

    dmem("init", "alice")
    stack = open_stack(tmp_path / "data", profile="essay_coach")
    stack.archive.insert(
        NewPassage(
            user_id="alice",
            text="Alice's robot is called Bolt",
            tags=("robots",),
            source=PassageSource.IMPORT,
        )
    )
    stack.close()
    code, out, _ = dmem("archive", "search", "alice", "robot name", "--json")
    assert code == 0
    assert json.loads(out)[0]["passage"]["text"] == "Alice's robot is called Bolt"
    code, out, _ = dmem("context", "alice", "--json")
    assert code == 0
    assert json.loads(out)["archival_passage_count"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("chat", "alice", " "), "nothing to say"),
        (("chat", "alice", "hi"), "cannot reach Temporal at 127.0.0.1:1"),
        (("rotate", "alice"), "cannot reach Temporal at 127.0.0.1:1"),
        (
            ("archive", "search", "alice", "x", "--top-k", "0"),
            "invalid input: top_k: Input should be greater than or equal to 1",
        ),
        (("archive", "search", "../x", "x"), "invalid user id"),
        (("forget", "alice", "--as", "dpo", "--reason", "asked"), "add --yes to confirm"),
        (("forget", "../x", "--as", "dpo", "--reason", "asked", "--yes"), "invalid user id"),
        (("forget", "alice", "--as", "dpo", "--reason", " ", "--yes"), "needs a reason"),
        (
            ("forget", "alice", "--as", "dpo", "--reason", "asked", "--yes"),
            "cannot reach Temporal at 127.0.0.1:1",
        ),
    ],
)
def test_more_user_errors(dmem: Runner, args: tuple[str, ...], message: str) -> None:
    dmem("init", "alice")
    code, _out, err = dmem(*args)
    assert code == 2
    assert err.startswith("dmem: error: ")
    assert err.count("\n") == 1
    assert message in err


async def test_an_exhausted_model_script_fails_the_turn_saying_so(
    temporal_env: WorkflowEnvironment,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The scripted model answers a request past its last reply with an API error naming the
    reply asked for and the script's length; the turn fails with it and the CLI prints it."""
    settings = rig_settings(tmp_path / "data")
    base = _cli_on(temporal_env, settings, monkeypatch)
    exhausted = "the script is exhausted: reply 2 was asked for, but the script has only 1 reply"
    async with running_rig(temporal_env.client, settings, [{"text": "Hello."}]) as rig:
        assert await asyncio.to_thread(main, [*base, "chat", "alice", "hi"]) == 0
        capsys.readouterr()
        with pytest.raises(TurnFailed, match=exhausted):
            await rig.client.send_message("alice", "again", turn_id="t2")
        code = await asyncio.to_thread(main, [*base, "chat", "alice", "once more"])
        out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("dmem: error: the turn failed: ")
    assert err.count("\n") == 1
    assert exhausted in err


@pytest.mark.parametrize(
    ("command", "scripted_way"),
    [
        (("dev",), "no model configured: pass --model-script FILE"),
        (("worker",), "no model configured: pass --model-script FILE"),
        (("demo", "--live"), "without it the demo is scripted"),
    ],
)
def test_no_model_names_both_ways_to_get_one_before_starting_anything(
    dmem: Runner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, ...],
    scripted_way: str,
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    code, out, err = dmem(*command)
    assert (code, out) == (2, "")
    assert err.startswith("dmem: error: ")
    assert err.count("\n") == 1
    assert scripted_way in err
    assert "ANTHROPIC_API_KEY" in err
    assert not (tmp_path / "data").exists()  # no dev server, no store: nothing was started


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's path and parser, the top level first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _example_value(action: argparse.Action) -> str:
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type is int:
        return "3"
    return "0.5" if action.type is float else "x"


def _required_words(parser: argparse.ArgumentParser) -> list[str]:
    """The least a command line needs after this parser's command: its required arguments,
    then (for a parser of commands) its first command and that command's least."""
    words: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name, sub = next(iter(action.choices.items()))
            words += [name, *_required_words(sub)]
        elif action.required:
            words += [*action.option_strings[-1:], _example_value(action)]
    return words


def test_every_option_help_shows_is_accepted_where_it_shows_it() -> None:
    """Each option a command's --help shows parses right after that command (the top level's:
    before any command) and lands in the arguments the command reads."""
    checked = 0
    for path, parser in _commands(build_parser()):
        help_text = parser.format_help()
        for action in parser._actions:
            shown = [o for o in action.option_strings if o.startswith("--") and o in help_text]
            if not shown or action.dest == "help":
                continue
            option = shown[-1]
            value = [] if action.nargs == 0 else [_example_value(action)]
            argv = [*path, option, *value, *_required_words(parser)]
            args = build_parser().parse_args(argv)
            parsed = getattr(args, action.dest)
            if action.nargs == 0:
                assert parsed is True, argv
            else:
                parsed = parsed[0] if isinstance(parsed, list) else parsed
                convert = action.type if callable(action.type) else str
                assert parsed == convert(value[0]), argv
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("option", ["--data-dir", "--database-url", "--profile"])
def test_common_options_go_before_or_after_the_command(option: str) -> None:
    dest = option[2:].replace("-", "_")
    for argv in (
        [option, "v", "archive", "search", "alice", "q"],
        ["archive", option, "v", "search", "alice", "q"],
        ["archive", "search", "alice", "q", option, "v"],
        ["demo", "--keep", option, "v"],
        [option, "v", "demo", "--keep"],
    ):
        assert getattr(build_parser().parse_args(argv), dest) == "v", argv
    assert getattr(build_parser().parse_args(["init", "alice"]), dest) is None


def test_scripted_model_command_answers_past_its_script_until_stopped(tmp_path: Path) -> None:
    """`dmem scripted-model` keeps serving once its script is used up, so the worker gets the
    'exhausted' error rather than a refused connection it would retry for minutes."""
    script = tmp_path / "script.json"
    script.write_text('[{"text": "only reply"}]', encoding="utf-8")
    server = popen_interruptible(
        [sys.executable, "-m", "durable_memory.cli", "scripted-model", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        first_line = server.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", first_line)
        assert url, first_line
        model = AnthropicModel(base_url=url.group())
        assert model.create(SETTINGS, "s", HELLO, []).text == "only reply"
        assert "ANTHROPIC_BASE_URL=" in server.stdout.readline()
        with pytest.raises(ModelCallError, match="reply 2 was asked for, but the script has only"):
            model.create(SETTINGS, "s", HELLO, [])
        model.close()
        assert server.poll() is None
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=30)
    assert server.returncode == 130, err
