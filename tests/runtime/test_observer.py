"""BatchedSession's observer hook (``ortbatch._observe``): each request's tag is taken on
the caller's side when it is queued (its contextvars are the caller's), and each batch is
told once, after its requests are settled, with one batch id for all its requests, the
rows, the padded and real tokens, the timings and the tags in batch order. Composition is
forced with a gate (the only worker is held while the next batch queues), not timing."""

from __future__ import annotations

import contextvars
import threading

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import BatchedSession
from ortbatch._observe import BatchRecord
from tests.runtime.helpers import GatedSession, PoisonSession

WHO: contextvars.ContextVar[str | None] = contextvars.ContextVar("who", default=None)


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.records: list[BatchRecord] = []
        self.told = threading.Event()
        self.fail = fail

    def on_submit(self) -> str | None:
        return WHO.get()

    def on_batch(self, record: BatchRecord) -> None:
        self.records.append(record)
        self.told.set()
        if self.fail:
            raise RuntimeError("a broken observer")


def feed(rid: int, length: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full((1, length), rid, np.int64),
        "attention_mask": np.ones((1, length), np.int64),
        "extra": np.zeros((1, 3), np.float32),
    }


def submit_as(bs: BatchedSession, who: str, f: dict[str, np.ndarray]):
    return contextvars.copy_context().run(lambda: (WHO.set(who), bs.submit(f))[1])


@pytest.fixture
def gated(echo_path):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    recorder = Recorder()
    bs = BatchedSession(sess, workers=1, observer=recorder)
    yield bs, sess, recorder
    sess.gate.set()
    bs.close()


def test_requests_that_shared_a_batch_carry_its_id_rows_and_tokens(gated):
    bs, sess, recorder = gated
    first = submit_as(bs, "a", feed(1, 3))
    assert sess.entered.wait(10)  # the one worker holds "a": "b" and "c" queue together
    rest = [submit_as(bs, "b", feed(2, 5)), submit_as(bs, "c", feed(3, 2))]
    sess.gate.set()
    for f in [first, *rest]:
        f.result(10)
    bs.close()
    one, two = recorder.records
    assert list(one.tags) == ["a"] and (one.rows, one.requests, one.padded_tokens, one.real_tokens) == (1, 1, 3, 3)
    assert list(two.tags) == ["b", "c"]
    assert (two.rows, two.requests, two.padded_tokens, two.real_tokens) == (2, 2, 10, 7)
    assert one.batch_id != two.batch_id
    assert two.duration_ns > 0 and two.started_ns >= one.started_ns
    assert len(two.waits_ns) == 2 and all(w > 0 for w in two.waits_ns)  # they waited behind "a"
    assert two.error is None


def test_a_broken_observer_never_fails_a_request(echo_path):
    sess = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    recorder = Recorder(fail=True)
    with BatchedSession(sess, workers=1, observer=recorder) as bs:
        out = bs.run(None, feed(4, 2))
        assert int(out[0][0, 0, 0]) == 4
        assert recorder.told.wait(10)


def test_a_failed_request_is_told_with_its_error(echo_path):
    sess = PoisonSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    recorder = Recorder()
    with BatchedSession(sess, workers=1, observer=recorder) as bs, pytest.raises(Exception, match="poisoned"):
        contextvars.copy_context().run(lambda: (WHO.set("bad"), bs.run(None, feed(-7, 2)))[1])
    (record,) = [r for r in recorder.records if r.error is not None]
    assert list(record.tags) == ["bad"] and "poisoned" in str(record.error)


def test_the_observer_can_be_set_later_and_removed(echo_path):
    sess = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    with BatchedSession(sess, workers=1) as bs:
        bs.run(None, feed(1, 2))
        recorder = Recorder()
        bs.observer = recorder
        bs.run(None, feed(1, 2))
        bs.observer = None
        bs.run(None, feed(1, 2))
    assert len(recorder.records) == 1
