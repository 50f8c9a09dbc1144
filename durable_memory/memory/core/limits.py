"""The error for going over a limit (durable_memory.models.limits), and the checks that share it.

`LimitExceeded` is a DurableMemoryError: the CLI exits 2, a tool call becomes an `is_error`
result the model can act on, an activity does not retry it. Its message names the limit.
"""

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.models.limits import MAX_QUERY_CHARS


class LimitExceeded(DurableMemoryError):
    """An input over a limit of durable_memory.models.limits; the message says which, by how
    much, and what to do instead."""

    def __init__(
        self, what: str, size: int, limit: int, advice: str, unit: str = "characters"
    ) -> None:
        super().__init__(f"{what} is {size} {unit}, over the limit of {limit}; {advice}")
        self.size = size
        self.limit = limit


def check_query(query: str) -> None:
    """Refuse a search query longer than MAX_QUERY_CHARS, before any work is done on it."""
    if len(query) > MAX_QUERY_CHARS:
        raise LimitExceeded(
            "the search query", len(query), MAX_QUERY_CHARS, "search with a few key words"
        )


def cut_text(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a note saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [... cut: {len(text) - limit} more characters not shown]"


CUT_MARK = "…"


def cut_at_word(text: str, limit: int) -> str:
    """`text` on one line (runs of whitespace as one space), at most `limit` characters: if
    longer, cut at the last word boundary that fits and marked with '…'. A word is split only
    when the first word alone is longer than the limit. For summaries a person reads, where
    a word cut in half reads as a different word."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    head = flat[: max(limit - len(CUT_MARK), 1)]
    if flat[len(head)] != " ":  # the cut falls inside a word: keep only whole words
        space = head.rfind(" ")
        if space > 0:
            head = head[:space]
    return head.rstrip() + CUT_MARK
