"""The journal of a write under way (`.git/dmem-journal`): the HEAD it started from and the
labels it is writing (and the records, `profile.toml` or `policies.toml`, it changes). Written
before the first file, removed after the commit, so a journal found by the next writer means
the write did not finish (see recovery.py)."""

from dataclasses import dataclass, field
from pathlib import Path

from durable_memory.memory.core.ids import validate_label
from durable_memory.memory.store.git.layout import RECORD_FILES
from durable_memory.memory.store.git.refs import FULL_SHA, read_git_file, write_git_file

JOURNAL_FILE = "dmem-journal"
_JOURNAL_BASE = "base="
"""The journal's first line: the HEAD a write started from, a known-good commit to go back to."""


@dataclass(frozen=True)
class Journal:
    base: str | None
    """The HEAD the write started from; None for a user's first commit (or a torn line)."""
    labels: list[str]
    """The blocks whose files the write was changing."""
    records: list[str] = field(default_factory=list)
    """The records (`RECORD_FILES`) the write was changing too."""


def write_journal(
    git_dir: Path, head: str | None, labels: list[str], records: list[str] | None = None
) -> None:
    base = [f"{_JOURNAL_BASE}{head}"] if head else []
    entries = [*base, *labels, *(records or [])]
    write_git_file(git_dir, JOURNAL_FILE, "\n".join(entries))


def read_journal(git_dir: Path) -> Journal | None:
    """The journal of an interrupted write, or None if no write was interrupted."""
    text = read_git_file(git_dir, JOURNAL_FILE)
    if text is None:
        return None
    lines = [line for line in text.split("\n") if line]
    base = None
    if lines and lines[0].startswith(_JOURNAL_BASE):
        base = lines.pop(0).removeprefix(_JOURNAL_BASE)
        base = base if FULL_SHA.fullmatch(base) else None
    records = [line for line in lines if line in RECORD_FILES]  # a label has no '.'
    labels = [validate_label(line) for line in lines if line not in RECORD_FILES]
    return Journal(base=base, labels=labels, records=records)


def clear_journal(git_dir: Path) -> None:
    (git_dir / JOURNAL_FILE).unlink(missing_ok=True)
