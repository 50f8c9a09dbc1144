"""The benchmark plots in docs/, drawn from the JSON the benchmarks wrote (bench/results/).

.venv/bin/python -m bench.plots [--results bench/results] [--docs docs]
"""

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

OURS, FLOOR = "tab:blue", "tab:gray"


def _load(folder: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    return data


def _cdf(ax: Axes, samples: list[float], label: str, color: str) -> None:
    ordered = sorted(samples)
    ax.plot(
        ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label, color=color
    )


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def turn_latency(pipeline: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, title, target in (
        (axes[0], "turn_reply", "Turn: start -> reply in hand", 1.3),
        (axes[1], "tool_turn_reply", "Tool turn: model -> tool -> model", 1.3),
        (axes[2], "approval_commit", "Approval -> commit visible", 1.2),
    ):
        row = pipeline[key]
        _cdf(ax, row["ours_ms"], f"durable-memory (p50 {row['ours_p50']:.0f} ms)", OURS)
        _cdf(ax, row["floor_ms"], f"floor (p50 {row['floor_p50']:.0f} ms)", FLOOR)
        ax.set_title(
            f"{title}\np50 {row['ratio_p50']:.2f}x, p95 {row['ratio_p95']:.2f}x the floor "
            f"(target <= {target}x)",
            fontsize=10,
        )
        ax.set_xlabel("ms")
        ax.set_ylabel("share of samples")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    _save(fig, out)


def idle_turns(idle: dict[str, Any], out: Path) -> None:
    """Per turn after a rest, on a dev server with the default poll cap and on ours: the
    latency (top) and the time its tasks waited to be handed out (bottom)."""
    legs = idle["legs"]
    fig, axes = plt.subplots(2, len(legs), figsize=(6.5 * len(legs), 6.5), squeeze=False)
    for column, (kind, servers) in enumerate(legs.items()):
        top, bottom = axes[0][column], axes[1][column]
        for (server, row), color in zip(servers.items(), ("tab:red", OURS), strict=False):
            turns = range(1, len(row["ms"]) + 1)
            top.plot(turns, row["ms"], ".-", color=color, label=server)
            bottom.plot(turns, row["dispatch_wait_ms"], ".-", color=color, label=server)
        top.set_title(f"{kind}: {idle['turns']} turns after {idle['idle_s']:.0f} s idle")
        top.set_ylabel("start -> reply, ms")
        bottom.set_ylabel("its tasks' wait to be handed out, ms")
        bottom.set_xlabel("turn after the rest")
        for ax in (top, bottom):
            ax.axvline(10.5, color=FLOOR, alpha=0.4, linestyle=":")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    _save(fig, out)


def throughput(pipeline: dict[str, Any], out: Path) -> None:
    rows = pipeline["throughput"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    xs = range(len(rows))
    ax.bar(
        [x - 0.2 for x in xs], [r["ours"] for r in rows], 0.4, label="durable-memory", color=OURS
    )
    ax.bar([x + 0.2 for x in xs], [r["floor"] for r in rows], 0.4, label="floor", color=FLOOR)
    for x, row in zip(xs, rows, strict=True):
        ax.annotate(f"{row['ratio']:.2f}x", (x - 0.2, row["ours"]), ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"{r['users']} user{'s' if r['users'] > 1 else ''}" for r in rows])
    ax.set_ylabel("turns per second")
    ax.set_title("Throughput, concurrent conversations (target >= 0.8x the floor)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    _save(fig, out)


def context_compile(compile_: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in (
        (axes[0], "blocks", "memory blocks (10 messages)"),
        (axes[1], "messages", "messages in the context (5 blocks)"),
    ):
        series = compile_[key]
        ns = [r["n"] for r in series["rows"]]
        ax.loglog(ns, [r["ours_ms"] for r in series["rows"]], "o-", color=OURS, label="compile")
        ax.loglog(ns, [r["floor_ms"] for r in series["rows"]], "s--", color=FLOOR, label="floor")
        last = series["rows"][-1]
        ax.loglog(
            ns,
            [last["ours_ms"] * n / last["n"] for n in ns],
            ":",
            color="tab:red",
            label="linear through the last point",
        )
        ax.set_xlabel(label)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"Context compile: t ~ n^{series['exponent']:.2f}")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    _save(fig, out)


def archive(archive_: dict[str, Any], out: Path) -> None:
    rows = archive_["sizes"]
    ns = [r["passages"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, style in (("hybrid", "o-"), ("bm25", "^-"), ("vector", "v-")):
        ax.loglog(ns, [r[f"{mode}_p50"] for r in rows], style, label=f"{mode} p50")
    ax.loglog(ns, [r["hybrid_p95"] for r in rows], "o:", color="tab:blue", label="hybrid p95")
    ax.loglog(ns, [r["floor_p50"] for r in rows], "s--", color=FLOOR, label="floor p50")
    ax.scatter([10_000, 100_000], [5, 30], marker="_", s=400, color="tab:red", label="targets")
    recall = archive_["recall"]["recall_at_10"]
    ax.set_title(
        f"Archive search, one user (recall@10: hybrid {recall['hybrid']:.2f}, "
        f"bm25 {recall['bm25']:.2f}, vector {recall['vector']:.2f})",
        fontsize=10,
    )
    ax.set_xlabel("passages")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, out)


def prompt_cache(cache: dict[str, Any], out: Path) -> None:
    rows = cache["turns"]
    turns = [r["turn"] for r in rows]
    edits = [r["turn"] for r in rows if r["approved_edits"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(turns, [r["uncached"] for r in rows], "^-", color="tab:red", label="uncached")
    ax.plot(
        turns,
        [r["per_turn"] for r in rows],
        "v-",
        color="tab:gray",
        label="cached, per-turn blocks",
    )
    ax.plot(
        turns, [r["cached"] for r in rows], "o-", color=OURS, label="cached, memory update (this)"
    )
    ax.plot(turns, [r["prefix_floor"] for r in rows], ":", color="black", label="prefix floor")
    ax.plot(turns, [r["floor"] for r in rows], "s--", color=FLOOR, label="floor")
    for turn in edits:
        ax.axvline(turn + 0.5, color="tab:orange", alpha=0.25)
    t = cache["totals"]
    ax.set_title(
        f"Input per turn, {len(rows)} turns (orange: an edit approved): cached "
        f"{cache['cached_over_floor']:.2f}x floor, {cache['cached_over_uncached']:.2f}x uncached "
        f"(totals {t['cached'] / 1000:.0f}k / {t['floor'] / 1000:.0f}k / "
        f"{t['uncached'] / 1000:.0f}k)",
        fontsize=9,
    )
    ax.set_xlabel("turn")
    ax.set_ylabel("input-token equivalents")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args()
    matplotlib.use("Agg")  # files only, never a screen
    pipeline = _load(args.results, "pipeline")
    turn_latency(pipeline, args.docs / "bench-turn-latency.png")
    throughput(pipeline, args.docs / "bench-throughput.png")
    context_compile(_load(args.results, "context_compile"), args.docs / "bench-context-compile.png")
    archive(_load(args.results, "archive_search"), args.docs / "bench-archive-search.png")
    prompt_cache(_load(args.results, "prompt_cache"), args.docs / "bench-prompt-cache.png")
    idle_turns(_load(args.results, "idle"), args.docs / "bench-idle-turns.png")


if __name__ == "__main__":
    main()
