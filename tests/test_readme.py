"""The newcomer path: every shell command README.md (and docs/*.md) shows runs as written from
the repository root after `make demo`, every `dmem` command they name parses with the options
shown, and the README's session runs for real against a dev server and the scripted model
its `dmem dev` line names."""

import argparse
import asyncio
import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.cli import build_parser, main
from durable_memory.scripted_model import load_script
from tests.support.temporal_helpers import rig_settings, running_rig
from tests.test_cli import ENV_KEYS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCE = re.compile(r"^```(?:sh|bash|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE_DMEM = re.compile(r"(?<!`)`((?:\.venv/bin/)?dmem [^`]+)`")
DMEM = ".venv/bin/dmem"
# What a placeholder stands for when a command is only parsed, not run.
PLACEHOLDER_VALUES = {"<diff-id>": "0" * 32, "<sha>": "0" * 12}
# Long-running or covered elsewhere: `dev` and `worker` are the test's own dev server and
# worker, `scripted-model` serves until Ctrl-C, `demo` is tests/test_cli.py's.
NOT_RUN_IN_THE_SESSION = {"dev", "worker", "scripted-model", "demo"}


@dataclass(frozen=True)
class Shown:
    """A command as a document shows it."""

    where: str  # file:line
    words: tuple[str, ...]  # shell words, comments dropped; brackets and placeholders kept
    fenced: bool  # in a shell code block (meant to be run), not a mention in prose

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def _shown_commands() -> list[Shown]:
    shown: list[Shown] = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        name = doc.relative_to(ROOT)
        for fence in SHELL_FENCE.finditer(text):
            first_line = text.count("\n", 0, fence.start(1)) + 1
            for offset, line in enumerate(fence.group(1).splitlines()):
                words = tuple(shlex.split(line, comments=True))
                if words:
                    shown.append(Shown(f"{name}:{first_line + offset}", words, fenced=True))
        for span in INLINE_DMEM.finditer(text):
            line = text.count("\n", 0, span.start()) + 1
            shown.append(Shown(f"{name}:{line}", tuple(span.group(1).split()), fenced=False))
    return shown


SHOWN = _shown_commands()
FENCED = [c for c in SHOWN if c.fenced]
DMEM_SHOWN = [c for c in SHOWN if c.words[0] in (DMEM, "dmem")]


def _expand(words: tuple[str, ...], *, optional: bool) -> list[str]:
    """The argv a synopsis stands for: `[...]` groups kept (`optional`) or dropped, the first of
    `a|b` alternatives, placeholders left for the caller."""
    argv: list[str] = []
    depth = 0
    for word in words:
        opens = word.startswith("[")
        inside = depth > 0 or opens
        depth += word.count("[") - word.count("]")
        if inside and not optional:
            continue
        word = word.strip("[]")
        argv.append(word.split("|")[0] if "|" in word and not word.startswith("<") else word)
    return argv


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_parser(argv: list[str]) -> tuple[list[str], argparse.ArgumentParser]:
    """The (sub)command path argv names, skipping options before it, and its parser."""
    parser = build_parser()
    path: list[str] = []
    words = iter(argv)
    for word in words:
        commands = _subparsers(parser)
        if not commands:
            break
        if word.startswith("-"):
            action = parser._option_string_actions.get(word)
            if action is not None and action.nargs != 0:
                next(words, None)
            continue
        assert word in commands, f"no command {' '.join([*path, word])!r}"
        path.append(word)
        parser = commands[word]
    return path, parser


def _parse(argv: list[str]) -> argparse.Namespace:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(stderr.getvalue().strip()) from None


def _fresh_shell_path() -> str:
    """PATH as a new shell has it: without the virtualenv this test runs in."""
    venv = os.environ.get("VIRTUAL_ENV") or str(ROOT / ".venv")
    return os.pathsep.join(
        d for d in os.environ.get("PATH", "").split(os.pathsep) if not d.startswith(venv)
    )


@pytest.mark.parametrize("shown", FENCED, ids=str)
def test_every_shell_command_runs_from_the_repository_root(shown: Shown) -> None:
    program, *rest = shown.words
    if program == "export":
        assert all(re.fullmatch(r"[A-Z_]+=\S+", word) for word in rest), shown
    elif program == "make":
        dry_run = subprocess.run(
            ["make", "-n", "-C", str(ROOT), *rest], capture_output=True, text=True, check=False
        )
        assert dry_run.returncode == 0, f"{shown}: {dry_run.stderr}"
    elif "/" in program:
        assert os.access(ROOT / program, os.X_OK), f"{shown}: {program} is not there"
    else:
        found = shutil.which(program, path=_fresh_shell_path())
        assert found, f"{shown}: {program} is not on PATH in a new shell (write {DMEM}?)"


@pytest.mark.parametrize("shown", [c for c in SHOWN if c.where.startswith("README.md")], ids=str)
def test_the_readme_names_dmem_as_it_runs_from_the_repository_root(shown: Shown) -> None:
    """In prose too: a newcomer copies `dmem demo --json` as readily as a code block."""
    assert shown.words[0] != "dmem", f"{shown}: write {DMEM}"


def test_the_dmem_the_readme_shows_runs() -> None:
    result = subprocess.run(
        [str(ROOT / DMEM), "--help"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: dmem ")


@pytest.mark.parametrize("shown", DMEM_SHOWN, ids=str)
def test_every_dmem_command_shown_parses_with_the_options_shown(shown: Shown) -> None:
    """A command in a code block parses as written, with and without its optional parts; a
    mention in prose names a real command and only options that command takes."""
    argv = _expand(shown.words[1:], optional=True)
    path, parser = _command_parser(argv)
    with pytest.raises(SystemExit) as help_exit, contextlib.redirect_stdout(io.StringIO()):
        build_parser().parse_args([*path, "--help"])
    assert help_exit.value.code == 0
    if shown.fenced and argv != ["--help"]:
        for optional in (True, False):
            expanded = _expand(shown.words[1:], optional=optional)
            _parse([PLACEHOLDER_VALUES.get(w, w) for w in expanded])
    else:
        for word in argv:
            option = word.split("=")[0]
            if option.startswith("--"):
                assert option in parser._option_string_actions, f"{shown}: no {option}"


@dataclass
class Session:
    """What the session's commands printed that later ones refer to."""

    diff_ids: list[str]
    shas: list[str]

    def fill(self, word: str) -> str:
        if word == "<diff-id>":
            return self.diff_ids.pop(0)
        if word == "<sha>":
            return self.shas[-1]  # the oldest commit of the block
        return word

    def remember(self, out: str) -> None:
        for diff_id in re.findall(r"^\s*([0-9a-f]{32})\s", out, re.MULTILINE):
            if diff_id not in self.diff_ids:
                self.diff_ids.append(diff_id)
        shas = re.findall(r"^([0-9a-f]{12})\s", out, re.MULTILINE)
        if shas:
            self.shas = shas


def _readme_session() -> Iterator[tuple[Shown, list[str]]]:
    """The README's fenced commands in order: (command, argv without the program)."""
    for shown in FENCED:
        if shown.where.startswith("README.md") and shown.words[0] in (DMEM, "export"):
            yield shown, _expand(shown.words[1:], optional=False)


async def test_the_readme_session_runs_against_a_dev_server(
    temporal_env: WorkflowEnvironment,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    session = list(_readme_session())
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    exports = [argv for shown, argv in session if shown.words[0] == "export"]
    for name, _, value in (word.partition("=") for argv in exports for word in argv):
        monkeypatch.setenv(name, value)
    [dev] = [argv for _, argv in session if argv[:1] == ["dev"]]
    script = load_script(ROOT / dev[dev.index("--model-script") + 1])
    settings = rig_settings(tmp_path / "data", profile=os.environ.get("DMEM_PROFILE", "default"))
    monkeypatch.setenv("DMEM_DATA_DIR", str(settings.memory.data_dir))
    monkeypatch.setenv(
        "DMEM_TEMPORAL_ADDRESS", temporal_env.client.service_client.config.target_host
    )
    monkeypatch.setenv("DMEM_TASK_QUEUE", settings.temporal.task_queue)
    monkeypatch.setenv("EDITOR", "true")  # `dmem edit`: the editor leaves the block as it was
    monkeypatch.chdir(ROOT)
    state = Session(diff_ids=[], shas=[])
    ran = []
    async with running_rig(temporal_env.client, settings, script):
        for shown, argv in session:
            if shown.words[0] == "export" or argv == ["--help"]:
                continue  # exported above; `--help`: test_the_dmem_the_readme_shows_runs
            if _command_parser(argv)[0][0] in NOT_RUN_IN_THE_SESSION:
                continue
            code = await asyncio.to_thread(main, [state.fill(word) for word in argv])
            out, err = capsys.readouterr()
            assert code == 0, f"{shown}: {err}"
            state.remember(out)
            ran.append(argv[0])
    assert {"chat", "approve", "reject", "restore"} <= set(ran)
