"""Batch formation policy and queue, without ONNX Runtime and without threads."""

from __future__ import annotations

import pytest

from ortbatch.errors import QueueFullError, RequestTimeoutError, SessionClosedError
from ortbatch.runtime.scheduler import BatchPolicy, CostModel, Request, Scheduler


class FixedCost(CostModel):
    def __init__(self, a: float, b: float) -> None:
        super().__init__()
        self.a, self.b, self.c = a, b, 0.0

    def observe(self, rows: int, length: int, seconds: float) -> None:  # frozen
        pass


def reqs(lengths, rows=None):
    rows = rows or [1] * len(lengths)
    return [Request(item=i, rows=r, length=n) for i, (n, r) in enumerate(zip(lengths, rows, strict=True))]


def lengths_of(pending, picked):
    return [pending[i].length for i in picked]


def test_oldest_always_included_and_window_is_similar_lengths():
    pol = BatchPolicy(max_rows=4, cost=FixedCost(a=32, b=1))
    pending = reqs([50, 3, 4, 49, 5, 48, 3, 51])
    picked = pol.select(pending)
    assert 0 in picked
    assert sorted(lengths_of(pending, picked)) == [48, 49, 50, 51]


def test_equal_lengths_fill_to_the_row_cap_fifo():
    pol = BatchPolicy(max_rows=5, cost=FixedCost(a=32, b=1))
    pending = reqs([8] * 9)
    assert pol.select(pending) == [0, 1, 2, 3, 4]


def test_rows_cap_counts_rows():
    pol = BatchPolicy(max_rows=6, cost=FixedCost(a=1000, b=1))
    pending = reqs([8, 8, 8, 8], rows=[4, 3, 2, 1])
    picked = pol.select(pending)
    assert sum(pending[i].rows for i in picked) <= 6 and 0 in picked


def test_token_cap_is_hard():
    pol = BatchPolicy(max_rows=32, max_tokens=100, cost=FixedCost(a=1e6, b=1))
    pending = reqs([10, 30, 20, 25, 12, 11])
    picked = pol.select(pending)
    assert len(picked) * max(lengths_of(pending, picked)) <= 100 and 0 in picked


def test_high_fixed_cost_takes_everything_low_fixed_cost_groups():
    pending = reqs([10, 100, 12, 90, 11, 95])
    big = BatchPolicy(max_rows=32, cost=FixedCost(a=1e6, b=1)).select(pending)
    assert big == list(range(6))
    small = BatchPolicy(max_rows=32, cost=FixedCost(a=0.0, b=1)).select(pending)
    assert sorted(lengths_of(pending, small)) == [10]  # no fixed cost: padding is pure loss


def fifo_padding(lengths, cap):
    return sum(cap * max(lengths[i : i + cap]) for i in range(0, len(lengths), cap))


def test_grouping_pads_less_than_fifo_on_a_fixed_arrival_set():
    lengths = [5, 60, 7, 55, 6, 64, 5, 58, 8, 61, 6, 57, 7, 62, 5, 59]
    pol = BatchPolicy(max_rows=4, cost=FixedCost(a=64, b=1))
    sched = Scheduler(pol, max_queue=100)
    for r in reqs(lengths):
        sched.put(r)
    padded = 0
    batches = []
    while sched.queued:
        batch = sched.take_and_finish()
        batches.append([r.length for r in batch])
        padded += len(batch) * max(r.length for r in batch)
    assert sum(len(b) for b in batches) == len(lengths)
    assert padded < fifo_padding(lengths, 4)
    assert batches[0][0] == 5  # oldest first


def test_cost_model_learns_affine_costs():
    cm = CostModel(refit_every=4)
    for rows in (1, 2, 4, 8, 16):
        for length in (8, 16, 64, 128):
            cm.observe(rows, length, 0.001 + 2e-6 * rows * length)
    assert cm.fitted
    assert cm.a == pytest.approx(0.001, rel=0.05)
    assert cm.predict(10, 50) == pytest.approx(0.001 + 2e-6 * 500, rel=0.05)


def test_cost_model_ignores_nonsense_fits():
    cm = CostModel(refit_every=4)
    for _ in range(8):
        cm.observe(4, 8, 0.0)  # all zero times: no usable slope
    assert not cm.fitted and cm.b > 0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_queue_full_and_closed():
    sched = Scheduler(BatchPolicy(), max_queue=2)
    sched.put(Request(0, 1, 1))
    sched.put(Request(1, 1, 1))
    with pytest.raises(QueueFullError) as info:
        sched.put(Request(2, 1, 1))
    assert info.value.queued == 2
    dropped = sched.close(drain=False)
    assert len(dropped) == 2
    with pytest.raises(SessionClosedError):
        sched.put(Request(3, 1, 1))
    assert sched.take_and_finish() is None


def test_cancelled_requests_free_queue_space_and_are_skipped():
    sched = Scheduler(BatchPolicy(), max_queue=2)
    a, b = Request(0, 1, 1), Request(1, 1, 1)
    sched.put(a)
    sched.put(b)
    a.future.cancel()
    sched.put(Request(2, 1, 1))  # room again
    batch = sched.take_and_finish()
    assert [r.item for r in batch] == [1, 2]


def test_expired_requests_are_failed_not_run():
    clock = Clock()
    sched = Scheduler(BatchPolicy(), max_queue=10, clock=clock)
    old = Request(0, 1, 1, deadline=clock.t + 1)
    new = Request(1, 1, 1, deadline=clock.t + 100)
    sched.put(old)
    sched.put(new)
    clock.t += 5
    batch = sched.take_and_finish()
    assert [r.item for r in batch] == [1]
    with pytest.raises(RequestTimeoutError):
        old.future.result(0)


