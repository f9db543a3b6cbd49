"""How thread settings trade one-client latency against throughput under load.

    python benchmarks/thread_settings.py exports/minilm

Compares, on one model and one seeded request set, direct ``InferenceSession.run`` (ORT
defaults) against BatchedSession (2 workers) over sessions with 1 intra-op thread per run,
2 threads without spinning, and 2 threads with spinning: one client's p50 latency at 8-16
tokens, and throughput at 64 closed-loop clients at 8-16 and 8-128 tokens. Ratios are
measured in one run; absolute figures drift between runs on a shared machine.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ortbatch import BatchedSession


def make_feeds(lo: int, hi: int, n: int, seed: int, with_types: bool) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(n):
        k = int(rng.integers(lo, hi + 1))
        f = {
            "input_ids": rng.integers(1000, 2000, (1, k)).astype(np.int64),
            "attention_mask": np.ones((1, k), np.int64),
        }
        if with_types:
            f["token_type_ids"] = np.zeros((1, k), np.int64)
        feeds.append(f)
    return feeds


def drive(fn, feeds, clients: int) -> float:
    it = iter(range(len(feeds)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            fn(feeds[i])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(feeds) / (time.perf_counter() - t0)


def p50_ms(fn, feeds) -> float:
    times = []
    for f in feeds:
        t0 = time.perf_counter()
        fn(f)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def session(path: Path, intra: int, spin: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = intra
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, help="export directory (ortbatch.json + model.onnx) or .onnx file")
    ap.add_argument("--requests", type=int, default=1200, help="requests at 8-16 tokens (a third at 8-128)")
    args = ap.parse_args()
    path = args.export / "model.onnx" if args.export.is_dir() else args.export
    direct = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    types = "token_type_ids" in {i.name for i in direct.get_inputs()}
    cands = {
        "1 thread/run (default)": BatchedSession(str(args.export)),
        "2 threads, no spinning": BatchedSession(session(path, 2, False), workers=2),
        "2 threads, spinning": BatchedSession(session(path, 2, True), workers=2),
    }
    lat = make_feeds(8, 16, 60, 1, types)
    base = p50_ms(lambda f: direct.run(None, f), lat)
    print(f"one client p50, 8-16 tokens: direct {base:.2f} ms")
    for name, bs in cands.items():
        v = p50_ms(lambda f, bs=bs: bs.run(None, f), lat)
        print(f"  {name:26s} {v:6.2f} ms  ({v / base:.2f}x direct)")
    for lo, hi, n in ((8, 16, args.requests), (8, 128, args.requests // 3)):
        feeds = make_feeds(lo, hi, n, 0, types)
        d = drive(lambda f: direct.run(None, f), feeds, 64)
        print(f"64 clients, {lo}-{hi} tokens: direct {d:.1f} req/s")
        for name, bs in cands.items():
            drive(lambda f, bs=bs: bs.run(None, f), feeds[:200], 64)  # warm-up, cost model
            v = drive(lambda f, bs=bs: bs.run(None, f), feeds, 64)
            print(f"  {name:26s} {v:7.1f} req/s  ({v / d:.2f}x direct)")
    for bs in cands.values():
        bs.close()


if __name__ == "__main__":
    main()
