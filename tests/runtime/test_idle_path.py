"""The idle path: a lone ``run()`` executes on the caller's thread, a batch that runs
alone goes to the latency session, and neither overtakes or blocks queued work."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import BatchedSession
from ortbatch.runtime import session as session_mod
from ortbatch.runtime.executor import cpu_count

from .helpers import GatedSession


def feed(value: int, n: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full((1, n), value, np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "extra": np.zeros((1, 3), np.float32),
    }


def ids_of(out: list[np.ndarray]) -> np.ndarray:
    """The echo model's ``hidden[..., 0]``: the request's input_ids."""
    return out[0][..., 0]


class ThreadRecordingSession(GatedSession):
    """A GatedSession (open unless a test clears ``gate``) that also records which thread ran
    each batch and counts runs that have started (``running``)."""

    def __init__(self, sess: Any) -> None:
        super().__init__(sess)
        self.gate.set()
        self.threads: list[int] = []
        self.running = threading.Semaphore(0)

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.threads.append(threading.get_ident())
        self.running.release()
        return super().run(names, feed)

    def first_ids(self) -> list[list[int]]:
        """Each batch's first input_ids value per row (the echo feeds' request ids)."""
        return [[int(x) for x in batch["input_ids"][:, 0]] for batch in self.batches]


@pytest.fixture
def recording(echo_path):
    return ThreadRecordingSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))


def test_lone_run_executes_on_the_callers_thread(recording):
    with BatchedSession(recording, workers=2) as bs:
        out = bs.run(None, feed(5, 3))
        assert recording.threads == [threading.get_ident()]
        np.testing.assert_array_equal(ids_of(out), np.full((1, 3), 5))
        s = bs.stats()
        assert (s.requests, s.completed, s.batches, s.alone_batches, s.inline_runs) == (1, 1, 1, 1, 1)


def test_requests_arriving_during_an_inline_run_are_served_by_the_workers(recording):
    recording.gate.clear()
    with BatchedSession(recording, workers=2) as bs:
        results: dict[str, Any] = {}
        lone = threading.Thread(target=lambda: results.setdefault("lone", bs.run(None, feed(1, 2))))
        lone.start()
        assert recording.running.acquire(timeout=10)  # the lone request is running inline
        futs = [bs.submit(feed(10 + i, 4)) for i in range(3)]
        assert recording.running.acquire(timeout=10)  # a worker took the queued ones meanwhile
        recording.gate.set()
        lone.join(10)
        assert not lone.is_alive()
        np.testing.assert_array_equal(ids_of(results["lone"]), np.full((1, 2), 1))
        for i, f in enumerate(futs):
            np.testing.assert_array_equal(ids_of(f.result(10)), np.full((1, 4), 10 + i))
        assert recording.threads[0] == lone.ident
        assert lone.ident not in recording.threads[1:]
        assert sorted(x for ids in recording.first_ids()[1:] for x in ids) == [10, 11, 12]
        s = bs.stats()
        assert s.inline_runs == 1 and s.batches == len(recording.threads) and s.completed == 4


def test_no_inline_run_while_requests_are_queued(recording):
    recording.gate.clear()
    with BatchedSession(recording, workers=1) as bs:
        first = bs.submit(feed(1, 2))
        assert recording.running.acquire(timeout=10)  # the only worker is busy
        queued = bs.submit(feed(2, 2))
        out: dict[str, Any] = {}
        caller = threading.Thread(target=lambda: out.setdefault("r", bs.run(None, feed(3, 2))))
        caller.start()
        caller.join(0.2)
        assert caller.is_alive()  # it queued behind the others instead of running inline
        recording.gate.set()
        caller.join(10)
        first.result(10), queued.result(10)
        assert caller.ident not in recording.threads
        np.testing.assert_array_equal(ids_of(out["r"]), np.full((1, 2), 3))


def test_inline_errors_are_typed_like_queued_ones(echo_path):
    from ortbatch.errors import InvalidInputError

    with BatchedSession(str(echo_path), workers=2) as bs:
        with pytest.raises(InvalidInputError, match="input_ids"):
            bs.run(None, {**feed(1, 3), "input_ids": np.ones((1, 3), np.float32)})
        assert bs.stats().requests == 0  # rejected before it was accepted, as when queued


@pytest.mark.skipif(cpu_count() < 2, reason="a latency session needs more cores than one worker gets")
def test_latency_session_is_built_on_cpu_with_every_core(echo_path):
    with BatchedSession(str(echo_path), workers=2) as bs:
        assert bs.latency_session is not None
        assert bs.latency_session.get_session_options().intra_op_num_threads == cpu_count()
        assert bs.session.get_session_options().intra_op_num_threads == max(1, cpu_count() // 2)
    with BatchedSession(str(echo_path), workers=2, latency_session=False) as bs:
        assert bs.latency_session is None
    with BatchedSession(str(echo_path), workers=1) as bs:
        assert bs.latency_session is None  # the one worker already has every core


def test_latency_session_needs_a_path(echo_path):
    sess = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="latency_session=True needs a model path"):
        BatchedSession(sess, latency_session=True)
    with BatchedSession(sess) as bs:
        assert bs.latency_session is None


def test_latency_session_is_not_built_for_gpu_or_user_options_or_big_models(echo_path, monkeypatch):
    want = session_mod._want_latency_session
    cpu = [("CPUExecutionProvider", {})]
    monkeypatch.setattr(session_mod, "cpu_count", lambda: 8)
    assert want(None, echo_path, cpu, 2, None)
    assert not want(None, echo_path, [("CUDAExecutionProvider", {}), *cpu], 2, None)
    assert not want(None, echo_path, cpu, 2, ort.SessionOptions())
    assert want(True, echo_path, [("CUDAExecutionProvider", {})], 2, None)  # explicit wins
    monkeypatch.setattr(session_mod, "_LATENCY_SESSION_MAX_BYTES", 10)
    assert not want(None, echo_path, cpu, 2, None)


@pytest.mark.skipif(cpu_count() < 2, reason="a latency session needs more cores than one worker gets")
def test_a_batch_that_runs_alone_uses_the_latency_session_and_loaded_ones_do_not(echo_path):
    with BatchedSession(str(echo_path), workers=2) as bs:
        used: list[str] = []
        for label, ex in (("latency", bs._alone_executor), ("workers", bs._executor)):
            real = ex.run

            def spy(binding, feed_, names, real=real, label=label):
                used.append(label)
                return real(binding, feed_, names)

            ex.run = spy  # type: ignore[method-assign]
        np.testing.assert_array_equal(ids_of(bs.submit(feed(4, 3)).result(10)), np.full((1, 3), 4))
        assert used == ["latency"]
        assert (bs.stats().alone_batches, bs.stats().inline_runs) == (1, 0)
        # the cost model learns only from the workers' session
        assert not bs.stats().cost_model["fitted"]
