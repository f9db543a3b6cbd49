"""One client, one request at a time: where a lone request's latency goes in BatchedSession.

    python benchmarks/one_client.py MODEL [--providers cuda] [--lengths 16,64,128] [--requests 200] [--max-id 1000]

For each length L, ``--requests`` requests of one row of L tokens go, one at a time, through
three paths on **the same session**, the one BatchedSession runs a lone request on (its
``latency_session`` where it built one, on CPU; else its own), so the kernels are the same:

* ``direct``: ``session.run`` with numpy feeds;
* ``binding``: ortbatch's device runner alone (on a GPU: IOBinding, inputs bound from the
  host, outputs bound on the device and copied back once; on CPU: ``session.run``);
* ``batched``: ``BatchedSession.run`` (the queue, a worker thread, then that runner);

and a fourth on a session of its own:

* ``separate``: ``session.run`` on a second session built as ``ortbatch bench`` builds its
  ``direct`` baseline (ONNX Runtime's default options, the same providers), so a gap between
  ``direct`` and ``separate`` is the two sessions' doing, not the runtime's. Both sessions'
  provider options go in the JSON.

The four alternate request by request, after a warm-up at each length, so drift in the
machine's clocks falls on all of them alike. Reported: p50 and p90 in ms of each, and each
other path's p50 less ``direct``'s. scripts/gpu-check.sh runs it on CUDA
(step 8): at one client ``ortbatch bench`` found batched 0.74-0.78x direct at 8-128 tokens on an
H200 (about 1 ms more at p50) and level at 8-16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("direct", "binding", "batched", "separate")


def feed_for(session: Any, length: int, rng: np.random.Generator, max_id: int = 1000) -> dict[str, np.ndarray]:
    """One row of ``length`` tokens for each of the session's inputs (ids below ``max_id``, mask, token types)."""
    feed = {}
    for spec in session.get_inputs():
        dtype = np.int32 if spec.type == "tensor(int32)" else np.int64
        if "mask" in spec.name:
            feed[spec.name] = np.ones((1, length), dtype)
        elif "type" in spec.name:
            feed[spec.name] = np.zeros((1, length), dtype)
        else:
            feed[spec.name] = rng.integers(min(5, max_id - 1), max_id, size=(1, length)).astype(dtype)
    return feed


def measure(
    model: str, providers: str, lengths: list[int], requests: int, max_id: int = 1000, seed: int = 0
) -> dict[str, Any]:
    from ortbatch import BatchedSession
    from ortbatch._ort.binding import DeviceRunner
    from ortbatch.bench.runner import baseline_for

    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"providers": providers, "requests": requests, "modes": list(MODES), "lengths": {}}
    with BatchedSession(model, providers=providers, max_batch_size=32) as bs:
        # a lone request runs on the latency session where there is one (CPU), else on the session
        session = bs.latency_session if bs.latency_session is not None else bs.session
        out["provider"] = session.get_providers()[0]
        names = [o.name for o in session.get_outputs()]
        runner = DeviceRunner(session)
        binding = runner.binding()
        separate = baseline_for(Path(model), providers, {})
        out["provider_options"] = {
            "batched": session.get_provider_options(),
            "separate": separate.get_provider_options(),
        }
        paths = {
            "direct": lambda f: session.run(names, f),
            "binding": lambda f: runner.run(binding, f, names),
            "batched": lambda f: bs.run(names, f),
            "separate": lambda f: separate.run(names, f),
        }
        for length in lengths:
            feeds = [feed_for(session, length, rng, max_id) for _ in range(requests)]
            want = session.run(names, feeds[0])
            for mode, call in paths.items():  # warm-up, and the four answer alike
                for _ in range(5):
                    got = call(feeds[0])
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3, err_msg=f"{mode} at length {length}")
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for feed in feeds:
                for mode in MODES:
                    t0 = time.perf_counter()
                    paths[mode](feed)
                    times[mode].append((time.perf_counter() - t0) * 1e3)
            row: dict[str, Any] = {
                m: {"p50_ms": float(np.percentile(t, 50)), "p90_ms": float(np.percentile(t, 90))}
                for m, t in times.items()
            }
            row["batched_minus_direct_p50_ms"] = row["batched"]["p50_ms"] - row["direct"]["p50_ms"]
            row["binding_minus_direct_p50_ms"] = row["binding"]["p50_ms"] - row["direct"]["p50_ms"]
            row["separate_minus_direct_p50_ms"] = row["separate"]["p50_ms"] - row["direct"]["p50_ms"]
            out["lengths"][str(length)] = row
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"one client, {result['requests']} requests per length, on {result['provider']}",
        "| tokens | direct p50 / p90 ms | binding p50 / p90 ms | batched p50 / p90 ms | separate p50 / p90 ms "
        "| binding - direct | batched - direct | separate - direct |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, row in result["lengths"].items():
        cells = [f"{row[m]['p50_ms']:.3f} / {row[m]['p90_ms']:.3f}" for m in MODES]
        lines.append(
            f"| {length} | {' | '.join(cells)} | {row['binding_minus_direct_p50_ms']:+.3f} | "
            f"{row['batched_minus_direct_p50_ms']:+.3f} | {row['separate_minus_direct_p50_ms']:+.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an export directory or an .onnx file")
    p.add_argument("--providers", default="cpu")
    p.add_argument("--lengths", default="16,64,128")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-id", type=int, default=1000, help="token ids are drawn below this (the vocabulary's size)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if not lengths or min(lengths) < 1 or args.requests < 1 or args.max_id < 2:
        p.error("--lengths and --requests must be positive, --max-id at least 2")
    result = measure(args.model, args.providers, lengths, args.requests, args.max_id)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
