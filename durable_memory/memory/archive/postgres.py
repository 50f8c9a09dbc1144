"""The shared archive on PostgreSQL: full text by tsvector + GIN, vectors searched exactly.

For deployments whose workers run on several hosts: they share `memory.database_url`, and the
archive lives there too (`memory.archive: postgres`). One table holds every user's passages;
every query names the user, and a passage's key is (user, id), so an id that two users share
stays two passages and neither sees or deletes the other's.

Vectors are float32 bytes, scored exactly in Python over the user's filtered rows (as the
embedded store does, one matrix-vector product); pgvector is not used yet. BM25 is replaced by
ts_rank over the `simple` text configuration; both legs meet in the same
relative_score_fusion as the other backends.
"""

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, cast

import numpy as np
import psycopg
from sqlalchemy import Connection, Engine, text

from durable_memory.memory.archive.embedders import Embedder, Vector
from durable_memory.memory.archive.protocol import (
    ArchiveError,
    check_passage,
    chunk_ids,
    embed_for_writing,
    missing_chunks,
    relative_score_fusion,
)
from durable_memory.memory.archive.sqlite import LEG_LIMIT
from durable_memory.memory.core.ids import validate_user_id
from durable_memory.memory.store.recall import fts_terms
from durable_memory.memory.store.sql import (
    POSTGRES_TEXT_CONFIG,
    create_sql_engine,
    postgres_text_index,
    reading,
    utc,
)
from durable_memory.memory.store.sql.direct import run
from durable_memory.models.archive import (
    ArchiveSearch,
    NewPassage,
    Passage,
    PassageHit,
    PassageSource,
    TagMatch,
)

_TABLES = [
    "CREATE TABLE IF NOT EXISTS archive_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS archive_passages (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        user_id TEXT NOT NULL,
        id TEXT NOT NULL,
        text TEXT NOT NULL,
        tags TEXT[] NOT NULL,
        created_at TIMESTAMPTZ NOT NULL,
        source TEXT NOT NULL,
        label TEXT,
        commit_sha TEXT,
        chunk INTEGER NOT NULL,
        vector BYTEA NOT NULL,
        UNIQUE (user_id, id)
    )""",
    "CREATE INDEX IF NOT EXISTS archive_passages_user_time "
    "ON archive_passages (user_id, created_at)",
    postgres_text_index("archive_passages_fts", "archive_passages", "text"),
]
_SCHEMA_LOCK = "durable_memory.archive.schema"
"""Serialises the schema's creation: concurrent CREATE ... IF NOT EXISTS can still collide."""

_COLUMNS = "seq, id, user_id, text, tags, created_at, source, label, commit_sha, chunk"
_COUNT = text("SELECT count(*) FROM archive_passages WHERE user_id = :user")
"""Every turn counts the user's passages (its context's metadata): built once."""
_TEXT_VECTOR = f"to_tsvector('{POSTGRES_TEXT_CONFIG}', text)"  # as the GIN index is built


def _passage(row: Any) -> Passage:
    return Passage(
        id=row.id,
        user_id=row.user_id,
        text=row.text,
        tags=tuple(row.tags),
        source=PassageSource(row.source),
        label=row.label,
        commit_sha=row.commit_sha,
        chunk=row.chunk,
        created_at=row.created_at.astimezone(UTC),
    )


def _filter_sql(request: ArchiveSearch, mark: str = ":{}") -> tuple[str, dict[str, object]]:
    """The request's filters as ` AND ...` clauses over archive_passages, and their values;
    `mark` formats a parameter's name (SQLAlchemy's `:name`, psycopg's `%(name)s`)."""
    clauses: list[str] = []
    params: dict[str, object] = {}
    if request.start is not None:
        clauses.append(f"created_at >= {mark.format('start')}")
        params["start"] = utc(request.start)
    if request.end is not None:
        clauses.append(f"created_at < {mark.format('end')}")
        params["end"] = utc(request.end)
    if request.tags:
        # && : shares a tag with the request; @> : holds all of the request's tags.
        operator = "&&" if request.tag_match is TagMatch.ANY else "@>"
        clauses.append(f"tags {operator} CAST({mark.format('tags')} AS TEXT[])")
        params["tags"] = list(request.tags)
    return "".join(f" AND {c}" for c in clauses), params


