"""Commit messages and identities: authors' names are validated, trailers (`Key: value` lines
that name what a commit records, e.g. a Diff-Id) are written and parsed here."""

import re
from collections.abc import Mapping
from datetime import UTC

import git

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.models.history import Author, AuthorKind, CommitInfo

_AUTHOR_NAME = re.compile(r"[^\x00-\x1f\x7f<>]{1,100}")
_TRAILER_KEY = re.compile(r"[A-Z][A-Za-z-]{0,39}")


def validate_author_name(name: object) -> str:
    """Names go into commit identities: 1-100 characters, no control characters, no '<' '>'."""
    if not isinstance(name, str) or not _AUTHOR_NAME.fullmatch(name) or name != name.strip():
        raise DurableMemoryError(
            f"invalid name {name!r:.60}: use 1-100 characters without control characters, "
            "'<', '>' or surrounding spaces"
        )
    return name


def _one_line(value: str) -> str:
    return " ".join(value.split())


def format_message(summary: str, body: str = "", trailers: Mapping[str, str] | None = None) -> str:
    """A commit message: summary line, optional body, then `Key: value` trailers."""
    parts = [_one_line(summary)[:200] or "Update memory"]
    if body.strip():
        parts.append(body.strip())
    if trailers:
        for key in trailers:
            if not _TRAILER_KEY.fullmatch(key):
                raise ValueError(f"bad trailer key {key!r}")
        parts.append("\n".join(f"{k}: {_one_line(v)}" for k, v in trailers.items() if v))
    return "\n\n".join(parts) + "\n"


def author_actor(author: Author) -> git.Actor:
    """The git identity of an author: its name, and its kind in the email (`user+alice@...`)."""
    slug = re.sub(r"[^a-z0-9]+", "-", author.name.lower()).strip("-") or "someone"
    return git.Actor(validate_author_name(author.name), f"{author.kind.value}+{slug}@localhost")


def parse_trailers(message: str) -> dict[str, str]:
    paragraphs = message.strip().split("\n\n")
    if len(paragraphs) < 2:
        return {}
    found: dict[str, str] = {}
    for line in paragraphs[-1].splitlines():
        key, sep, value = line.partition(": ")
        if not sep or not _TRAILER_KEY.fullmatch(key):
            return {}
        found[key] = value
    return found


def message_text(commit: git.Commit) -> str:
    message = commit.message
    return message if isinstance(message, str) else message.decode("utf-8", errors="replace")


def commit_info(commit: git.Commit) -> CommitInfo:
    email = commit.author.email or ""
    kind = email.split("+", 1)[0] if "+" in email else AuthorKind.SYSTEM.value
    message = message_text(commit)
    return CommitInfo(
        sha=commit.hexsha,
        message=message.strip(),
        author=commit.author.name or "",
        author_kind=kind,
        timestamp=commit.authored_datetime.astimezone(UTC),
        trailers=parse_trailers(message),
    )
