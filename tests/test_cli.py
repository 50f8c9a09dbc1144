"""`dmem`: commands work; user errors are one line on stderr and exit status 2."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from durable_memory.cli import main

Runner = Callable[..., tuple[int, str, str]]

ENV_KEYS = ("DMEM_DATA_DIR", "DMEM_DATABASE_URL", "DMEM_PROFILE", "DMEM_CONFIG")


@pytest.fixture
def dmem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Runner:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("blocks", "../etc"), "invalid user id '../etc'"),
        (("blocks", "nobody"), "user 'nobody' has no memory yet"),
        (("blocks", "alice", "diary"), "no block 'diary' in profile 'essay-coach'"),
        (("approve", "not-a-diff", "--as", "bob"), "invalid diff id 'not-a-diff'"),
        (("approve", "0" * 32, "--as", "bob"), f"no diff {'0' * 32}"),
        (("reject", "0" * 32, "--as", "bob", "--reason", " "), "a rejection needs a reason"),
        (("restore", "alice", "student", "zzzz", "--as", "bob"), "invalid commit sha 'zzzz'"),
        (("history", "alice", "student", "--limit", "0"), "history limit must be positive"),
        (("recall", "alice", "x", "--limit", "1000"), "limit must be between 1 and 200"),
        (("approve", "0" * 32, "--as", "bob", "--edit", "/nonexistent.md"), "cannot read"),
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


def test_diffs_approve_reject_from_the_command_line(dmem: Runner, tmp_path: Path) -> None:
    from durable_memory.memory.stack import open_stack
    from durable_memory.models.operations import AddItem, SetField

    dmem("init", "alice")
    service = open_stack(tmp_path / "data", profile="essay_coach").service
    a = service.propose("alice", "student", AddItem(field="strengths", value="Grit"), "r", "turn:1")
    b = service.propose(
        "alice", "journey", SetField(field="stage", value="drafting"), "r", "turn:1"
    )
    code, out, _ = dmem("diffs", "alice")
    assert code == 0
    assert a.id in out
    assert "+- Grit" in out
    assert {d["id"] for d in json.loads(dmem("diffs", "alice", "--json")[1])} == {a.id, b.id}
    code, out, _ = dmem("approve", a.id, "--as", "ms-rivera")
    assert code == 0
    assert "approved" in out
    code, out, _ = dmem("reject", b.id, "--as", "ms-rivera", "--reason", "too early")
    assert code == 0
    code, _, err = dmem("approve", b.id, "--as", "ms-rivera")
    assert code == 2
    assert "already rejected by ms-rivera" in err
    assert json.loads(dmem("diffs", "alice", "--json")[1]) == []


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
    assert summary["model"].startswith("scripted model at http://127.0.0.1:")
    assert sorted(summary["diffs"].values()) == ["approved", "approved", "approved", "rejected"]
    assert [t["turn_id"] for t in summary["turns"]] == ["demo-turn-1", "demo-turn-2"]
    assert summary["rotation"]["commit"] == summary["commits"][0]
    assert summary["search_hits"][0] in summary["rotation"]["passages"]


def test_chat_context_archive_and_rotate(dmem: Runner, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            [
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "archival_memory_insert",
                            "input": {
                                "content": "Alice's robot is called Bolt",
                                "tags": ["robots"],
                            },
                        }
                    ]
                },
                {"text": "Noted in my archive."},
            ]
        ),
        encoding="utf-8",
    )
    code, out, err = dmem("chat", "alice", "My robot is called Bolt", "--script", str(script))
    assert (code, out.strip()) == (0, "Noted in my archive.")
    assert "scripted model" in err
    code, out, _ = dmem("archive", "search", "alice", "robot name", "--json")
    hits = json.loads(out)
    assert hits[0]["passage"]["text"] == "Alice's robot is called Bolt"
    code, out, _ = dmem("context", "alice", "--json")
    overview = json.loads(out)
    assert (overview["recall_message_count"], overview["archival_passage_count"]) == (4, 1)
    code, out, _ = dmem("rotate", "alice")
    assert (code, out.strip()) == (0, "no block is over its rotation threshold")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("chat", "alice", " "), "nothing to say"),
        (("chat", "alice", "hi", "--script", "/nonexistent.json"), "cannot read the model script"),
        (
            ("archive", "search", "alice", "x", "--top-k", "0"),
            "invalid input: top_k: Input should be greater than or equal to 1",
        ),
        (("archive", "search", "../x", "x"), "invalid user id"),
        (("rotate", "alice", "diary"), "no block 'diary'"),
    ],
)
def test_more_user_errors(dmem: Runner, args: tuple[str, ...], message: str) -> None:
    dmem("init", "alice")
    code, _out, err = dmem(*args)
    assert code == 2
    assert err.startswith("dmem: error: ")
    assert err.count("\n") == 1
    assert message in err
