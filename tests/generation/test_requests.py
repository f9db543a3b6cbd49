"""Scheduling, lifecycle and errors, on the onnx.helper fake decoder (no torch).

The fake decoder's next token is a sum over the row's unmasked history plus 7x its
position, so a leaking pad, a wrong position or a misrouted cache row changes tokens.
Batch composition is made deterministic with gates held in ``on_token`` callbacks
(they run on the scheduler thread), never with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import (
    BatchedGenerator,
    InferenceError,
    InvalidInputError,
    ManifestError,
    ModelContractError,
    ProviderError,
    QueueFullError,
    RequestTimeoutError,
    SessionClosedError,
)
from ortbatch._ort import build_session
from ortbatch.generation import SamplingParams, StreamToken, generation_section

from .fake_decoder import CONTEXT, EOS, VOCAB, reference


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [rs.randint(4, VOCAB, size=n).tolist() for n in lengths]


class Gate:
    """An on_token callback that parks the scheduler thread at a chosen token."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, token: StreamToken) -> None:
        if token.index == self.at:
            self.entered.set()
            assert self.release.wait(10)

    def hold(self) -> None:
        assert self.entered.wait(10), "the scheduler never reached the gate"


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def test_continuous_batching_matches_reference(fake_dir: Path, no_thread_leak: None) -> None:
    ps = prompts([1, 4, 9, 2, 17, 6, 30, 3, 11, 5], seed=7)
    news = [20, 5, 33, 12, 8, 25, 3, 30, 14, 9]
    with BatchedGenerator(fake_dir, max_batch_size=4) as gen:
        futs = [gen.submit(p, n) for p, n in zip(ps, news, strict=True)]
        results = [f.result(10) for f in futs]
        # a future is settled in the step that finishes it; its row leaves the batch after
        wait_until(lambda: gen.stats().active_rows == 0)
        stats = gen.stats()
    for p, n, out in zip(ps, news, results, strict=True):
        ref = reference(p, n)
        assert list(out.token_ids) == ref
        assert out.finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert out.completion_tokens == len(ref) and out.prompt_tokens == len(p)
        assert 0 <= out.time_to_first_token_s <= out.total_time_s
    assert any(r.finish_reason == "stop" for r in results)  # eos exercised
    assert stats.completed == len(ps) and stats.failed == 0
    assert stats.max_decode_rows == 4
    assert (stats.active_rows, stats.reserved_tokens, stats.cache_length) == (0, 0, 0)


def test_token_budget_admits_oldest_first(fake_dir: Path, no_thread_leak: None) -> None:
    ps = prompts([10, 2, 2, 2], seed=2)
    order: list[int] = []
    lock = threading.Lock()

    def record(i: int) -> Callable[[StreamToken], None]:
        def cb(tok: StreamToken) -> None:
            if tok.finish_reason is not None:
                with lock:
                    order.append(i)

        return cb

    # Budget 40: the 10+20 request leaves no room for a 2+20 one beside it, and the
    # small ones must not overtake it.
    with BatchedGenerator(fake_dir, max_batch_size=8, max_tokens_in_flight=40) as gen:
        gate = Gate(at=0)
        blocker = gen.submit([5], 1, on_token=gate)
        gate.hold()
        futs = [gen.submit(p, 20, on_token=record(i)) for i, p in enumerate(ps)]
        gate.release.set()
        outs = [f.result(10) for f in futs]
        blocker.result(10)
        wait_until(lambda: gen.stats().active_rows == 0)  # the last row leaves after its future is settled
        stats = gen.stats()
        with pytest.raises(InvalidInputError, match="max_tokens_in_flight"):
            gen.submit(prompts([30])[0], 20)
    for p, out in zip(ps, outs, strict=True):
        assert list(out.token_ids) == reference(p, 20)
    # 10+20 reserved leaves no room for a 2+20 beside it, nor do two 2+20 fit (44 > 40):
    # one row at a time, in arrival order; the big head of the queue is not overtaken.
    assert order == [0, 1, 2, 3]
    assert stats.max_decode_rows == 1
    assert stats.reserved_tokens == 0


