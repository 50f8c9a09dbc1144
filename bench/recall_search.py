"""Recall search on SQLite: one user's messages searched alone in the file, then with other
users' messages beside them (every user shares recall_messages and its FTS5 index). The
floor is the bare FTS5 query for the same words over the same index, with no user, ranking
join or count around it.

    .venv/bin/python -m bench.recall_search [--own 1000] [--others 100000] [--out r.json]
"""

import argparse
import json
import random
import sqlite3
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.archive_search import zipf_texts, zipf_vocabulary
from bench.common import describe, latencies, machine
from durable_memory.memory.store.db import make_engine
from durable_memory.memory.store.recall import RecallStore


def _bulk(db: sqlite3.Connection, users: list[str], texts: list[str]) -> None:
    """Rows as `RecallStore.append` writes them, in one transaction (the triggers index them)."""
    stamp = datetime.now(UTC).isoformat(sep=" ")
    with db:
        db.executemany(
            "INSERT INTO recall_messages (user_id, turn_id, seq, role, content, is_error, "
            "created_at) VALUES (?, ?, 0, 'user', ?, 0, ?)",
            [(u, f"t{n}", t, stamp) for n, (u, t) in enumerate(zip(users, texts, strict=True))],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--own", type=int, default=1000)
    parser.add_argument("--others", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    info = machine()
    print(f"machine: {describe(info)}")
    rng = random.Random(13)
    words = zipf_vocabulary(rng)
    # Words common enough that a user's 1,000 messages hold some of each.
    queries = [rng.choice(words[:60]) for _ in range(args.queries)]
    result: dict[str, Any] = {"machine": info, "own": args.own, "others": args.others}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.db"
        engine = make_engine(f"sqlite:///{path}")
        store = RecallStore(engine)
        db = sqlite3.connect(path)
        _bulk(db, ["me"] * args.own, zipf_texts(args.own, words, rng))

        def bare(query: str) -> object:
            return db.execute(
                "SELECT rowid, bm25(recall_fts) FROM recall_fts WHERE recall_fts MATCH ? "
                "ORDER BY bm25(recall_fts) LIMIT 20",
                (f'"{query}"',),
            ).fetchall()

        for phase, count in (("alone", 0), ("crowded", args.others)):
            _bulk(db, [f"other{n % 100}" for n in range(count)], zipf_texts(count, words, rng))
            store.search("me", queries[0])
            ours = latencies(lambda q: store.search("me", q), queries, args.runs)
            floor = latencies(bare, queries, args.runs)
            result[phase] = {
                "p50": ours[0],
                "p95": ours[1],
                "floor_p50": floor[0],
                "floor_p95": floor[1],
            }
            print(
                f"{args.own} messages of one user, {count:>6} of others: search p50 "
                f"{ours[0]:6.2f} ms p95 {ours[1]:6.2f} ms | bare FTS5 query p50 {floor[0]:6.2f} "
                f"ms p95 {floor[1]:6.2f} ms"
            )
        db.close()
        engine.dispose()
    result["crowded_over_alone_p50"] = result["crowded"]["p50"] / result["alone"]["p50"]
    print(f"crowded / alone, p50: {result['crowded_over_alone_p50']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