class PostgresArchive:
    """ArchiveStore on a PostgreSQL database (a SQLAlchemy URL; config.postgres_archive_url
    checks it is one)."""

    def __init__(self, database_url: str, embedder: Embedder) -> None:
        self.embedder = embedder
        self.engine: Engine = create_sql_engine(database_url)
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": _SCHEMA_LOCK}
                )
                for ddl in _TABLES:
                    conn.execute(text(ddl))
                self._check_embedder(conn)
        except BaseException:
            self.engine.dispose()  # a refused archive keeps no connections open
            raise

    def _check_embedder(self, conn: Connection) -> None:
        wanted = {"embedder": self.embedder.name, "dim": str(self.embedder.dim)}
        conn.execute(
            text(
                "INSERT INTO archive_meta (key, value) VALUES (:key, :value) ON CONFLICT DO NOTHING"
            ),
            [{"key": k, "value": v} for k, v in wanted.items()],
        )
        meta = {r.key: r.value for r in conn.execute(text("SELECT key, value FROM archive_meta"))}
        if (meta.get("embedder"), meta.get("dim")) != (wanted["embedder"], wanted["dim"]):
            raise ArchiveError(
                f"the PostgreSQL archive was built with embedder {meta.get('embedder')} "
                f"(dimension {meta.get('dim')}); opening it with {self.embedder.name} "
                f"(dimension {self.embedder.dim}) would mix incompatible vectors. Use the "
                "same embedder, or another database and re-import"
            )

    def close(self) -> None:
        self.engine.dispose()

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
        with self.engine.begin() as conn:
            known = set(
                conn.execute(
                    text(
                        "SELECT id FROM archive_passages WHERE user_id = :user AND id = ANY(:ids)"
                    ),
                    {"user": passage.user_id, "ids": ids},
                ).scalars()
            )
        todo = missing_chunks(ids, chunks, known)
        if not todo:
            return ids
        vectors = embed_for_writing(self.embedder, todo, before_write)
        created = utc(passage.created_at or datetime.now(UTC))
        rows = [
            {
                "id": pid,
                "user_id": passage.user_id,
                "text": chunk_text,
                "tags": list(passage.tags),
                "created_at": created,
                "source": passage.source.value,
                "label": passage.label,
                "commit_sha": passage.commit_sha,
                "chunk": index,
                "vector": vectors[n].astype(np.float32).tobytes(),
            }
            for n, (index, pid, chunk_text) in enumerate(todo)
        ]
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO archive_passages (id, user_id, text, tags, created_at, source, "
                    "label, commit_sha, chunk, vector) VALUES (:id, :user_id, :text, "
                    "CAST(:tags AS TEXT[]), :created_at, :source, :label, :commit_sha, :chunk, "
                    ":vector) ON CONFLICT (user_id, id) DO NOTHING"
                ),
                rows,
            )
        return ids

    def delete(self, user_id: str, ids: list[str]) -> int:
        validate_user_id(user_id)
        if not ids:
            return 0
        with self.engine.begin() as conn:
            result = conn.execute(
                text("DELETE FROM archive_passages WHERE user_id = :user AND id = ANY(:ids)"),
                {"user": user_id, "ids": ids},
            )
            return int(result.rowcount)

    def forget_user(self, user_id: str) -> int:
        validate_user_id(user_id)
        with self.engine.begin() as conn:
            result = conn.execute(
                text("DELETE FROM archive_passages WHERE user_id = :user"), {"user": user_id}
            )
            return int(result.rowcount)

    # -- reads -----------------------------------------------------------------------------

    def count(self, user_id: str) -> int:
        validate_user_id(user_id)
        with reading(self.engine) as conn:  # one statement: no BEGIN and COMMIT around it
            return int(run(conn, _COUNT, {"user": user_id}).scalar_one())

    def page(self, user_id: str, *, limit: int = 50, offset: int = 0) -> list[Passage]:
        validate_user_id(user_id)
        if not 1 <= limit <= 1000 or offset < 0:
            raise ArchiveError("limit must be 1-1000 and offset not negative")
        return self._newest(user_id, "", {}, limit, offset)

    def _newest(
        self, user_id: str, where: str, params: dict[str, object], limit: int, offset: int = 0
    ) -> list[Passage]:
        with reading(self.engine) as conn:
            rows = conn.execute(
                text(
                    f"SELECT {_COLUMNS} FROM archive_passages WHERE user_id = :user{where} "
                    "ORDER BY created_at DESC, seq DESC LIMIT :limit OFFSET :offset"
                ),
                {"user": user_id, **params, "limit": limit, "offset": offset},
            )
            return [_passage(r) for r in rows]

    def search(self, user_id: str, request: ArchiveSearch) -> list[PassageHit]:
        validate_user_id(user_id)
        terms = fts_terms(request.query)  # refuses an over-long query before any work
        if request.start and request.end and request.start >= request.end:
            raise ArchiveError("start must be before end")
        where, params = _filter_sql(request)
        if not terms:
            newest = self._newest(user_id, where, params, request.top_k)
            return [PassageHit(passage=p, score=0.0) for p in newest]
        scope = {"user": user_id, **params, "limit": LEG_LIMIT}
        # In a transaction when the vectors are read: they are read on the driver's own
        # connection, whose errors SQLAlchemy does not see; a connection found dead by it is
        # reported (a transient error) and the pool dropped by the rollback, as for any
        # statement of ours. The keyword leg alone is one statement: in autocommit.
        with self.engine.begin() if request.alpha > 0.0 else reading(self.engine) as conn:
            keyword = self._keyword_leg(conn, terms, where, scope) if request.alpha < 1.0 else {}
            rows = self._vector_rows(conn, request, user_id) if request.alpha > 0.0 else []
        # The query is embedded only when there are rows to compare it with (the embedder's
        # few ms, most of a search, are not paid for a user with an empty archive; the
        # embedded archive skips it too), and with no connection held: it needs no database.
        # A row gone by the last read below is left out.
        vector = self._vector_leg(rows, self.embedder.embed_query(request.query)) if rows else {}
        fused = relative_score_fusion(vector, keyword, request.alpha)
        ranked = sorted(fused.items(), key=lambda kv: (-kv[1], -int(kv[0])))[: request.top_k]
        if not ranked:
            return []
        with reading(self.engine) as conn:
            found = {
                str(r.seq): r
                for r in conn.execute(
                    text(
                        f"SELECT {_COLUMNS} FROM archive_passages "
                        "WHERE user_id = :user AND seq = ANY(:seqs)"
                    ),
                    {"user": user_id, "seqs": [int(k) for k, _ in ranked]},
                )
            }
        return [PassageHit(passage=_passage(found[k]), score=s) for k, s in ranked if k in found]

    @staticmethod
    def _keyword_leg(
        conn: Connection, terms: Sequence[str], where: str, scope: dict[str, object]
    ) -> dict[str, float]:
        """ts_rank of the user's rows matching any of `terms` (each taken as a plain word)."""
        words = {f"w{i}": term for i, term in enumerate(terms)}
        any_word = " || ".join(f"plainto_tsquery('{POSTGRES_TEXT_CONFIG}', :{w})" for w in words)
        rows = conn.execute(
            text(
                f"SELECT seq, ts_rank({_TEXT_VECTOR}, q) FROM archive_passages, "
                f"(SELECT {any_word} AS q) AS query "
                f"WHERE user_id = :user AND {_TEXT_VECTOR} @@ q{where} "
                "ORDER BY 2 DESC, seq DESC LIMIT :limit"
            ),
            {**scope, **words},
        )
        return {str(seq): float(rank) for seq, rank in rows}

    @staticmethod
    def _vector_rows(
        conn: Connection, request: ArchiveSearch, user_id: str
    ) -> list[tuple[int, bytes]]:
        """(seq, vector) of the user's filtered rows."""
        where, params = _filter_sql(request, "%({})s")
        # psycopg's binary results: parsing 10k vectors as hex text costs three times as much.
        driver = cast("psycopg.Connection[Any]", conn.connection.driver_connection)
        with driver.cursor(binary=True) as cursor:
            cursor.execute(
                f"SELECT seq, vector FROM archive_passages WHERE user_id = %(user)s{where}",
                {"user": user_id, **params},
            )
            return cursor.fetchall()

    def _vector_leg(self, rows: list[tuple[int, bytes]], query: Vector) -> dict[str, float]:
        """Cosine (a dot product: the vectors are unit length) of `query` and each row."""
        matrix = np.frombuffer(b"".join(vector for _, vector in rows), dtype=np.float32)
        sims = matrix.reshape(len(rows), self.embedder.dim) @ query
        top = min(LEG_LIMIT, len(rows))
        best = np.argpartition(-sims, top - 1)[:top]
        return {str(rows[i][0]): float(sims[i]) for i in best}
