"""A thin client (issue 15 §4): every `dmem` command a backend or an operator uses, and
`MemoryClient`, run from a host that has only the Temporal address, the database URL and the
git remote (and its token), with an empty data dir of its own.

The same session of commands runs twice, for a user the worker's first turn creates: once in
the embedded mode (worker and commands on one data dir, SQLite, the embedded archive) and once
distributed (a worker with its own data dir, the client with another, PostgreSQL, the postgres
archive and `dmem git-serve`). Both transcripts must read the same once commit ids, diff ids and
times are numbered in order of appearance; each of the client's writes lands as exactly one
commit of the user's main; afterwards the client's data dir holds nothing but clones of the
remote, none ahead of it. Two clients racing on one user's edits both land, in a linear
history: the push is the compare-and-set.
"""

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from durable_memory.bootstrap import stack_from_settings
from durable_memory.cli import LOCAL_DISK, build_parser, main
from durable_memory.client import MemoryClient
from durable_memory.config import Settings
from durable_memory.memory.core.errors import GitRemoteUnavailable, ProfileError
from durable_memory.memory.core.formats import to_markdown
from tests.support.agent_helpers import edit_block, tool_use
from tests.support.distributed import distributed_env, distributed_settings, git_server
from tests.support.git_checks import git_output
from tests.support.postgres import fresh_schema_url
from tests.support.temporal_helpers import Rig, rig_settings, running_rig
from tests.support.worker_process import address
from tests.test_cli import _cli_on, _commands

USER = "alice"
ROBOT = "Alice's robot is called Bolt"
SCRIPT: list[dict[str, Any]] = [
    {
        "content": [
            edit_block("student", field="strengths", operation="add", value="Grit"),
            edit_block("journey", field="stage", operation="set", value="drafting"),
            edit_block("engagement_strategy", field="approach", operation="set", value="Socratic"),
            tool_use("archival_memory_insert", content=ROBOT, tags=["robots"]),
        ]
    },
    {"text": "Noted: Bolt, your grit, and a Socratic approach."},
]

Dmem = Callable[..., Awaitable[str]]
"""Run one `dmem` command on the client's host; its standard output, or with `fails=True` its
one line of error (exit status 2)."""
Log = Callable[[str], list[str]]
"""The user's main as `author|subject` lines, newest first, where the truth is kept: the
repository in the embedded data dir, the remote's bare repository when distributed."""


async def session(dmem: Dmem, log: Log, tmp_path: Path) -> list[str]:
    """The commands a backend or an operator runs, in order; their outputs. `tmp_path`: a new
    directory for the files the commands are given."""
    tmp_path.mkdir()
    out = [await dmem("chat", USER, "I built a robot called Bolt", "--turn-id", "t1", "--json")]
    grit, stage, approach = (d["id"] for d in json.loads(out[0])["diffs"])
    out.append(await dmem("diffs", USER))  # with each diff's preview
    out.append(await dmem("diffs", USER, "--json"))
    out.append(await dmem("approve", grit, "--as", "ms-rivera"))
    markdown = await dmem("blocks", USER, "engagement_strategy", "--format", "markdown")
    edited = tmp_path / "approach.md"
    edited.write_text(
        markdown.replace("## Approach\n", "## Approach\nQuestions first\n"), encoding="utf-8"
    )
    out.append(await dmem("approve", approach, "--as", "ms-rivera", "--edit", str(edited)))
    out.append(await dmem("reject", stage, "--as", "ms-rivera", "--reason", "too early"))
    out.append(await dmem("blocks", USER, "--json"))
    out.append(await dmem("blocks", USER, "student", "--format", "toml"))
    out.append(history := await dmem("history", USER, "student", "--json"))

    created = json.loads(history)[-1]["sha"]
    out.append(
        await one_commit(log, USER, dmem("restore", USER, "student", created, "--as", "bob"))
    )
    editor = tmp_path / "editor.sh"
    editor.write_text("#!/bin/sh\nsed -i 's/^## Name$/## Name\\nAlice/' \"$1\"\n", encoding="utf-8")
    editor.chmod(editor.stat().st_mode | stat.S_IXUSR)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EDITOR", str(editor))
        out.append(await one_commit(log, USER, dmem("edit", USER, "student")))
    journey = await dmem("blocks", USER, "journey", "--format", "toml")
    checkout = tmp_path / "checkout"
    (checkout / "blocks").mkdir(parents=True)
    edited_journey = journey.replace('stage = "exploring"', 'stage = "outlining"')
    (checkout / "blocks" / "journey.toml").write_text(edited_journey, encoding="utf-8")
    out.append(await one_commit(log, USER, dmem("import", USER, str(checkout), "--as", "bob")))
    out.append(await one_commit(log, "bob", dmem("init", "bob"), new=True))

    for command in (
        ("history", USER, "journey"),
        ("blocks", USER, "journey"),
        ("archive", "search", USER, "robot name", "--json"),
        # Ranked search: one hit (each database ranks ties its own way); then newest first.
        ("recall", USER, "robot", "--role", "user"),
        ("recall", USER, "--limit", "3"),
        ("context", USER, "--json"),
        ("rotate", USER),
        ("profiles",),
        ("profile", "set", USER, "essay_coach", "--as", "bob"),
        ("blocks", "bob", "human", "--format", "prompt"),
    ):
        out.append(await dmem(*command))

    (checkout / "blocks" / "journey.toml").write_text(
        edited_journey.replace("outlining", "nap"), encoding="utf-8"
    )
    before = log(USER)
    for command in (  # refused alike, with one line, and nothing changes
        ("blocks", "nobody"),
        ("history", USER, "diary"),
        ("restore", USER, "student", "0" * 40, "--as", "bob"),
        ("approve", "0" * 32, "--as", "bob"),
        ("import", USER, str(checkout), "--as", "bob"),
        ("profile", "set", USER, "default", "--as", "bob"),
    ):
        out.append(await dmem(*command, fails=True))
    assert log(USER) == before
    out.append("\n".join(before))
    return [text.replace(str(tmp_path), "<files>") for text in out]


