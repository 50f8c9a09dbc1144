"""The turn store keeps the first context and the first reply stored for a step, whoever
stores it: attempts of one step running at once (a retry beside a zombie attempt) all get the
same one back, on SQLite and PostgreSQL; a context dropped between attempts is stored again.
Storing the first costs one statement; only an attempt that finds one stored reads it."""

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, func, select

from durable_memory.memory.store.recall import RecallStore
from durable_memory.memory.store.summaries import SummaryStore
from durable_memory.memory.store.turns import PromptBaseStore, TurnStepRow, TurnStore
from durable_memory.models.context import PromptBase
from durable_memory.models.recall import MessageRole, NewMessage
from tests.support.memory import statements_sent
from tests.test_isolation import _context, _reply

ATTEMPTS = 8


def test_attempts_saving_one_step_at_once_all_get_the_first_reply(engine: Engine) -> None:
    turns = TurnStore(engine)
    with ThreadPoolExecutor(ATTEMPTS) as pool:
        kept = list(
            pool.map(
                lambda n: turns.save_reply("alice", "t1", 1, _reply(f"attempt {n}")).text,
                range(ATTEMPTS),
            )
        )
    assert len(set(kept)) == 1
    assert turns.reply("alice", "t1", 1) == _reply(kept[0])
    with engine.connect() as connection:
        rows = connection.execute(select(func.count()).select_from(TurnStepRow)).scalar_one()
    assert rows == 1


def test_a_new_reply_is_stored_with_its_writes_or_nothing_is(engine: Engine) -> None:
    """`save_new_reply`: the reply, its messages in recall and the dropped context at once;
    where the step has a reply stored (another attempt's), False and nothing of it written:
    the stored reply stays, no message is recorded, the context is still there. Another user's
    step under the same turn id is its own."""
    turns, recall = TurnStore(engine), RecallStore(engine)
    said = [NewMessage(role=MessageRole.ASSISTANT, content="first")]

    def save(user: str, text: str) -> bool:
        messages = [NewMessage(role=MessageRole.ASSISTANT, content=text)]
        also = [recall.recording(user, "t1", messages, first_seq=1000)]
        return turns.save_new_reply(user, "t1", 1, _reply(text), also, drop_context=True)

    turns.save_context("alice", "t1", _context("alice's"))
    turns.save_reply("alice", "t1", 1, _reply("stored before"))
    assert not save("alice", "second")
    assert turns.reply("alice", "t1", 1) == _reply("stored before")
    assert recall.turn("alice", "t1") == []
    assert turns.context("alice", "t1").system == "alice's"
    turns.save_context("bob", "t1", _context("bob's"))
    assert save("bob", "first")
    assert turns.reply("bob", "t1", 1) == _reply("first")
    assert [(m.role, m.content) for m in recall.turn("bob", "t1")] == [
        (m.role, m.content) for m in said
    ]
    assert turns.stored_context("bob", "t1") is None
    assert turns.parsed_contexts.turns() == [("alice", "t1")]


def test_a_context_dropped_between_attempts_is_stored_again(engine: Engine) -> None:
    turns = TurnStore(engine)
    assert turns.save_context("alice", "t1", _context("first")).system == "first"
    assert turns.save_context("alice", "t1", _context("second")).system == "first"
    turns.drop_context("alice", "t1")
    assert turns.save_context("alice", "t1", _context("third")).system == "third"
    assert turns.context("alice", "t1").system == "third"


def test_storing_the_first_is_one_statement_and_only_a_repeat_reads_it(engine: Engine) -> None:
    """The insert that keeps a stored row says whether it inserted (its rowcount): on
    PostgreSQL it said -1 unless asked to keep the count, so every first context and reply was
    read back after it was stored, a round trip each (three in a tool-using turn)."""
    turns = TurnStore(engine)
    saves: list[Callable[[str], object]] = [
        lambda text: turns.save_context("alice", "t1", _context(text)),
        lambda text: turns.save_reply("alice", "t1", 1, _reply(text)),
    ]
    for save in saves:
        with statements_sent(engine) as first:
            save("first")
        with statements_sent(engine) as again:
            save("second")
        assert [s.split()[0] for s in first] == ["INSERT"]
        assert [s.split()[0] for s in again] == ["INSERT", "SELECT"]
    assert turns.context("alice", "t1").system == "first"
    assert turns.reply("alice", "t1", 1) == _reply("first")


