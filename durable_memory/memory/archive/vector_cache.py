"""The embedded archive's vectors in memory: each user's as one matrix, searched exactly.

The cache is bounded in bytes (each entry counted whole: vectors, row ids, times and tags), least
recently searched user out first; the bound is `memory.vector_cache_mib` (config.py). Users
with few passages are not kept: reloading theirs costs less than holding them.

An entry carries the user's version, which every write bumps in the database (so a write
from another process counts too): an entry whose version is not the current one is a miss.
"""

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from durable_memory.memory.archive.embedders import Vector
from durable_memory.memory.store.sql import utc
from durable_memory.models.archive import ArchiveSearch, TagMatch

VECTOR_CACHE_BYTES = 64 * 2**20
"""Vectors kept in memory across users (about 40,000 of 384 dimensions: 200 users with 200
passages each), least recently searched out first. One user larger than this is still kept
(alone): reloading 100k vectors for every search costs far more."""
MIN_CACHED_ROWS = 1000
"""A user with fewer passages is not kept: their vectors reload from SQLite in under 2 ms
(200 in 0.4 ms), a small part of a search that embeds its query (5-7 ms), while keeping them
would cost 1.5 KiB per passage for every such user the worker has served."""
_TAGS_BYTES = 8
"""What one row's tags cost in an entry: a pointer to a tag set shared by every row with the
same tags (from_rows), the sets themselves being few."""


def _shared(tag_sets: dict[str, frozenset[str]], tags_json: str) -> frozenset[str]:
    found = tag_sets.get(tags_json)
    if found is None:
        found = tag_sets[tags_json] = frozenset(json.loads(tags_json))
    return found


@dataclass(frozen=True)
class UserVectors:
    version: int
    rowids: np.ndarray
    vectors: Vector
    created: np.ndarray
    tags: list[frozenset[str]]

    @classmethod
    def from_rows(cls, version: int, rows: Sequence[Any], dim: int) -> "UserVectors":
        """From the rows (rowid, created_at, tags as JSON, vector as float32 bytes). Rows with
        the same tags share one set: most rows have none, and a set costs 216 bytes, a seventh
        of the row's vector."""
        tag_sets: dict[str, frozenset[str]] = {}  # tags as JSON -> the one set of them
        return cls(
            version=version,
            rowids=np.array([r[0] for r in rows], dtype=np.int64),
            vectors=(
                np.frombuffer(b"".join(r[3] for r in rows), dtype=np.float32).reshape(
                    len(rows), dim
                )
                if rows
                else np.zeros((0, dim), dtype=np.float32)
            ),
            created=np.array([r[1] for r in rows], dtype=np.float64),
            tags=[_shared(tag_sets, r[2]) for r in rows],
        )

    @property
    def nbytes(self) -> int:
        """What the entry holds in memory, near enough to bound the cache by."""
        arrays = self.rowids.nbytes + self.vectors.nbytes + self.created.nbytes
        return arrays + len(self.tags) * _TAGS_BYTES

    def mask(self, request: ArchiveSearch) -> np.ndarray:
        """Which rows pass the request's time and tag filters."""
        mask = np.ones(len(self.rowids), dtype=bool)
        if request.start is not None:
            mask &= self.created >= utc(request.start).timestamp()
        if request.end is not None:
            mask &= self.created < utc(request.end).timestamp()
        if request.tags:
            wanted = set(request.tags)
            match = (
                (lambda t: bool(t & wanted))
                if request.tag_match is TagMatch.ANY
                else (lambda t: wanted <= t)
            )
            mask &= np.array([match(t) for t in self.tags], dtype=bool)
        return mask


class VectorCache:
    """Users' vectors, least recently searched out first once over `max_bytes`, those of users
    with fewer than `min_rows` passages not kept at all; thread-safe."""

    def __init__(self, max_bytes: int, min_rows: int = MIN_CACHED_ROWS) -> None:
        self.max_bytes = max_bytes
        self.min_rows = min_rows
        self._entries: OrderedDict[str, UserVectors] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, user_id: str, version: int) -> UserVectors | None:
        """The user's vectors if the cached ones are of `version`."""
        with self._lock:
            cached = self._entries.get(user_id)
            if cached is None or cached.version != version:
                return None
            self._entries.move_to_end(user_id)
            return cached

    def put(self, user_id: str, vectors: UserVectors) -> None:
        if len(vectors.rowids) < self.min_rows:
            return
        with self._lock:
            self._entries[user_id] = vectors
            self._entries.move_to_end(user_id)
            held = sum(c.nbytes for c in self._entries.values())
            while held > self.max_bytes and len(self._entries) > 1:
                _, evicted = self._entries.popitem(last=False)
                held -= evicted.nbytes

    def forget(self, user_id: str) -> None:
        with self._lock:
            self._entries.pop(user_id, None)

    def users(self) -> list[str]:
        """Users whose vectors are in memory, least recently searched first."""
        with self._lock:
            return list(self._entries)
