"""BatchedSession on CUDA: device IOBinding path, exact results under concurrency."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import BatchedSession
from tests.runtime.test_concurrency import make_feed

pytestmark = pytest.mark.gpu


def test_cuda_session_uses_device_binding_and_is_exact(echo_path):
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = [make_feed(i, int(rng.integers(1, 40)), int(rng.integers(1, 5))) for i in range(1000)]
    results: list = [None] * len(feeds)
    with BatchedSession(str(echo_path), providers="cuda", max_batch_size=32) as bs:
        assert bs.get_providers()[0] == "CUDAExecutionProvider"
        assert bs._executor.device == "cuda"

        def client(k: int) -> None:
            for i in range(k, len(feeds), 16):
                results[i] = bs.run(None, feeds[i])

        threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert bs.stats().mean_rows_per_batch > 1
    for feed, got in zip(feeds, results, strict=True):
        for g, w in zip(got, plain.run(None, feed), strict=True):
            assert g.dtype == w.dtype and np.array_equal(g, w)


def test_cuda_float_model_matches_cpu(embed_path):
    cpu = ort.InferenceSession(str(embed_path), providers=["CPUExecutionProvider"])
    with BatchedSession(str(embed_path), providers=["CUDAExecutionProvider", "CPUExecutionProvider"]) as bs:
        futs = []
        feeds = []
        for n in range(1, 40):
            f = {"input_ids": (np.arange(n, dtype=np.int64) % 100)[None], "attention_mask": np.ones((1, n), np.int64)}
            feeds.append(f)
            futs.append(bs.submit(f))
        for f, fut in zip(feeds, futs, strict=True):
            for g, w in zip(fut.result(60), cpu.run(None, f), strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
