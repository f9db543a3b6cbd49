"""Every path settles every future, in a way every waiter sees (issue 43's lost wake-up).

``concurrent.futures.wait`` and ``as_completed`` count a cancelled future as done only once
``set_running_or_notify_cancel()`` has moved it to CANCELLED_AND_NOTIFIED; the generator's
futures used to stay CANCELLED, so a caller waiting on a request it (or its callback) had
cancelled sat until its timeout with the engine idle. These checks use ``timeout=0``: the
answer is decided by the futures' states, not by how long anything takes.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ortbatch.errors import InferenceError
from ortbatch.generation.seq2seq import Seq2SeqGenerator

pytestmark = [pytest.mark.export, pytest.mark.slow]


def test_cancelled_requests_wake_wait_and_as_completed(seq2seq_export: Callable[[str], Any]) -> None:
    exported = seq2seq_export("t5")
    cancelled_mid = threading.Event()
    holder: list[concurrent.futures.Future[Any]] = []

    def cancel_at_second_token(tok: Any) -> None:
        if tok.index >= 1 and holder and holder[0].cancel():
            cancelled_mid.set()

    with Seq2SeqGenerator(exported.directory, max_batch_size=4) as gen:
        mid = gen.submit("The quick brown fox", 12, num_beams=1, on_token=cancel_at_second_token)
        holder.append(mid)
        queued = gen.submit_choices("Hello", 12, do_sample=True, num_return_sequences=2, seed=1)
        for f in queued:
            f.cancel()
        assert cancelled_mid.wait(60), "the request's second token never came"
        done_one = gen.submit("Paris", 3, num_beams=1)
        done_one.result(timeout=60)
        futures = [mid, *queued, done_one]
        assert all(f.done() for f in futures)
        _, not_done = concurrent.futures.wait(futures, timeout=0)
        assert not not_done, f"wait() does not see {len(not_done)} cancelled future(s) as done"
        assert len(list(concurrent.futures.as_completed(futures, timeout=0))) == len(futures)
        assert mid.cancelled() and all(f.cancelled() for f in queued)
    # the generator's own bookkeeping of these futures is undisturbed
    assert gen.stats().cancelled >= 3


def test_a_broken_start_fails_its_requests(
    seq2seq_export: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the encoder run (not an OrtBatchError) stops the loop; the requests it had taken
    off the queue, in no cohort yet, still get the error instead of hanging their callers."""
    exported = seq2seq_export("t5")
    gen = Seq2SeqGenerator(exported.directory, max_batch_size=4)
    gate = threading.Event()

    def broken(feeds: Any) -> Any:
        gate.wait(60)
        raise RuntimeError("a bug")

    monkeypatch.setattr(gen.runner, "encode", broken)
    try:
        fut = gen.submit("Hello", 3, num_beams=1)
        gate.set()
        with pytest.raises(InferenceError, match="a bug"):
            fut.result(timeout=60)
    finally:
        gen.close(timeout=60)
