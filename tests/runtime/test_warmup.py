"""BatchedSession(warmup=True): the grid runs before the constructor returns, is not
counted as traffic, and the session reports ready only then; serve turns it on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ortbatch import BatchedSession
from ortbatch._ort import binding as binding_module
from ortbatch.runtime.warmup import describe_grid, warmup_grid


def test_warmup_runs_the_grid_before_ready_and_is_not_counted(echo_path, monkeypatch):
    shapes = []
    real = binding_module.DeviceRunner.run

    def spy(self, binding, feed, names):
        shapes.append(tuple(feed["input_ids"].shape))
        return real(self, binding, feed, names)

    monkeypatch.setattr(binding_module.DeviceRunner, "run", spy)
    with BatchedSession(str(echo_path), max_batch_size=4, warmup=True, latency_session=False) as bs:
        assert bs.ready and bs.warmup_s > 0
        # on the CPU provider alone: the one smallest request (the grid buys nothing there)
        assert shapes == [(1, 1)]
        assert bs.warmup_plan == "1 shape (1x1 rows x tokens) on 1 session(s), CPUExecutionProvider"
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


def test_a_gpu_provider_gets_the_grid_and_the_cpu_alone_one_smallest_request(echo_path):
    with BatchedSession(str(echo_path), max_batch_size=4) as bs:
        gpu = warmup_grid(bs.signature, 4, (), ["CUDAExecutionProvider", "CPUExecutionProvider"])
        cpu = warmup_grid(bs.signature, 4, (), ["CPUExecutionProvider"])
    assert gpu == [(r, n) for r in (1, 4) for n in (1, 16, 128)]
    assert cpu == [(1, 1)]
    assert describe_grid(gpu) == "6 shapes (rows 1, 4 x lengths 1, 16, 128)"


def test_the_latency_session_is_warmed_too(echo_path, monkeypatch):
    runners = []
    real = binding_module.DeviceRunner.run

    def spy(self, binding, feed, names):
        runners.append(id(self))
        return real(self, binding, feed, names)

    monkeypatch.setattr(binding_module.DeviceRunner, "run", spy)
    with BatchedSession(str(echo_path), max_batch_size=4, warmup=True, latency_session=True) as bs:
        assert bs.latency_session is not None
        assert len(set(runners)) == 2 and len(runners) == 2, runners
        assert "on 2 session(s)" in bs.warmup_plan


def test_serve_warms_up_and_readiness_waits_for_it():
    from ortbatch.serve.served.model import ServedModel
    from ortbatch.serve.server import ServeConfig

    assert ServeConfig().session_kwargs()["warmup"] is True
    fake = SimpleNamespace(session=SimpleNamespace(closed=False, ready=False))
    assert ServedModel.ready.fget(fake) is False
    fake.session.ready = True
    assert ServedModel.ready.fget(fake) is True
