"""Deterministic batch formation: a gate holds the first batch while the test queues the
rest, so what the next batch can contain is fixed before it forms. No sleeps."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import BatchedSession
from tests.runtime.helpers import GatedSession


def feed(rid: int, length: int, rows: int = 1) -> dict[str, np.ndarray]:
    ids = np.full((rows, length), rid, np.int64)
    return {
        "input_ids": ids,
        "attention_mask": np.ones((rows, length), np.int64),
        "extra": np.zeros((rows, 3), np.float32),
    }


def ids_in(batch: dict[str, np.ndarray]) -> list[int]:
    """Request ids of a batch's rows, in order (ids are the fill value; pads are 0)."""
    return [int(row.max()) for row in batch["input_ids"]]


@pytest.fixture
def gated(echo_path):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    made: list[BatchedSession] = []

    def make(**kw) -> tuple[BatchedSession, GatedSession]:
        bs = BatchedSession(sess, workers=1, **kw)
        made.append(bs)
        return bs, sess

    yield make
    sess.gate.set()
    for bs in made:
        bs.close()


def block_worker(bs: BatchedSession, sess: GatedSession):
    """Submit request 1 and wait until the worker is inside its run (holding the gate)."""
    fut = bs.submit(feed(1, 4))
    assert sess.entered.wait(10)
    return fut


def test_rows_cap_counts_rows_not_requests(gated):
    bs, sess = gated(max_batch_size=8)
    first = block_worker(bs, sess)
    futs = [bs.submit(feed(10 + i, 4, rows=3)) for i in range(6)]  # 18 rows
    sess.gate.set()
    for f in [first, *futs]:
        f.result(10)
    later = sess.batches[1:]
    assert all(len(b["input_ids"]) <= 8 for b in later)
    assert [len(b["input_ids"]) for b in later] == [6, 6, 6]  # two 3-row requests fit, a third would not


def test_padded_token_cap(gated):
    bs, sess = gated(max_batch_size=32, max_batch_tokens=40)
    first = block_worker(bs, sess)
    futs = [bs.submit(feed(10 + i, 10)) for i in range(10)]
    sess.gate.set()
    for f in [first, *futs]:
        f.result(10)
    for b in sess.batches[1:]:
        assert b["input_ids"].size <= 40
    assert [len(b["input_ids"]) for b in sess.batches[1:]] == [4, 4, 2]


def test_single_request_over_token_cap_still_runs_alone(gated):
    bs, sess = gated(max_batch_tokens=8)
    first = block_worker(bs, sess)
    big = bs.submit(feed(50, 20))
    small = bs.submit(feed(51, 2))
    sess.gate.set()
    assert big.result(10)[0].shape == (1, 20, 2)
    small.result(10)
    first.result(10)
    assert ids_in(sess.batches[1]) == [50]


def test_oldest_request_always_in_next_batch(gated):
    bs, sess = gated(max_batch_size=4)
    first = block_worker(bs, sess)
    oldest = bs.submit(feed(99, 60))  # long, unlike everything after it
    futs = [bs.submit(feed(10 + i, 3)) for i in range(12)]
    sess.gate.set()
    for f in [first, oldest, *futs]:
        f.result(10)
    assert 99 in ids_in(sess.batches[1])


def test_length_grouping_pads_less_than_fifo(gated):
    bs, sess = gated(max_batch_size=4)
    first = block_worker(bs, sess)
    lengths = [3, 40, 4, 38, 3, 41, 5, 39, 4, 40, 3, 37, 5, 42, 4, 36]
    futs = [bs.submit(feed(10 + i, n)) for i, n in enumerate(lengths)]
    sess.gate.set()
    for f in [first, *futs]:
        f.result(10)
    real = sum(lengths)
    grouped_padded = sum(b["input_ids"].size for b in sess.batches[1:])
    fifo_padded = sum(4 * max(lengths[i : i + 4]) for i in range(0, len(lengths), 4))
    assert sum(len(b["input_ids"]) for b in sess.batches[1:]) == len(lengths)
    assert grouped_padded < fifo_padded
    assert 1 - real / grouped_padded < 0.25 < 1 - real / fifo_padded


def test_greedy_when_idle_no_waiting(echo_path):
    with BatchedSession(str(echo_path), workers=1) as bs:
        for i in range(5):
            bs.run(None, feed(i + 1, 3))
        s = bs.stats()
    assert s.batches == 5 and s.rows_histogram == {1: 5}


def test_max_delay_waits_for_a_fuller_batch(echo_path):
    # A full batch (2 rows) goes at once; the delay only applies while it is not full.
    with BatchedSession(str(echo_path), workers=1, max_batch_size=2, max_delay_ms=60_000) as bs:
        a = bs.submit(feed(1, 3))
        b = bs.submit(feed(2, 5))
        a.result(30), b.result(30)
        assert bs.stats().rows_histogram == {2: 1}


def test_max_delay_lone_request_waits_at_least_the_delay(echo_path):
    with BatchedSession(str(echo_path), workers=1, max_delay_ms=150) as bs:
        bs.run(None, feed(1, 3))
        waited = bs.stats().queue_wait_ms["max"]
    assert waited >= 150 * 0.99  # a lower bound: the clock cannot run backwards


def test_close_drains_a_delayed_request_without_waiting_out_the_delay(echo_path):
    bs = BatchedSession(str(echo_path), workers=1, max_delay_ms=600_000)
    fut = bs.submit(feed(1, 3))
    bs.close(drain=True, timeout=30)
    assert fut.result(0)[0].shape == (1, 3, 2)