def test_cancel_future_mid_flight_frees_row(fake_dir: Path, no_thread_leak: None) -> None:
    a, b = prompts([5, 8], seed=3)
    with BatchedGenerator(fake_dir, max_batch_size=4) as gen:
        gate = Gate(at=3)
        fa = gen.submit(a, 40, on_token=gate)
        fb = gen.submit(b, 40)
        gate.hold()
        assert fa.cancel()
        gate.release.set()
        out_b = fb.result(10)
        wait_until(lambda: gen.stats().active_rows == 0)
        stats = gen.stats()
    assert fa.cancelled()
    assert list(out_b.token_ids) == reference(b, 40)  # the other row is unaffected
    assert stats.cancelled == 1 and stats.completed == 1
    # a's row left at the next step: it generated at most one more token after the gate
    assert stats.generated_tokens <= len(reference(b, 40)) + 5


def test_cancel_while_queued(fake_dir: Path, no_thread_leak: None) -> None:
    with BatchedGenerator(fake_dir) as gen:
        gate = Gate(at=0)
        blocker = gen.submit([5], 1, on_token=gate)
        gate.hold()
        queued = gen.submit([6, 7], 10)
        assert queued.cancel()
        gate.release.set()
        blocker.result(10)
        wait_until(lambda: gen.stats().cancelled == 1)
        assert gen.stats().prompt_tokens == 1  # the cancelled prompt never ran


def test_cancelled_requests_wake_wait_and_as_completed(fake_dir: Path, no_thread_leak: None) -> None:
    """``Future.cancel()`` alone does not wake ``concurrent.futures.wait``: a cancelled request,
    mid-way or queued, must count as done there at once, as its ``done()`` says."""
    from concurrent.futures import as_completed, wait

    with BatchedGenerator(fake_dir, max_batch_size=4) as gen:
        gate = Gate(at=2)
        mid = gen.submit([5, 6], 40, on_token=gate)
        gate.hold()
        queued = gen.submit([7], 10)
        assert mid.cancel() and queued.cancel()
        done, not_done = wait([mid, queued], timeout=0)
        assert not not_done and done == {mid, queued}
        assert set(as_completed([mid, queued], timeout=0)) == {mid, queued}
        gate.release.set()
        wait_until(lambda: gen.stats().active_rows == 0)


def test_stream_yields_tokens_and_text(fake_dir: Path, no_thread_leak: None) -> None:
    p = prompts([6], seed=4)[0]

    async def main(gen: BatchedGenerator) -> list[StreamToken]:
        return [tok async for tok in gen.stream(p, 25)]

    with BatchedGenerator(fake_dir) as gen:
        toks = asyncio.run(main(gen))
        full = gen.generate(p, 25)
    assert [t.token_id for t in toks] == list(full.token_ids) == reference(p, 25)
    assert [t.index for t in toks] == list(range(len(toks)))
    assert [t.finish_reason for t in toks][-1] == full.finish_reason
    assert all(t.finish_reason is None for t in toks[:-1])


def test_stream_break_and_task_cancel_free_rows(fake_dir: Path, no_thread_leak: None) -> None:
    p = prompts([6], seed=5)[0]
    long_p = [4] * 3  # sum 12, positions keep it far from eos for a while

    async def paced(
        gen: BatchedGenerator, stream: AsyncIterator[StreamToken]
    ) -> tuple[Gate, asyncio.Task[StreamToken]]:
        """Start ``stream`` in the same batch as a 4-token pacer whose gate parks the scheduler
        at its token 3: the stream then has sent its tokens 0-2 and cannot run on to its end
        before the caller breaks or cancels (the scheduler does not wait for a slow consumer)."""
        park = Gate(at=0)
        gen.submit([5], 1, on_token=park)
        park.hold()  # the scheduler is parked: what is queued now is admitted together
        first = asyncio.ensure_future(anext(stream))  # its first step submits the request
        while gen.stats().queued < 1:
            await asyncio.sleep(0)
        pacer = Gate(at=3)
        gen.submit(long_p, 4, on_token=pacer)
        park.release.set()
        return pacer, first

    async def main(gen: BatchedGenerator) -> None:
        async with contextlib.aclosing(gen.stream(p, 50)) as stream:
            pacer, first = await paced(gen, stream)
            assert (await first).index == 0
            async for tok in stream:
                if tok.index == 2:
                    break
        pacer.release.set()  # only now: the stream's future is already cancelled

        seen: list[int] = []
        two = asyncio.Event()
        long_stream = gen.stream(long_p, 50)

        async def consume(first: asyncio.Task[StreamToken]) -> None:
            async with contextlib.aclosing(long_stream) as stream:
                seen.append((await first).token_id)
                async for tok in stream:
                    seen.append(tok.token_id)
                    if len(seen) == 2:
                        two.set()

        pacer, first = await paced(gen, long_stream)
        task = asyncio.create_task(consume(first))
        await two.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pacer.release.set()

    with BatchedGenerator(fake_dir) as gen:
        gate_free = Gate(at=-1)  # never parks; just exercises the callback path
        gen.submit([4], 1, on_token=gate_free).result(10)
        asyncio.run(main(gen))
        wait_until(lambda: gen.stats().active_rows == 0 and gen.stats().cancelled == 2)
        # 1 + two parks of 1 + two pacers of 4; each stream stopped within a step of its cancel
        assert gen.stats().generated_tokens <= 1 + 2 + 8 + 2 * 5


