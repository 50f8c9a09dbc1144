"""Strict identifiers. Checked before any path, query or commit is built from them.

The rules themselves are plain data in models/ids.py, shared with the models that carry ids.
"""

from durable_memory.memory.core.errors import InvalidIdentifier
from durable_memory.models.ids import DIFF_ID, LABEL, SHA, USER_ID, IdentifierRule


def _check(value: object, rule: IdentifierRule) -> str:
    try:
        return rule.check(value)
    except ValueError as error:
        raise InvalidIdentifier(str(error)) from None


def validate_user_id(user_id: object) -> str:
    """Return `user_id` if it is 1-64 ASCII letters, digits, '_' or '-' (not first)."""
    return _check(user_id, USER_ID)


def validate_label(label: object) -> str:
    """Return `label` if it is a lowercase identifier of 1-48 characters."""
    return _check(label, LABEL)


def validate_diff_id(diff_id: object) -> str:
    """Return `diff_id` if it is 32 lowercase hex digits (a uuid4 without dashes)."""
    return _check(diff_id, DIFF_ID)


def validate_sha(sha: object) -> str:
    """Return `sha` if it looks like a (possibly abbreviated) git commit sha."""
    return _check(sha, SHA)
