"""`dmem`: the command line for people. User errors print one line and exit with status 2."""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from durable_memory.config import memory_settings
from durable_memory.memory.errors import DurableMemoryError
from durable_memory.memory.service import MemoryService, open_service
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.recall import MessageRole

EXIT_USER_ERROR = 2


class UsageError(DurableMemoryError):
    """A command line that makes no sense."""


def _service(args: argparse.Namespace) -> MemoryService:
    settings = memory_settings()
    return open_service(
        args.data_dir or settings.data_dir,
        args.database_url or settings.database_url,
        args.profile or settings.profile,
    )


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
    sha = _service(args).ensure_user(args.user)
    print(f"memory of '{args.user}' is at commit {sha[:12]}")


def cmd_blocks(args: argparse.Namespace) -> None:
    service = _service(args)
    labels = [args.label] if args.label else [b.label for b in service.profile.blocks]
    if args.json:
        blocks = service.read_blocks(args.user)
        data = {
            label: {"fields": blocks[label].fields, "value": blocks[label].value}
            for label in labels
            if service.spec(label)
        }
        print(json.dumps(data, indent=2, ensure_ascii=False))
        return
    print("\n\n".join(service.render(args.user, label, args.format) for label in labels))


def cmd_edit(args: argparse.Namespace) -> None:
    service = _service(args)
    markdown = service.render(args.user, args.label, "markdown")
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.NamedTemporaryFile("w+", suffix=".md", encoding="utf-8", delete=False) as f:
        f.write(markdown)
        path = Path(f.name)
    try:
        while True:
            if subprocess.call([*shlex.split(editor), str(path)]) != 0:
                raise UsageError(f"the editor {editor!r} failed; nothing was changed")
            edited = path.read_text(encoding="utf-8")
            if edited == markdown:
                print("no change")
                return
            try:
                sha = service.edit_markdown(args.user, args.label, edited, _person(args.user))
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
    sha = _service(args).commit_hand_edits(args.user, _person(args.as_name))
    print(f"committed {sha[:12]}" if sha else "no hand edits to import")


def cmd_history(args: argparse.Namespace) -> None:
    commits = _service(args).history(args.user, args.label, args.limit)
    lines = [
        f"{c.sha[:12]}  {c.timestamp:%Y-%m-%d %H:%M:%S}  {c.author} ({c.author_kind})  "
        f"{c.message.splitlines()[0]}"
        for c in commits
    ]
    _emit(args, commits, "\n".join(lines) or "no history")


def cmd_restore(args: argparse.Namespace) -> None:
    sha = _service(args).restore(args.user, args.label, args.sha, _person(args.as_name))
    print(f"restored {args.label} from {args.sha[:12]} as commit {sha[:12]}")


def cmd_diffs(args: argparse.Namespace) -> None:
    service = _service(args)
    diffs = service.pending(args.user)
    text = "\n".join(
        f"{d.id}  {d.label}  {d.summary}\n  reasoning: {d.reasoning}\n"
        + "".join(f"  {line}\n" for line in service.preview(d.id).splitlines())
        for d in diffs
    )
    _emit(args, diffs, text or "no pending diffs")


def cmd_approve(args: argparse.Namespace) -> None:
    edited = None
    if args.edit:
        try:
            edited = Path(args.edit).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read {args.edit}: {error}") from None
    diff = _service(args).approve(args.diff_id, args.as_name, edited_markdown=edited)
    if diff.commit_sha:
        print(f"approved {diff.id}: commit {diff.commit_sha[:12]}")
    else:
        print(f"approved {diff.id} but it is {diff.status.value}: {diff.decision_reason}")


def cmd_reject(args: argparse.Namespace) -> None:
    diff = _service(args).reject(args.diff_id, args.as_name, args.reason)
    print(f"rejected {diff.id}")


def cmd_recall(args: argparse.Namespace) -> None:
    roles = [MessageRole(r) for r in args.role] if args.role else None
    page = _service(args).recall.search(
        args.user, args.query, roles=roles, limit=args.limit, offset=args.offset
    )
    text = "\n".join(
        f"{m.created_at:%Y-%m-%d %H:%M}  {m.role.value:<11} {m.content[:100]}"
        for m in page.messages
    )
    _emit(args, page, f"{text}\n({len(page.messages)} of {page.total})" if text else "no match")


def cmd_demo(args: argparse.Namespace) -> None:
    from durable_memory.demo import run_core_demo

    run_core_demo(data_dir=args.data_dir, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmem", description=__doc__)
    parser.add_argument("--data-dir", help="data directory (default: memory.data_dir)")
    parser.add_argument("--database-url", help="SQLAlchemy URL (default: SQLite in the data dir)")
    parser.add_argument("--profile", help="bundled profile name or profile TOML path")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, func: Callable[[argparse.Namespace], None], help_: str, json_flag: bool = False
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    p = add("demo", cmd_demo, "show the memory core at work in a temporary data dir", True)
    p = add("init", cmd_init, "create a user's memory repository")
    p.add_argument("user")
    p = add("blocks", cmd_blocks, "show a user's memory blocks", True)
    p.add_argument("user")
    p.add_argument("label", nargs="?")
    p.add_argument("--format", choices=["toml", "markdown", "prompt"], default="markdown")
    p = add("edit", cmd_edit, "edit a block's Markdown form in $EDITOR (committed as the user)")
    p.add_argument("user")
    p.add_argument("label")
    p = add("import", cmd_import, "validate and commit block files edited by hand in the repo")
    p.add_argument("user")
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
    p = add("reject", cmd_reject, "reject a pending diff")
    p.add_argument("diff_id")
    p.add_argument("--as", dest="as_name", required=True, help="who rejects")
    p.add_argument("--reason", required=True)
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
    except KeyboardInterrupt:
        print("dmem: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
