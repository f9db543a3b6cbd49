"""run_async on an event loop (ortbatch.runtime.bridge): a loop turn's requests are
queued together, results come back a burst at a time, and every request still ends in
its own outputs or its own typed error."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import BatchedSession, InvalidInputError, QueueFullError, RequestTimeoutError, SessionClosedError
from ortbatch.runtime import bridge
from ortbatch.runtime.scheduler import Slot
from tests.runtime.helpers import GatedSession


def rid_of(outputs: list[np.ndarray]) -> int:
    """Which request an answer belongs to (the echo model doubles ``extra``)."""
    return int(outputs[2][0, 0]) // 2


def feed(rid: int, length: int = 4) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full((1, length), rid, np.int64),
        "attention_mask": np.ones((1, length), np.int64),
        "extra": np.full((1, 3), rid, np.float32),
    }


class CountingLoop(asyncio.SelectorEventLoop):
    """Counts the wake-ups other threads send it."""

    def __init__(self) -> None:
        super().__init__()
        self.woken = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.woken += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def gated(echo_path, **kw) -> tuple[GatedSession, BatchedSession]:
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    return sess, BatchedSession(sess, workers=1, **kw)


def test_one_turns_requests_are_one_batch_and_one_wake_up(echo_path):
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    loop = CountingLoop()
    with BatchedSession(str(echo_path), workers=1, max_batch_size=32, latency_session=False) as s:

        async def main() -> list:
            return await asyncio.gather(*(s.run_async(None, feed(i)) for i in range(20)))

        try:
            results = loop.run_until_complete(main())
        finally:
            loop.close()
        stats = s.stats()
    for i, got in enumerate(results):
        for g, w in zip(got, plain.run(None, feed(i)), strict=True):
            assert g.dtype == w.dtype and np.array_equal(g, w)
    # queued by one put_many, so the idle worker could not start on the first alone
    assert (stats.batches, stats.rows) == (1, 20)
    # 20 results, one batch: the loop was woken once for all of them, at the batch's end
    # (however busy the machine: a wake-up at the first result let a loaded loop take it
    # alone, and be woken again for each of the others, up to 20)
    assert loop.woken == 1


def test_a_full_queue_refuses_only_the_requests_beyond_its_room(echo_path):
    sess, s = gated(echo_path, max_queue=3)
    with s:
        first = s.submit(feed(1))
        assert sess.entered.wait(10)

        async def main() -> list:
            tasks = [asyncio.ensure_future(s.run_async(None, feed(10 + i))) for i in range(5)]
            await asyncio.sleep(0.05)  # all five offered in one turn; three fit
            sess.gate.set()
            return await asyncio.gather(*tasks, return_exceptions=True)

        outcomes = asyncio.run(main())
        first.result(10)
    ok = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(ok) == 3 and len(refused) == 2
    assert all(isinstance(e, QueueFullError) and (e.queued, e.max_queue) == (3, 3) for e in refused)
    assert refused[0] is not refused[1]  # each its own exception
    # the oldest three ran, in order, each with its own rows
    assert [rid_of(o) for o in ok] == [10, 11, 12]
    assert isinstance(outcomes[3], QueueFullError) and isinstance(outcomes[4], QueueFullError)


def test_closing_queues_and_drains_what_this_turn_started(echo_path):
    with BatchedSession(str(echo_path), workers=1) as s:

        async def main() -> list:
            tasks = [asyncio.ensure_future(s.run_async(None, feed(i))) for i in range(6)]
            await asyncio.sleep(0)  # the tasks have started: their requests wait for the next turn
            s.close(drain=True)  # on the loop's own thread, before that turn
            return await asyncio.gather(*tasks)

        results = asyncio.run(main())
    assert [rid_of(r) for r in results] == list(range(6))


def test_a_deadline_that_passes_while_running_still_gets_the_result(echo_path):
    sess, s = gated(echo_path)
    with s:

        async def main() -> list:
            task = asyncio.ensure_future(s.run_async(None, feed(5), timeout_s=0.05))
            await asyncio.to_thread(sess.entered.wait, 10)
            await asyncio.sleep(0.15)  # the deadline passes while the batch runs
            sess.gate.set()
            return await task

        out = asyncio.run(main())
    assert rid_of(out) == 5
    assert not s.stats().errors


def test_a_deadline_that_passes_while_queued_is_a_timeout_and_never_runs(echo_path):
    sess, s = gated(echo_path)
    with s:
        first = s.submit(feed(1))
        assert sess.entered.wait(10)

        async def main() -> None:
            with pytest.raises(RequestTimeoutError):
                await s.run_async(None, feed(2), timeout_s=0.05)

        asyncio.run(main())
        sess.gate.set()
        first.result(10)
        s.run(None, feed(3))
        assert 2 not in {int(b["input_ids"].max()) for b in sess.batches}
        assert s.stats().errors == {"RequestTimeoutError": 1}


def test_a_result_for_a_closed_loop_is_dropped_and_the_session_serves_on(echo_path):
    sess, s = gated(echo_path)
    with s:
        loop = asyncio.new_event_loop()

        async def abandon() -> None:
            task = asyncio.ensure_future(s.run_async(None, feed(4)))
            await asyncio.to_thread(sess.entered.wait, 10)  # running: cancelling cannot drop it
            task.cancel()

        loop.run_until_complete(abandon())
        loop.close()
        sess.gate.set()  # the worker settles it; its loop is gone
        out = s.run(None, feed(6), timeout_s=10)
        assert rid_of(out) == 6
        assert s.stats().failed == 0


def test_many_loops_on_many_threads_each_get_their_own_rows(echo_path):
    """Four threads, each its own loop, 150 requests each at once: every answer is its own
    request's (a result delivered through the wrong loop's mailbox would show here)."""
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    errors: list[BaseException] = []
    with BatchedSession(str(echo_path), workers=2, max_batch_size=16, max_queue=1000) as s:

        def client(t: int) -> None:
            async def main() -> None:
                ids = [t * 1000 + i for i in range(150)]
                lengths = [2 + i % 7 for i in range(150)]
                got = await asyncio.gather(*(s.run_async(None, feed(r, n)) for r, n in zip(ids, lengths, strict=True)))
                for r, n, out in zip(ids, lengths, got, strict=True):
                    for g, w in zip(out, plain.run(None, feed(r, n)), strict=True):
                        assert g.shape == w.shape and np.array_equal(g, w), (r, n)

            try:
                asyncio.run(main())
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        assert s.stats().completed == 600


def test_closed_loops_leave_nothing_behind(echo_path):
    # this test's own loops, by weak reference: the mailboxes are shared by the whole process,
    # so loops other tests left alive must not decide it
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    with BatchedSession(str(echo_path), workers=1) as s:
        for i in range(5):
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(s.run_async(None, feed(i)))
            finally:
                loop.close()
            loops.append(weakref.ref(loop))
            del loop
        gc.collect()
        assert len(s._outboxes) == 0
        # nothing of the session's or the bridge's (outbox, mailbox, slot) keeps a closed loop
        assert [ref() for ref in loops] == [None] * 5


def test_submit_each_admits_or_refuses_each_request_on_its_own(echo_path):
    sess, s = gated(echo_path, max_queue=2)
    with s:
        first = s.submit(feed(1))
        assert sess.entered.wait(10)
        bad = {"input_ids": np.ones((1, 4), np.int32)}
        out = s.submit_each(
            [(feed(2), None, None), (bad, None, None), (feed(3), ["extra_out"], None), (feed(4), None, None)]
        )
        assert isinstance(out[1], InvalidInputError) and "input_ids" in str(out[1])
        assert isinstance(out[3], QueueFullError) and (out[3].queued, out[3].max_queue) == (2, 2)
        sess.gate.set()
        first.result(10)
        assert rid_of(out[0].result(10)) == 2
        (extra,) = out[2].result(10)
        assert int(extra[0, 0]) // 2 == 3
    closed = s.submit_each([(feed(5), None, None)])
    assert isinstance(closed[0], SessionClosedError)


class _Recording(Slot):
    """A slot that records how it was settled (as the engine's _Answer posts itself)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def _on_settled(self) -> None:
        self.events.append("error" if self._exc is not None else "result")

    def _on_cancelled(self) -> None:
        self.events.append("cancelled")


def test_submit_each_settles_the_callers_own_slots(echo_path):
    sess, s = gated(echo_path, max_queue=2)
    with s:
        first = s.submit(feed(1))
        assert sess.entered.wait(10)
        slots = [_Recording() for _ in range(4)]
        bad = {"input_ids": np.ones((1, 4), np.int32)}
        requests = [(feed(2), None, None), (bad, None, None), (feed(3), None, None), (feed(4), None, None)]
        out = s.submit_each(requests, slots=slots)
        assert out[0] is slots[0] and out[2] is slots[2]
        assert isinstance(out[1], InvalidInputError) and isinstance(out[3], QueueFullError)
        assert slots[2].cancel()  # still queued: dropped, and told so
        sess.gate.set()
        first.result(10)
        deadline = time.monotonic() + 10
        while not slots[0].events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slots[0].events == ["result"] and rid_of(slots[0]._result) == 2
        assert slots[2].events == ["cancelled"]
        assert slots[1].events == [] and slots[3].events == []  # refused: never settled, the error says it
        with pytest.raises(ValueError, match="2 slots for 1 requests"):
            s.submit_each([(feed(5), None, None)], slots=[_Recording(), _Recording()])


def test_a_batch_settled_inside_one_wake_up_wakes_its_loop_once_at_the_end():
    loop = CountingLoop()
    try:
        box = bridge.mailbox_for(loop)
        futures = [loop.create_future() for _ in range(3)]
        seen: list[int] = []

        def worker() -> None:  # a worker thread settling a batch of three
            with bridge.one_wake_up():
                for i, fut in enumerate(futures):
                    box.post(fut, i, None)
                    seen.append(loop.woken)  # not woken while the batch is being settled
            seen.append(loop.woken)

        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        assert seen == [0, 0, 0, 1]
        loop.run_until_complete(asyncio.gather(*futures))
        assert [f.result() for f in futures] == [0, 1, 2]
    finally:
        loop.close()
