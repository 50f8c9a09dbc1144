"""Archival memory on the embedded store: search latency with 1k, 10k and 100k passages of one
user beside its floor, insert throughput beside its floor, and recall@10 of hybrid search on
a hand-labelled set (bench/data/archive_labelled.json) with the real embedder.

Floors, measured in the same run on the same data:
- search: the two legs bare: one FTS5 `bm25` query (LIMIT 100, no user or filter clause) and
  one numpy product of the user's vector matrix with the query plus a top-100 partition;
- insert: a plain INSERT of the same text and vector into a table with an FTS5 index.

Latency corpora have a Zipf vocabulary of 5,000 words (realistic BM25 posting lists) and
random unit vectors (exact search costs the same whatever the values; embedding 100k passages
would take the embedder an hour); the query vector is precomputed and the embedder's own cost
is reported apart. Each latency is the median over --runs runs of --queries queries.

Crowding: one user's 1,000 passages searched alone in the file, then with --crowd passages of
100 other users beside them (every user shares the file and its full-text index).

    .venv/bin/python -m bench.archive_search [--passages 1000,10000,100000] [--crowd 100000]
                                           [--out r.json]
"""

import argparse
import json
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import describe, latencies, machine
from durable_memory.memory.archive.embedders import Embedder, Vector, default_embedder
from durable_memory.memory.archive.sqlite import SqliteArchive
from durable_memory.memory.store.recall import fts_terms
from durable_memory.models.archive import ArchiveSearch, NewPassage, PassageSource

VOCABULARY = 5_000
LEG = 100
LABELLED = Path(__file__).parent / "data" / "archive_labelled.json"
DISTRACTORS = 1_000
MODES = {"hybrid": 0.5, "bm25": 0.0, "vector": 1.0}


def zipf_vocabulary(rng: random.Random) -> list[str]:
    consonants, vowels = "bcdfghklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < VOCABULARY:
        words.add(
            "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 4)))
        )
    return sorted(words)


def zipf_texts(n: int, words: list[str], rng: random.Random) -> list[str]:
    weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf, s = 1
    return [" ".join(rng.choices(words, weights, k=rng.randint(12, 40))) for _ in range(n)]


class RandomVectors:
    """Unit vectors for the store; the store's search cost does not depend on their values."""

    def __init__(self, name: str, dim: int, seed: int = 7) -> None:
        self.name, self.dim = name, dim
        self.rng = np.random.default_rng(seed)

    def embed_passages(self, texts: list[str]) -> Vector:
        v = self.rng.standard_normal((len(texts), self.dim)).astype(np.float32)
        unit: Vector = v / np.linalg.norm(v, axis=1, keepdims=True)
        return unit

    def embed_query(self, text: str) -> Vector:
        one: Vector = self.embed_passages([text])[0]
        return one


class BareLegs:
    """The search floor: the same FTS5 index and vectors, queried with nothing around them."""

    def __init__(self, path: Path, archive: SqliteArchive, user: str) -> None:
        self.db = sqlite3.connect(path)
        cache = archive._vectors(user)  # the matrix our search uses, loaded once
        self.vectors = cache.vectors

    def search(self, query: str, vector: Vector) -> None:
        match = " OR ".join('"' + t.replace('"', '""') + '"' for t in fts_terms(query))
        self.db.execute(
            "SELECT rowid, bm25(passages_fts) FROM passages_fts WHERE passages_fts MATCH ? "
            "ORDER BY bm25(passages_fts) LIMIT ?",
            (match, LEG),
        ).fetchall()
        sims = self.vectors @ vector
        np.argpartition(-sims, min(LEG, len(sims)) - 1)[:LEG]


