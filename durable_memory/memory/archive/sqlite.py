"""The embedded archive: SQLite FTS5 (BM25) + float32 vectors, exact search per user.

One file, WAL mode, so several processes (workers, the CLI) share it. Vectors of a user are
cached in memory as one matrix and searched exactly (vector_cache.py); the cache is keyed by
a per-user version that every write bumps, so a write from another process invalidates it too.

Over 300 lines because it is one class: its writes, reads and the two legs of its hybrid
search share one schema and one connection per thread; split further, each part would
reach into the others. The SQL helpers are store/sql's, the vectors in memory are in
vector_cache.py.
"""

import json
import sqlite3
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from durable_memory.memory.archive.embedders import Embedder, Vector
from durable_memory.memory.archive.protocol import (
    ArchiveError,
    check_passage,
    chunk_ids,
    embed_for_writing,
    missing_chunks,
    relative_score_fusion,
)
from durable_memory.memory.archive.vector_cache import (
    MIN_CACHED_ROWS,
    VECTOR_CACHE_BYTES,
    UserVectors,
    VectorCache,
)
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.erasure import truncate_wal
from durable_memory.memory.store.recall import fts_terms
from durable_memory.memory.store.sql import OwnedIndex, connect_sqlite, immediate, utc
from durable_memory.models.archive import (
    ArchiveSearch,
    NewPassage,
    Passage,
    PassageHit,
    PassageSource,
    TagMatch,
)

LEG_LIMIT = 100
"""Candidates each leg (BM25, vector) contributes to the fusion, as Weaviate's hybrid does."""

_TABLES = [
    "CREATE TABLE IF NOT EXISTS archive_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS passages (
        rowid INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        user_id TEXT NOT NULL,
        text TEXT NOT NULL,
        tags TEXT NOT NULL,
        created_at REAL NOT NULL,
        source TEXT NOT NULL,
        label TEXT,
        commit_sha TEXT,
        chunk INTEGER NOT NULL,
        vector BLOB NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS passages_user_time ON passages (user_id, created_at)",
    """CREATE TABLE IF NOT EXISTS archive_versions (
        user_id TEXT PRIMARY KEY, version INTEGER NOT NULL
    )""",
]
PASSAGES_FTS = OwnedIndex(
    "passages_fts",
    table="passages",
    rowid="rowid",
    column="text",
    tokenize="unicode61 remove_diacritics 2",
)
"""One full-text index for every user's passages, each row with its owner."""

_COLUMNS = "rowid, id, user_id, text, tags, created_at, source, label, commit_sha, chunk"


def _passage(row: sqlite3.Row) -> Passage:
    return Passage(
        id=row["id"],
        user_id=row["user_id"],
        text=row["text"],
        tags=tuple(json.loads(row["tags"])),
        source=PassageSource(row["source"]),
        label=row["label"],
        commit_sha=row["commit_sha"],
        chunk=row["chunk"],
        created_at=datetime.fromtimestamp(row["created_at"], UTC),
    )


def _epoch(value: datetime) -> float:
    return utc(value).timestamp()