async def one_commit(log: Log, user: str, write: Awaitable[str], *, new: bool = False) -> str:
    """Run a command that writes (`new`: creates the user); it must add exactly one commit to
    the user's main, on top of what was there."""
    before = [] if new else log(user)
    said = await write
    assert log(user)[1:] == before, said
    return said


_TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:?\d\d)?")
_ID = re.compile(r"\b(?:[0-9a-f]{40}|[0-9a-f]{32}|[0-9a-f]{12})\b")
_SCORE = re.compile(r'"score": [0-9.e-]+')


def normalised(outputs: list[str]) -> list[str]:
    """Ids numbered in order of first appearance (the same id twice stays the same number),
    times and archive scores (each backend ranks with its own formula) blanked."""
    numbers: dict[str, str] = {}

    def number(match: re.Match[str]) -> str:
        return numbers.setdefault(match.group(), f"<id{len(numbers)}>")

    return [
        _SCORE.sub('"score": <score>', _ID.sub(number, _TIME.sub("<time>", text)))
        for text in outputs
    ]


def cli_runner(base: list[str], capsys: pytest.CaptureFixture[str]) -> Dmem:
    async def dmem(*args: str, fails: bool = False) -> str:
        code = await asyncio.to_thread(main, [*base, *args])
        out, err = capsys.readouterr()
        if fails:
            assert (code, out, err.count("\n")) == (2, "", 1), (args, out, err)
            return err
        assert code == 0, (args, err)
        return out

    return dmem


