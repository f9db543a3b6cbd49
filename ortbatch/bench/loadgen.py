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
    clients = _Clients(call, feeds, ids, concurrency, arrivals, keep)
    threads = [
        threading.Thread(target=clients.client, args=(s,), daemon=True, name=f"bench-client-{s}")
        for s in range(concurrency)
    ]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    clients.t0 = time.perf_counter()
    clients.stop_at = clients.t0 + max_seconds
    clients.start.wait()
    _join(threads, clients.stop_at + grace_s, clients.done_counts, on_progress)
    cpu = time.process_time() - cpu0
    finished = clients.sent & ~np.isnan(clients.latencies)
    # throughput runs from the common start to the last completion, not to the last join
    elapsed = float(np.max(clients.ends[finished]) - clients.t0) if finished.any() else 0.0
    order = np.flatnonzero(finished)
    return DriveResult(
        concurrency=concurrency,
        elapsed_s=elapsed,
        cpu_s=cpu,
        served=[int(ids[int(k)]) for k in order],
        latencies_s=clients.latencies[order],
        errors=int(clients.failed[order].sum()),
        error_samples=clients.errors,
        truncated=bool(not clients.sent.all()),
        hung=sum(t.is_alive() for t in threads),
        sent_objects=[clients.objects[int(k)] for k in order],
        kept=clients.kept,
    )


class _Clients:
    """The client threads' shared state: the next request to send, and what each one got.
    ``t0`` and ``stop_at`` are set just before the start barrier opens."""

    def __init__(
        self,
        call: Callable[[dict[str, np.ndarray]], Any],
        feeds: Sequence[dict[str, np.ndarray]],
        ids: Sequence[int],
        concurrency: int,
        arrivals: np.ndarray | None,
        keep: frozenset[int],
    ) -> None:
        n = len(ids)
        self.call, self.feeds, self.ids, self.arrivals, self.keep = call, feeds, ids, arrivals, keep
        self.latencies = np.full(n, np.nan)
        self.ends = np.full(n, np.nan)
        self.failed = np.zeros(n, dtype=bool)
        self.sent = np.zeros(n, dtype=bool)
        self.objects: list[Any] = [None] * n
        self.kept: dict[int, Any] = {}
        self.errors: list[str] = []
        self.counter = itertools.count()  # next() on a count is atomic under the GIL
        self.done_counts = [0] * concurrency
        self.start = threading.Barrier(concurrency + 1)
        self.t0 = 0.0
        self.stop_at = 0.0

    def client(self, slot: int) -> None:
        self.start.wait()
        t0, stop_at, arrivals, n = self.t0, self.stop_at, self.arrivals, len(self.ids)
        counter, call, feeds, ids, keep = self.counter, self.call, self.feeds, self.ids, self.keep
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
            self.objects[k] = feed
            self.sent[k] = True
            try:
                out = call(feed)
            except Exception as exc:  # every failure is counted and one sample kept
                self.failed[k] = True
                if len(self.errors) < 5:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                if i in keep:
                    self.kept[i] = out
            end = time.perf_counter()
            self.ends[k] = end
            self.latencies[k] = end - began
            self.done_counts[slot] += 1


def _join(
    threads: list[threading.Thread],
    give_up: float,
    done_counts: list[int],
    on_progress: Callable[[int], None] | None,
) -> None:
    """Wait for the clients until ``give_up``, reporting completions as they come."""
    reported = 0
    for t in threads:
        while t.is_alive() and time.perf_counter() < give_up:
            t.join(timeout=0.2)
            if on_progress is not None:
                total = sum(done_counts)
                if total > reported:
                    on_progress(total - reported)
                    reported = total
    if on_progress is not None and sum(done_counts) > reported:
        on_progress(sum(done_counts) - reported)
