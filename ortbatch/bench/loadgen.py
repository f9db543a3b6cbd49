"""The client side of a benchmark: C threads replaying a :class:`Workload`, bounded in count and time.

Closed loop: each client sends its next request as soon as its previous one returns. Poisson:
request ``k`` is due at ``t0 + arrivals[k]``; a client that picks it up late still measures
latency from the due time (no coordinated omission), so a saturated system shows its queue.
Callers of :func:`drive` pass the one function that differs between modes and peers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DriveResult", "drive"]


@dataclass
class DriveResult:
    """What the clients saw. ``served`` are request ids in the order they were *sent*."""

    concurrency: int
    elapsed_s: float
    cpu_s: float
    served: list[int]
    latencies_s: np.ndarray  # aligned with ``served``
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    truncated: bool = False  # the time cap stopped it before every request was sent
    hung: int = 0  # clients still blocked when the grace period ended
    sent_objects: list[Any] = field(default_factory=list)  # the feeds actually handed over
    kept: dict[int, Any] = field(default_factory=dict)  # outputs of the probe requests

    @property
    def completed(self) -> int:
        return len(self.served) - self.errors


def drive(
    call: Callable[[dict[str, np.ndarray]], Any],
    feeds: Sequence[dict[str, np.ndarray]],
    ids: Sequence[int],
    concurrency: int,
    *,
    arrivals: np.ndarray | None = None,
    max_seconds: float = 300.0,
    grace_s: float = 60.0,
    keep: frozenset[int] = frozenset(),
    on_progress: Callable[[int], None] | None = None,
) -> DriveResult:
    """Send ``feeds[i]`` for ``i in ids`` through ``call`` from ``concurrency`` threads.

    Stops sending at ``max_seconds``; waits ``grace_s`` more for in-flight calls, then gives up
    on them (daemon threads) and counts them as ``hung``. Outputs of ids in ``keep`` are kept.
    """
    n = len(ids)
    latencies = np.full(n, np.nan)
    ends = np.full(n, np.nan)
    failed = np.zeros(n, dtype=bool)
    sent = np.zeros(n, dtype=bool)
    objects: list[Any] = [None] * n
    kept: dict[int, Any] = {}
    errors: list[str] = []
    counter = itertools.count()  # next() on a count is atomic under the GIL
    done_counts = [0] * concurrency
    start = threading.Barrier(concurrency + 1)
    t0_box = [0.0]
    stop_at_box = [0.0]

    def client(slot: int) -> None:
        start.wait()
        t0 = t0_box[0]
        stop_at = stop_at_box[0]
        while True:
            k = next(counter)
            if k >= n:
                return
            now = time.perf_counter()
            if now >= stop_at:
                return
            if arrivals is not None:
                due = t0 + float(arrivals[k])
                if due > now:
                    time.sleep(due - now)
                began = due
            else:
                began = now
            i = ids[k]
            feed = feeds[i]
            objects[k] = feed
            sent[k] = True
            try:
                out = call(feed)
            except Exception as exc:  # every failure is counted and one sample kept
                failed[k] = True
                if len(errors) < 5:
                    errors.append(f"{type(exc).__name__}: {exc}")
            else:
                if i in keep:
                    kept[i] = out
            end = time.perf_counter()
            ends[k] = end
            latencies[k] = end - began
            done_counts[slot] += 1

    threads = [
        threading.Thread(target=client, args=(s,), daemon=True, name=f"bench-client-{s}") for s in range(concurrency)
    ]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    t0_box[0] = time.perf_counter()
    stop_at_box[0] = t0_box[0] + max_seconds
    start.wait()
    give_up = stop_at_box[0] + grace_s
    reported = 0
    for t in threads:
        while t.is_alive() and time.perf_counter() < give_up:
            t.join(timeout=0.2)
            if on_progress is not None:
                total = sum(done_counts)
                if total > reported:
                    on_progress(total - reported)
                    reported = total
    cpu = time.process_time() - cpu0
    finished = sent & ~np.isnan(latencies)
    # throughput runs from the common start to the last completion, not to the last join
    elapsed = float(np.max(ends[finished]) - t0_box[0]) if finished.any() else 0.0
    if on_progress is not None and sum(done_counts) > reported:
        on_progress(sum(done_counts) - reported)
    hung = sum(t.is_alive() for t in threads)
    order = np.flatnonzero(finished)
    return DriveResult(
        concurrency=concurrency,
        elapsed_s=elapsed,
        cpu_s=cpu,
        served=[int(ids[int(k)]) for k in order],
        latencies_s=latencies[order],
        errors=int(failed[order].sum()),
        error_samples=errors,
        truncated=bool(not sent.all()),
        hung=hung,
        sent_objects=[objects[int(k)] for k in order],
        kept=kept,
    )