def _insert_floor(path: Path, texts: list[str], vectors: Vector) -> float:
    """Inserts per second into a bare table with an FTS5 index, autocommit, WAL."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE p (text TEXT, vector BLOB)")
    db.execute("CREATE VIRTUAL TABLE f USING fts5(text, content='p', content_rowid='rowid')")
    db.execute(
        "CREATE TRIGGER p_ai AFTER INSERT ON p BEGIN "
        "INSERT INTO f(rowid, text) VALUES (new.rowid, new.text); END"
    )
    t = time.perf_counter()
    for text, vector in zip(texts, vectors, strict=True):
        db.execute("INSERT INTO p VALUES (?, ?)", (text, vector.tobytes()))
    rate = len(texts) / (time.perf_counter() - t)
    db.close()
    return rate


def _size(n: int, queries: int, runs: int, dim: int, name: str) -> dict[str, Any]:
    rng = random.Random(7)
    words = zipf_vocabulary(rng)
    texts = zipf_texts(n, words, rng)
    asks = [" ".join(rng.choices(words[:2000], k=3)) for _ in range(queries)]
    fake = RandomVectors(name, dim)
    with tempfile.TemporaryDirectory() as tmp:
        floor_rate = _insert_floor(Path(tmp) / "floor.db", texts, fake.embed_passages(texts))
        archive = SqliteArchive(Path(tmp) / "archive.db", fake)
        t = time.perf_counter()
        for text in texts:
            archive.insert(NewPassage(user_id="bench", text=text, source=PassageSource.IMPORT))
        rate = n / (time.perf_counter() - t)
        print(
            f"{n:>7} passages: insert {rate:6.0f}/s | floor {floor_rate:6.0f}/s | "
            f"ratio {rate / floor_rate:.2f}x (vectors precomputed)"
        )
        vectors = {q: fake.embed_query(q) for q in asks}
        bare = BareLegs(Path(tmp) / "archive.db", archive, "bench")
        floor = latencies(lambda q: bare.search(q, vectors[q]), asks, runs)
        row: dict[str, Any] = {
            "passages": n,
            "insert_per_s": rate,
            "insert_floor_per_s": floor_rate,
            "floor_p50": floor[0],
            "floor_p95": floor[1],
        }
        for mode, alpha in MODES.items():

            def search(query: str, alpha: float = alpha) -> object:
                request = ArchiveSearch(query=query, alpha=alpha)
                return archive.search_vector("bench", request, vectors[query])

            search(asks[0])  # the first search loads the user's vectors
            p50, p95 = latencies(search, asks, runs)
            row[f"{mode}_p50"], row[f"{mode}_p95"] = p50, p95
            print(f"{'':>18}{mode:<7} search p50 {p50:6.2f} ms p95 {p95:6.2f} ms")
        print(
            f"{'':>18}floor   search p50 {floor[0]:6.2f} ms p95 {floor[1]:6.2f} ms | hybrid "
            f"ratio p50 {row['hybrid_p50'] / floor[0]:.2f}x"
        )
        bare.db.close()
        archive.close()
    return row


def crowded(own: int, others: int, queries: int, runs: int, dim: int, name: str) -> dict[str, Any]:
    """One user's search alone in the file, then with `others` passages of 100 other users
    beside it (all users share the file and its full-text index)."""
    rng = random.Random(11)
    words = zipf_vocabulary(rng)
    asks = [" ".join(rng.choices(words[:2000], k=3)) for _ in range(queries)]
    fake = RandomVectors(name, dim)
    vectors = {q: fake.embed_query(q) for q in asks}
    row: dict[str, Any] = {"own": own, "others": others}
    with tempfile.TemporaryDirectory() as tmp:
        archive = SqliteArchive(Path(tmp) / "archive.db", fake)
        for text in zipf_texts(own, words, rng):
            archive.insert(NewPassage(user_id="bench", text=text, source=PassageSource.IMPORT))
        for phase, count in (("alone", 0), ("crowded", others)):
            for i, text in enumerate(zipf_texts(count, words, rng)):
                archive.insert(
                    NewPassage(user_id=f"other{i % 100}", text=text, source=PassageSource.IMPORT)
                )

            def search(query: str) -> object:
                return archive.search_vector("bench", ArchiveSearch(query=query), vectors[query])

            search(asks[0])
            row[f"{phase}_p50"], row[f"{phase}_p95"] = latencies(search, asks, runs)
        archive.close()
    print(
        f"{own} passages of one user, hybrid search: alone p50 {row['alone_p50']:.2f} ms "
        f"p95 {row['alone_p95']:.2f} ms | beside {others} of 100 other users p50 "
        f"{row['crowded_p50']:.2f} ms p95 {row['crowded_p95']:.2f} ms | ratio p50 "
        f"{row['crowded_p50'] / row['alone_p50']:.2f}x"
    )
    return row


def _distractors(rng: random.Random) -> list[str]:
    """Session notes about the same student, sharing the labelled set's vocabulary."""
    work = [
        "essay on Hamlet",
        "lab report on enzymes",
        "history essay on the Cold War",
        "argumentative essay on social media",
        "book report on 1984",
        "research paper on water quality",
        "short story for the writing club",
        "reflection on the field trip",
    ]
    skill = [
        "paragraph structure",
        "word choice",
        "choosing evidence",
        "sentence variety",
        "the strength of the argument",
        "the order of ideas",
        "formal tone",
    ]
    part = ["introduction", "second body paragraph", "conclusion", "thesis", "title"]
    outcome = [
        "it reads more clearly now",
        "she wants another look next week",
        "the teacher approved the plan",
        "it still needs a stronger example",
    ]
    teacher = ["Ms. Rivera", "Mr. Chen", "the substitute teacher", "her tutor"]
    templates = [
        "On day {d} of the unit, Alice and I reviewed draft {n} of her {w}; we worked on {s}.",
        "Session note: Alice revised the {p} of her {w} and {o}.",
        "Alice asked how to improve {s} in her {w} before the next class.",
        "{t} returned the {w} with comments about {s}; {o}.",
        "We spent twenty minutes on the {p} of the {w}; {o}.",
    ]
    return [
        rng.choice(templates).format(
            d=rng.randint(1, 30),
            n=rng.randint(1, 5),
            w=rng.choice(work),
            s=rng.choice(skill),
            p=rng.choice(part),
            o=rng.choice(outcome),
            t=rng.choice(teacher),
        )
        for _ in range(DISTRACTORS)
    ]