def test_stream_raises_submit_errors_and_generate_async(fake_dir: Path, no_thread_leak: None) -> None:
    async def main(gen: BatchedGenerator) -> None:
        with pytest.raises(InvalidInputError):
            async for _ in gen.stream([], 5):
                pass
        out = await gen.generate_async([9, 9], 5)
        assert list(out.token_ids) == reference([9, 9], 5)

    with BatchedGenerator(fake_dir) as gen:
        asyncio.run(main(gen))


def test_deadline_while_queued(fake_dir: Path, no_thread_leak: None) -> None:
    with BatchedGenerator(fake_dir) as gen:
        gate = Gate(at=0)
        blocker = gen.submit([5], 1, on_token=gate)
        gate.hold()
        late = gen.submit([6, 7], 10, timeout_s=0.05)
        time.sleep(0.15)
        gate.release.set()
        with pytest.raises(RequestTimeoutError, match="not run"):
            late.result(10)
        blocker.result(10)
        assert gen.stats().timed_out == 1


def test_deadline_mid_generation_keeps_partial(fake_dir: Path, no_thread_leak: None) -> None:
    p = [4, 4]
    with BatchedGenerator(fake_dir) as gen:
        fut = gen.submit(p, 60, timeout_s=0.1, on_token=lambda t: time.sleep(0.01))
        with pytest.raises(RequestTimeoutError) as info:
            fut.result(10)
        other = gen.generate(p, 5)  # still serving
        wait_until(lambda: gen.stats().active_rows == 0)
    partial = info.value.partial
    assert partial.finish_reason == "timeout"
    assert 0 < partial.completion_tokens < 60
    assert list(partial.token_ids) == reference(p, 60)[: partial.completion_tokens]
    assert list(other.token_ids) == reference(p, 5)


def test_queue_full_is_an_answer(fake_dir: Path, no_thread_leak: None) -> None:
    with BatchedGenerator(fake_dir, max_queue=2) as gen:
        gate = Gate(at=0)
        blocker = gen.submit([5], 1, on_token=gate)
        gate.hold()
        waiting = [gen.submit([6], 3), gen.submit([7], 3)]
        with pytest.raises(QueueFullError) as info:
            gen.submit([8], 3)
        assert (info.value.queued, info.value.max_queue) == (2, 2)
        gate.release.set()
        for f in [blocker, *waiting]:
            f.result(10)
        assert gen.stats().rejected == 1
        gen.submit([8], 3).result(10)  # room again


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ("", {}, "empty"),
        ([], {}, "no tokens"),
        (np.zeros((0,), np.int64), {}, "no tokens"),
        ([1] * (CONTEXT - 4), {"max_new_tokens": 10}, "context of 64"),
        ([1] * (CONTEXT + 1), {"max_new_tokens": 1}, "context"),
        ([5, VOCAB], {}, "outside the vocabulary"),
        ([-1, 5], {}, "outside the vocabulary"),
        ([1.5, 2.0], {}, "integers"),
        ([[1, 2], [3, 4]], {}, "1-D"),
        ("hello", {"max_new_tokens": 4}, "tokenizer"),
        ([5], {"max_new_tokens": 0}, "max_new_tokens"),
        ([5], {"temperature": -1.0, "max_new_tokens": 4}, "temperature"),
        ([5], {"top_k": 0, "max_new_tokens": 4}, "top_k"),
        ([5], {"top_p": 0.0, "max_new_tokens": 4}, "top_p"),
        ([5], {"stop": ["x"], "max_new_tokens": 4}, "tokenizer"),
        ([5], {"timeout_s": 0, "max_new_tokens": 4}, "timeout_s"),
        ([5], {"timeout_s": "1", "max_new_tokens": 4}, "timeout_s"),  # was a TypeError
        ([5], {"timeout_s": True, "max_new_tokens": 4}, "timeout_s"),  # was taken as 1 second
        ([5], {"timeout_s": float("nan"), "max_new_tokens": 4}, "timeout_s"),
    ],
)
def test_bad_requests_are_rejected_at_submit(fake_dir: Path, prompt: object, kwargs: dict, match: str) -> None:
    with BatchedGenerator(fake_dir) as gen:
        with pytest.raises(InvalidInputError, match=match) as info:
            gen.submit(prompt, **kwargs)
        assert isinstance(info.value, ValueError)
        assert gen.generate([5, 6], 4).completion_tokens >= 1  # still serving
        assert gen.stats().submitted == 1


