"""Strict identifiers. Checked before any path, query or commit is built from them."""

import re

from durable_memory.memory.core.errors import InvalidIdentifier

# ASCII only on purpose: unicode look-alikes, whitespace, separators and dot-files are refused.
_USER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_LABEL = re.compile(r"[a-z][a-z0-9_]{0,47}")
_DIFF_ID = re.compile(r"[0-9a-f]{32}")
_SHA = re.compile(r"[0-9a-f]{4,40}")


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check(value: object, pattern: re.Pattern[str], what: str, rule: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidIdentifier(f"invalid {what} {_describe(value)}: {rule}")
    return value


def validate_user_id(user_id: object) -> str:
    """Return `user_id` if it is 1-64 ASCII letters, digits, '_' or '-' (not first)."""
    return _check(
        user_id,
        _USER_ID,
        "user id",
        "use 1-64 ASCII letters, digits, '_' or '-', starting with a letter or digit",
    )


def validate_label(label: object) -> str:
    """Return `label` if it is a lowercase identifier of 1-48 characters."""
    return _check(
        label,
        _LABEL,
        "block label",
        "use 1-48 lowercase ASCII letters, digits or '_', starting with a letter",
    )


def validate_diff_id(diff_id: object) -> str:
    """Return `diff_id` if it is 32 lowercase hex digits (a uuid4 without dashes)."""
    return _check(diff_id, _DIFF_ID, "diff id", "expected 32 lowercase hex digits")


def validate_sha(sha: object) -> str:
    """Return `sha` if it looks like a (possibly abbreviated) git commit sha."""
    return _check(sha, _SHA, "commit sha", "expected 4-40 lowercase hex digits")
