"""Concurrency correctness: every result equals its unbatched run; none lost or misrouted.

The echo model's output rows encode their input rows exactly (request id * 1000 +
row * 100 + position), so any mixed-up row, wrong trim or lost result shows up as an
inequality. All assertions run in the main thread.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import BatchedSession

THREADS = 32
PER_THREAD = 70  # 32 x 70 = 2240 requests


def make_feed(rid: int, length: int, rows: int) -> dict[str, np.ndarray]:
    ids = (rid * 1000 + np.arange(rows)[:, None] * 100 + np.arange(length)[None, :]).astype(np.int64)
    mask = np.ones((rows, length), np.int64)
    mask[:, length - (rid % 3) :] = 0 if length > 3 else 1  # some masked tails
    extra = np.stack([np.full(3, rid + r, np.float32) for r in range(rows)])
    return {"input_ids": ids, "attention_mask": mask, "extra": extra}


def run_threads(bs: BatchedSession, feeds: list[dict[str, np.ndarray]]) -> list:
    results: list = [None] * len(feeds)
    errors: list[BaseException] = []

    def client(start: int) -> None:
        try:
            for i in range(start, len(feeds), THREADS):
                results[i] = bs.run(None, feeds[i])
        except BaseException as exc:  # collected, asserted in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    return results


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_threads_every_result_equals_unbatched(echo_path, workers, no_thread_leak):
    rng = np.random.default_rng(workers)
    feeds = [make_feed(i, int(rng.integers(1, 40)), int(rng.integers(1, 5))) for i in range(THREADS * PER_THREAD)]
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    with BatchedSession(str(echo_path), max_batch_size=16, workers=workers) as bs:
        results = run_threads(bs, feeds)
        stats = bs.stats()
    mismatched = []
    for i, (feed, got) in enumerate(zip(feeds, results, strict=True)):
        want = plain.run(None, feed)
        assert got is not None, f"request {i} lost"
        for g, w in zip(got, want, strict=True):
            if g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(g, w):
                mismatched.append(i)
    assert not mismatched, f"{len(mismatched)} misrouted/mismatched results, first {mismatched[:5]}"
    assert stats.completed == len(feeds) and stats.failed == 0
    assert stats.batches < len(feeds), "nothing was batched"
    assert max(stats.rows_histogram) <= 16


def test_float_model_batched_equals_unbatched_within_tolerance(embed_path):
    rng = np.random.default_rng(7)
    feeds = []
    for _ in range(THREADS * 20):
        n = int(rng.integers(1, 30))
        feeds.append(
            {
                "input_ids": rng.integers(0, 100, (1, n)).astype(np.int64),
                "attention_mask": np.ones((1, n), np.int64),
            }
        )
    plain = ort.InferenceSession(str(embed_path), providers=["CPUExecutionProvider"])
    with BatchedSession(str(embed_path)) as bs:
        results = run_threads(bs, feeds)
    for feed, got in zip(feeds, results, strict=True):
        want = plain.run(None, feed)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_asyncio_thousand_tasks(echo_path, no_thread_leak):
    rng = np.random.default_rng(11)
    feeds = [make_feed(i, int(rng.integers(1, 33)), int(rng.integers(1, 5))) for i in range(1200)]
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])

    async def main(bs: BatchedSession) -> list:
        return await asyncio.gather(*(bs.run_async(None, f) for f in feeds))

    with BatchedSession(str(echo_path), max_batch_size=32, max_queue=2000) as bs:
        results = asyncio.run(main(bs))
        stats = bs.stats()
    for feed, got in zip(feeds, results, strict=True):
        for g, w in zip(got, plain.run(None, feed), strict=True):
            assert g.dtype == w.dtype and np.array_equal(g, w)
    assert stats.mean_rows_per_batch > 2


def test_submit_futures_and_output_subsets(echo_path):
    rng = np.random.default_rng(3)
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    choices = [["hidden"], ["pooled", "extra_out"], ["extra_out", "hidden"], None]
    with BatchedSession(str(echo_path)) as bs:
        jobs = []
        for i in range(400):
            feed = make_feed(i, int(rng.integers(1, 20)), 1)
            names = choices[i % len(choices)]
            jobs.append((feed, names, bs.submit(feed, names)))
        for feed, names, fut in jobs:
            got = fut.result(timeout=60)
            want = plain.run(names, feed)
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert np.array_equal(g, w)
