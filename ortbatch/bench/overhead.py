"""What the batching layer itself costs per request, measured on an identity-like model.

The model copies its inputs to its outputs, so ONNX Runtime's own work is a few
microseconds per call and the time per request at saturation is what queueing, batch
formation, padding, splitting and waking the caller cost. Rows, same requests for all:

* ``direct, C clients``: C threads calling ``InferenceSession.run`` (the price of Python
  threads calling ORT at all — the floor any client pays);
* ``batched, C clients``: the same threads calling ``BatchedSession.run`` (the headline);
* ``batched, submit pipeline``: one thread keeping ``window`` futures in flight (the runtime
  without client-thread switching).
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from .._extras import require
from .loadgen import drive
from .workload import LengthSpec, load_target, make_workload

__all__ = ["build_identity_model", "measure_overhead"]


def build_identity_model(path: str | Path) -> Path:
    """Write a two-input model whose outputs are its inputs (ragged ``sequence`` axis)."""
    onnx = require("onnx", "bench")
    from onnx import TensorProto, helper

    seq = ["batch", "sequence"]
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["input_ids"], ["ids_out"]),
            helper.make_node("Identity", ["attention_mask"], ["mask_out"]),
        ],
        "identity",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, seq),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, seq),
        ],
        [
            helper.make_tensor_value_info("ids_out", TensorProto.INT64, seq),
            helper.make_tensor_value_info("mask_out", TensorProto.INT64, seq),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = Path(path)
    onnx.save(model, str(path))
    return path


def measure_overhead(
    *,
    concurrency: int = 64,
    requests: int = 4000,
    max_seconds: float = 30.0,
    max_batch_size: int = 32,
    workers: int | None = None,
    window: int = 256,
    lengths: str = "8-16",
    seed: int = 0,
) -> dict[str, Any]:
    """Microseconds per request at saturation for direct, batched and a submit pipeline."""
    from .._ort import plain_session
    from ..runtime.session import BatchedSession
    from .workload import parse_lengths

    spec: LengthSpec = parse_lengths(lengths)
    with tempfile.TemporaryDirectory(prefix="ortbatch-overhead-") as tmp:
        model = build_identity_model(Path(tmp) / "identity.onnx")
        sess = plain_session(model)
        target = load_target(model, sess)
        wl = make_workload(target, spec, requests, seed=seed)
        warm = make_workload(target, spec, min(requests, 512), seed=seed + 1)
        ids = list(range(len(wl)))
        names = target.outputs
        rows: list[dict[str, Any]] = []

        def record(label: str, completed: int, elapsed: float, cpu: float, rows_per_batch: float) -> None:
            rows.append(
                {
                    "label": label,
                    "completed": completed,
                    "us_per_request": round(elapsed / completed * 1e6, 2) if completed else float("nan"),
                    "cpu_us_per_request": round(cpu / completed * 1e6, 2) if completed else float("nan"),
                    "mean_rows_per_batch": round(rows_per_batch, 2),
                }
            )

        def direct_call(feed: Any) -> Any:
            return sess.run(names, feed)

        drive(direct_call, warm.feeds, list(range(len(warm))), concurrency, max_seconds=max_seconds)
        res = drive(direct_call, wl.feeds, ids, concurrency, max_seconds=max_seconds)
        record(f"direct, {concurrency} clients (session.run)", res.completed, res.elapsed_s, res.cpu_s, 1.0)

        with BatchedSession(
            str(model), max_batch_size=max_batch_size, workers=workers, max_queue=max(1024, 4 * concurrency, 2 * window)
        ) as bs:

            def batched_call(feed: Any) -> Any:
                return bs.run(names, feed)

            drive(batched_call, warm.feeds, list(range(len(warm))), concurrency, max_seconds=max_seconds)
            s0 = bs.stats()
            res = drive(batched_call, wl.feeds, ids, concurrency, max_seconds=max_seconds)
            s1 = bs.stats()
            record(
                f"batched, {concurrency} clients (BatchedSession.run)",
                res.completed,
                res.elapsed_s,
                res.cpu_s,
                _rows_per_batch(s0, s1),
            )

            done, elapsed, cpu, rpb = _submit_pipeline(bs, wl.feeds, ids, names, window, max_seconds)
            record(f"batched, submit pipeline ({window} in flight)", done, elapsed, cpu, rpb)
            workers_used = getattr(bs, "workers", workers)

    headline = rows[1]["us_per_request"]
    return {
        "model": "identity (both inputs copied to outputs)",
        "lengths": str(spec),
        "requests": requests,
        "concurrency": concurrency,
        "max_batch_size": max_batch_size,
        "workers": workers_used,
        "rows": rows,
        "us_per_request_at_saturation": headline,
        "target_us": 100.0,
    }


def _submit_pipeline(
    bs: Any, feeds: Any, ids: list[int], names: list[str], window: int, max_seconds: float
) -> tuple[int, float, float, float]:
    """``window`` submits in flight, one collected per one sent: (completed, seconds, CPU
    seconds, rows per batch)."""
    s0 = bs.stats()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    inflight: deque[Any] = deque()
    done = 0
    for i in ids:
        if time.perf_counter() > deadline:
            break
        inflight.append(bs.submit(feeds[i], output_names=names))
        if len(inflight) >= window:
            inflight.popleft().result(timeout=max_seconds)
            done += 1
    while inflight:
        inflight.popleft().result(timeout=max_seconds)
        done += 1
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return done, elapsed, cpu, _rows_per_batch(s0, bs.stats())


def _rows_per_batch(before: Any, after: Any) -> float:
    batches = after.batches - before.batches
    return (after.rows - before.rows) / batches if batches else 0.0
