"""Claude's memory tool (`memory_20250818`) over a user's memory blocks, every write a proposal.

`/memories` is the user's memory: `/memories/<label>.md` for each block of the profile, in the
Markdown form people edit (formats.to_markdown). The directory is flat and fixed: the profile
declares the blocks, a person adds, removes and renames them.

- `view /memories` lists the files with each block's characters used and limit; `view` of a
  file shows its committed text with line numbers and, after it, the agent's own pending
  proposals for that block and its latest ones that were not applied (rejected, expired,
  conflicted), with the reason.
- `create` (of an existing file), `str_replace` and `insert` edit the committed Markdown and
  propose the result as a rewrite of the block through `Review.propose`: the validation, char
  limit, supersession and approval of every other edit. Nothing is written to memory.
- `delete`, `rename` and `create` of a new file are tool errors: memory is human-controlled.

Commands are parsed with the SDK's own models and dispatched by its abstract backend
(`BetaAbstractMemoryTool`). A path is accepted only in the exact forms `/memories`,
`/memories/` and `/memories/<label>.md`, with no normalising: `..`, `.`, `//`, backslashes,
NUL bytes, encodings and lookalikes never reach a block. Every error is a `ToolError` with a
message the model can act on. Each line of a file is shown after its number, so no text in
memory can pass for a line of ours; values the model wrote (summaries, reasons) are JSON
strings.
"""

import json
import re
from typing import Annotated

from anthropic.lib.tools import BetaAbstractMemoryTool, ToolError
from anthropic.types.beta import (
    BetaMemoryTool20250818Command,
    BetaMemoryTool20250818CreateCommand,
    BetaMemoryTool20250818DeleteCommand,
    BetaMemoryTool20250818InsertCommand,
    BetaMemoryTool20250818RenameCommand,
    BetaMemoryTool20250818StrReplaceCommand,
    BetaMemoryTool20250818ViewCommand,
)
from pydantic import Field, TypeAdapter, ValidationError

from durable_memory.memory.core.blocks import render_value
from durable_memory.memory.core.errors import FormatError, validation_message
from durable_memory.memory.core.formats import from_markdown, to_markdown
from durable_memory.memory.core.limits import cut_text
from durable_memory.memory.core.operations import line_numbers, rewrite_operation
from durable_memory.memory.service.access import Block
from durable_memory.memory.service.blocks import Blocks
from durable_memory.memory.service.review import Review
from durable_memory.models.diffs import DiffStatus, PendingDiff, Proposer
from durable_memory.models.limits import MAX_ARGUMENT_NAME_CHARS

MEMORIES = "/memories"
MAX_PATH_CHARS = 256
"""Longer paths are refused before anything else: no block's path comes close."""
RECENT_UNAPPLIED = 5
"""How many of its latest proposals for a block that were not applied `view` shows."""
MAX_PREVIEW_CHARS = 2000
"""Of one pending proposal's unified diff in a `view` (the whole result is bounded too)."""
LINE_NUMBER_WIDTH = 6
"""As the SDK's own file-backed memory tool numbers lines."""
_FILE = re.compile(r"/memories/([a-z][a-z0-9_]{0,47})\.md")
_UNAPPLIED = [DiffStatus.REJECTED, DiffStatus.EXPIRED, DiffStatus.CONFLICTED]
_HUMAN_CONTROLLED = (
    "memory is human-controlled: a person adds, removes and renames memory files (the blocks "
    "of the profile); you can propose changes to a file's content with create, str_replace "
    "or insert"
)

_COMMAND: TypeAdapter[BetaMemoryTool20250818Command] = TypeAdapter(
    # The SDK's union, discriminated on `command` so an error names the one command's field.
    Annotated[BetaMemoryTool20250818Command, Field(discriminator="command")]
)


def settled_ahead(diff: PendingDiff) -> str | None:
    """What the model is told of a proposal a standing approval settled as it was made (see
    service/review.py), None for one that waits for a person."""
    if diff.status is DiffStatus.APPROVED:
        return (
            f"A standing approval ({diff.decision_reason}) covered it: it is in memory now; "
            "do not propose it again."
        )
    if diff.status is DiffStatus.CONFLICTED:
        return f"A standing approval covered it, but it did not apply ({diff.decision_reason})."
    return None


