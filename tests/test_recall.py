"""Recall memory on SQLite (FTS5) and PostgreSQL (full text): store, search, filter, paginate."""

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine

from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.recall import RecallStore
from durable_memory.models.recall import MessageRole, NewMessage

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _msg(role: MessageRole, content: str, **kw: str) -> NewMessage:
    return NewMessage(role=role, content=content, **kw)


@pytest.fixture
def recall(engine: Engine) -> RecallStore:
    store = RecallStore(engine)
    store.append(
        "alice",
        "t1",
        [
            _msg(MessageRole.USER, "I love building robots with my sister"),
            _msg(MessageRole.ASSISTANT, "What did the robots teach you?"),
            _msg(
                MessageRole.TOOL_CALL,
                '{"label": "student"}',
                tool_name="core_memory_append",
                tool_call_id="toolu_1",
            ),
            _msg(MessageRole.TOOL_RESULT, "Edit awaits approval", tool_call_id="toolu_1"),
        ],
        at=T0,
    )
    store.append(
        "alice",
        "t2",
        [_msg(MessageRole.USER, "Robots again, and poetry")],
        at=T0 + timedelta(days=2),
    )
    store.append("bob", "t3", [_msg(MessageRole.USER, "robots robots robots")], at=T0)
    return store


def test_every_message_kept_in_order_with_turn_and_time(recall: RecallStore) -> None:
    recent = recall.recent("alice", 10)
    assert [(m.turn_id, m.seq, m.role) for m in recent] == [
        ("t1", 0, MessageRole.USER),
        ("t1", 1, MessageRole.ASSISTANT),
        ("t1", 2, MessageRole.TOOL_CALL),
        ("t1", 3, MessageRole.TOOL_RESULT),
        ("t2", 0, MessageRole.USER),
    ]
    assert recent[2].tool_name == "core_memory_append"
    assert recent[2].tool_call_id == "toolu_1"
    assert recent[0].created_at == T0
    assert recall.count("alice") == 5
    assert [m.content for m in recall.recent("alice", 2)][-1] == "Robots again, and poetry"


def test_the_messages_after_an_id_come_with_the_users_count(recall: RecallStore) -> None:
    """What a context compile reads: the user's messages after its summary and how many the
    user has in all, together; their own only (bob's message is not counted), and the count
    still given when nothing comes after."""
    every = recall.after("alice", 0)
    assert recall.after_counted("alice", 0) == (every, 5)
    assert recall.after_counted("alice", every[2].id) == (every[3:], 5)
    assert recall.after_counted("alice", every[-1].id) == ([], 5)
    assert recall.after_counted("bob", 0)[1] == 1
    assert recall.after_counted("carol", 0) == ([], 0)


def test_append_is_idempotent_per_turn_and_seq(recall: RecallStore) -> None:
    again = recall.append(
        "alice", "t1", [_msg(MessageRole.USER, "I love building robots with my sister")]
    )
    assert again[0].id == recall.recent("alice", 10)[0].id
    assert recall.count("alice") == 5


def test_record_keeps_what_is_stored_and_indexes_each_message_once(recall: RecallStore) -> None:
    """`record` (a turn's steps: one statement, no rows back) as `append`: a position already
    stored keeps its message, the new positions are added, and the full-text index holds each
    stored message once (a kept row adds no index entry); another user's same turn is theirs."""
    first = recall.recent("alice", 10)[0]
    recall.record(
        "alice",
        "t1",
        [_msg(MessageRole.USER, "a retry says otherwise: dinosaurs"), _msg(MessageRole.USER, "x")],
        first_seq=0,
    )
    recall.record("alice", "t1", [_msg(MessageRole.ASSISTANT, "kites and robots")], first_seq=4)
    recall.record("alice", "t1", [_msg(MessageRole.ASSISTANT, "kites and robots")], first_seq=4)
    recall.record("bob", "t1", [_msg(MessageRole.USER, "kites")], first_seq=0)
    recall.record("alice", "t1", [])
    stored = recall.turn("alice", "t1")
    assert [m.content for m in stored][:2] == [first.content, "What did the robots teach you?"]
    assert [m.seq for m in stored] == [0, 1, 2, 3, 4]
    assert stored[0].id == first.id
    assert recall.count("alice") == 6
    assert recall.count("bob") == 2
    assert recall.search("alice", "dinosaurs").total == 0
    assert recall.search("alice", "kites").total == 1
    assert recall.search("alice", "robots").total == 4
    assert [m.content for m in recall.search("bob", "kites").messages] == ["kites"]