def test_drain_then_stop():
    sched = Scheduler(BatchPolicy(max_rows=2), max_queue=10)
    for i in range(3):
        sched.put(Request(i, 1, 1))
    sched.close(drain=True)
    assert [r.item for r in sched.take_and_finish()] == [0, 1]
    assert [r.item for r in sched.take_and_finish()] == [2]
    assert sched.take_and_finish() is None


def test_cost_model_learns_superlinear_batches_and_then_prefers_moderate_ones():
    cm = CostModel(refit_every=4)
    truth = lambda r, n: 1e-4 + 1e-6 * r * n + 2e-10 * (r * n) ** 2  # noqa: E731
    for rows in (1, 2, 4, 8, 16, 32):
        for length in (8, 32, 64, 128):
            cm.observe(rows, length, truth(rows, length))
    assert cm.fitted and cm.d > 0
    assert cm.predict(32, 128) == pytest.approx(truth(32, 128), rel=0.05)
    # efficiency (real elements per second) peaks at a moderate batch, not the biggest
    eff = {n: n * 64 / cm.predict(n, 64) for n in range(1, 41)}
    peak = max(eff, key=eff.get)
    assert 1 < peak < 40
    picked = BatchPolicy(max_rows=64, cost=cm).select(reqs([64] * 40))
    assert picked == list(range(peak))  # equal lengths: FIFO, stopping at the peak


# -- LightFuture: the light future behind BatchedSession.run ------------------------------------
def test_slot_result_exception_and_timeout():
    import concurrent.futures
    import threading

    from ortbatch.runtime.scheduler import LightFuture

    s = LightFuture()
    with pytest.raises(concurrent.futures.TimeoutError):
        s.result(timeout=0.01)
    assert s.set_running_or_notify_cancel()
    assert not s.cancel()  # running: too late
    threading.Timer(0.05, s.set_result, args=([1, 2],)).start()
    assert s.result(timeout=5) == [1, 2]
    assert s.result() == [1, 2] and s.done()  # a second call returns the same
    with pytest.raises(concurrent.futures.InvalidStateError):
        s.set_result(3)

    e = LightFuture()
    e.set_running_or_notify_cancel()
    e.set_exception(RequestTimeoutError("late"))
    with pytest.raises(RequestTimeoutError, match="late"):
        e.result(0)


def test_slot_cancel_before_running():
    import concurrent.futures

    from ortbatch.runtime.scheduler import LightFuture

    s = LightFuture()
    assert s.cancel() and s.cancel() and s.cancelled() and s.done()
    assert not s.set_running_or_notify_cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        s.result(0)
    with pytest.raises(concurrent.futures.InvalidStateError):
        s.set_exception(RuntimeError())


def test_put_inline_claims_only_an_idle_scheduler():
    sched = Scheduler(BatchPolicy(), max_queue=10)
    assert sched.put(Request(0, 1, 1), inline_ok=True)  # idle: the caller runs it
    assert not sched.put(Request(1, 1, 1), inline_ok=True)  # one is running: queue
    assert sched.accepted == 2 and sched.queued == 1
    sched.finished()
    assert not sched.put(Request(2, 1, 1), inline_ok=True)  # something is queued: queue
    assert [r.item for r in sched.take_and_finish()] == [1, 2]
    assert sched.put(Request(3, 1, 1), inline_ok=True)
    delayed = Scheduler(BatchPolicy(max_delay_s=0.01), max_queue=10)
    assert not delayed.put(Request(0, 1, 1), inline_ok=True)  # max_delay asks for company


def test_selection_is_the_best_window_holding_the_oldest():
    """Against brute force over every contiguous window of the length-sorted queue that holds
    the oldest request and respects the caps: no heuristic shortcut may lose throughput."""
    import random

    def window_score(pol, chosen):
        rows = sum(r.rows for r in chosen)
        return sum(r.rows * r.length for r in chosen) / pol.cost.predict(rows, max(r.length for r in chosen))

    rng = random.Random(0)
    for _ in range(300):
        lo, hi = rng.choice([(8, 16), (8, 128), (1, 4)])
        pending = [Request(i, rng.choice([1, 1, 1, 2, 4]), rng.randint(lo, hi)) for i in range(rng.randint(2, 24))]
        cost = FixedCost(a=rng.choice([1, 10, 100, 1000]), b=1)
        cost.c, cost.d = rng.choice([0, 1e-3, 1e-2]), rng.choice([0, 0, 1e-4, 1e-3])
        pol = BatchPolicy(max_rows=rng.choice([4, 8, 32]), max_tokens=rng.choice([None, None, 200, 1000]), cost=cost)
        order = sorted(range(len(pending)), key=lambda x: pending[x].length)
        k = order.index(0)
        best = 0.0
        for i in range(k + 1):
            for j in range(k, len(pending)):
                chosen = [pending[x] for x in order[i : j + 1]]
                rows, longest = sum(r.rows for r in chosen), max(r.length for r in chosen)
                if (i, j) == (k, k) or (
                    rows <= pol.max_rows and (pol.max_tokens is None or rows * longest <= pol.max_tokens)
                ):
                    best = max(best, window_score(pol, chosen))
        picked = pol.select(pending)
        assert 0 in picked
        assert window_score(pol, [pending[x] for x in picked]) >= best * (1 - 1e-9)