def test_prompt_as_2d_single_row_and_numpy(fake_dir: Path) -> None:
    with BatchedGenerator(fake_dir) as gen:
        a = gen.generate(np.array([[7, 8, 9]], dtype=np.int32), 6)
        b = gen.generate([7, 8, 9], 6)
    assert a.token_ids == b.token_ids == tuple(reference([7, 8, 9], 6))


@pytest.mark.timeout(60)
def test_generate_on_the_scheduler_thread_is_refused_not_hung(fake_dir: Path, no_thread_leak: None) -> None:
    with BatchedGenerator(fake_dir, max_batch_size=2) as gen:
        seen: list[BaseException | object] = []
        done = threading.Event()

        def nested(token: StreamToken) -> None:
            if token.index == 0:
                try:
                    seen.append(gen.generate([5, 6], 3))
                except BaseException as exc:
                    seen.append(exc)
                finally:
                    done.set()

        outer = gen.submit([4, 4], 5, on_token=nested)
        assert done.wait(10), "generate() on the scheduler thread never returned"
        assert isinstance(seen[0], InvalidInputError) and "submit()" in str(seen[0])
        assert list(outer.result(10).token_ids) == reference([4, 4], 5)
        assert list(gen.generate([5, 6], 3).token_ids) == reference([5, 6], 3)


def test_close_without_drain_fails_everything(fake_dir: Path, no_thread_leak: None) -> None:
    gen = BatchedGenerator(fake_dir, max_batch_size=1)
    gate = Gate(at=1)
    running = gen.submit([4, 4], 30, on_token=gate)
    gate.hold()
    queued = gen.submit([5], 30)
    closer = threading.Thread(target=gen.close, kwargs={"drain": False})
    closer.start()
    wait_until(lambda: gen.closed)
    gate.release.set()
    closer.join(10)
    assert not closer.is_alive()
    for fut in (running, queued):
        with pytest.raises(SessionClosedError):
            fut.result(10)
    with pytest.raises(SessionClosedError):
        gen.submit([5], 3)
    gen.close()  # twice is fine


def test_close_drains_queued_work(fake_dir: Path, no_thread_leak: None) -> None:
    gen = BatchedGenerator(fake_dir, max_batch_size=2)
    ps = prompts([3, 5, 7, 9], seed=6)
    futs = [gen.submit(p, 15) for p in ps]
    gen.close()
    for p, f in zip(ps, futs, strict=True):
        assert list(f.result(0).token_ids) == reference(p, 15)


def test_on_token_error_fails_only_that_request(fake_dir: Path, no_thread_leak: None) -> None:
    def boom(tok: StreamToken) -> None:
        if tok.index == 2:
            raise RuntimeError("callback failed")

    with BatchedGenerator(fake_dir) as gen:
        bad = gen.submit([4, 5], 20, on_token=boom)
        good = gen.submit([6, 7], 20)
        with pytest.raises(RuntimeError, match="callback failed"):
            bad.result(10)
        assert list(good.result(10).token_ids) == reference([6, 7], 20)