def parse_command(arguments: object) -> BetaMemoryTool20250818Command:
    """The memory tool's input as the SDK's command model; a ToolError saying what is wrong."""
    try:
        return _COMMAND.validate_python(arguments)
    except ValidationError as error:
        raise ToolError(validation_message(error, "invalid memory command")) from None


def _quoted(path: str) -> str:
    return json.dumps(cut_text(path, MAX_ARGUMENT_NAME_CHARS), ensure_ascii=False)


def _file(label: str) -> str:
    return f"{MEMORIES}/{label}.md"


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(
        f"{str(number).rjust(LINE_NUMBER_WIDTH)}\t{line}"
        for number, line in enumerate(lines, first)
    )


def _lines(text: str) -> list[str]:
    """A file's lines, without the empty one after its final newline."""
    return text.removesuffix("\n").split("\n")


def _is_directory(path: str) -> bool:
    """Whether `path` is `/memories` itself (else it names something in it, not yet known to
    be a block's file). Refuses every path outside `/memories`, with the reason."""
    if len(path) > MAX_PATH_CHARS:
        raise ToolError(
            f"the path is {len(path)} characters long; memory paths are at most "
            f"{MAX_PATH_CHARS}: use {MEMORIES}/<block>.md"
        )
    if "\x00" in path:
        raise ToolError(f"the path {_quoted(path)} contains a NUL byte; use {MEMORIES}/<block>.md")
    if path in (MEMORIES, MEMORIES + "/"):
        return True
    if not path.startswith(MEMORIES + "/"):
        raise ToolError(
            f"the path {_quoted(path)} is outside your memory directory; every memory path "
            f"starts with {MEMORIES}/ (view {MEMORIES} lists the files)"
        )
    name = path.removeprefix(MEMORIES + "/")
    if any(part in ("", ".", "..") for part in name.split("/")) or "\\" in name:
        raise ToolError(
            f"the path {_quoted(path)} is not allowed: {MEMORIES} is one flat directory, with "
            f"no '.', '..' or empty parts; use {MEMORIES}/<block>.md"
        )
    return False


def proposal_text(diff: PendingDiff) -> str:
    """What the model is told of the edit it proposed: its id and summary, and whether it
    awaits a person or was settled at once (a standing approval)."""
    settled = settled_ahead(diff)
    if settled is not None:
        return (
            f"Proposed edit {diff.id} to {_file(diff.label)}: "
            f"{json.dumps(diff.summary, ensure_ascii=False)}. {settled}"
        )
    return (
        f"Proposed edit {diff.id} to {_file(diff.label)}: "
        f"{json.dumps(diff.summary, ensure_ascii=False)}. It awaits a person's approval and "
        f"is not in memory yet; view {_file(diff.label)} shows it among your pending "
        "proposals. A new edit of this file replaces it, so put all your changes to one "
        "file in one edit, and do not propose this one again."
    )


