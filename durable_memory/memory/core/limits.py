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