class _FailingSession:
    """Wraps the real session; fails prefills that contain a poisoned id, or the n-th decode
    counted from :meth:`arm` (the construction-time position probe is not counted)."""

    def __init__(self, real: object, poison: int | None = None, fail_decode_at: int | None = None) -> None:
        self._real, self.poison, self.fail_decode_at, self.decodes = real, poison, fail_decode_at, 0
        self.armed = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def run(self, names: list[str], feed: dict) -> list:
        ids = feed["input_ids"]
        if ids.shape[1] > 1 and self.poison is not None and (ids == self.poison).any():
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : poisoned prompt")
        if ids.shape[1] == 1 and self.armed:
            self.decodes += 1
            if self.decodes == self.fail_decode_at:
                raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : decode failed")
        return self._real.run(names, feed)


class _FailingFactory:
    """``BatchedGenerator(session_factory=...)``: builds the real session, wrapped."""

    def __init__(self, **how: int) -> None:
        self.how = how
        self.session: _FailingSession | None = None

    def __call__(self, *args: object, **kwargs: object) -> _FailingSession:
        self.session = _FailingSession(build_session(*args, **kwargs), **self.how)
        return self.session

    def arm(self) -> None:
        assert self.session is not None
        self.session.armed = True


def test_failed_prefill_fails_only_its_request(fake_dir: Path, no_thread_leak: None) -> None:
    failing = _FailingFactory(poison=13)
    with BatchedGenerator(fake_dir, session_factory=failing) as gen:
        failing.arm()
        gate = Gate(at=0)
        blocker = gen.submit([5], 1, on_token=gate)
        gate.hold()
        # Same length: these three are prefilled as one group, which fails and is split.
        futs = [gen.submit(p, 8) for p in ([20, 21, 22], [13, 14, 15], [30, 31, 32])]
        gate.release.set()
        blocker.result(10)
        with pytest.raises(InferenceError, match="poisoned"):
            futs[1].result(10)
        assert list(futs[0].result(10).token_ids) == reference([20, 21, 22], 8)
        assert list(futs[2].result(10).token_ids) == reference([30, 31, 32], 8)
        assert gen.stats().failed == 1


def test_failed_decode_fails_its_rows_and_serving_continues(fake_dir: Path, no_thread_leak: None) -> None:
    failing = _FailingFactory(fail_decode_at=3)
    with BatchedGenerator(fake_dir, session_factory=failing) as gen:
        failing.arm()
        # Held at the blocker's first token, so the three are admitted and decoded together
        # (a prompt of two tokens: a one-token prefill would count as a decode).
        gate = Gate(at=0)
        blocker = gen.submit([5, 6], 1, on_token=gate)
        gate.hold()
        futs = [gen.submit([4 + i, 9], 20) for i in range(3)]
        gate.release.set()
        blocker.result(10)
        for f in futs:
            with pytest.raises(InferenceError, match="decode failed"):
                f.result(10)
        assert list(gen.generate([6, 7], 10).token_ids) == reference([6, 7], 10)
        wait_until(lambda: gen.stats().active_rows == 0)  # the last row leaves after its future is settled
        stats = gen.stats()
    assert stats.failed == 3 and stats.active_rows == 0


def test_manifest_generation_section_is_used(fake_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "exp"
    shutil.copytree(fake_dir, d)
    section = generation_section(d)
    assert section["max_context_length"] == CONTEXT and section["num_layers"] == 1
    section["max_context_length"] = 20
    manifest = {"format": 1, "model": "model.onnx", "padding_side": "left", "generation": section}
    (d / "ortbatch.json").write_text(json.dumps(manifest))
    with BatchedGenerator(d) as gen:
        with pytest.raises(InvalidInputError, match="context of 20"):
            gen.submit([5] * 15, 6)
        assert gen.generate([5] * 15, 5).completion_tokens >= 1
    section["past_keys"] = "oops"
    (d / "ortbatch.json").write_text(json.dumps({**manifest, "generation": section}))
    with pytest.raises(ManifestError, match="past_keys"):
        BatchedGenerator(d)
    # without a generation section, the layout is inferred from the graph
    (d / "ortbatch.json").write_text(json.dumps({"format": 1, "model": "model.onnx"}))
    with BatchedGenerator(d) as gen:
        assert gen.layout.max_context_length == CONTEXT
    # the manifest's limits (e.g. TensorRT profile shapes) bound context and batch
    limits = {"max_batch_size": 2, "max_sequence_length": 30}
    (d / "ortbatch.json").write_text(json.dumps({"format": 1, "model": "model.onnx", "limits": limits}))
    with BatchedGenerator(d, max_batch_size=8) as gen:
        assert gen.max_batch_size == 2
        with pytest.raises(InvalidInputError, match="context of 30"):
            gen.submit([5] * 25, 6)
        outs = [f.result(10) for f in [gen.submit([5 + i] * 3, 5) for i in range(4)]]
        assert [list(o.token_ids) for o in outs] == [reference([5 + i] * 3, 5) for i in range(4)]
        assert gen.stats().max_decode_rows == 2


def test_not_a_decoder_is_a_contract_error(echo_path: Path, tmp_path: Path) -> None:
    shutil.copy(echo_path, tmp_path / "model.onnx")
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 8}))
    with pytest.raises(ModelContractError, match="text-generation-with-past"):
        BatchedGenerator(tmp_path)
    with pytest.raises(ModelContractError):
        BatchedGenerator(tmp_path / "missing")