def test_a_base_left_where_it_was_is_read_not_written(engine: Engine) -> None:
    """Nearly every turn moves the prompt base to where it already is. That is one read: an
    upsert whose update changes nothing still locks the row (on PostgreSQL a transaction id
    and a commit flushed to the WAL; on SQLite the write lock), so it is not sent. A base
    that differs is written, and read back as written; `with_last_reply` reads it and the
    newest reply's time together."""
    bases = PromptBaseStore(engine)
    assert bases.with_last_reply("alice") == (None, None, (0, None))
    first = PromptBase(commit="a" * 40, summarized_through_message_id=0)
    moved = PromptBase(commit="b" * 40, summarized_through_message_id=7)
    for base, sent in [
        (first, ["SELECT", "INSERT"]),
        (first, ["SELECT"]),
        (moved, ["SELECT", "INSERT"]),
        (moved, ["SELECT"]),
    ]:
        with statements_sent(engine) as statements:
            bases.move("alice", base)
        assert [s.split()[0] for s in statements] == sent
        assert bases.get("alice") == base
    TurnStore(engine).save_reply("alice", "t1", 1, _reply("hello"))
    kept, last, _ = bases.with_last_reply("alice")
    assert kept == moved
    assert last is not None
    assert abs(datetime.now(UTC) - last) < timedelta(minutes=5)
    assert bases.with_last_reply("bob") == (None, None, (0, None))


def test_a_tool_step_reads_its_reply_and_context_in_one_statement(engine: Engine) -> None:
    """A tool step reads its model reply and its turn's context together: one statement, each
    part None when missing (a context dropped once the turn's agent loop ended, a step not yet
    answered), and only the asking user's rows, whoever else used the turn id."""
    turns = TurnStore(engine)
    turns.save_reply("alice", "t1", 1, _reply("alice's reply"))
    turns.save_context("alice", "t1", _context("alice's context"))
    turns.save_reply("bob", "t1", 1, _reply("bob's reply"))
    turns.save_context("bob", "t1", _context("bob's context"))
    with statements_sent(engine) as statements:
        reply, context, _ = turns.reply_and_context("alice", "t1", 1)
    assert [s.split()[0] for s in statements] == ["SELECT"]
    assert reply == _reply("alice's reply")
    assert context is not None
    assert context.system == "alice's context"
    reply, context, _ = turns.reply_and_context("alice", "t1", 2)
    assert reply is None
    assert context is not None
    assert context.system == "alice's context"
    turns.drop_context("alice", "t1")
    assert turns.reply_and_context("alice", "t1", 1) == (_reply("alice's reply"), None, [])
    assert turns.reply_and_context("carol", "t1", 1) == (None, None, [])
    reply, context, _ = turns.reply_and_context("bob", "t1", 1)
    assert reply == _reply("bob's reply")
    assert context is not None
    assert context.system == "bob's context"


def test_a_base_moved_after_the_steps_own_read_is_not_read_again(engine: Engine) -> None:
    """A turn reads the base before compiling (`with_last_reply`) and moves it after: given
    that read, the move sends nothing for a base where the read found it, and only the write
    for one that differs."""
    bases = PromptBaseStore(engine)
    first = PromptBase(commit="a" * 40, summarized_through_message_id=0)
    moved = PromptBase(commit="b" * 40, summarized_through_message_id=7)
    for base, sent in [
        (first, ["INSERT"]),
        (first, []),
        (moved, ["INSERT"]),
        (moved, []),
    ]:
        read = bases.with_last_reply("alice")
        with statements_sent(engine) as statements:
            bases.move("alice", base, read=read)
        assert [s.split()[0] for s in statements] == sent
        assert bases.get("alice") == base
    assert bases.get("bob") is None


def test_the_base_read_carries_the_users_newest_summary(engine: Engine) -> None:
    """A turn reads its user's newest conversation summary with the prompt base, in the one
    statement (`with_last_reply`), and compiles from it: the same answer the summary store's
    own read gives, for the asking user only (ids that share a prefix too)."""
    bases, summaries = PromptBaseStore(engine), SummaryStore(engine)
    summaries.add("alice", 5, "the first")
    summaries.add("alice", 9, "the newest")
    summaries.add("alicia", 12, "hers")
    for user, expected in [("alice", (9, "the newest")), ("alicia", (12, "hers"))]:
        with statements_sent(engine) as statements:
            read = bases.with_last_reply(user)
        assert len(statements) == 1
        assert read.summary == expected == summaries.latest(user)
    assert bases.with_last_reply("bob").summary == (0, None)
    assert summaries.latest("bob") is None
