"""BatchedSession(warmup=True): the grid runs before the constructor returns, is not
counted as traffic, and the session reports ready only then; serve turns it on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ortbatch import BatchedSession
from ortbatch._ort import binding as binding_module
from ortbatch.runtime.warmup import warmup_grid


def test_warmup_runs_the_grid_before_ready_and_is_not_counted(echo_path, monkeypatch):
    shapes = []
    real = binding_module.DeviceRunner.run

    def spy(self, binding, feed, names):
        shapes.append(tuple(feed["input_ids"].shape))
        return real(self, binding, feed, names)

    monkeypatch.setattr(binding_module.DeviceRunner, "run", spy)
    with BatchedSession(str(echo_path), max_batch_size=4, warmup=True, latency_session=False) as bs:
        assert bs.ready and bs.warmup_s > 0
        assert set(shapes) == {(r, n) for r in (1, 4) for n in (1, 16, 128)}
        stats = bs.stats()
        assert stats.batches == 0 and stats.completed == 0  # warm-up is not traffic
        feed = {
            "input_ids": np.array([[3, 4]], np.int64),
            "attention_mask": np.ones((1, 2), np.int64),
            "extra": np.zeros((1, 3), np.float32),
        }
        assert bs.run(["pooled"], feed)[0].tolist() == [[7]]
    assert not bs.ready


def test_no_warmup_by_default(echo_path, monkeypatch):
    calls = []
    monkeypatch.setattr(binding_module.DeviceRunner, "run", lambda *a: calls.append(a))
    with BatchedSession(str(echo_path)) as bs:
        assert bs.warmup_s == 0.0 and bs.ready
    assert calls == []


def test_grid_includes_the_tensorrt_profile_opt_length(echo_path):
    with BatchedSession(str(echo_path), max_batch_size=32) as bs:
        trt = [["TensorrtExecutionProvider", {"trt_profile_opt_shapes": "input_ids:32x64,attention_mask:32x64"}]]
        grid = warmup_grid(bs.signature, 32, trt)
    assert (32, 64) in grid and (1, 1) in grid and (8, 16) in grid


def test_serve_warms_up_and_readiness_waits_for_it():
    from ortbatch.serve.served.model import ServedModel
    from ortbatch.serve.server import ServeConfig

    assert ServeConfig().session_kwargs()["warmup"] is True
    fake = SimpleNamespace(session=SimpleNamespace(closed=False, ready=False))
    assert ServedModel.ready.fget(fake) is False
    fake.session.ready = True
    assert ServedModel.ready.fget(fake) is True
