"""The hooks through which a caller watches the runtimes work, request by request: what
:class:`~ortbatch.BatchedSession` and :class:`~ortbatch.generation.BatchedGenerator` tell an
``observer`` (``ortbatch serve``'s tracing, :mod:`ortbatch.serve.tracing`, implements them
with OpenTelemetry; the runtimes know nothing of it).

The contract, the same for both:

* ``on_submit()`` is called on the caller's thread (its context: its contextvars) when a
  request is queued, and returns a **tag**, anything; the runtime keeps it with the
  request and hands it back in the records below. ``None``: nothing is recorded for it.
* the records are passed on the runtime's own thread, after the requests' futures are
  settled (a slow observer delays the next batch, never an answer already made);
* an observer that raises is logged and ignored: it never fails a request.

Without an observer (the default) a runtime pays one ``is None`` test per request and per
batch. Times are wall-clock nanoseconds (``time.time_ns()``), as tracing wants them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "BatchObserver",
    "BatchRecord",
    "GenerationObserver",
    "StepRecord",
    "next_batch_id",
    "notify",
    "tag_for",
]

log = logging.getLogger("ortbatch")

# one sequence for every session and generator of the process: a batch id names one batch
_BATCH_IDS = itertools.count(1)


def next_batch_id() -> int:
    """A batch id no other batch of this process has."""
    return next(_BATCH_IDS)


@dataclass(frozen=True)
class BatchRecord:
    """One run of a :class:`~ortbatch.BatchedSession` (or, for a generator, one prefill)."""

    #: unique in the process; every request of the batch carries it
    batch_id: int
    #: rows the batch held (a request may bring several) and the requests
    rows: int
    requests: int
    #: rows x the longest length: what the model computed
    padded_tokens: int
    #: the requests' own tokens (rows x their own length)
    real_tokens: int
    #: when the run began, and how long it took (pad, run, split)
    started_ns: int
    duration_ns: int
    #: per request, in batch order: its tag, and how long it waited in the queue
    tags: Sequence[Any]
    waits_ns: Sequence[int]
    #: set when the run failed (then the batch holds the one request it failed for)
    error: BaseException | None = None


@dataclass(frozen=True)
class StepRecord:
    """One decode step of a :class:`~ortbatch.generation.BatchedGenerator` (sampled: one
    in every ``observer.step_every``)."""

    #: the generator's step count (1 for its first decode step)
    step: int
    #: rows decoded, and the cache positions computed (rows x the cache length)
    rows: int
    padded_tokens: int
    started_ns: int
    duration_ns: int
    #: the tags of the rows' requests
    tags: Sequence[Any]


class BatchObserver(Protocol):
    """What :class:`~ortbatch.BatchedSession` tells (``BatchedSession(observer=...)``)."""

    def on_submit(self) -> Any: ...

    def on_batch(self, record: BatchRecord) -> None: ...


class GenerationObserver(Protocol):
    """What :class:`~ortbatch.generation.BatchedGenerator` tells: the prefill that admitted
    requests (a :class:`BatchRecord`), one decode step in every ``step_every``, and each
    request's end (its future, settled: a ``Completion``, an error, or cancelled)."""

    step_every: int

    def on_submit(self) -> Any: ...

    def on_prefill(self, record: BatchRecord) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...

    def on_done(self, tag: Any, future: Future[Any]) -> None: ...


def notify(method: Any, *args: Any) -> None:
    """Call an observer's ``method(*args)``; an error is logged, never raised."""
    try:
        method(*args)
    except Exception:
        log.exception("an observer's %s failed (ignored)", getattr(method, "__name__", method))


def tag_for(observer: Any) -> Any:
    """``observer.on_submit()`` (None when it fails: nothing is recorded for the request)."""
    try:
        return observer.on_submit()
    except Exception:
        log.exception("an observer's on_submit failed (ignored)")
        return None
