"""Counters of a BatchedGenerator (``BatchedGenerator.stats()``).

The same conventions as :mod:`ortbatch.runtime.stats`: a frozen snapshot dataclass with
``as_dict()``, filled by a thread-safe recorder that has one method per event and takes
its lock once per event; failures are also counted by error type (``errors``), and
``requests`` / ``completed`` / ``failed`` / ``cancelled`` / ``queued`` mean what they mean
in :class:`ortbatch.runtime.stats.Stats`, so one exporter reads both.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prefix_cache import PrefixCacheStats

__all__ = ["GenerationStats", "GenerationStatsRecorder"]

# Outcomes a request ends in, each a counter of GenerationStats.
OUTCOMES = ("completed", "failed", "cancelled", "timed_out")


@dataclass(frozen=True)
class GenerationStats:
    """A snapshot of a :class:`BatchedGenerator`'s counters.

    ``submitted`` requests were accepted (``requests`` is the same number, under the
    name :class:`~ortbatch.runtime.stats.Stats` uses); each ends ``completed``,
    ``failed``, ``cancelled`` or ``timed_out``; ``errors`` counts the failed and
    timed-out ones by error type, as the runtime's ``errors`` does. ``rejected`` ones
    were refused at submit (queue full). Times are seconds.

    ``kv_cache`` is the cache that runs (``"in-place"`` or ``"concat"``); on the in-place
    cache, ``row_moves`` counts rows moved down into free slots, and the ``prefix_cache_*``
    counters the prefix cache: prompts looked up, prompts that reused a cached prefix
    (``hits``), prompt tokens not run because they were cached, blocks evicted, and the
    bytes held against the budget.
    """

    submitted: int
    completed: int
    failed: int
    cancelled: int
    timed_out: int
    rejected: int
    queued: int
    active_rows: int
    reserved_tokens: int
    cache_length: int
    decode_steps: int
    prefill_runs: int
    prompt_tokens: int
    generated_tokens: int
    mean_decode_rows: float
    max_decode_rows: int
    cache_padding_fraction: float
    decode_time_s: float
    prefill_time_s: float
    cache_copies: int = 0
    slot_reuses: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    kv_cache: str = "concat"
    row_moves: int = 0
    prefix_cache_lookups: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_tokens_saved: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_budget_bytes: int = 0

    @property
    def requests(self) -> int:
        """Requests accepted (the runtime's name for ``submitted``)."""
        return self.submitted

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return {**asdict(self), "requests": self.requests}


class GenerationStatsRecorder:
    """Thread-safe accumulation: callers record submits and rejections, the scheduler
    thread everything else."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._padding_sum = 0.0
        self._decode_time = 0.0
        self._prefill_time = 0.0
        self._max_decode_rows = 0
        self._active = (0, 0, 0)  # rows, reserved tokens, cache length

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to counter ``key`` (``submitted``, ``rejected``, ``generated_tokens``, ...)."""
        with self._lock:
            self._counts[key] += n

    def outcome(self, key: str, error: BaseException | None = None) -> None:
        """One request ended in ``key`` (one of :data:`OUTCOMES`); a failure names its error."""
        with self._lock:
            self._counts[key] += 1
            if error is not None and key in ("failed", "timed_out"):
                self._errors[type(error).__name__] += 1

    def recount(self, key: str, error: BaseException | None = None) -> None:
        """An outcome counted in advance did not happen: the caller cancelled meanwhile."""
        with self._lock:
            self._counts[key] -= 1
            self._counts["cancelled"] += 1
            if error is not None and key in ("failed", "timed_out"):
                self._errors[type(error).__name__] -= 1
                if not self._errors[type(error).__name__]:
                    del self._errors[type(error).__name__]

    def prefill(self, seconds: float, prompt_tokens: int) -> None:
        """One prefill run (``prompt_tokens`` 0 when it failed)."""
        with self._lock:
            self._counts["prefill_runs"] += 1
            self._counts["prompt_tokens"] += prompt_tokens
            self._prefill_time += seconds

    def decode(self, rows: int, padding_fraction: float) -> None:
        """One decode step of ``rows`` live rows over a cache ``padding_fraction`` padding."""
        with self._lock:
            self._counts["decode_steps"] += 1
            self._counts["decode_rows"] += rows
            self._max_decode_rows = max(self._max_decode_rows, rows)
            self._padding_sum += padding_fraction

    def decode_time(self, seconds: float) -> None:
        with self._lock:
            self._decode_time += seconds

    def active(self, rows: int, reserved_tokens: int, cache_length: int) -> None:
        """The batch as it is after a step (read by :meth:`snapshot`)."""
        with self._lock:
            self._active = (rows, reserved_tokens, cache_length)

    def snapshot(
        self, queued: int, kv_cache: str = "concat", prefix: PrefixCacheStats | None = None
    ) -> GenerationStats:
        with self._lock:
            c = Counter(self._counts)
            rows, reserved, length = self._active
            padding, decode_time, prefill_time = self._padding_sum, self._decode_time, self._prefill_time
            max_rows, errors = self._max_decode_rows, dict(self._errors)
        steps = c["decode_steps"]
        return GenerationStats(
            submitted=c["submitted"],
            completed=c["completed"],
            failed=c["failed"],
            cancelled=c["cancelled"],
            timed_out=c["timed_out"],
            rejected=c["rejected"],
            queued=queued,
            active_rows=rows,
            reserved_tokens=reserved,
            cache_length=length,
            decode_steps=steps,
            prefill_runs=c["prefill_runs"],
            prompt_tokens=c["prompt_tokens"],
            generated_tokens=c["generated_tokens"],
            mean_decode_rows=c["decode_rows"] / steps if steps else 0.0,
            max_decode_rows=max_rows,
            cache_padding_fraction=padding / steps if steps else 0.0,
            decode_time_s=decode_time,
            prefill_time_s=prefill_time,
            cache_copies=c["cache_copies"],
            slot_reuses=c["slot_reuses"],
            errors=errors,
            kv_cache=kv_cache,
            row_moves=c["row_moves"],
            **_prefix_fields(prefix),
        )


def _prefix_fields(prefix: PrefixCacheStats | None) -> dict[str, int]:
    if prefix is None:
        return {}
    return {
        "prefix_cache_lookups": prefix.lookups,
        "prefix_cache_hits": prefix.hits,
        "prefix_cache_tokens_saved": prefix.tokens_saved,
        "prefix_cache_evictions": prefix.evicted_blocks,
        "prefix_cache_bytes": prefix.bytes,
        "prefix_cache_budget_bytes": prefix.budget_bytes,
    }
