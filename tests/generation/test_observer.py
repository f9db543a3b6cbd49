"""BatchedGenerator's observer hook (``ortbatch._observe``): a tag per request taken on the
caller's side, the prefill that admitted requests together (one batch id), one decode step
in every ``step_every`` (sampled) with the rows it decoded, and each request's end with its
settled future. Requests are made to join one prefill with a gate on the scheduler thread."""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from ortbatch._observe import BatchRecord, StepRecord
from ortbatch.generation import BatchedGenerator

from .fake_decoder import VOCAB
from .test_requests import Gate

WHO: contextvars.ContextVar[str | None] = contextvars.ContextVar("who", default=None)


class Recorder:
    step_every = 4

    def __init__(self) -> None:
        self.prefills: list[BatchRecord] = []
        self.steps: list[StepRecord] = []
        self.done: dict[Any, Future[Any]] = {}
        self.all_done = threading.Event()
        self.expected = 0

    def on_submit(self) -> Any:
        return WHO.get()

    def on_prefill(self, record: BatchRecord) -> None:
        self.prefills.append(record)

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def on_done(self, tag: Any, future: Future[Any]) -> None:
        self.done[tag] = future
        if len(self.done) == self.expected:
            self.all_done.set()


def submit_as(gen: BatchedGenerator, who: str, prompt: list[int], n: int, **kw: Any) -> Future[Any]:
    return contextvars.copy_context().run(lambda: (WHO.set(who), gen.submit(prompt, n, **kw))[1])


def test_the_generator_tells_prefills_sampled_steps_and_ends(fake_dir: Path, no_thread_leak: None) -> None:
    rs = np.random.RandomState(0)
    p = [rs.randint(4, VOCAB, size=n).tolist() for n in (5, 3, 7)]
    recorder = Recorder()
    recorder.expected = 3
    gate = Gate(at=0)
    with BatchedGenerator(fake_dir, max_batch_size=4, observer=recorder) as gen:
        first = submit_as(gen, "a", p[0], 12, on_token=gate)
        gate.hold()  # the scheduler is parked at "a"'s first token: "b" and "c" queue together
        rest = [submit_as(gen, "b", p[1], 12), submit_as(gen, "c", p[2], 12)]
        gate.release.set()
        outs = [f.result(60) for f in [first, *rest]]
        assert recorder.all_done.wait(10)
    one, two = recorder.prefills
    assert list(one.tags) == ["a"] and list(two.tags) == ["b", "c"]
    assert (two.rows, two.real_tokens, two.padded_tokens) == (2, 10, 14)
    assert one.batch_id != two.batch_id
    assert [s.step for s in recorder.steps] == list(range(1, recorder.steps[-1].step + 1, 4))
    assert all(s.rows == len(s.tags) and s.padded_tokens >= s.rows for s in recorder.steps)
    assert any(set(s.tags) == {"a", "b", "c"} for s in recorder.steps)  # they decoded together
    for tag, out in zip("abc", outs, strict=True):
        assert recorder.done[tag].result() is out