@pytest.mark.postgres
async def test_every_command_from_a_thin_client_answers_as_in_the_embedded_mode(
    temporal_env: WorkflowEnvironment,
    postgres_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    embedded = rig_settings(tmp_path / "embedded")
    base = _cli_on(temporal_env, embedded, monkeypatch)
    async with running_rig(temporal_env.client, embedded, SCRIPT):
        users = embedded.memory.data_dir / "users"
        alone = await session(
            cli_runner(base, capsys),
            lambda user: repo_log(users / user),
            tmp_path / "embedded-files",
        )

    with git_server(tmp_path / "remote") as server:
        worker = distributed_settings(
            tmp_path / "worker",
            database_url=fresh_schema_url(postgres_url),
            git_remote=server.url,
        )
        client = on_host(worker, tmp_path / "client")
        base = thin_client(temporal_env, client, monkeypatch)
        async with running_rig(temporal_env.client, worker, SCRIPT):
            shared = await session(
                cli_runner(base, capsys),
                lambda user: repo_log(tmp_path / "remote" / f"{user}.git"),
                tmp_path / "client-files",
            )
        assert_only_clones(client.memory.data_dir, tmp_path / "remote")

    assert normalised(shared) == normalised(alone)


def on_host(settings: Settings, data_dir: Path) -> Settings:
    """The same deployment seen from another host: its own (empty) data dir."""
    data_dir.mkdir()
    memory = settings.memory.model_copy(update={"data_dir": data_dir})
    return settings.model_copy(update={"memory": memory})


def thin_client(
    temporal_env: WorkflowEnvironment, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """`dmem` configured as on another host: Temporal, the database, the archive and the git
    remote from the environment; the options naming its own data dir and the profile."""
    base = _cli_on(temporal_env, settings, monkeypatch)
    for key, value in distributed_env(settings).items():
        monkeypatch.setenv(key, value)
    return base


def repo_log(repo: Path) -> list[str]:
    return git_output(repo, "log", "--format=%an|%s", "main").splitlines()


def assert_only_clones(data_dir: Path, remote_root: Path) -> None:
    """The client's data dir holds nothing but disposable clones, none ahead of the remote:
    every commit a clone holds is on the remote's main (a cache may be behind it)."""
    assert sorted(p.name for p in data_dir.iterdir()) == ["clones"]
    for clone in (data_dir / "clones").iterdir():
        assert (clone / ".git").is_dir(), clone
        held = set(git_output(clone, "rev-list", "--all").split())
        remote = remote_root / f"{clone.name}.git"
        pushed = git_output(remote, "rev-list", "main").split() if remote.exists() else []
        assert held <= set(pushed), clone
        assert git_output(clone, "status", "--porcelain", "--ignored") == ""


@pytest.mark.postgres
async def test_two_clients_racing_on_one_user_both_land_in_a_linear_history(
    temporal_env: WorkflowEnvironment, postgres_url: str, tmp_path: Path
) -> None:
    """Each client's edits, made at once, are each one commit on top of the other's: a push
    that lost the race is refused and the edit redone on the new head."""
    rounds = 4
    with git_server(tmp_path / "remote") as server:
        worker = distributed_settings(
            tmp_path / "worker", database_url=fresh_schema_url(postgres_url), git_remote=server.url
        )
        remote = tmp_path / "remote" / f"{USER}.git"
        async with (
            running_rig(temporal_env.client, worker, [{"text": "Hello."}]) as rig,
            connected(rig, on_host(worker, tmp_path / "a")) as first,
            connected(rig, on_host(worker, tmp_path / "b")) as second,
        ):
            await first.send_message(USER, "hi", turn_id="t1")  # the worker creates alice
            before = repo_log(remote)

            async def edits(client: MemoryClient, label: str, field: str) -> None:
                block = await asyncio.to_thread(client.stack.blocks.read_block, USER, label)
                for n in range(rounds):
                    fields = {**block.fields, field: f"{field} {n}"}
                    markdown = to_markdown(block.spec, fields)
                    await client.edit_block(USER, label, markdown, author=f"{label}-editor")

            await asyncio.gather(
                edits(first, "student", "name"), edits(second, "journey", "current_focus")
            )
            final = await asyncio.to_thread(rig.stack.blocks.read_blocks, USER)
        after = repo_log(remote)
        assert_only_clones(tmp_path / "a", tmp_path / "remote")
        assert_only_clones(tmp_path / "b", tmp_path / "remote")

    assert after[len(after) - len(before) :] == before
    new = after[: len(after) - len(before)]
    assert sorted(new) == sorted(
        ["student-editor|Edit student"] * rounds + ["journey-editor|Edit journey"] * rounds
    )
    assert git_output(remote, "rev-list", "--merges", "main") == ""  # linear
    assert final["student"].fields["name"] == f"name {rounds - 1}"
    assert final["journey"].fields["current_focus"] == f"current_focus {rounds - 1}"


@pytest.mark.postgres
async def test_a_memory_client_on_another_host_answers_as_the_workers_host(
    temporal_env: WorkflowEnvironment, postgres_url: str, tmp_path: Path
) -> None:
    """Every MemoryClient call from a host with an empty data dir: reads answer as on the
    worker's own host, each write is one commit on the remote, a refused write changes
    nothing, and a remote that is down is one clear error that changes nothing."""
    root = tmp_path / "remote"

    def log(user: str) -> list[str]:
        return repo_log(root / f"{user}.git")

    with git_server(root) as server:
        worker = distributed_settings(
            tmp_path / "worker", database_url=fresh_schema_url(postgres_url), git_remote=server.url
        )
        async with (
            running_rig(temporal_env.client, worker, SCRIPT) as rig,
            connected(rig, on_host(worker, tmp_path / "thin")) as thin,
        ):
            reply = await thin.send_message(USER, "I built a robot called Bolt", turn_id="t1")
            grit, stage, approach = (d.id for d in reply.diffs)
            await assert_same_answers(thin, rig.client, approach)
            approved = await thin.approve(grit, "ms-rivera")
            assert approved is not None
            assert (
                approved.commit_sha == git_output(root / f"{USER}.git", "rev-parse", "main").strip()
            )
            await thin.reject(stage, "ms-rivera", "too early")
            strategy = await asyncio.to_thread(
                thin.stack.blocks.read_block, USER, "engagement_strategy"
            )
            edited = to_markdown(strategy.spec, {**strategy.fields, "approach": "Questions first"})
            await thin.approve(approach, "ms-rivera", edited_markdown=edited)
            await assert_same_answers(thin, rig.client, approach)

            created = (await thin.history(USER, "student"))[-1].sha
            await one_commit(log, USER, thin.restore(USER, "student", created, "bob"))
            student = await asyncio.to_thread(thin.stack.blocks.read_block, USER, "student")
            named = to_markdown(student.spec, {**student.fields, "name": "Alice"})
            await one_commit(log, USER, thin.edit_block(USER, "student", named, "alice"))
            await one_commit(log, "bob", thin.create_user("bob", "default"), new=True)
            assert await thin.profile_of("bob") == await rig.client.profile_of("bob")
            before = log(USER)
            with pytest.raises(ProfileError, match="cannot change to profile 'default'"):
                await thin.set_profile(USER, "default", "bob")
            assert log(USER) == before
            await assert_same_answers(thin, rig.client, approach)
            # A `dmem` process that knows nothing but its environment, started elsewhere.
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            env = {
                "PATH": os.environ["PATH"],
                "DMEM_TEMPORAL_ADDRESS": address(temporal_env),
                **distributed_env(on_host(worker, tmp_path / "third")),
            }
            shown = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "durable_memory.cli", "history", USER, "student", "--json"],
                cwd=elsewhere,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert shown.returncode == 0, shown.stderr
            history = await rig.client.history(USER, "student")
            assert json.loads(shown.stdout) == [c.model_dump(mode="json") for c in history]
            assert list(elsewhere.iterdir()) == []
            assert_only_clones(tmp_path / "third", root)

            server.stop()
            for call in (
                lambda: thin.history(USER, "student"),
                lambda: thin.edit_block(USER, "student", named.replace("Alice", "Eve"), "eve"),
            ):
                with pytest.raises(GitRemoteUnavailable, match="unavailable"):
                    await call()
            assert log(USER) == before
    assert_only_clones(tmp_path / "thin", root)


async def assert_same_answers(here: MemoryClient, there: MemoryClient, diff_id: str) -> None:
    """The reads of MemoryClient answer the same on both hosts."""
    reads: list[Callable[[MemoryClient], Awaitable[object]]] = [
        lambda c: c.pending_diffs(USER),
        lambda c: c.preview(diff_id),
        lambda c: c.history(USER, "student"),
        lambda c: c.profile_of(USER),
        lambda c: c.context_overview(USER),
        lambda c: c.search_archive(USER, "robot name"),
    ]
    for read in reads:
        assert await read(here) == await read(there)


def connected(rig: Rig, settings: Settings) -> MemoryClient:
    """A MemoryClient of another host: the rig's Temporal connection, its own memory stack."""
    return MemoryClient(rig.client.client, settings, stack_from_settings(settings))


def test_import_from_the_repository_is_refused_on_a_thin_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its clones are reset to the remote at every read: hand edits there would be lost, so
    `dmem import` needs the directory they are in, and says so before opening any store."""
    settings = distributed_settings(
        tmp_path / "data",
        database_url="postgresql+psycopg://nobody@127.0.0.1:1/none",
        git_remote=(tmp_path / "remote").as_uri(),
    )
    for key, value in distributed_env(settings).items():
        monkeypatch.setenv(key, value)
    code = main(["--data-dir", str(tmp_path / "data"), "import", USER, "--as", "bob"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert "give the DIR whose blocks/ holds the edited files" in err
    assert not (tmp_path / "data").exists()


def test_commands_that_need_this_hosts_disk_say_so_in_their_help() -> None:
    """Every other command runs from a thin client."""
    local = {
        path
        for path, parser in _commands(build_parser())
        if path and LOCAL_DISK in " ".join(parser.format_help().split())
    }
    assert local == {("dev",), ("worker",), ("demo",), ("import",), ("git-serve",)}
