"""Strict identifiers. Checked before any path, query or commit is built from them."""

import re

from durable_memory.memory.errors import InvalidIdentifier

# ASCII only on purpose: unicode look-alikes, whitespace, separators and dot-files are refused.
_USER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_LABEL = re.compile(r"[a-z][a-z0-9_]{0,47}")
_DIFF_ID = re.compile(r"[0-9a-f]{32}")
_SHA = re.compile(r"[0-9a-f]{4,40}")


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_user_id(user_id: object) -> str:
    """Return `user_id` if it is 1-64 ASCII letters, digits, '_' or '-' (not first)."""
    if not isinstance(user_id, str) or not _USER_ID.fullmatch(user_id):
        raise InvalidIdentifier(
            f"invalid user id {_describe(user_id)}: use 1-64 ASCII letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return user_id


def validate_label(label: object) -> str:
    """Return `label` if it is a lowercase identifier of 1-48 characters."""
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise InvalidIdentifier(
            f"invalid block label {_describe(label)}: use 1-48 lowercase ASCII letters, digits "
            "or '_', starting with a letter"
        )
    return label


def validate_diff_id(diff_id: object) -> str:
    """Return `diff_id` if it is 32 lowercase hex digits (a uuid4 without dashes)."""
    if not isinstance(diff_id, str) or not _DIFF_ID.fullmatch(diff_id):
        raise InvalidIdentifier(
            f"invalid diff id {_describe(diff_id)}: expected 32 lowercase hex digits"
        )
    return diff_id


def validate_sha(sha: object) -> str:
    """Return `sha` if it looks like a (possibly abbreviated) git commit sha."""
    if not isinstance(sha, str) or not _SHA.fullmatch(sha):
        raise InvalidIdentifier(
            f"invalid commit sha {_describe(sha)}: expected 4-40 lowercase hex digits"
        )
    return sha
