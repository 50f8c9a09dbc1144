"""Context compile time against the number of memory blocks (1 -> 50) and of messages in the
context (10 -> 5,000), beside its floor: reading the same block files and message rows
without compiling anything (open + read of each file, one plain SQL query).

The growth is fitted as t = a * n^b over the points from n >= 10 blocks / 100 messages
(below that the fixed cost dominates); b <= 1.1 is "no worse than linear".

    .venv/bin/python -m bench.context_compile [--runs 15] [--out results.json]
"""

import argparse
import functools
import json
import math
import random
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import describe, machine
from durable_memory.bootstrap import MemoryStack, open_stack
from durable_memory.memory.core.profiles import parse_profile
from durable_memory.models.history import Author, AuthorKind
from durable_memory.models.recall import MessageRole, NewMessage
from durable_memory.workers.worker import freeze_startup_objects

BLOCK_COUNTS = (1, 2, 5, 10, 20, 50)
MESSAGE_COUNTS = (10, 100, 500, 1000, 2000, 5000)
FIXED_BLOCKS = 5
FIXED_MESSAGES = 10
WORDS = [
    "essay",
    "draft",
    "thesis",
    "paragraph",
    "evidence",
    "argument",
    "robot",
    "competition",
    "deadline",
    "outline",
    "revise",
    "source",
    "quote",
    "feedback",
    "structure",
    "clarity",
    "introduction",
    "conclusion",
    "topic",
    "claim",
]
USER = Author(name="bench", kind=AuthorKind.USER)


def _profile(blocks: int) -> str:
    parts = [
        'name = "bench"\n[persona]\nname = "Coach"\nrole = "Essay coach"\n'
        'instructions = "You coach students through their essays."\n'
    ]
    parts += [
        f'[[blocks]]\nlabel = "block_{i:02d}"\nkind = "text"\n'
        f'description = "Notes number {i} about the student."\nlimit = 2000\n'
        for i in range(blocks)
    ]
    return "\n".join(parts)


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words)).capitalize() + "."


def _stack(tmp: Path, blocks: int, messages: int, rng: random.Random) -> MemoryStack:
    root = tmp / f"b{blocks}-m{messages}-{rng.random()}"
    stack = open_stack(root, profile=parse_profile(_profile(blocks), "bench"))
    stack.blocks.ensure_user("u")
    for spec in stack.blocks.profile("u").blocks:  # every block about half full
        stack.edits.edit_block("u", spec.label, {"value": _sentence(rng, 150)}, USER)
    for turn in range(messages // 2):
        stack.recall.append(
            "u",
            f"t{turn}",
            [
                NewMessage(role=MessageRole.USER, content=_sentence(rng, rng.randint(8, 40))),
                NewMessage(role=MessageRole.ASSISTANT, content=_sentence(rng, rng.randint(8, 60))),
            ],
        )
    return stack


def _floor(stack: MemoryStack) -> None:
    """Read what compile reads, and do nothing with it."""
    repo = stack.git.repo_path("u") / "blocks"
    for path in sorted(repo.glob("*.toml")):
        path.read_bytes()
    db = sqlite3.connect(stack.git.data_dir / "memory.db")
    db.execute(
        "SELECT id, role, content FROM recall_messages WHERE user_id = ? ORDER BY id", ("u",)
    ).fetchall()
    db.close()


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm: caches, the tokenizer, SQLite pages
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _exponent(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log t against log n."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def _stacks(
    tmp: Path, counts: tuple[int, ...], shape: Callable[[int], tuple[int, int]]
) -> dict[int, MemoryStack]:
    rng = random.Random(11)
    return {n: _stack(tmp, *shape(n), rng) for n in counts}


def _series(name: str, stacks: dict[int, MemoryStack], runs: int) -> dict[str, Any]:
    rows = []
    for n, stack in stacks.items():
        ours = _median_ms(functools.partial(stack.compile, "u"), runs)
        floor = _median_ms(functools.partial(_floor, stack), runs)
        overview = stack.compile("u").overview
        stack.close()
        rows.append(
            {
                "n": n,
                "ours_ms": ours,
                "floor_ms": floor,
                "ratio": ours / floor,
                "tokens": overview.total_tokens,
            }
        )
        print(
            f"{name} {n:>5}: compile {ours:8.2f} ms | floor {floor:6.2f} ms | ratio "
            f"{ours / floor:5.1f}x | {overview.total_tokens:>7} tokens"
        )
    fitted = [(r["n"], r["ours_ms"]) for r in rows if r["n"] >= (10 if name == "blocks" else 100)]
    exponent = _exponent(fitted)
    per_item = (rows[-1]["ours_ms"] - rows[0]["ours_ms"]) / (rows[-1]["n"] - rows[0]["n"])
    print(
        f"{name}: t ~ n^{exponent:.2f} (linear is 1.00); {per_item * 1000:.0f} us per extra "
        f"{name[:-1]}"
    )
    return {"rows": rows, "exponent": exponent, "us_per_item": per_item * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    info = machine()
    print(f"machine: {describe(info)}")
    with tempfile.TemporaryDirectory() as tmp:
        by_blocks = _stacks(Path(tmp), BLOCK_COUNTS, lambda n: (n, FIXED_MESSAGES))
        by_messages = _stacks(Path(tmp), MESSAGE_COUNTS, lambda n: (FIXED_BLOCKS, n))
        freeze_startup_objects()  # as the worker does once it has started
        results = {
            "machine": info,
            "blocks": _series("blocks", by_blocks, args.runs),
            "messages": _series("messages", by_messages, args.runs),
        }
    if args.out:
        args.out.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