def recall_at_10(embedder: Embedder) -> dict[str, Any]:
    """recall@10 per mode on the labelled set: the share of relevant passages in the top 10,
    averaged over the questions."""
    data = json.loads(LABELLED.read_text(encoding="utf-8"))
    passages: dict[str, str] = data["passages"]
    with tempfile.TemporaryDirectory() as tmp:
        archive = SqliteArchive(Path(tmp) / "archive.db", embedder)
        for text in [*passages.values(), *_distractors(random.Random(3))]:
            archive.insert(NewPassage(user_id="alice", text=text, source=PassageSource.IMPORT))
        key_of = {text: key for key, text in passages.items()}
        scores: dict[str, list[float]] = {mode: [] for mode in MODES}
        missed: dict[str, list[str]] = {mode: [] for mode in MODES}
        for item in data["queries"]:
            vector = embedder.embed_query(item["query"])
            for mode, alpha in MODES.items():
                hits = archive.search_vector(
                    "alice", ArchiveSearch(query=item["query"], alpha=alpha, top_k=10), vector
                )
                found = {key_of.get(h.passage.text) for h in hits}
                share = len(found & set(item["relevant"])) / len(item["relevant"])
                scores[mode].append(share)
                if share < 1:
                    missed[mode].append(item["query"])
        archive.close()
    result = {mode: statistics.fmean(v) for mode, v in scores.items()}
    print(
        f"recall@10 on {len(data['queries'])} labelled questions over {len(passages)} + "
        f"{DISTRACTORS} passages: "
        + ", ".join(f"{mode} {value:.3f}" for mode, value in result.items())
    )
    print(f"   hybrid missed: {missed['hybrid']}")
    return {"recall_at_10": result, "missed": missed, "questions": len(data["queries"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--passages", default="1000,10000,100000")
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--crowd", type=int, default=100_000, help="other users' passages beside one user's 1,000"
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    info = machine()
    print(f"machine: {describe(info)}")
    real = default_embedder()
    rng = random.Random(5)
    words = zipf_vocabulary(rng)
    sample = zipf_texts(200, words, rng)
    t = time.perf_counter()
    real.embed_passages(sample)
    per_passage = (time.perf_counter() - t) / len(sample) * 1000
    questions = [q["query"] for q in json.loads(LABELLED.read_text(encoding="utf-8"))["queries"]]
    query_p50, _ = latencies(real.embed_query, questions, 1)
    print(
        f"embedder {real.name}: {per_passage:.1f} ms per passage (batch of 200), "
        f"{query_p50:.1f} ms per question of the labelled set (p50)"
    )
    results: dict[str, Any] = {
        "machine": info,
        "embedder": {"ms_per_passage": per_passage, "ms_per_query_p50": query_p50},
        "recall": recall_at_10(real),
        "sizes": [
            _size(int(n), args.queries, args.runs, real.dim, real.name)
            for n in args.passages.split(",")
        ],
        "crowded": crowded(1000, args.crowd, args.queries, args.runs, real.dim, real.name),
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
