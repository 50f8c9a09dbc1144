"""The strict identifier rules, as plain data: the models refuse a bad id with them at the
boundary, and the domain raises its own error from the same rule (memory/core/ids.py)."""

import re
from dataclasses import dataclass


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class IdentifierRule:
    what: str
    """What the identifier names, as the error message says it ("user id")."""
    pattern: re.Pattern[str]
    rule: str
    """How to write a valid one, as the error message says it."""

    def check(self, value: object) -> str:
        """`value` if it matches; otherwise a ValueError naming the value and the rule."""
        if not isinstance(value, str) or not self.pattern.fullmatch(value):
            raise ValueError(f"invalid {self.what} {_describe(value)}: {self.rule}")
        return value


# ASCII only on purpose: unicode look-alikes, whitespace, separators and dot-files are refused.
USER_ID = IdentifierRule(
    "user id",
    re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"),
    "use 1-64 ASCII letters, digits, '_' or '-', starting with a letter or digit",
)
LABEL = IdentifierRule(
    "block label",
    re.compile(r"[a-z][a-z0-9_]{0,47}"),
    "use 1-48 lowercase ASCII letters, digits or '_', starting with a letter",
)
DIFF_ID = IdentifierRule("diff id", re.compile(r"[0-9a-f]{32}"), "expected 32 lowercase hex digits")
SHA = IdentifierRule(
    "commit sha", re.compile(r"[0-9a-f]{4,40}"), "expected 4-40 lowercase hex digits"
)
