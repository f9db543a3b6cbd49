"""Who waits, who decodes, and what changes at each step boundary. Pure Python: no ONNX Runtime.

The generator's step loop asks this scheduler, in order, at every iteration:

1. :meth:`Scheduler.admit`: wait for work; drop pending requests that were cancelled or
   whose deadline passed; admit pending requests oldest-first while rows stay under
   ``max_batch_size`` and the tokens they reserve (prompt + ``max_new_tokens`` of every
   admitted row) under ``max_tokens_in_flight``. The first that does not fit stops
   admission, so nobody overtakes the head of the queue and nothing starves;
2. :meth:`Scheduler.reap`: settle active rows whose caller cancelled or whose deadline
   passed; the rows that stay are returned;
3. :meth:`Scheduler.prefill_groups`: the admitted prompts grouped by length so that a
   group's padding stays bounded;
4. :meth:`Scheduler.place`: where the rows that join go in the cache — in the slots of
   rows that left, or by one rebuild — and whether rows that left are dropped now
   (:class:`Placement`, carried out on the cache by the step loop). On the in-place cache
   (``slots=True``) every row keeps its slot: rows that join take free slots, rows that
   leave free theirs, and rows high up move down into free slots when that pays;
5. :meth:`Scheduler.record_token`: after each model run, one token per row: stops on
   eos, a stop string or ``max_new_tokens``, and settles the request's future.

Callers only call :meth:`put` and :meth:`close` (under one lock); everything else runs
on the step loop's thread. Every request ends in exactly one outcome, counted in the
stats recorder before its future is settled (a caller may read stats as soon as it is).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._lifecycle import settle
from ..errors import InferenceError, QueueFullError, RequestTimeoutError, SessionClosedError
from .processors import TokenLogprob, choose_rows
from .requests import GenerationRequest, StreamToken
from .stats import GenerationStatsRecorder

__all__ = ["CompactionCost", "Placement", "Scheduler"]

IDLE_WAIT_S = 0.25  # the scheduler re-checks deadlines at least this often when idle
CANCELLED = InferenceError("cancelled")  # marker only: never set on a future

_OPEN, _DRAINING, _ABORTING, _CLOSED = "open", "draining", "aborting", "closed"


@dataclass
class CompactionCost:
    """What dropping rows that left costs (a cache copy) against what keeping them costs
    (their share of every decode step). Both are learned as the generator runs; these
    are the starting estimates."""

    copy_s_per_byte: float = 1e-9  # learned from the cache copies made
    step_s: float = 0.0  # the last decode step's time

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes:
            self.copy_s_per_byte = 0.7 * self.copy_s_per_byte + 0.3 * seconds / nbytes

    def worth_moving(self, rows: int, free: int, steps_left: float, move_bytes: int) -> bool:
        """Whether moving rows (``move_bytes`` of cache) down into ``free`` of ``rows`` slots,
        so the batch is that much shorter, saves more decode time than the copy costs."""
        return self.step_s * free / rows * steps_left > self.copy_s_per_byte * move_bytes

    def worth_compacting(self, rows: int, leaving: int, steps_left: float, cache_bytes: int) -> bool:
        """Whether dropping ``leaving`` of ``rows`` rows now saves more decode time, over
        ``steps_left`` steps, than copying the others' share of ``cache_bytes`` costs."""
        waste = self.step_s * leaving / rows * steps_left
        copy = self.copy_s_per_byte * cache_bytes * (rows - leaving) / rows
        return waste > copy


@dataclass
class Placement:
    """What the cache does at a step boundary, in this order.

    ``slots[j]``: the cache row that joining row ``j`` is written into, in place (the row
    of a request that left). ``rebuild``: the rows one copy keeps, in order (``None``: no
    copy), with the joining rows stacked after them when ``append``. ``reset``: nothing
    is left; start from an empty cache. ``copy_bytes``: what the rebuild (or the moves)
    copies.

    On the in-place cache, first ``free``: the slots of rows that left; then ``moves``:
    ``(from, to)`` rows moved down into free slots; then the joining rows written into
    ``slots`` (free ones, or new ones past the end); the batch is then ``rows`` slots long
    and each slot must hold ``capacity`` positions (the longest budget of its rows).
    """

    slots: list[int] = field(default_factory=list)
    rebuild: list[int] | None = None
    append: bool = False
    reset: bool = False
    copy_bytes: int = 0
    free: list[int] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    rows: int = 0
    capacity: int = 0


