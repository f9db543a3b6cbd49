"""Time-to-ready against first-request latency, for each warm-up (issue 46).

    python benchmarks/warmup.py exports/minilm

For each warm-up — none, the one smallest request (what a CPU-only session runs), and the
GPU grid (rows 1, 8, max x lengths 1, 16, 128, max) — a fresh BatchedSession is built (as
``ortbatch serve`` builds it, with its latency session) and timed; then the first 1x12-token
and 8x40-token requests, and the median of the next ones (the warmed latency). Each mode
runs in its own process, so no mode warms another's ONNX Runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one(path: str, mode: str) -> dict[str, float]:
    import numpy as np

    import ortbatch.runtime.warmup as warmup
    from ortbatch import BatchedSession

    if mode == "grid":  # the GPU grid, on whatever provider this is
        warmup._cpu_only = lambda active: False  # type: ignore[assignment]
    t0 = time.perf_counter()
    bs = BatchedSession(path, warmup=mode != "none")
    ready = time.perf_counter() - t0

    def request(rows: int, n: int) -> float:
        feed = {"input_ids": np.full((rows, n), 1000, np.int64), "attention_mask": np.ones((rows, n), np.int64)}
        if "token_type_ids" in bs.input_names:
            feed["token_type_ids"] = np.zeros((rows, n), np.int64)
        t = time.perf_counter()
        bs.run(None, feed)
        return (time.perf_counter() - t) * 1000

    out = {"ready_s": ready, "warmup_s": bs.warmup_s, "first_1x12_ms": request(1, 12), "first_8x40_ms": request(8, 40)}
    out["warmed_1x12_ms"] = statistics.median(request(1, 12) for _ in range(20))
    out["warmed_8x40_ms"] = statistics.median(request(8, 40) for _ in range(10))
    bs.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export")
    ap.add_argument("--mode", choices=["none", "smallest", "grid"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one(args.export, args.mode)))
        return
    print("| warm-up | ready (s) | warm-up (s) | first 1x12 (ms) | warmed 1x12 | first 8x40 (ms) | warmed 8x40 |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("none", "smallest", "grid"):
        done = subprocess.run([sys.executable, __file__, args.export, "--mode", mode], capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"| {mode} | {r['ready_s']:.2f} | {r['warmup_s']:.2f} | {r['first_1x12_ms']:.1f} | "
            f"{r['warmed_1x12_ms']:.1f} | {r['first_8x40_ms']:.1f} | {r['warmed_8x40_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