def test_missing_gpu_provider_is_an_error(fake_dir: Path) -> None:

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    with pytest.raises(ProviderError, match="CUDAExecutionProvider"):
        BatchedGenerator(fake_dir, providers="cuda")


def test_layout_without_onnx_package_reads_the_graph_with_ort(fake_dir: Path) -> None:
    from ortbatch.generation import layout

    with_onnx = layout.read_io(fake_dir / "model.onnx")
    with_ort = layout._read_io_ort(fake_dir / "model.onnx")
    assert [(n, d) for n, d, _ in with_onnx[0]] == [(n, d) for n, d, _ in with_ort[0]]
    assert [(n, d) for n, d, _ in with_onnx[1]] == [(n, d) for n, d, _ in with_ort[1]]
    assert [s for _, _, s in with_onnx[0]] == [s for _, _, s in with_ort[0]]


def test_a_mask_one_column_too_long_is_caught(fake_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exported graph silently accepts a mask one column too long; the generator must not."""
    from ortbatch.generation.cache import KVCache

    real = KVCache.attention_mask
    monkeypatch.setattr(KVCache, "attention_mask", lambda self, new=1, dtype=np.int64: real(self, new + 1, dtype))
    with BatchedGenerator(fake_dir) as gen:
        with pytest.raises(InferenceError, match="mask"):
            gen.generate([5, 6, 7], 5)
        monkeypatch.setattr(KVCache, "attention_mask", real)
        assert list(gen.generate([5, 6, 7], 5).token_ids) == reference([5, 6, 7], 5)


def test_many_threads_with_cancels_and_deadlines_all_settle(fake_dir: Path, no_thread_leak: None) -> None:
    rs = np.random.RandomState(11)
    jobs = [(rs.randint(4, VOCAB, size=rs.randint(1, 20)).tolist(), int(rs.randint(1, 40))) for _ in range(160)]
    results: dict[int, object] = {}
    lock = threading.Lock()

    with BatchedGenerator(fake_dir, max_batch_size=6, max_tokens_in_flight=120, max_queue=1000) as gen:

        def client(worker: int) -> None:
            for i in range(worker, len(jobs), 8):
                prompt, n = jobs[i]
                fut = gen.submit(prompt, n, timeout_s=5.0 if i % 7 else 0.001)
                if i % 5 == 0:
                    fut.cancel()
                try:
                    outcome: object = fut.result(30)
                except BaseException as exc:  # collected and checked in the main thread
                    outcome = exc
                with lock:
                    results[i] = outcome

        threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        wait_until(lambda: gen.stats().active_rows == 0 and gen.stats().queued == 0)
        stats = gen.stats()

    import concurrent.futures

    assert len(results) == len(jobs)
    done = 0
    for i, outcome in results.items():
        prompt, n = jobs[i]
        if isinstance(outcome, concurrent.futures.CancelledError):
            assert i % 5 == 0
        elif isinstance(outcome, RequestTimeoutError):
            assert i % 7 == 0
        else:
            assert list(outcome.token_ids) == reference(prompt, n), i  # type: ignore[attr-defined]
            done += 1
    assert done == stats.completed
    assert stats.submitted == stats.completed + stats.cancelled + stats.timed_out + stats.failed
    assert stats.failed == 0 and stats.reserved_tokens == 0 and stats.cache_length == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_batch_size": 0},
        {"max_queue": 0},
        {"timeout_s": 0},
        {"max_tokens_in_flight": 1},
        {"max_new_tokens": 0},
        {"max_context_length": 1},
    ],
)
def test_bad_constructor_arguments(fake_dir: Path, kwargs: dict, no_thread_leak: None) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        BatchedGenerator(fake_dir, **kwargs)


def test_last_position_logits_needs_a_matmul_lm_head(fake_dir: Path) -> None:
    with BatchedGenerator(fake_dir) as gen:  # logits come from OneHot: left as they are
        assert not gen.last_position_logits
        assert list(gen.generate([4, 5], 6).token_ids) == reference([4, 5], 6)
    with pytest.raises(ModelContractError, match="last position"):
        BatchedGenerator(fake_dir, last_position_logits=True)


def test_stats_are_current_when_the_future_is_done(fake_dir: Path) -> None:
    async def main(gen: BatchedGenerator) -> None:
        for i in range(5):
            before = gen.stats().completed
            async for _ in gen.stream([4 + i], 3):
                pass
            assert gen.stats().completed == before + 1
            gen.generate([5], 2)
            assert gen.stats().completed == before + 2
            gen.submit([5], 2).result(10)
            assert gen.stats().completed == before + 3

    with BatchedGenerator(fake_dir) as gen:
        asyncio.run(main(gen))


def test_sampling_params_object_and_keywords_are_the_same_request(fake_dir: Path) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, seed=5, max_new_tokens=12)
    with BatchedGenerator(fake_dir) as gen:
        by_object = gen.generate([4, 5, 6], params=params)
        by_keywords = gen.generate([4, 5, 6], 12, temperature=0.9, top_k=20, seed=5)
        overridden = gen.generate([4, 5, 6], 3, params=params)  # the keyword wins over the object
        with pytest.raises(InvalidInputError, match="seed must be a non-negative integer"):
            gen.submit([4, 5], 3, temperature=1.0, seed=-1)
        with pytest.raises(TypeError, match="temprature"):
            gen.submit([4, 5], 3, temprature=1.0)  # type: ignore[call-arg]
    assert by_object.token_ids == by_keywords.token_ids  # (12 tokens, or fewer if eos came first)
    assert by_object.completion_tokens <= 12 and overridden.completion_tokens <= 3
    assert overridden.token_ids == by_object.token_ids[: overridden.completion_tokens]


class _NaNFactory(_FailingFactory):
    """The real session, whose logits turn NaN for the rows of a prefill holding ``poison``
    (a damaged model in miniature); armed after construction, as above."""

    def __call__(self, *args: object, **kwargs: object) -> _FailingSession:
        real = build_session(*args, **kwargs)
        poison = self.how["poison"]
        outer = self

        class NaNSession(_FailingSession):
            def run(self, names: list[str], feed: dict) -> list:
                outs = real.run(names, feed)
                if outer.session is not None and outer.session.armed:
                    rows = (feed["input_ids"] == poison).any(axis=1)
                    outs[0] = np.where(rows[:, None, None], np.nan, outs[0]).astype(outs[0].dtype)
                return outs

        self.session = NaNSession(real)
        return self.session


def test_non_finite_logits_fail_only_their_request(fake_dir: Path, no_thread_leak: None) -> None:
    """NaN logits never become a token (argmax of NaN would pick one silently): the row's
    request fails with an InferenceError saying so; its batch-mates generate as alone."""
    nan = _NaNFactory(poison=13)
    with BatchedGenerator(fake_dir, session_factory=nan) as gen:
        nan.arm()
        gate = Gate(at=0)
        blocker = gen.submit([5], 1, on_token=gate)
        gate.hold()
        futs = [
            gen.submit(p, 8, temperature=t, seed=1)
            for p, t in (([20, 21, 22], 0), ([13, 14, 15], 0.7), ([30, 31, 32], 0))
        ]
        gate.release.set()
        blocker.result(10)
        with pytest.raises(InferenceError, match="non-finite"):
            futs[1].result(10)
        assert list(futs[0].result(10).token_ids) == reference([20, 21, 22], 8)
        assert list(futs[2].result(10).token_ids) == reference([30, 31, 32], 8)
        assert gen.stats().failed == 1
