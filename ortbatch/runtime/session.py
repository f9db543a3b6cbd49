"""BatchedSession: many concurrent callers, one batched ONNX Runtime run.

    from ortbatch import BatchedSession

    with BatchedSession("exports/minilm") as bs:
        (hidden,) = bs.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask})

Each caller sends one request (arrays with a leading batch dim, usually 1 row) and
gets back exactly what the model would have returned for that request alone: its
own rows, ragged axes trimmed to its own length, the same dtypes. Meanwhile the
workers pad and stack whatever is queued into one IOBinding run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import logging
import math
import numbers
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from .._lifecycle import check_positive, forget_live, settle, track_live
from .._observe import BatchObserver, BatchRecord, next_batch_id, notify, tag_for
from ..errors import (
    InferenceError,
    InvalidInputError,
    OrtBatchError,
    RequestTimeoutError,
    SessionClosedError,
    map_ort_error,
)
from ..manifest import MANIFEST_NAME, Manifest
from .bridge import AsyncSlot, Outbox, mailbox_for, one_wake_up
from .collate import Collator, PaddingCollator
from .executor import (
    GPU_PROVIDERS,
    Executor,
    WorkerBinding,
    build_session,
    check_active,
    cpu_count,
    resolve_providers,
)
from .scheduler import BatchPolicy, CostModel, LightFuture, Request, Scheduler, Slot
from .signature import ModelSignature
from .stats import Stats, StatsRecorder

__all__ = ["BatchedSession", "deadline_seconds"]

log = logging.getLogger("ortbatch")

_OPEN, _CLOSING, _CLOSED = "open", "closing", "closed"
_LATENCY_SESSION_MAX_BYTES = 1 << 30  # auto-build the latency session only for models up to 1 GiB


@dataclass(frozen=True)
class _Limits:
    """A BatchedSession's batching limits: the caller's, else what ``ortbatch tune`` wrote
    into the manifest for this export, else the defaults; each checked."""

    max_batch_size: int
    max_batch_tokens: int | None
    workers: int
    max_delay_ms: float
    max_queue: int
    timeout_s: float | None

    @classmethod
    def resolve(
        cls,
        manifest: Manifest | None,
        max_batch_size: int | None,
        max_batch_tokens: int | None,
        workers: int | None,
        max_delay_ms: float,
        max_queue: int,
        timeout_s: float | None,
    ) -> _Limits:
        # what `ortbatch tune` chose for this export, where the caller sets nothing
        tuned = manifest.runtime if manifest is not None else {}
        if max_batch_size is None:
            max_batch_size = tuned.get("max_batch_size", 32)
        if max_batch_tokens is None:
            max_batch_tokens = tuned.get("max_batch_tokens")
        if workers is None:
            workers = tuned.get("workers")
        check_positive("max_batch_size", max_batch_size)
        check_positive("max_queue", max_queue)
        if max_batch_tokens is not None:
            check_positive("max_batch_tokens", max_batch_tokens)
        if workers is not None:
            check_positive("workers", workers)
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms}")
        timeout_s = deadline_seconds(timeout_s, "timeout_s")
        assert max_batch_size is not None
        return cls(
            max_batch_size, max_batch_tokens, workers if workers is not None else 2, max_delay_ms, max_queue, timeout_s
        )


class BatchedSession:
    """Wrap an ONNX Runtime session so that concurrent single requests run batched.

    Args:
        sess_or_path: an ``onnxruntime.InferenceSession``, a path to a ``.onnx`` file,
            or an export directory holding ``ortbatch.json``.
        max_batch_size: most rows in one batch (a request's rows all count). ``None``:
            the export's tuned setting (manifest ``runtime``, from ``ortbatch tune``), else 32.
            ``max_batch_tokens`` and ``workers`` also default to the tuned settings.
        max_batch_tokens: hard cap on a batch's padded cost, rows x longest length.
            ``None``: no cap; batches are formed by the learned cost model.
        max_delay_ms: how long a free worker may wait after the oldest request
            arrived for a fuller batch. 0 (default): never wait.
        max_queue: requests allowed to wait; beyond that ``QueueFullError``.
        timeout_s: default deadline per request (before it starts running).
        workers: batches in flight at once. ``None``: 2 (one is padded and copied while
            another runs); a session built here then gets ``cores // workers`` threads each.
        pad_values: pad value per input name, overriding the manifest (default 0).
        padding_side: ``"right"`` or ``"left"``, overriding the manifest.
        providers: ``None`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``,
            ``"tensorrt"``, or an ONNX Runtime provider list. Only used when the
            session is built here; a requested GPU provider that is not active is
            a :class:`ProviderError`.
        collator: a custom :class:`~ortbatch.Collator` (default: padding collator built
            from the manifest or the graph).
        session_options: ``onnxruntime.SessionOptions`` for a session built here.
        latency_session: also build a second session with one intra-op thread per core,
            used for a batch that runs alone (the system was idle), so that one client
            gets direct ``session.run`` latency while loaded batches keep
            ``cores // workers`` threads each. It holds its own copy of the weights.
            ``None`` (default): built when this session is built here on CPU with fewer
            threads per worker than cores and the model is at most 1 GiB.
        warmup: before the constructor returns, run what makes the first real request
            as fast as the next ones (see :mod:`ortbatch.runtime.warmup`): on a GPU
            provider a small grid of shapes (rows 1, 8, max_batch_size x lengths 1, 16,
            128, the maximum and the TensorRT profile's opt lengths), so no request pays
            for an engine build or algorithm search; on the CPU provider alone, one
            smallest request (more buys nothing there, measured). ``ortbatch serve``
            turns it on. A shape the model refuses is logged and skipped.
        observer: told of each request queued and each batch run (its id, rows, padded
            tokens, timings and requests): a :class:`~ortbatch._observe.BatchObserver`,
            such as ``ortbatch serve``'s tracing. Also settable as ``session.observer``.

    When nothing is queued or running, :meth:`run` executes its request on the
    caller's own thread (no hand-off to a worker and back); requests that arrive
    meanwhile are batched by the workers as usual.
    """

    def __init__(
        self,
        sess_or_path: Any,
        *,
        max_batch_size: int | None = None,
        max_batch_tokens: int | None = None,
        max_delay_ms: float = 0.0,
        max_queue: int = 1024,
        timeout_s: float | None = None,
        workers: int | None = None,
        pad_values: Mapping[str, Any] | None = None,
        padding_side: str | None = None,
        providers: str | Sequence[Any] | None = None,
        collator: Collator | None = None,
        session_options: Any = None,
        latency_session: bool | None = None,
        warmup: bool = False,
        observer: BatchObserver | None = None,
    ) -> None:
        #: told of every request and batch (see ``observer`` above); None: nothing is told
        self.observer = observer
        self.manifest = _find_manifest(sess_or_path)
        limits = _Limits.resolve(
            self.manifest, max_batch_size, max_batch_tokens, workers, max_delay_ms, max_queue, timeout_s
        )
        self.workers = limits.workers
        self.latency_session: Any = None
        self._open(sess_or_path, providers, session_options, latency_session)
        limit = self.manifest.max_batch_size if self.manifest is not None else None
        self.max_batch_size = min(limits.max_batch_size, limit) if limit else limits.max_batch_size
        self.signature = ModelSignature.from_node_args(
            self.session.get_inputs(),
            self.session.get_outputs(),
            manifest=self.manifest,
            pad_values=pad_values,
            padding_side=padding_side,
        )
        self.signature.max_rows = self.max_batch_size
        self.collator: Collator = collator if collator is not None else PaddingCollator(self.signature)
        self.output_names: list[str] = [o.name for o in self.session.get_outputs()]
        self.input_names: list[str] = [i.name for i in self.session.get_inputs()]
        self._output_set = frozenset(self.output_names)
        self.timeout_s = limits.timeout_s
        #: most requests that may wait at once (a larger group is refused by submit_many)
        self.max_queue = max_queue
        self._build_scheduling(limits)
        #: what the warm-up ran, in words ("" without warm-up); see :mod:`.warmup`
        self.warmup_plan = ""
        #: seconds the warm-up took (0.0 without warm-up)
        self.warmup_s = self._warm_up() if warmup else 0.0
        self._state = _OPEN
        self._state_lock = threading.Lock()
        self._on_worker = _OnWorker()
        self._threads = [
            threading.Thread(target=self._worker, name=f"ortbatch-worker-{i}", daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()
        track_live(self)

    def _open(self, sess_or_path: Any, providers: Any, session_options: Any, latency_session: bool | None) -> None:
        """Build the sessions from a path (and the latency session where it pays), or take
        the one handed in, checked to be on ``providers``."""
        if isinstance(sess_or_path, (str, os.PathLike)):
            model_path = self.manifest.model_path if self.manifest is not None else Path(sess_or_path)
            if not model_path.is_file():
                raise FileNotFoundError(f"no ONNX model at {model_path}")
            if self.manifest is not None:
                requested = resolve_providers(providers, self.manifest.providers, self.manifest.directory)
            else:
                requested = resolve_providers(providers)
            self.session = build_session(model_path, requested, workers=self.workers, session_options=session_options)
            if _want_latency_session(latency_session, model_path, requested, self.workers, session_options):
                self.latency_session = build_session(
                    model_path, requested, workers=1, session_options=session_options, latency=True
                )
        else:
            if latency_session:
                raise ValueError(
                    "latency_session=True needs a model path: BatchedSession cannot rebuild a session it was handed"
                )
            self.session = sess_or_path
            if providers is not None:
                check_active(self.session, resolve_providers(providers))
            _describe_handed_session(self.session, self.workers)

    def _build_scheduling(self, limits: _Limits) -> None:
        """The batch policy, scheduler, statistics and executors (not yet the worker threads)."""
        self._cost = CostModel()
        self._policy = BatchPolicy(
            max_rows=self.max_batch_size,
            max_tokens=limits.max_batch_tokens,
            max_delay_s=limits.max_delay_ms / 1e3,
            cost=self._cost,
        )
        self._stats = StatsRecorder()
        self._sched = Scheduler(self._policy, limits.max_queue, on_expired=self._stats.error)
        # run_async's requests of the current loop turn, per event loop (ortbatch.runtime.bridge)
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()
        self._executor = Executor(self.session)
        # A batch that runs alone (and an inline run) goes to the latency session if there is one.
        self._alone_executor = Executor(self.latency_session) if self.latency_session is not None else self._executor
        self._inline_binding = self._alone_executor.binding()

    # -- the InferenceSession-like face ---------------------------------------------------
    def get_inputs(self) -> list[Any]:
        """The wrapped session's inputs (``onnxruntime.NodeArg``)."""
        return list(self.session.get_inputs())

    def get_outputs(self) -> list[Any]:
        """The wrapped session's outputs (``onnxruntime.NodeArg``)."""
        return list(self.session.get_outputs())

    def get_providers(self) -> list[str]:
        """Execution providers active in the wrapped session."""
        return list(self.session.get_providers())

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any = None,
        *,
        timeout_s: float | None = None,
    ) -> list[np.ndarray]:
        """Run one request, batched with whatever else is queued; blocks until done.

        Same contract as ``InferenceSession.run`` for this one request: returns the
        outputs named in ``output_names`` (all, in model order, when ``None`` or empty).
        ``timeout_s`` overrides the session's deadline for this request: a positive
        number of seconds (``math.inf`` or anything beyond ~31 years: no deadline);
        zero, negative, NaN or a non-number is an :class:`InvalidInputError` before
        anything is queued, whether or not the session is idle. Called from a done-callback
        of this session's futures (on the worker settling them), it runs right there.
        """
        if run_options is not None:
            raise InvalidInputError(
                "run_options apply to a whole batch and cannot be set per request in a BatchedSession"
            )
        fut = LightFuture()
        req = self._request(input_feed, output_names, timeout_s, fut)
        if self._on_worker.active:
            return self._run_on_worker(req, fut)
        if self._sched.put(req, inline_ok=True):
            # Idle: run it here, on the caller's thread, skipping two thread hand-offs.
            try:
                fut.set_running_or_notify_cancel()
                self._run([req], self._inline_binding, [0.0], self._alone_executor)
                self._stats.ran_alone(inline=True)
            finally:
                self._sched.finished()
            return fut.result()
        if req.deadline is None:
            return fut.result()
        try:
            return fut.result(timeout=max(req.deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
            if self._sched.cancel(req):
                self._stats.error(RequestTimeoutError())
                raise RequestTimeoutError("deadline passed before the request could run; it was dropped") from None
            return fut.result()  # already running: its result is on the way

    def _run_on_worker(self, req: Request, fut: LightFuture) -> list[np.ndarray]:
        """``run`` called on one of this session's workers (from a done-callback it is
        settling): queued, the request would wait for the very worker that waits for it
        (with one worker, forever), so it runs here and now, on a binding of its own."""
        self._sched.accept_unqueued()
        fut.set_running_or_notify_cancel()
        self._run([req], self._executor.binding(), [0.0], self._executor)
        return fut.result()

    async def run_async(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
    ) -> list[np.ndarray]:
        """``await``-able :meth:`run`. Cancelling the task drops a still-queued request.

        Requests started in one turn of the event loop are queued together at its next
        turn, and finished ones are handed back to the loop a batch at a time
        (:mod:`ortbatch.runtime.bridge`): the loop is woken once per burst, not once
        per request."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[np.ndarray]] = loop.create_future()
        req = self._request(_own(input_feed), output_names, timeout_s, AsyncSlot(fut, mailbox_for(loop)))
        box = self._outboxes.get(loop)
        if box is None:
            box = self._outboxes.setdefault(loop, Outbox(loop, self._sched))
        box.add(req)
        timer = None
        if req.deadline is not None:
            timer = loop.call_later(max(req.deadline - time.monotonic(), 0.0), self._expire, req, box)
        try:
            return await fut
        except asyncio.CancelledError:
            if not box.remove(req):
                self._sched.cancel(req)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self, req: Request, box: Outbox) -> None:
        """A ``run_async`` request's deadline passed: drop it unless it is running (then
        its result is on the way)."""
        if box.remove(req) or self._sched.cancel(req):
            self._stats.error(RequestTimeoutError())
            slot = req.future
            assert isinstance(slot, AsyncSlot)
            if not slot.future.done():
                slot.future.set_exception(
                    RequestTimeoutError("deadline passed before the request could run; it was dropped")
                )

    def submit(
        self,
        input_feed: Mapping[str, Any],
        output_names: Sequence[str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> concurrent.futures.Future[list[np.ndarray]]:
        """Queue one request; the Future resolves to its outputs (list, in ``output_names``
        order) or to a typed error. ``future.cancel()`` drops it if it has not started.
        The request holds its own copy of the arrays: the caller may reuse them at once."""
        fut: concurrent.futures.Future[list[np.ndarray]] = concurrent.futures.Future()
        self._sched.put(self._request(_own(input_feed), output_names, timeout_s, fut))
        return fut

    def submit_each(
        self,
        requests: Sequence[tuple[Mapping[str, Any], Sequence[str] | None, float | None]],
        *,
        slots: Sequence[Slot] | None = None,
    ) -> list[Any]:
        """Queue independent requests at once, each ``(input_feed, output_names,
        timeout_s)``: like calling :meth:`submit` for each, under one lock and at most one
        worker wake-up (for a caller that receives requests in bursts, such as a
        front-end link). Unlike :meth:`submit_many`, each is admitted or refused on its
        own: the result holds, in order, the request's future or the typed error it was
        refused with (:class:`InvalidInputError`, :class:`QueueFullError` once the queue
        is full, :class:`SessionClosedError`); nothing is raised.

        ``slots``: one fresh :class:`~ortbatch.runtime.scheduler.Slot` per request, settled
        in place of a Future (a caller that hears of each outcome through its slot's
        ``_on_settled``/``_on_cancelled``, such as the engine of ``--frontends``, saves
        a Future, its Condition and a callback per request); the result then holds the
        slot for each request admitted."""
        if slots is not None and len(slots) != len(requests):
            raise ValueError(f"{len(slots)} slots for {len(requests)} requests")
        out: list[Any] = []
        reqs: list[Request] = []
        where: list[int] = []
        for i, (feed, names, timeout_s) in enumerate(requests):
            fut: Any = concurrent.futures.Future() if slots is None else slots[i]
            try:
                reqs.append(self._request(_own(feed), names, timeout_s, fut))
            except OrtBatchError as exc:
                out.append(exc)
                continue
            where.append(len(out))
            out.append(fut)
        if reqs:
            for i, error in zip(where, self._sched.put_each(reqs), strict=True):
                if error is not None:
                    assert isinstance(error, OrtBatchError)
                    out[i] = error
        return out

    def submit_many(
        self,
        input_feeds: Sequence[Mapping[str, Any]],
        output_names: Sequence[str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[concurrent.futures.Future[list[np.ndarray]]]:
        """Queue several requests as one unit: all are admitted, or none is.

        Each feed is validated first (an :class:`InvalidInputError` names the first bad
        one and nothing is queued). More feeds than ``max_queue`` can never fit: an
        :class:`InvalidInputError` that states the limit. Too little room left now: a
        :class:`QueueFullError` (retry later). Refusing costs O(1), whatever is queued.
        Each future settles like one from :meth:`submit`.
        """
        feeds = list(input_feeds)
        if not feeds:
            return []
        if len(feeds) > self._sched.max_queue:
            raise InvalidInputError(
                f"{len(feeds)} requests at once can never be queued: this session queues at most "
                f"{self._sched.max_queue} (max_queue); send them in smaller groups"
            )
        futures: list[concurrent.futures.Future[list[np.ndarray]]] = [concurrent.futures.Future() for _ in feeds]
        reqs = [self._request(_own(f), output_names, timeout_s, fut) for f, fut in zip(feeds, futures, strict=True)]
        self._sched.put_many(reqs)
        return futures

    def stats(self) -> Stats:
        """Counters, batch sizes, padding and timing percentiles so far."""
        return self._stats.snapshot(self._sched.accepted, self._sched.queued, self.workers, self._cost.snapshot())

    @property
    def closed(self) -> bool:
        return self._state != _OPEN

    @property
    def ready(self) -> bool:
        """Open and (when ``warmup=True``) warmed up: what a readiness probe should report."""
        return self._state == _OPEN

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests and join the workers.

        ``drain=True`` runs every queued request first; ``drain=False`` fails them with
        :class:`SessionClosedError`. Safe to call twice and from any thread.
        """
        with self._state_lock:
            if self._state == _OPEN:
                self._state = _CLOSING
        for box in _values(self._outboxes):
            box.flush()  # requests started on a loop this turn are queued, so drained like the rest
        dropped = self._sched.close(drain)
        for req in dropped:
            if req.future.set_running_or_notify_cancel():
                req.future.set_exception(SessionClosedError("session closed before the request ran"))
                self._stats.error(SessionClosedError())
        me = threading.current_thread()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            if t is not me:
                t.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        with self._state_lock:
            if not any(t.is_alive() for t in self._threads):
                self._state = _CLOSED
        forget_live(self)

    def __enter__(self) -> BatchedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=True)

    def __repr__(self) -> str:
        return (
            f"<BatchedSession {self._state} inputs={self.input_names} workers={self.workers} "
            f"max_batch_size={self.max_batch_size} providers={self.get_providers()}>"
        )

    # -- internals -------------------------------------------------------------------------
    def _warm_up(self) -> float:
        from .warmup import describe_grid, warmup_feeds, warmup_grid

        providers = self.manifest.providers if self.manifest is not None else ()
        active = self.get_providers()
        feeds = warmup_feeds(self.signature, self.max_batch_size, providers, active)
        t0 = time.perf_counter()
        runners = [self._executor] + ([self._alone_executor] if self._alone_executor is not self._executor else [])
        if feeds:
            grid = describe_grid(warmup_grid(self.signature, self.max_batch_size, providers, active))
            self.warmup_plan = f"{grid} on {len(runners)} session(s), {', '.join(active)}"
            log.info("warm-up: %s", self.warmup_plan)
        for runner in runners:
            binding = runner.binding()
            for feed in feeds:
                try:
                    runner.run(binding, feed, self.output_names)
                except Exception as exc:  # the model may refuse a shape it was never meant for
                    shape = {k: list(v.shape) for k, v in feed.items()}
                    log.warning("BatchedSession warm-up: skipped shape %s: %s", shape, exc)
        elapsed = time.perf_counter() - t0
        log.info("BatchedSession warmed up %d shape(s) in %.2fs", len(feeds), elapsed)
        return elapsed

    def _request(
        self,
        input_feed: Mapping[str, Any],
        output_names: Sequence[str] | None,
        timeout_s: float | None,
        future: concurrent.futures.Future[Any] | Slot,
    ) -> Request:
        if self._state != _OPEN:
            raise SessionClosedError("the session is closed; no new requests are accepted")
        if output_names is None:
            names: Sequence[str] = self.output_names
        else:
            if isinstance(output_names, str):
                raise InvalidInputError(f"output_names must be a list of names, got the string {output_names!r}")
            names = list(output_names)
            for n in names:
                if not isinstance(n, str) or n not in self._output_set:
                    raise InvalidInputError(f"unknown output {n!r}; the model's outputs are {self.output_names}")
            if not names:  # as InferenceSession.run: no names asks for every output
                names = self.output_names
        item = self.collator.prepare(input_feed)
        t = self.timeout_s if timeout_s is None else deadline_seconds(timeout_s, "timeout_s")
        deadline = time.monotonic() + t if t is not None else None
        tag = tag_for(self.observer) if self.observer is not None else None
        return Request(item, item.rows, item.length, names, deadline, future, tag)

    def _worker(self) -> None:
        self._on_worker.active = True
        binding = self._executor.binding()
        alone_binding = self._alone_executor.binding() if self._alone_executor is not self._executor else binding
        sched = self._sched
        while True:
            taken = sched.start_batch()
            if taken is None:
                return
            batch, alone = taken
            try:
                live = [r for r in batch if r.future.set_running_or_notify_cancel()]
                if len(live) < len(batch):
                    self._stats.cancel(len(batch) - len(live))
                if live:
                    now = time.monotonic()
                    waits = [now - r.enqueued for r in live]
                    if alone:
                        self._run(live, alone_binding, waits, self._alone_executor)
                        self._stats.ran_alone(inline=False)
                    else:
                        self._run(live, binding, waits, self._executor)
            except BaseException as exc:  # never let a worker die with futures unsettled
                for r in batch:
                    settle(r.future, error=InferenceError(f"internal error: {exc!r}"))
                if not isinstance(exc, Exception):
                    raise
            finally:
                sched.finished()
            # drop the batch before waiting for the next: its futures keep their callers'
            # event loops (and results) alive
            taken = batch = live = None  # type: ignore[assignment]

    def _run(self, reqs: list[Request], binding: WorkerBinding, waits: list[float] | None, executor: Executor) -> None:
        """Collate, run and split ``reqs``; on failure split the group and retry halves,
        so only the request(s) that fail on their own get the error."""
        t0 = time.perf_counter()
        wall = time.time_ns() if self.observer is not None else 0
        feed: dict[str, np.ndarray] | None = None
        try:
            feed, state = self.collator.collate([r.item for r in reqs])
            if len(reqs) == 1:
                names = list(reqs[0].output_names)
            else:
                wanted = set().union(*(r.output_names for r in reqs))
                names = [n for n in self.output_names if n in wanted]
            try:
                outs = executor.run(binding, feed, names)
            except Exception:
                if len(reqs) > 1 or binding.io is None:
                    raise
                # A lone failing request: IOBinding reports every ORT failure as a plain
                # RuntimeError, losing the status (INVALID_ARGUMENT vs FAIL). Run it once
                # through session.run, which raises ORT's typed error (or succeeds, if the
                # failure was transient).
                outs = executor.run_plain(feed, names)
            results = self.collator.split(dict(zip(names, outs, strict=True)), state)
            if len(results) != len(reqs):
                raise InferenceError(f"collator returned {len(results)} results for {len(reqs)} requests")
        except Exception as exc:
            if len(reqs) > 1:
                mid = len(reqs) // 2
                self._run(reqs[:mid], binding, waits[:mid] if waits else None, executor)
                self._run(reqs[mid:], binding, waits[mid:] if waits else None, executor)
                return
            err = exc if isinstance(exc, OrtBatchError) else map_ort_error(exc, "inference failed")
            if err is not exc:
                err.__cause__ = exc
            self._stats.error(err)
            settle(reqs[0].future, error=err)
            if self.observer is not None:
                self._observed(reqs, wall, time.perf_counter() - t0, waits, err)
            return
        elapsed = time.perf_counter() - t0
        rows = sum(r.rows for r in reqs)
        longest = max(r.length for r in reqs)
        if executor is self._executor:  # the cost model describes the workers' session
            self._cost.observe(rows, longest, elapsed)
        self._stats.batch(rows, len(reqs), sum(r.rows * r.length for r in reqs), rows * longest, elapsed, waits or [])
        ok = 0
        with one_wake_up():
            for req, res in zip(reqs, results, strict=True):
                try:
                    req.future.set_result([res[n] for n in req.output_names])
                    ok += 1
                except KeyError as exc:
                    settle(req.future, error=InferenceError(f"collator gave no output {exc}"))
                except concurrent.futures.InvalidStateError:
                    pass
        self._stats.finished(ok)
        if self.observer is not None:
            self._observed(reqs, wall, elapsed, waits)

    def _observed(
        self,
        reqs: list[Request],
        wall: int,
        elapsed: float,
        waits: list[float] | None,
        error: BaseException | None = None,
    ) -> None:
        """Tell the observer of a batch run (after its requests are settled)."""
        observer = self.observer
        if observer is None:
            return
        rows = sum(r.rows for r in reqs)
        record = BatchRecord(
            batch_id=next_batch_id(),
            rows=rows,
            requests=len(reqs),
            padded_tokens=rows * max(r.length for r in reqs),
            real_tokens=sum(r.rows * r.length for r in reqs),
            started_ns=wall,
            duration_ns=int(elapsed * 1e9),
            tags=[r.tag for r in reqs],
            waits_ns=[int(w * 1e9) for w in waits] if waits else [0] * len(reqs),
            error=error,
        )
        notify(observer.on_batch, record)


class _OnWorker(threading.local):
    """Per thread: whether it is one of this session's workers."""

    active = False


def _own(feed: Any) -> Any:
    """A queued request's own copy of the caller's arrays: ``submit`` and ``run_async``
    return before the batch is built, and a caller that refills its buffer meanwhile must
    still get the answer for what it sent. (``run`` blocks its caller, so it needs none.)"""
    if type(feed) is not dict and not isinstance(feed, Mapping):
        return feed  # a custom collator's request type: its own business (or refused in prepare)
    return {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in feed.items()}


def _values(boxes: weakref.WeakKeyDictionary[Any, Outbox]) -> list[Outbox]:
    """The outboxes, read from any thread (a loop may add its own meanwhile)."""
    while True:
        try:
            return list(boxes.values())
        except RuntimeError:  # changed size during iteration: read again
            continue


def _want_latency_session(
    wanted: bool | None,
    model_path: Path,
    providers: Sequence[tuple[str, dict[str, Any]]],
    workers: int,
    session_options: Any,
) -> bool:
    """Whether to build the latency session (see ``BatchedSession(latency_session=...)``)."""
    if wanted is not None:
        return wanted
    if session_options is not None or any(name in GPU_PROVIDERS for name, _ in providers):
        return False  # the user's own thread settings; on a GPU threads are not the limit
    cores = cpu_count()
    if max(1, cores // workers) >= cores:
        return False  # the workers' session already has every core
    weight_bytes = sum(f.stat().st_size for f in model_path.parent.glob(glob.escape(model_path.name) + "*"))
    return weight_bytes <= _LATENCY_SESSION_MAX_BYTES


# Deadlines past this many seconds (about 31 years) are no deadline at all; waits on
# locks and futures reject timeouts above threading.TIMEOUT_MAX (~292 years on Linux).
_NO_DEADLINE_BEYOND_S = 1e9


def deadline_seconds(value: Any, name: str) -> float | None:
    """A deadline in seconds as given by a caller: a positive finite number, or
    ``None``/``math.inf``/anything beyond ~31 years for none. Anything else (zero,
    negative, NaN, a bool, a non-number) is an :class:`InvalidInputError`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's numbers too, not np.bool_
        raise InvalidInputError(f"{name} must be a number of seconds, got {value!r}", input_name=name)
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float: no deadline either
        return None
    if math.isnan(seconds) or seconds <= 0:
        raise InvalidInputError(f"{name} must be > 0 seconds (or None for no deadline), got {value!r}", input_name=name)
    return None if seconds > _NO_DEADLINE_BEYOND_S else seconds


def _find_manifest(sess_or_path: Any) -> Manifest | None:
    if not isinstance(sess_or_path, (str, os.PathLike)):
        return None
    p = Path(sess_or_path)
    if p.is_dir():
        return Manifest.load(p).verify()
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist (expected a .onnx file or an export directory)")
    sidecar = p.parent / MANIFEST_NAME
    if sidecar.is_file():
        m = Manifest.load(p.parent)
        if Path(m.model).name == p.name:
            return m.verify()
    return None


def _describe_handed_session(session: Any, workers: int) -> None:
    """Say what thread settings a handed-in session has (they belong to the session)."""
    if not log.isEnabledFor(logging.INFO):
        return
    try:
        ort = require("onnxruntime")
        opts = session.get_session_options()
        threads = opts.intra_op_num_threads or cpu_count()
        log.info(
            "BatchedSession: wrapping a session with intra_op_num_threads=%s on %s cores, %d worker(s); "
            "for CPU throughput, build it with intra_op_num_threads=cores//workers or pass a path "
            "and let BatchedSession choose (ORT %s)",
            threads,
            cpu_count(),
            workers,
            ort.__version__,
        )
    except Exception:  # a duck-typed session may not have options
        pass
