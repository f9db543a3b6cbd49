"""Counters and timing distributions of a BatchedSession (``BatchedSession.stats()``)."""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["Stats", "StatsRecorder"]

_WINDOW = 8192  # recent samples kept for percentiles


@dataclass(frozen=True)
class Stats:
    """A snapshot of a session's activity since it was created.

    Times are milliseconds; percentiles cover the most recent 8192 samples.
    ``padding_fraction`` is the share of padded elements in all batches run
    (0 = no padding). ``errors`` counts failed requests by error type.
    ``alone_batches`` counts batches that ran with nothing else queued or running (on
    the latency session when there is one), ``inline_runs`` those of them that ran on
    the caller's own thread (``run()`` on an idle session).
    """

    requests: int
    completed: int
    failed: int
    cancelled: int
    batches: int
    rows: int
    mean_rows_per_batch: float
    mean_requests_per_batch: float
    rows_histogram: dict[int, int]
    padding_fraction: float
    queue_wait_ms: dict[str, float]
    run_ms: dict[str, float]
    errors: dict[str, int]
    queued: int
    workers: int
    cost_model: dict[str, Any] = field(default_factory=dict)
    alone_batches: int = 0
    inline_runs: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        d = asdict(self)
        d["rows_histogram"] = {str(k): v for k, v in sorted(self.rows_histogram.items())}
        return d


def _percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    arr = np.asarray(samples, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(arr.max())}


class StatsRecorder:
    """Thread-safe accumulation; one lock acquisition per batch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completed = 0
        self.cancelled = 0
        self.batches = 0
        self.batch_requests = 0
        self.rows = 0
        self.real = 0
        self.padded = 0
        self.hist: Counter[int] = Counter()
        self.errors: Counter[str] = Counter()
        self.alone = 0
        self.inline = 0
        self.waits: deque[float] = deque(maxlen=_WINDOW)
        self.runs: deque[float] = deque(maxlen=_WINDOW)

    def batch(self, rows: int, nreq: int, real: int, padded: int, run_s: float, waits: list[float]) -> None:
        with self._lock:
            self.batches += 1
            self.batch_requests += nreq
            self.rows += rows
            self.real += real
            self.padded += padded
            self.hist[rows] += 1
            self.runs.append(run_s)
            self.waits.extend(waits)

    def ran_alone(self, inline: bool) -> None:
        with self._lock:
            self.alone += 1
            self.inline += inline

    def finished(self, ok: int) -> None:
        with self._lock:
            self.completed += ok

    def error(self, exc: BaseException, count: int = 1) -> None:
        with self._lock:
            self.errors[type(exc).__name__] += count

    def cancel(self, count: int = 1) -> None:
        with self._lock:
            self.cancelled += count

    def snapshot(self, requests: int, queued: int, workers: int, cost_model: dict[str, Any]) -> Stats:
        with self._lock:  # copy under the lock; the percentiles are computed outside it
            waits, runs = list(self.waits), list(self.runs)
            failed = sum(self.errors.values())
            snap = Stats(
                requests=requests,
                completed=self.completed,
                failed=failed,
                cancelled=self.cancelled,
                batches=self.batches,
                rows=self.rows,
                mean_rows_per_batch=self.rows / self.batches if self.batches else 0.0,
                mean_requests_per_batch=self.batch_requests / self.batches if self.batches else 0.0,
                rows_histogram=dict(self.hist),
                padding_fraction=1.0 - self.real / self.padded if self.padded else 0.0,
                queue_wait_ms={},
                run_ms={},
                errors=dict(self.errors),
                queued=queued,
                workers=workers,
                cost_model=cost_model,
                alone_batches=self.alone,
                inline_runs=self.inline,
            )
        snap.queue_wait_ms.update(_percentiles(waits))
        snap.run_ms.update(_percentiles(runs))
        return snap