class Scheduler:
    """Pending requests, active rows (one per cache row), admission and every outcome.

    ``clock`` is the deadline clock (``time.monotonic``; tests pass a fake one). ``slots``:
    the cache keeps each row in its slot (the in-place cache; see :meth:`place`).
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_tokens_in_flight: int,
        max_queue: int,
        eos_token_ids: Iterable[int],
        stats: GenerationStatsRecorder,
        prefill_padding: float = 0.25,
        cost: CompactionCost | None = None,
        clock: Callable[[], float] = time.monotonic,
        idle_wait_s: float = IDLE_WAIT_S,
        slots: bool = False,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.slots = slots
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_queue = max_queue
        self.prefill_padding = prefill_padding
        self.cost = cost if cost is not None else CompactionCost()
        self.clock = clock
        self._eos = frozenset(eos_token_ids)
        self._stats = stats
        self._idle_wait_s = idle_wait_s
        # Shared between callers and the step loop: guarded by _lock.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[GenerationRequest] = deque()
        self._state = _OPEN  # open -> draining | aborting -> closed
        # The step loop's only: one request per cache row; rows that left may linger (see place).
        self.rows: list[GenerationRequest] = []

    # -- the callers' side ---------------------------------------------------------------
    def put(self, req: GenerationRequest) -> None:
        """Queue ``req``; :class:`QueueFullError` or :class:`SessionClosedError` if it cannot wait."""
        self.put_many([req])

    def put_many(self, reqs: Sequence[GenerationRequest]) -> None:
        """Queue ``reqs`` (the choices of one prompt) together, next to each other, or none of them."""
        with self._lock:
            if self._state != _OPEN:
                raise SessionClosedError("the generator is closed")
            if len(self._pending) + len(reqs) > self.max_queue:
                self._stats.count("rejected")
                raise QueueFullError(len(self._pending), self.max_queue)
            self._pending.extend(reqs)
            self._stats.count("submitted", len(reqs))
            self._wake.notify()

    def close(self, drain: bool) -> None:
        """Stop accepting; ``drain`` lets queued and active requests finish, else they fail."""
        with self._lock:
            if self._state == _OPEN:
                self._state = _DRAINING if drain else _ABORTING
            elif self._state == _DRAINING and not drain:
                self._state = _ABORTING
            self._wake.notify_all()

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._state != _OPEN

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- the step loop's side ------------------------------------------------------------
    def live(self) -> list[int]:
        """Indices of the rows still generating (the others left and are not yet dropped)."""
        return [i for i, r in enumerate(self.rows) if not r.done]

    def admit(self) -> tuple[list[GenerationRequest], bool]:
        """Wait for work, drop dead pending requests, admit oldest-first under the limits.

        Returns the admitted requests and whether the loop should stop (closed, and
        nothing is left to do). Closing without draining fails everything here.
        """
        dropped: list[tuple[GenerationRequest, BaseException]] = []
        admitted: list[GenerationRequest] = []
        alive = [r for r in self.rows if not r.done]
        with self._lock:
            if not alive:
                self._wake.wait_for(lambda: bool(self._pending) or self._state != _OPEN, timeout=self._idle_wait_s)
            if self._state == _ABORTING:
                err = SessionClosedError("the generator was closed without draining")
                dropped = [(r, err) for r in [*self._pending, *alive]]
                self._pending.clear()
                self.rows = []
                stop = True
            else:
                dropped = self._drop_dead_pending()
                rows, reserved = len(alive), sum(r.reserved_tokens for r in alive)
                while self._pending and rows < self.max_batch_size:
                    head = self._pending[0]
                    if reserved + head.reserved_tokens > self.max_tokens_in_flight:
                        break  # oldest first: nobody overtakes the head of the queue
                    admitted.append(self._pending.popleft())
                    rows += 1
                    reserved += head.reserved_tokens
                stop = self._state == _DRAINING and not self._pending and not alive and not admitted
        for req, exc in dropped:
            self.fail(req, exc)
        return admitted, stop

    def _drop_dead_pending(self) -> list[tuple[GenerationRequest, BaseException]]:
        """Under the lock: take cancelled and expired requests out of the queue."""
        now = self.clock()
        dropped: list[tuple[GenerationRequest, BaseException]] = []
        waiting: deque[GenerationRequest] = deque()
        for req in self._pending:
            if req.future.cancelled():
                dropped.append((req, CANCELLED))
            elif req.deadline is not None and now >= req.deadline:
                waited = now - req.submitted_at
                late = RequestTimeoutError(
                    f"request {req.id}: deadline passed after {waited:.3f}s while queued; it was not run"
                )
                dropped.append((req, late))
            else:
                waiting.append(req)
        self._pending = waiting
        return dropped

    def reap(self) -> list[int]:
        """Indices of the rows that stay: not finished, not cancelled, not past their deadline
        (those are settled here; their rows are freed by the next placement)."""
        now = self.clock()
        keep: list[int] = []
        for i, req in enumerate(self.rows):
            if req.done:
                continue
            if req.future.cancelled():
                self.fail(req, CANCELLED)
            elif req.deadline is not None and now >= req.deadline:
                self.time_out(req, now)
            else:
                keep.append(i)
        return keep

    def prefill_groups(self, reqs: Sequence[GenerationRequest]) -> list[list[GenerationRequest]]:
        """Group prompts of similar length so a group's padding stays under ``prefill_padding``."""
        ordered = sorted(reqs, key=lambda r: r.prompt.shape[0])
        groups: list[list[GenerationRequest]] = []
        for req in ordered:
            if groups:
                group = groups[-1]
                longest = req.prompt.shape[0]
                real = sum(r.prompt.shape[0] for r in group) + longest
                if longest * (len(group) + 1) <= real * (1.0 + self.prefill_padding):
                    group.append(req)
                    continue
            groups.append([req])
        return groups

    def place(
        self,
        keep: list[int],
        joined: list[GenerationRequest],
        joined_lens: list[int],
        cache_length: int,
        cache_bytes: Callable[[], int],
    ) -> Placement:
        """Seat the rows that join (``joined``, their cache lengths ``joined_lens``) and
        decide whether rows that left are dropped; returns what the cache must do.

        A full cache copy costs several decode steps on a large cache, so: joining rows
        take the slots of rows that left, in place, when there are enough and the cache
        is long enough; otherwise one rebuild drops the rows that left and stacks the
        new ones. Rows that left and are not replaced stay in the batch, unread, until
        the compute they waste (a share of each step, for the steps the others still
        have to go) outweighs the copy that drops them.
        """
        if self.slots:
            return self._place_in_slots(keep, joined, cache_bytes)
        rows = self.rows
        kept = set(keep)
        free = [i for i in range(len(rows)) if i not in kept]
        if not keep and not joined:
            self.rows = []
            return Placement(reset=True)
        plan = Placement()
        incoming = list(joined)
        if incoming and len(incoming) <= len(free) and all(n <= cache_length for n in joined_lens):
            plan.slots = free[: len(incoming)]
            for req, slot in zip(incoming, plan.slots, strict=True):
                rows[slot] = req
            self._stats.count("slot_reuses", len(incoming))
            keep = sorted(keep + plan.slots)
            free = free[len(incoming) :]
            incoming = []
        if incoming or (free and self._worth_compacting(keep, free, cache_bytes())):
            plan.rebuild, plan.append = keep, bool(incoming)
            plan.copy_bytes = cache_bytes() * len(keep) // max(1, len(rows))
            self.rows = [rows[i] for i in keep] + incoming
            self._stats.count("cache_copies")
        return plan

    def _place_in_slots(
        self, keep: list[int], joined: list[GenerationRequest], cache_bytes: Callable[[], int]
    ) -> Placement:
        """:meth:`place` on the in-place cache: nothing is rebuilt. Joining rows take the
        lowest free slots (then new ones at the end); free slots at the end are dropped for
        free; rows above the live count move down into the free slots below it when the
        compute those slots waste (every step runs them) outweighs copying the rows."""
        rows = list(self.rows)
        kept = set(keep)
        if not keep and not joined:
            self.rows = []
            return Placement(reset=True)
        free = [i for i in range(len(rows)) if i not in kept]
        slots = free[: len(joined)] + list(range(len(rows), len(rows) + max(0, len(joined) - len(free))))
        rows += joined[len(free) :]
        for req, slot in zip(joined, slots, strict=True):
            rows[slot] = req
        self._stats.count("slot_reuses", min(len(joined), len(free)))
        holes = free[len(joined) :]
        plan = Placement(slots=slots, free=holes)
        live = len(rows) - len(holes)
        movers = [i for i in range(live, len(rows)) if i not in set(holes)]
        if movers and self._worth_moving(len(rows), len(movers), len(holes), cache_bytes()):
            plan.moves = list(zip(movers, [h for h in holes if h < live], strict=True))
            plan.copy_bytes = cache_bytes() * len(movers) // max(1, live)
            for src, dst in plan.moves:
                rows[dst] = rows[src]
            del rows[live:]
            self._stats.count("row_moves", len(movers))
        else:
            while rows and len(rows) - 1 in set(holes):
                rows.pop()
        self.rows = rows
        plan.rows = len(rows)
        plan.capacity = max((r.reserved_tokens for r in rows if not r.done), default=0)
        return plan

    def _worth_moving(self, rows: int, movers: int, free: int, cache_bytes: int) -> bool:
        live = [r for r in self.rows if not r.done]
        steps_left = sum(r.max_new_tokens - len(r.generated) for r in live) / max(1, len(live))
        return self.cost.worth_moving(rows, free, steps_left, cache_bytes * movers // max(1, len(live)))

    def _worth_compacting(self, keep: list[int], free: list[int], cache_bytes: int) -> bool:
        if not keep:
            return True
        # steps the surviving rows still have to go, at most (stop strings and EOS end some sooner)
        steps_left = sum(self.rows[i].max_new_tokens - len(self.rows[i].generated) for i in keep) / len(keep)
        return self.cost.worth_compacting(len(keep) + len(free), len(free), steps_left, cache_bytes)

    # -- outcomes ------------------------------------------------------------------------
    def next_token(self, req: GenerationRequest, logits: Any) -> bool:
        """Choose ``req``'s next token from its last-position ``logits`` and record it; True
        when it is done (finished, or failed: non-finite logits fail this request only)."""
        return self.next_tokens([req], logits[None], [0])[0]

    def next_tokens(self, reqs: Sequence[GenerationRequest], logits: Any, rows: Sequence[int]) -> list[bool]:
        """Choose and record the next token of each ``reqs[j]`` from ``logits[rows[j]]``
        (``[R, vocab]``): rows without extras on the fast path, the others processed
        together (:func:`~.processors.choose_rows`). Whether each is done."""
        choices = choose_rows([r.params for r in reqs], [r.state for r in reqs], [r.rng for r in reqs], logits, rows)
        done: list[bool] = []
        for req, (token, logprob) in zip(reqs, choices, strict=True):
            if isinstance(token, InferenceError):
                self.fail(req, token)
                done.append(True)
            else:
                done.append(self.record_token(req, token, logprob))
        return done

    def finish_without_tokens(self, req: GenerationRequest) -> None:
        """Settle a request that asked for no new tokens (``max_new_tokens=0``: prompt logprobs only)."""
        req.done = True
        self._settle_counted(req, "completed", result=req.completion("length", self.clock()))

    def record_token(self, req: GenerationRequest, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Record one generated token of ``req``; settle it and return True when it is done."""
        if req.first_token_at is None:
            req.first_token_at = self.clock()
        req.generated.append(token)
        if req.state is not None:
            req.state.observe(token)
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        self._stats.count("generated_tokens")
        params = req.params
        reason = None
        stop_id = token in params.stop_token_ids
        if stop_id or (token in self._eos and not params.ignore_eos):
            reason = "stop"
        # A stop token's own text is left out, as vLLM does, unless include_stop_str_in_output.
        text = reason is None or (stop_id and params.include_stop_str_in_output)
        # vLLM checks stop strings from the first token past min_tokens, in the new text only
        check_stop = len(req.generated) > params.min_tokens
        delta, stopped = req.tracker.push(token, check_stop) if text else ("", False)
        if stopped:
            reason = "stop"
        elif reason is None and len(req.generated) >= req.max_new_tokens:
            reason = "length"
        if reason is not None:
            delta += req.tracker.finish(check_stop)
            if req.tracker.stop_string is not None:  # completed in the tail held back till now
                reason = "stop"
        if req.on_token is not None:
            try:
                req.on_token(StreamToken(token, delta, len(req.generated) - 1, reason, logprob, req.choice))
            except Exception as exc:
                self.fail(req, exc)
                return True
        if reason is not None:
            req.done = True
            self._settle_counted(req, "completed", result=req.completion(reason, self.clock()))
            return True
        return False

    def time_out(self, req: GenerationRequest, now: float) -> None:
        err = RequestTimeoutError(
            f"request {req.id}: deadline passed after {now - req.submitted_at:.3f}s with "
            f"{len(req.generated)} of {req.max_new_tokens} tokens generated"
        )
        err.partial = req.completion("timeout", now)  # type: ignore[attr-defined]
        self.fail(req, err)

    def fail(self, req: GenerationRequest, err: BaseException) -> None:
        """End ``req`` with ``err`` (:data:`CANCELLED`: the caller cancelled it)."""
        req.done = True
        if err is CANCELLED or req.future.cancelled():
            self._stats.outcome("cancelled")
            return
        self._settle_counted(req, "timed_out" if isinstance(err, RequestTimeoutError) else "failed", error=err)

    def fail_everything(self, err: BaseException) -> None:
        """The step loop broke: fail every request still queued or active, refuse new ones."""
        with self._lock:
            self._state = _CLOSED
            pending = list(self._pending)
            self._pending.clear()
        for req in [*self.rows, *pending]:
            if not req.done:
                self.fail(req, err)
        self.rows = []

    def stopped(self) -> None:
        """The step loop has ended."""
        with self._lock:
            self._state = _CLOSED

    def publish(self, cache_length: int) -> None:
        """Make the batch as it is now visible to ``stats()``."""
        alive = [r for r in self.rows if not r.done]
        self._stats.active(len(alive), sum(r.reserved_tokens for r in alive), cache_length)

    def _settle_counted(self, req: GenerationRequest, key: str, *, result: Any = None, error: Any = None) -> None:
        # Counted before settling: the caller may read stats() as soon as its future is done.
        self._stats.outcome(key, error)
        if not settle(req.future, result=result, error=error):
            self._stats.recount(key, error)  # cancelled meanwhile