class SqliteArchive:
    """ArchiveStore on a SQLite file."""

    def __init__(
        self,
        path: str | Path,
        embedder: Embedder,
        *,
        cache_bytes: int = VECTOR_CACHE_BYTES,
        cache_min_rows: int = MIN_CACHED_ROWS,
    ) -> None:
        self.path = Path(path)
        self.embedder = embedder
        self._local = threading.local()
        self._cache = VectorCache(cache_bytes, cache_min_rows)
        with self._db() as db:
            PASSAGES_FTS.create(db, _TABLES)
            self._check_embedder(db)

    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = connect_sqlite(self.path)
            db.row_factory = sqlite3.Row
            self._local.db = db
        return db

    def _check_embedder(self, db: sqlite3.Connection) -> None:
        with immediate(db):
            meta = dict(db.execute("SELECT key, value FROM archive_meta").fetchall())
            if not meta:
                db.executemany(
                    "INSERT INTO archive_meta (key, value) VALUES (?, ?)",
                    [("embedder", self.embedder.name), ("dim", str(self.embedder.dim))],
                )
            elif (meta.get("embedder"), meta.get("dim")) != (
                self.embedder.name,
                str(self.embedder.dim),
            ):
                raise ArchiveError(
                    f"the archive {self.path} was built with embedder {meta.get('embedder')} "
                    f"(dimension {meta.get('dim')}); opening it with {self.embedder.name} "
                    f"(dimension {self.embedder.dim}) would mix incompatible vectors. Use the "
                    "same embedder, or a new archive file and re-import"
                )

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # -- writes ----------------------------------------------------------------------------

    def insert(
        self,
        passage: NewPassage,
        *,
        chunk: bool = False,
        before_write: Callable[[], object] | None = None,
    ) -> list[str]:
        chunks = check_passage(passage, chunk=chunk)
        ids = chunk_ids(passage, chunks)
        db = self._db()
        placeholders = ",".join("?" * len(ids))
        known = {
            r[0] for r in db.execute(f"SELECT id FROM passages WHERE id IN ({placeholders})", ids)
        }
        todo = missing_chunks(ids, chunks, known)
        if not todo:
            return ids
        vectors = embed_for_writing(self.embedder, todo, before_write)
        created = _epoch(passage.created_at or datetime.now(UTC))
        rows = [
            (
                pid,
                passage.user_id,
                text,
                json.dumps(list(passage.tags), ensure_ascii=False),
                created,
                passage.source.value,
                passage.label,
                passage.commit_sha,
                index,
                vectors[n].astype(np.float32).tobytes(),
            )
            for n, (index, pid, text) in enumerate(todo)
        ]
        with immediate(db):
            before = db.total_changes
            db.executemany(
                "INSERT OR IGNORE INTO passages (id, user_id, text, tags, created_at, source, "
                "label, commit_sha, chunk, vector) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            if db.total_changes > before:
                self._bump(db, passage.user_id)
        return ids

    @staticmethod
    def _bump(db: sqlite3.Connection, user_id: str) -> None:
        db.execute(
            "INSERT INTO archive_versions (user_id, version) VALUES (?, 1) "
            "ON CONFLICT (user_id) DO UPDATE SET version = version + 1",
            (user_id,),
        )

    def delete(self, user_id: str, ids: list[str]) -> int:
        validate_user_id(user_id)
        if not ids:
            return 0
        db = self._db()
        with immediate(db):
            deleted = 0
            for start in range(0, len(ids), 500):
                part = ids[start : start + 500]
                cursor = db.execute(
                    "DELETE FROM passages WHERE user_id = ? "
                    f"AND id IN ({','.join('?' * len(part))})",
                    [user_id, *part],
                )
                deleted += cursor.rowcount
            if deleted:
                self._bump(db, user_id)
        return deleted

    def forget_user(self, user_id: str) -> int:
        """Delete the user's passages (their bytes zeroed: `secure_delete`), merge the
        full-text index (FTS5 keeps a deleted row's tokens in old segments until then) and
        empty the WAL (its page images hold them too)."""
        validate_user_id(user_id)
        db = self._db()  # with secure_delete, as every connection (store/sql)
        with immediate(db):
            deleted = db.execute("DELETE FROM passages WHERE user_id = ?", (user_id,)).rowcount
            db.execute("DELETE FROM archive_versions WHERE user_id = ?", (user_id,))
            db.execute(f"INSERT INTO {PASSAGES_FTS.name} ({PASSAGES_FTS.name}) VALUES ('optimize')")
        truncate_wal(db)
        self._cache.forget(user_id)
        return int(deleted)

    def purge_deleted(self) -> None:
        """Drop what deleted passages left in the file: merge the full-text index (FTS5 keeps
        a deleted row's tokens in old segments until then) and empty the WAL (dmem redact)."""
        db = self._db()
        with immediate(db):
            db.execute(f"INSERT INTO {PASSAGES_FTS.name} ({PASSAGES_FTS.name}) VALUES ('optimize')")
        truncate_wal(db)

    # -- reads -----------------------------------------------------------------------------

    def count(self, user_id: str) -> int:
        validate_user_id(user_id)
        row = self._db().execute("SELECT COUNT(*) FROM passages WHERE user_id = ?", (user_id,))
        return int(row.fetchone()[0])

    def page(self, user_id: str, *, limit: int = 50, offset: int = 0) -> list[Passage]:
        validate_user_id(user_id)
        if not 1 <= limit <= 1000 or offset < 0:
            raise ArchiveError("limit must be 1-1000 and offset not negative")
        rows = self._db().execute(
            f"SELECT {_COLUMNS} FROM passages WHERE user_id = ? "
            "ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?",
            (user_id, limit, offset),
        )
        return [_passage(r) for r in rows]

    def _version(self, user_id: str) -> int:
        row = (
            self._db()
            .execute("SELECT version FROM archive_versions WHERE user_id = ?", (user_id,))
            .fetchone()
        )
        return int(row[0]) if row else 0

    def _vectors(self, user_id: str) -> UserVectors:
        version = self._version(user_id)
        cached = self._cache.get(user_id, version)
        if cached is not None:
            return cached
        rows = (
            self._db()
            .execute(
                "SELECT rowid, created_at, tags, vector FROM passages "
                "WHERE user_id = ? ORDER BY rowid",
                (user_id,),
            )
            .fetchall()
        )
        loaded = UserVectors.from_rows(version, rows, self.embedder.dim)
        self._cache.put(user_id, loaded)
        return loaded

    def cached_users(self) -> list[str]:
        """Users whose vectors are in memory, least recently searched first."""
        return self._cache.users()

    def _filter_sql(self, request: ArchiveSearch) -> tuple[str, list[object]]:
        clauses: list[str] = []
        params: list[object] = []
        if request.start is not None:
            clauses.append("p.created_at >= ?")
            params.append(_epoch(request.start))
        if request.end is not None:
            clauses.append("p.created_at < ?")
            params.append(_epoch(request.end))
        if request.tags:
            marks = ",".join("?" * len(request.tags))
            if request.tag_match is TagMatch.ANY:
                clauses.append(f"EXISTS (SELECT 1 FROM json_each(p.tags) WHERE value IN ({marks}))")
            else:
                clauses.append(
                    "(SELECT COUNT(DISTINCT value) FROM json_each(p.tags) "
                    f"WHERE value IN ({marks})) = {len(set(request.tags))}"
                )
            params.extend(request.tags)
        return "".join(f" AND {c}" for c in clauses), params

    def search(self, user_id: str, request: ArchiveSearch) -> list[PassageHit]:
        """Hybrid search; `search_vector` lets a caller pass a precomputed query embedding."""
        return self.search_vector(user_id, request, None)

    def search_vector(
        self, user_id: str, request: ArchiveSearch, query_vector: Vector | None
    ) -> list[PassageHit]:
        validate_user_id(user_id)
        terms = fts_terms(request.query)  # refuses an over-long query before any work
        if request.start and request.end and request.start >= request.end:
            raise ArchiveError("start must be before end")
        db = self._db()
        where, params = self._filter_sql(request)
        if not terms:
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM passages p WHERE p.user_id = ?{where} "
                "ORDER BY p.created_at DESC, p.rowid DESC LIMIT ?",
                [user_id, *params, request.top_k],
            ).fetchall()
            return [PassageHit(passage=_passage(r), score=0.0) for r in rows]
        keyword: dict[str, float] = {}
        if request.alpha < 1.0:
            match, rank = PASSAGES_FTS.match(user_id, terms, "OR"), PASSAGES_FTS.rank
            # The owner token matches that user's rows and no other, so without filters the
            # index alone ranks them (no lookup of each matching row in `passages`, which
            # costs as much as the match at 100k rows).
            query, args = (
                (
                    f"SELECT p.rowid, {rank} FROM passages_fts "
                    "JOIN passages p ON p.rowid = passages_fts.rowid "
                    f"WHERE passages_fts MATCH ? AND p.user_id = ?{where} "
                    f"ORDER BY {rank} LIMIT ?",
                    [match, user_id, *params, LEG_LIMIT],
                )
                if where
                else (
                    f"SELECT rowid, {rank} FROM passages_fts "
                    f"WHERE passages_fts MATCH ? ORDER BY {rank} LIMIT ?",
                    [match, LEG_LIMIT],
                )
            )
            for rowid, rank in db.execute(query, args):
                keyword[str(rowid)] = -float(rank)  # bm25() is lower-is-better
        vector: dict[str, float] = {}
        if request.alpha > 0.0:
            cache = self._vectors(user_id)
            if len(cache.rowids):
                q = (
                    query_vector
                    if query_vector is not None
                    else self.embedder.embed_query(request.query)
                )
                candidates = np.flatnonzero(cache.mask(request))
                if len(candidates):
                    # Score every row, then keep the candidates: `vectors[candidates]` would copy
                    # the matrix on every query, ten times the cost of the product (100k rows).
                    sims = (cache.vectors @ q)[candidates]
                    top = min(LEG_LIMIT, len(candidates))
                    best = np.argpartition(-sims, top - 1)[:top]
                    vector = {str(int(cache.rowids[candidates[i]])): float(sims[i]) for i in best}
        fused = relative_score_fusion(vector, keyword, request.alpha)
        ranked = sorted(fused.items(), key=lambda kv: (-kv[1], -int(kv[0])))[: request.top_k]
        if not ranked:
            return []
        marks = ",".join("?" * len(ranked))
        found = {
            str(r["rowid"]): r
            for r in db.execute(
                f"SELECT {_COLUMNS} FROM passages WHERE rowid IN ({marks})", [k for k, _ in ranked]
            )
            # By rowid only: `AND user_id = ?` would make SQLite walk the user's whole index.
            if r["user_id"] == user_id
        }
        return [PassageHit(passage=_passage(found[k]), score=s) for k, s in ranked if k in found]
