"""Bounded load test of ``ortbatch serve`` from a second process on loopback.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model minilm \\
        --export exports/minilm --requests 2000 --concurrency 64 --lengths 8-16

Builds a pool of distinct token requests (random ids, lengths drawn from --lengths),
computes each one's expected outputs with a direct ONNX Runtime run *alone*, then
sends --requests requests from --concurrency concurrent clients (tritonclient's
asyncio HTTP client, binary tensors: what Triton users send). Every response is
checked against its own request's expected outputs and its echoed id, so a lost,
misrouted or wrong response is counted, never averaged away.

``--inproc`` runs the same pool and concurrency against an in-process BatchedSession
(asyncio ``run_async``), for the HTTP-vs-in-process figure in docs/serve-benchmarks.md.

Only 127.0.0.1/localhost/::1 URLs are accepted; the run stops at --requests or
--duration, whichever comes first. Prints (and with --json writes) a summary:
sent, ok, mismatched, errors by kind, throughput, latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def build_pool(export: Path, size: int, lengths: tuple[int, int], seed: int) -> list[dict[str, Any]]:
    """Distinct requests (1 row each) with their expected outputs from a direct ORT run."""
    import onnxruntime as ort

    from ortbatch.manifest import Manifest

    manifest = Manifest.load(export) if (export / "ortbatch.json").is_file() else None
    model_path = manifest.model_path if manifest is not None else export
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    vocab = 1000
    tok_file = export / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(tok_file)).get_vocab_size()
    rng = np.random.default_rng(seed)
    names = [i.name for i in sess.get_inputs()]
    pool = []
    for _ in range(size):
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        # ids avoid the first few (special) tokens; any in-vocabulary id is valid input
        ids = rng.integers(min(5, vocab - 1), vocab, (1, n)).astype(np.int64)
        feed = {}
        for name in names:
            if name == "input_ids":
                feed[name] = ids
            elif name == "attention_mask":
                feed[name] = np.ones_like(ids)
            elif name == "token_type_ids":
                feed[name] = np.zeros_like(ids)
            else:
                raise SystemExit(f"serve_load: don't know how to fill input {name!r}")
        outs = sess.run(None, feed)
        pool.append({"feed": feed, "expected": dict(zip([o.name for o in sess.get_outputs()], outs, strict=True))})
    return pool


def matches(got: np.ndarray | None, want: np.ndarray) -> bool:
    if got is None or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind == "f":
        # batched with padding vs alone: the same maths, possibly different GEMM blocking
        return bool(np.allclose(got, want, rtol=1e-4, atol=1e-5))
    return bool(np.array_equal(got, want))


def summarize(latencies: list[float], elapsed: float, counts: dict[str, Any]) -> dict[str, Any]:
    lat = np.array(latencies) * 1e3 if latencies else np.zeros(1)
    ok = counts["ok"]
    return {
        **counts,
        "elapsed_s": round(elapsed, 3),
        "throughput_rps": round(ok / elapsed, 1) if elapsed else 0.0,
        "latency_ms": {
            "p50": round(float(np.percentile(lat, 50)), 2),
            "p90": round(float(np.percentile(lat, 90)), 2),
            "p99": round(float(np.percentile(lat, 99)), 2),
            "max": round(float(lat.max()), 2),
        },
    }


async def run_http(args: argparse.Namespace, pool: list[dict[str, Any]]) -> dict[str, Any]:
    import aiohttp
    import tritonclient.http.aio as aio
    from tritonclient.utils import InferenceServerException

    host = urlparse(args.url).netloc
    client = aio.InferenceServerClient(host, conn_limit=args.concurrency)
    counts: dict[str, Any] = {"sent": 0, "ok": 0, "mismatched": 0, "http_errors": {}, "connection_errors": 0}
    latencies: list[float] = []
    next_index = 0
    stop_at = time.monotonic() + args.duration
    rng = np.random.default_rng(args.seed + 1)
    choices = rng.integers(0, len(pool), args.requests)
    stopped = asyncio.Event()

    async def worker() -> None:
        nonlocal next_index
        while next_index < args.requests and time.monotonic() < stop_at and not stopped.is_set():
            i = next_index
            next_index += 1
            item = pool[int(choices[i])]
            inputs = []
            for name, arr in item["feed"].items():
                t = aio.InferInput(name, list(arr.shape), "INT64")
                t.set_data_from_numpy(arr, binary_data=not args.json_tensors)
                inputs.append(t)
            outputs = [aio.InferRequestedOutput(n, binary_data=not args.json_tensors) for n in item["expected"]]
            counts["sent"] += 1
            t0 = time.perf_counter()
            try:
                res = await client.infer(args.model, inputs, outputs=outputs, request_id=str(i))
            except InferenceServerException as exc:
                key = str(exc.status())
                counts["http_errors"][key] = counts["http_errors"].get(key, 0) + 1
                continue
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                counts["connection_errors"] += 1
                if args.stop_on_disconnect:
                    stopped.set()
                continue
            latencies.append(time.perf_counter() - t0)
            good = res.get_response().get("id") == str(i) and all(
                matches(res.as_numpy(n), want) for n, want in item["expected"].items()
            )
            counts["ok" if good else "mismatched"] += 1

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        await client.close()
    return summarize(latencies, time.perf_counter() - t0, counts)


async def run_inproc(args: argparse.Namespace, pool: list[dict[str, Any]]) -> dict[str, Any]:
    from ortbatch import BatchedSession

    counts: dict[str, Any] = {"sent": 0, "ok": 0, "mismatched": 0, "errors": 0}
    latencies: list[float] = []
    rng = np.random.default_rng(args.seed + 1)
    choices = rng.integers(0, len(pool), args.requests)
    next_index = 0
    with BatchedSession(
        args.export, max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens, workers=args.workers
    ) as bs:

        async def worker() -> None:
            nonlocal next_index
            while next_index < args.requests:
                i = next_index
                next_index += 1
                item = pool[int(choices[i])]
                names = list(item["expected"])
                counts["sent"] += 1
                t0 = time.perf_counter()
                try:
                    outs = await bs.run_async(names, item["feed"])
                except Exception:
                    counts["errors"] += 1
                    continue
                latencies.append(time.perf_counter() - t0)
                good = all(matches(o, item["expected"][n]) for n, o in zip(names, outs, strict=True))
                counts["ok" if good else "mismatched"] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
        summary = summarize(latencies, elapsed, counts)
        st = bs.stats()
        summary["mean_rows_per_batch"] = round(st.mean_rows_per_batch, 2)
        summary["padding_fraction"] = round(st.padding_fraction, 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="server base URL (loopback only), e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name on the server (default: the export directory's name)")
    p.add_argument("--export", type=Path, required=True, help="the export served (for expected outputs)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--lengths", default="8-16", help="token lengths, MIN-MAX (default 8-16)")
    p.add_argument("--pool", type=int, default=256, help="distinct requests to cycle through")
    p.add_argument("--duration", type=float, default=120.0, help="stop after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-tensors", action="store_true", help="JSON tensors instead of binary")
    p.add_argument(
        "--stop-on-disconnect",
        action="store_true",
        help="stop all clients at the first connection error (server shutting down)",
    )
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    p.add_argument("--inproc", action="store_true", help="in-process BatchedSession instead of HTTP")
    p.add_argument("--max-batch-size", type=int, default=32, help="--inproc only")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="--inproc only")
    p.add_argument("--workers", type=int, default=None, help="--inproc only")
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args(argv)
    lo, _, hi = args.lengths.partition("-")
    lengths = (int(lo), int(hi or lo))
    args.model = args.model or args.export.resolve().name
    if not args.inproc:
        if not args.url:
            p.error("--url is required (or --inproc)")
        if urlparse(args.url).hostname not in LOOPBACK:
            p.error(f"refusing to load-test {args.url}: loopback addresses only")
    pool = build_pool(args.export, min(args.pool, args.requests), lengths, args.seed)
    runner = run_inproc if args.inproc else run_http
    if args.warmup:
        warm = argparse.Namespace(**{**vars(args), "requests": args.warmup})
        asyncio.run(runner(warm, pool))
    summary = asyncio.run(runner(args, pool))
    summary.update(
        mode="inproc" if args.inproc else ("http-json" if args.json_tensors else "http-binary"),
        concurrency=args.concurrency,
        lengths=args.lengths,
    )
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