def test_text_search_is_per_user_and_matches_every_word(recall: RecallStore) -> None:
    page = recall.search("alice", "robots")
    assert page.total == 3
    assert {m.user_id for m in page.messages} == {"alice"}
    assert [m.content for m in recall.search("alice", "robots poetry").messages] == [
        "Robots again, and poetry"
    ]
    assert recall.search("alice", "dinosaurs").total == 0
    # FTS syntax typed by a person is taken as words, never as an operator or an error.
    assert recall.search("alice", 'robots" * (').total == 3
    assert recall.search("alice", "robots OR NEAR(").total == 0  # 'or', 'near' are words here


def test_filters_and_pagination(recall: RecallStore) -> None:
    users = recall.search("alice", "robots", roles=[MessageRole.USER])
    assert users.total == 2
    window = recall.search("alice", "", start=T0 + timedelta(days=1), end=T0 + timedelta(days=3))
    assert [m.turn_id for m in window.messages] == ["t2"]
    first = recall.search("alice", "", limit=2, offset=0)
    second = recall.search("alice", "", limit=2, offset=2)
    third = recall.search("alice", "", limit=2, offset=4)
    assert (first.total, len(first.messages), len(second.messages), len(third.messages)) == (
        5,
        2,
        2,
        1,
    )
    ids = [m.id for page in (first, second, third) for m in page.messages]
    assert len(set(ids)) == 5


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"limit": 0}, "limit must be between 1 and 200"),
        ({"limit": 201}, "limit must be between 1 and 200"),
        ({"offset": -1}, "offset must not be negative"),
        ({"start": T0, "end": T0}, "start must be before end"),
    ],
)
def test_bad_search_arguments(recall: RecallStore, kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(DurableMemoryError, match=error):
        recall.search("alice", "robots", **kwargs)  # type: ignore[arg-type]


def test_search_stays_within_users_whose_ids_differ_only_in_case(engine: Engine) -> None:
    store = RecallStore(engine)
    for user in ("Ann-1", "ann-1", "ann_1"):
        store.append(user, "t1", [_msg(MessageRole.USER, f"{user} keeps bees")], at=T0)
    for user in ("Ann-1", "ann-1", "ann_1"):
        page = store.search(user, "bees")
        assert [m.content for m in page.messages] == [f"{user} keeps bees"]
        assert page.total == 1


_RECALL_FTS_BEFORE_OWNER = [
    """CREATE VIRTUAL TABLE recall_fts USING fts5(
        content, content='recall_messages', content_rowid='id', tokenize='unicode61'
    )""",
    """CREATE TRIGGER recall_fts_insert AFTER INSERT ON recall_messages BEGIN
        INSERT INTO recall_fts(rowid, content) VALUES (new.id, new.content);
    END""",
    """CREATE TRIGGER recall_fts_delete AFTER DELETE ON recall_messages BEGIN
        INSERT INTO recall_fts(recall_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END""",
]


def test_a_recall_index_from_before_the_owner_column_is_rebuilt(tmp_path: Path) -> None:
    """A SQLite store whose FTS index lacks the owner column gets it on open, rebuilt from
    the messages, which stay exactly as they were."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path, isolation_level=None)
    old.execute(
        "CREATE TABLE recall_messages (id INTEGER PRIMARY KEY, user_id VARCHAR(64) NOT NULL, "
        "turn_id VARCHAR(128) NOT NULL, seq INTEGER NOT NULL, role VARCHAR(16) NOT NULL, "
        "content VARCHAR NOT NULL, tool_name VARCHAR, tool_call_id VARCHAR, "
        "is_error BOOLEAN NOT NULL, created_at DATETIME NOT NULL, UNIQUE (user_id, turn_id, seq))"
    )
    for ddl in _RECALL_FTS_BEFORE_OWNER:
        old.execute(ddl)
    for n, (user, content) in enumerate(
        [("alice", "robots and sisters"), ("bob", "robots at school"), ("alice", "tea time")]
    ):
        old.execute(
            "INSERT INTO recall_messages (user_id, turn_id, seq, role, content, is_error, "
            "created_at) VALUES (?, ?, 0, 'user', ?, 0, ?)",
            (user, f"t{n}", content, T0.isoformat(sep=" ")),
        )
    before = old.execute("SELECT * FROM recall_messages ORDER BY id").fetchall()
    old.close()

    engine = make_engine(f"sqlite:///{path}")
    store = RecallStore(engine)
    assert [m.content for m in store.search("alice", "robots").messages] == ["robots and sisters"]
    assert [m.content for m in store.search("bob", "robots").messages] == ["robots at school"]
    engine.dispose()
    make_engine(f"sqlite:///{path}").dispose()  # a second open finds nothing to do
    after = sqlite3.connect(path)
    assert after.execute("SELECT * FROM recall_messages ORDER BY id").fetchall() == before
    sql = after.execute("SELECT sql FROM sqlite_master WHERE name = 'recall_fts'").fetchone()[0]
    assert "owner" in sql
    after.close()
