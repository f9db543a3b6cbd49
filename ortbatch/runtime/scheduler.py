"""The request queue and batch formation. Pure Python: no ONNX Runtime here.

Workers call :meth:`Scheduler.take` when they are free; callers call
:meth:`Scheduler.put`. All queue state lives behind one lock, and every wait is a
``Condition.wait`` in a loop with a predicate (and a timeout when a deadline or
``max_delay_ms`` is pending), so a missed notify can delay nothing.

Batch formation (:class:`BatchPolicy`):

* greedy: a free worker takes what is queued at once; no timer runs when idle, so
  low load adds no latency and batches grow by themselves under load;
* ``max_delay_ms > 0`` lets a worker wait up to that long after the oldest request
  arrived for a fuller batch;
* hard caps: rows <= ``max_rows`` and padded cost (rows x longest) <= ``max_tokens``;
* the oldest request always goes into the next batch (no starvation);
* among pending requests, the batch is a window of similar lengths around the oldest
  that maximises *real* elements per second under a cost model of the run time,
  ``t = a + b*P + c*P*L + d*P*P`` (``P = rows*L``) fitted online from measured runs
  (:class:`CostModel`). Without measurements, a prior that values one run's fixed cost
  at ``prior_overhead`` padded elements is used.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import QueueFullError, RequestTimeoutError, SessionClosedError

__all__ = ["BatchPolicy", "CostModel", "LightFuture", "Request", "Scheduler", "Slot"]

_PENDING, _RUNNING, _CANCELLED, _FINISHED = 0, 1, 2, 3


class Slot:
    """The outcome of one request, as the runtime settles it: the subset of
    :class:`concurrent.futures.Future` it uses (pending → running → finished, or
    cancelled while pending), on one bare lock. Subclasses say how a waiter learns of the
    outcome (:meth:`_on_cancelled` under the lock, :meth:`_on_settled` after it)."""

    __slots__ = ("_exc", "_lock", "_result", "_state", "on_cancel")

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()  # guards _state transitions
        self._state = _PENDING
        self._result: Any = None
        self._exc: BaseException | None = None
        #: called (no lock held) when a pending slot is cancelled
        self.on_cancel: Callable[[], None] | None = None

    def set_running_or_notify_cancel(self) -> bool:
        with self._lock:
            if self._state == _CANCELLED:
                return False
            if self._state != _PENDING:
                raise RuntimeError("slot already running or done")
            self._state = _RUNNING
            return True

    def cancel(self) -> bool:
        with self._lock:
            if self._state == _RUNNING or self._state == _FINISHED:
                return False
            if self._state != _PENDING:
                return True
            self._state = _CANCELLED
            self._on_cancelled()
        if self.on_cancel is not None:
            self.on_cancel()
        return True

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def done(self) -> bool:
        return self._state == _CANCELLED or self._state == _FINISHED

    def set_result(self, value: Any) -> None:
        self._settle(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(None, exc)

    def _settle(self, value: Any, exc: BaseException | None) -> None:
        with self._lock:
            if self._state == _CANCELLED or self._state == _FINISHED:
                raise InvalidStateError(f"slot already {'cancelled' if self._state == _CANCELLED else 'done'}")
            self._result, self._exc = value, exc
            self._state = _FINISHED
        self._on_settled()

    def _on_cancelled(self) -> None:
        """A pending slot was cancelled (the lock is held)."""

    def _on_settled(self) -> None:
        """The outcome was set (the lock is released)."""


class LightFuture(Slot):
    """A one-shot result for a caller blocked in ``BatchedSession.run``.

    A ``Future`` allocates a ``Condition`` (and an ``RLock``) per request and wakes its
    waiter through it, which at thousands of requests per second is a measurable share
    of the runtime's own cost; this waits on a second bare lock, held until the outcome
    is set. ``submit`` still hands out real ``Future`` objects; both kinds are settled
    through the same calls.
    """

    __slots__ = ("_gate",)

    def __init__(self) -> None:
        super().__init__()
        self._gate = _thread.allocate_lock()  # held until the outcome is set
        self._gate.acquire()

    def _on_cancelled(self) -> None:
        self._gate.release()

    def _on_settled(self) -> None:
        self._gate.release()

    def result(self, timeout: float | None = None) -> Any:
        """The outcome; waits up to ``timeout`` seconds (``None``: forever)."""
        if not self._gate.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            raise FutureTimeoutError()
        self._gate.release()  # keep it open for any later call
        if self._state == _CANCELLED:
            raise CancelledError()
        if self._exc is not None:
            raise self._exc
        return self._result


class Request:
    """One queued request: its prepared payload, its future, and bookkeeping."""

    __slots__ = ("deadline", "enqueued", "future", "item", "length", "output_names", "rows", "tag")

    def __init__(
        self,
        item: Any,
        rows: int,
        length: int,
        output_names: Any = None,
        deadline: float | None = None,
        future: Future[Any] | Slot | None = None,
        tag: Any = None,
    ) -> None:
        self.item = item
        self.rows = rows
        self.length = length
        self.output_names = output_names
        self.deadline = deadline
        self.future: Future[Any] | Slot = future if future is not None else LightFuture()
        self.enqueued = 0.0
        #: what the session's observer said of it when it was queued (``ortbatch._observe``)
        self.tag = tag


class CostModel:
    """Online least-squares fit of batch run time ``t = a + b*P + c*P*L + d*P*P``.

    ``P = R*L`` is the padded cost (rows x padded length). ``c`` captures attention's
    quadratic cost in the length; ``d`` that very large batches get slower per element on
    a CPU (activations outgrow the caches), which is why a budget of a few hundred tokens
    beats "as many as fit" there. Coefficients that fit negative are dropped (an
    active-set refit), so the model stays monotone. Thread-safe; refits every few samples
    with exponential forgetting so it follows drift (other load, a new shape mix).
    """

    _TERMS = 4

    def __init__(
        self, prior_overhead: float = 64.0, min_overhead: float = 32.0, decay: float = 0.98, refit_every: int = 8
    ) -> None:
        self.min_overhead = min_overhead
        self._lock = threading.Lock()
        self._xtx = np.zeros((self._TERMS, self._TERMS))
        self._xty = np.zeros(self._TERMS)
        self._n = 0
        self._buffer: list[tuple[int, int, float]] = []
        self._decay = decay
        self._refit_every = refit_every
        self._refits = 0
        # coefficients in seconds; the prior only matters through ratios
        self.a = prior_overhead * 1e-6
        self.b = 1e-6
        self.c = 0.0
        self.d = 0.0
        self.fitted = False

    def observe(self, rows: int, length: int, seconds: float) -> None:
        """Record one batch's run time. Cheap: samples are buffered and folded into the
        normal equations (vectorised) every ``refit_every`` batches."""
        with self._lock:
            self._buffer.append((rows, length, seconds))
            # refit often while learning, then every 8x as many batches (a refit costs
            # ~0.1-0.5 ms of the worker's time; drift is slow next to that)
            every = self._refit_every if self._refits < 8 else 8 * self._refit_every
            if len(self._buffer) >= every:
                self._fold()
                if self._n >= 4:
                    self._refit()
                    self._refits += 1

    def _fold(self) -> None:
        samples = np.array(self._buffer, dtype=np.float64)
        self._buffer.clear()
        rows, length, seconds = samples[:, 0], samples[:, 1], samples[:, 2]
        p = rows * length
        x = np.stack([np.ones_like(p), p, p * length, p * p], axis=1)
        k = len(samples)
        w = self._decay ** np.arange(k - 1, -1, -1, dtype=np.float64)  # newest weighs most
        self._xtx = self._xtx * self._decay**k + (x * w[:, None]).T @ x
        self._xty = self._xty * self._decay**k + (x * (w * seconds)[:, None]).sum(axis=0)
        self._n += k

    def _solve(self, active: list[int]) -> np.ndarray | None:
        xtx = self._xtx[np.ix_(active, active)]
        xty = self._xty[active]
        scale = np.sqrt(np.maximum(np.diag(xtx), 1e-30))  # well-conditioned normal equations
        try:
            coef = np.linalg.solve(xtx / np.outer(scale, scale) + 1e-9 * np.eye(len(active)), xty / scale) / scale
        except np.linalg.LinAlgError:
            return None
        return coef if np.all(np.isfinite(coef)) else None

    def _refit(self) -> None:
        active = list(range(self._TERMS))
        coef = None
        while True:
            coef = self._solve(active)
            if coef is None:
                return
            # drop the most negative of the optional terms (c, d) and refit
            negative = [(v, t) for v, t in zip(coef, active, strict=True) if t >= 2 and v < 0]
            if not negative:
                break
            active.remove(min(negative)[1])
        full = dict(zip(active, (float(v) for v in coef), strict=True))
        a, b = full.get(0, 0.0), full.get(1, 0.0)
        if b <= 0:
            return
        # The intercept is the least determined coefficient (batches under load cluster in
        # a narrow size range) and a fit of ~0 would shrink batches to exact-length matches,
        # paying a run's fixed cost again and again. So a run's fixed cost is taken as at
        # least `min_overhead` padded elements.
        self.a, self.b, self.c, self.d = max(a, self.min_overhead * b), b, full.get(2, 0.0), full.get(3, 0.0)
        self.fitted = True

    def predict(self, rows: int, length: int) -> float:
        p = rows * length
        return self.a + self.b * p + self.c * p * length + self.d * p * p

    def snapshot(self) -> dict[str, float | bool]:
        return {
            "a_s": self.a,
            "b_s_per_elem": self.b,
            "c_s_per_elem_len": self.c,
            "d_s_per_elem2": self.d,
            "fitted": self.fitted,
        }


@dataclass
class BatchPolicy:
    """Caps and knobs of batch formation (see the module docstring)."""

    max_rows: int = 32
    max_tokens: int | None = None
    max_delay_s: float = 0.0
    cost: CostModel = field(default_factory=CostModel)

    def select(self, pending: list[Request]) -> list[int]:
        """Indices into ``pending`` (arrival order) of the next batch. Always holds 0."""
        n = len(pending)
        max_rows, max_tokens = self.max_rows, self.max_tokens
        if n == 1:
            return [0]
        lengths = [r.length for r in pending]
        cost = self.cost
        # Fast path: all the same length -> FIFO (no padding to save), up to the caps and
        # while each added request still raises elements per second.
        l0 = lengths[0]
        if all(x == l0 for x in lengths):
            take: list[int] = []
            rows = 0
            best = 0.0
            for i, r in enumerate(pending):
                n = rows + r.rows
                if take and (n > max_rows or (max_tokens is not None and n * l0 > max_tokens)):
                    break
                score = n * l0 / cost.predict(n, l0)
                if take and score < best:
                    break
                best = score
                take.append(i)
                rows = n
            return take
        order = sorted(range(n), key=lengths.__getitem__)
        k = order.index(0)
        srows = [pending[i].rows for i in order]
        slen = [lengths[i] for i in order]
        # prefix sums over the length-sorted order
        prow = [0] * (n + 1)
        preal = [0] * (n + 1)
        for idx in range(n):
            prow[idx + 1] = prow[idx] + srows[idx]
            preal[idx + 1] = preal[idx] + srows[idx] * slen[idx]
        # predict() inlined (this loop runs per batch under the queue lock)
        ca, cb, cc, cd = cost.a, cost.b, cost.c, cost.d
        best_score, best_i, best_j = -1.0, k, k
        for j in range(k, n):  # j: the longest request in the window
            L = slen[j]
            top_real = preal[j + 1]
            top_rows = prow[j + 1]
            if j > k and (
                top_rows - prow[k] > max_rows or (max_tokens is not None and (top_rows - prow[k]) * L > max_tokens)
            ):
                break
            peak = -1.0
            for i in range(k, -1, -1):  # extend toward shorter requests
                rows = top_rows - prow[i]
                if i < k and (rows > max_rows or (max_tokens is not None and rows * L > max_tokens)):
                    break
                p = rows * L
                score = (top_real - preal[i]) / (ca + cb * p + cc * p * L + cd * p * p)
                if score >= peak:
                    peak = score
                    if score > best_score or (score == best_score and j == best_j):  # ties: reach further
                        best_score, best_i, best_j = score, i, j
                elif i < k:
                    break  # past the peak: further extension only adds shorter rows
        i, j = best_i, best_j
        return sorted(order[i : j + 1])  # i <= k <= j: the oldest is always in


class Scheduler:
    """The queue shared by callers (``put``) and workers (``take``)."""

    def __init__(
        self,
        policy: BatchPolicy,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        on_expired: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.policy = policy
        self._on_expired = on_expired
        self.max_queue = max_queue
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._pending: list[Request] = []
        self._closed = False
        self._drain = True
        self._busy = 0  # batches taken and not yet finished, inline runs included
        self._idle = 0  # workers waiting in start_batch (put notifies only when there is one)
        # Set when a queued request's future was cancelled directly: only then may a full
        # queue hold dead entries worth a scan, so refusing stays O(1) otherwise.
        self._maybe_cancelled = False
        self.accepted = 0

    # -- callers ----------------------------------------------------------------------
    def put(self, req: Request, inline_ok: bool = False) -> bool:
        """Queue ``req``. With ``inline_ok``, an idle scheduler (nothing queued or running,
        no ``max_delay_ms``) does not queue it but returns True: the caller runs it on its
        own thread and then calls :meth:`finished` (no request is overtaken)."""
        with self._cond:
            if self._closed:
                raise SessionClosedError("the session is closed; no new requests are accepted")
            if inline_ok and not self._pending and not self._busy and self.policy.max_delay_s <= 0:
                self._busy += 1
                self.accepted += 1
                return True
            if not self._has_room(1):
                raise QueueFullError(len(self._pending), self.max_queue)
            self._enqueue([req])
            return False

    def accept_unqueued(self) -> None:
        """Count a request that runs without queueing (``run`` on a worker's own thread);
        :class:`SessionClosedError` once closed, as :meth:`put`."""
        with self._cond:
            if self._closed:
                raise SessionClosedError("the session is closed; no new requests are accepted")
            self.accepted += 1

    def put_many(self, reqs: list[Request]) -> None:
        """Queue all of ``reqs`` or none: :class:`QueueFullError` unless there is room for
        every one of them now (O(1) to refuse)."""
        with self._cond:
            if self._closed:
                raise SessionClosedError("the session is closed; no new requests are accepted")
            if not self._has_room(len(reqs)):
                raise QueueFullError(len(self._pending), self.max_queue)
            self._enqueue(reqs)

    def put_each(self, reqs: list[Request]) -> list[BaseException | None]:
        """Queue independent requests under one lock and at most one wake-up: each is
        admitted on its own, in order, until the queue is full. Returns, per request,
        ``None`` (queued) or the error it was refused with."""
        with self._cond:
            if self._closed:
                return [SessionClosedError("the session is closed; no new requests are accepted") for _ in reqs]
            room = 0
            while room < len(reqs) and self._has_room(room + 1):
                room += 1
            self._enqueue(reqs[:room])
            out: list[BaseException | None] = [None] * room
            out += [QueueFullError(len(self._pending), self.max_queue) for _ in reqs[room:]]
            return out

    def cancel(self, req: Request) -> bool:
        """Remove ``req`` if still queued; True if it was (its future is then cancelled)."""
        with self._cond:
            try:
                self._pending.remove(req)
            except ValueError:
                return False
        req.future.cancel()
        return True

    def finished(self) -> None:
        """A batch taken by :meth:`start_batch` (or an inline run, see :meth:`put`) is over."""
        with self._cond:
            self._busy -= 1

    @property
    def queued(self) -> int:
        return len(self._pending)

    # -- workers -----------------------------------------------------------------------
    def take_and_finish(self) -> list[Request] | None:
        """Block until a batch is ready; None once closed and (if draining) empty.

        For callers that do not track running batches (tests, tools): the batch counts as
        finished at once."""
        taken = self.start_batch()
        if taken is None:
            return None
        self.finished()
        return taken[0]

    def start_batch(self) -> tuple[list[Request], bool] | None:
        """Like :meth:`take_and_finish`, plus whether the batch runs *alone* (nothing else running,
        nothing left queued). Call :meth:`finished` after running it."""
        while True:
            expired: list[Request] = []
            try:
                taken = self._next_batch(expired)
            finally:
                # settled outside the lock, and before this worker waits again: an expired
                # request must not wait for the next batch (or close) to hear of it
                for req in expired:
                    exc = RequestTimeoutError("deadline passed before the request could run; it was dropped")
                    if _fail(req, exc) and self._on_expired is not None:
                        self._on_expired(exc)
            if taken is not _AGAIN:
                return taken

    def _next_batch(self, expired: list[Request]) -> tuple[list[Request], bool] | None:
        """:meth:`start_batch` under the lock; ``_AGAIN`` when it reaped expired requests
        (into ``expired``) that must be failed before it may wait."""
        with self._cond:
            while True:
                now = self._clock()
                self._reap(now, expired)
                if expired:
                    return _AGAIN
                if self._closed and (not self._pending or not self._drain):
                    return None
                pending = self._pending
                if pending:
                    delay = self.policy.max_delay_s
                    if delay > 0 and not self._closed:
                        wait = pending[0].enqueued + delay - now
                        if wait > 0 and sum(r.rows for r in pending) < self.policy.max_rows:
                            self._wait(self._timeout(wait, now))
                            continue
                    picked = self.policy.select(pending)
                    batch = [pending[i] for i in picked]
                    keep = set(picked)
                    self._pending = [r for i, r in enumerate(pending) if i not in keep]
                    if self._pending:
                        self._cond.notify()  # another free worker may take the rest
                    alone = not self._busy and not self._pending
                    self._busy += 1
                    return batch, alone
                self._wait(self._timeout(None, now))

    def close(self, drain: bool) -> list[Request]:
        """Stop accepting. Without drain, return the queued requests for the caller to fail."""
        with self._cond:
            self._closed = True
            self._drain = self._drain and drain
            dropped: list[Request] = []
            if not drain:
                dropped, self._pending = self._pending, []
            self._cond.notify_all()
            return dropped

    # -- internals (lock held) ------------------------------------------------------------
    def _enqueue(self, reqs: list[Request]) -> None:
        """Queue ``reqs`` (room already checked), waking a waiting worker."""
        if not reqs:
            return
        now = self._clock()
        for req in reqs:
            req.enqueued = now
            self._watch(req)
        self._pending.extend(reqs)
        self.accepted += len(reqs)
        if self._idle:
            self._cond.notify()

    def _has_room(self, n: int) -> bool:
        """Whether ``n`` more requests fit; scans for cancelled ones only when one of the
        queued futures was cancelled since the last scan."""
        if len(self._pending) + n <= self.max_queue:
            return True
        if not self._maybe_cancelled:
            return False
        self._maybe_cancelled = False
        self._pending = [r for r in self._pending if not r.future.cancelled()]
        return len(self._pending) + n <= self.max_queue

    def _watch(self, req: Request) -> None:
        fut = req.future
        if isinstance(fut, Future):
            fut.add_done_callback(self._note_if_cancelled)
        else:  # the runtime's own slots
            fut.on_cancel = self._note_cancelled

    def _note_cancelled(self) -> None:
        self._maybe_cancelled = True  # a plain store: safe without the lock

    def _note_if_cancelled(self, fut: Future[Any]) -> None:
        if fut.cancelled():
            self._maybe_cancelled = True

    def _wait(self, timeout: float | None) -> None:
        self._idle += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._idle -= 1

    def _timeout(self, wait: float | None, now: float) -> float | None:
        deadlines = [r.deadline for r in self._pending if r.deadline is not None]
        if deadlines:
            d = max(min(deadlines) - now, 0.0) + 1e-4
            wait = d if wait is None else min(wait, d)
        return wait

    def _reap(self, now: float, expired: list[Request]) -> None:
        pending = self._pending
        if not pending:
            return
        keep: list[Request] | None = None
        for idx, r in enumerate(pending):
            dead = r.future.cancelled() or (r.deadline is not None and r.deadline <= now)
            if dead and keep is None:
                keep = pending[:idx]
            if dead:
                if not r.future.cancelled():
                    expired.append(r)
            elif keep is not None:
                keep.append(r)
        if keep is not None:
            self._pending = keep


#: what Scheduler._next_batch returns when it reaped expired requests: settle them, look again
_AGAIN: tuple[list[Request], bool] = ([], False)


def _fail(req: Request, exc: BaseException) -> bool:
    """Settle a request that never ran (still PENDING) with ``exc``; True if this did."""
    fut = req.future
    try:
        if fut.set_running_or_notify_cancel():
            fut.set_exception(exc)
            return True
    except RuntimeError:  # already running or done: someone else settles it
        pass
    return False