class ProposingMemoryTool(BetaAbstractMemoryTool):
    """One memory tool call of one user in one turn. An edit's proposal, if the call made
    one, is `proposed` afterwards."""

    def __init__(
        self, blocks: Blocks, review: Review, user_id: str, turn_id: str, diff_id: str | None
    ) -> None:
        super().__init__()
        self._blocks = blocks
        self._review = review
        self._user_id = user_id
        self._turn_id = turn_id
        self._diff_id = diff_id
        self.proposed: PendingDiff | None = None

    def _no_such_file(self, path: str, doing: str) -> ToolError:
        profile = self._blocks.profile(self._user_id)
        files = ", ".join(_file(b.label) for b in profile.blocks)
        return ToolError(
            f"cannot {doing} {_quoted(path)}: there is no such memory file. {MEMORIES} holds "
            f"one file per memory block: {files}. New blocks are added by a person, not by you."
        )

    def _label(self, path: str, doing: str) -> str | None:
        """None for the directory, else the label of the block whose file `path` is; a
        ToolError for any other path."""
        if _is_directory(path):
            return None
        match = _FILE.fullmatch(path)
        if match is None or self._blocks.profile(self._user_id).block(match[1]) is None:
            raise self._no_such_file(path, doing)
        return match[1]

    def _block(self, path: str, doing: str) -> Block:
        """The block at file `path`; ToolError for the directory or a file that is none."""
        label = self._label(path, doing)
        if label is None:
            raise ToolError(
                f"{MEMORIES} is a directory; {doing} a file such as {MEMORIES}/<block>.md"
            )
        return self._blocks.read_block(self._user_id, label)

    def _editable(self, path: str, doing: str) -> Block:
        block = self._block(path, doing)
        if block.spec.read_only:
            raise ToolError(
                f"{_file(block.label)} is read-only: the profile does not let you propose edits "
                "to it"
            )
        return block

    # -- reading -------------------------------------------------------------------------

    def view(self, command: BetaMemoryTool20250818ViewCommand) -> str:
        if _is_directory(command.path):
            if command.view_range is not None:
                raise ToolError(f"view_range applies to a file, not to the directory {MEMORIES}")
            return self._directory()
        block = self._block(command.path, "view")
        lines = _lines(to_markdown(block.spec, block.fields))
        first, last = self._range(command.view_range, len(lines))
        shown = _numbered(lines[first - 1 : last], first)
        header = f"Here's the content of {_file(block.label)} with line numbers:"
        return "\n".join([header, shown, "", self._status(block), *self._proposals(block)])

    @staticmethod
    def _range(view_range: list[int] | None, count: int) -> tuple[int, int]:
        if view_range is None:
            return 1, count
        if len(view_range) != 2:
            raise ToolError("view_range takes two line numbers: [first, last] (last -1: the end)")
        first, last = view_range
        last = count if last == -1 else last
        if not 1 <= first <= last <= count:
            raise ToolError(
                f"invalid view_range {view_range}: the file has {count} lines; give "
                f"[first, last] with 1 <= first <= last <= {count}, or last -1 for the end"
            )
        return first, last

    def _status(self, block: Block) -> str:
        used = len(render_value(block.spec, block.fields))
        access = " Read-only: you cannot propose edits to it." if block.spec.read_only else ""
        return (
            f"[{block.label}: {used} of {block.spec.limit} characters used.{access} This is the "
            "committed text: an edit of yours is a proposal until a person approves it.]"
        )

    def _proposals(self, block: Block) -> list[str]:
        """The agent's own proposals for the block: pending, then recent ones not applied."""
        pending = self._review.proposals(
            self._user_id, block.label, [DiffStatus.PENDING], RECENT_UNAPPLIED
        )
        unapplied = self._review.proposals(self._user_id, block.label, _UNAPPLIED, RECENT_UNAPPLIED)
        out: list[str] = []
        if pending:
            out.append(
                "\nYour pending proposals for this file (not in memory yet; a new edit of the "
                "file replaces them):"
            )
            for diff in pending:
                preview = cut_text(self._review.preview(diff.id, self._user_id), MAX_PREVIEW_CHARS)
                out.append(f"- {self._headline(diff)}, awaiting a person's decision")
                out.extend(f"    {line}" for line in preview.rstrip("\n").split("\n"))
        if unapplied:
            out.append("\nYour latest proposals for this file that were not applied:")
            out.extend(
                f"- {self._headline(d)}, {d.status.value}"
                + (f" by {d.decided_by}" if d.status is DiffStatus.REJECTED else "")
                + f": {json.dumps(d.decision_reason or '', ensure_ascii=False)}"
                for d in unapplied
            )
        return out

    @staticmethod
    def _headline(diff: PendingDiff) -> str:
        summary = json.dumps(diff.summary, ensure_ascii=False)
        return f"diff {diff.id} (turn {diff.proposer.turn_id}) {summary}"

    def _directory(self) -> str:
        blocks = self._blocks.read_blocks(self._user_id)
        pending = [
            d.label for d in self._review.pending(self._user_id) if d.proposer.turn_id is not None
        ]
        lines = [
            f"Here're the files in {MEMORIES}, one per memory block (characters used of the "
            "block's limit; a person approves every change):"
        ]
        for block in blocks.values():
            used = len(render_value(block.spec, block.fields))
            notes = [f"{used}/{block.spec.limit} chars"]
            if block.spec.read_only:
                notes.append("read-only")
            if count := pending.count(block.label):
                notes.append(f"{count} pending proposal{'s' * (count > 1)} of yours")
            lines.append(f"{_file(block.label)}\t{', '.join(notes)}\t{block.spec.description}")
        return "\n".join(lines)

    # -- proposing -----------------------------------------------------------------------

    def _propose(self, block: Block, new_markdown: str, command: str) -> str:
        """Propose the block rewritten to `new_markdown`, computed from `block` as read."""
        try:
            fields = from_markdown(block.spec, new_markdown)
        except FormatError as error:  # its form, a field's value, the char limit
            raise ToolError(
                f"{command} on {_file(block.label)} failed, nothing proposed: {error} (the result "
                f"must keep the file's form: the front matter 'block: {block.label}', then a "
                "'## Section' per field, as view shows it)"
            ) from None
        if fields == block.fields:
            raise ToolError(
                f"{command} on {_file(block.label)} changes nothing in the block; nothing proposed"
            )
        diff = self._review.propose(
            self._user_id,
            block.label,
            rewrite_operation(block.spec, fields),
            f"Claude's memory tool: {command} on {_file(block.label)}",
            Proposer.turn(self._turn_id),
            diff_id=self._diff_id,
            read_at=block.sha,
        )
        self.proposed = diff
        return proposal_text(diff)

    def create(self, command: BetaMemoryTool20250818CreateCommand) -> str:
        block = self._editable(command.path, "create")
        return self._propose(block, command.file_text, "create")

    def str_replace(self, command: BetaMemoryTool20250818StrReplaceCommand) -> str:
        block = self._editable(command.path, "edit")
        text = to_markdown(block.spec, block.fields)
        if not command.old_str:
            raise ToolError("old_str is empty; copy the exact text to replace from the file")
        where = line_numbers(text, command.old_str)
        if not where:
            raise ToolError(
                f"No replacement was performed: old_str did not appear verbatim in "
                f"{_file(block.label)}; view the file and copy the text exactly"
            )
        if len(where) > 1:
            raise ToolError(
                f"No replacement was performed: old_str appears {len(where)} times in "
                f"{_file(block.label)} (lines {', '.join(map(str, where))}); include more "
                "surrounding text so that it is unique"
            )
        new_text = text.replace(command.old_str, command.new_str, 1)
        return self._propose(block, new_text, "str_replace")

    def insert(self, command: BetaMemoryTool20250818InsertCommand) -> str:
        block = self._editable(command.path, "edit")
        lines = _lines(to_markdown(block.spec, block.fields))
        if not 0 <= command.insert_line <= len(lines):
            raise ToolError(
                f"Invalid insert_line {command.insert_line}: {_file(block.label)} has "
                f"{len(lines)} lines; it should be within [0, {len(lines)}] (0: before line 1)"
            )
        lines.insert(command.insert_line, command.insert_text.rstrip("\n"))
        return self._propose(block, "\n".join(lines) + "\n", "insert")

    # -- refused -------------------------------------------------------------------------

    def delete(self, command: BetaMemoryTool20250818DeleteCommand) -> str:
        self._label(command.path, "delete")
        raise ToolError(f"cannot delete {_quoted(command.path)}: {_HUMAN_CONTROLLED}")

    def rename(self, command: BetaMemoryTool20250818RenameCommand) -> str:
        self._label(command.old_path, "rename")
        _is_directory(command.new_path)  # a path outside /memories gets its own error
        raise ToolError(f"cannot rename {_quoted(command.old_path)}: {_HUMAN_CONTROLLED}")
