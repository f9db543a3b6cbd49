"""The generation scheduler (ortbatch.generation.scheduler) with a fake clock and a fake
runner: admission, deadlines, cancellation, placement and outcomes, without ONNX Runtime
and without threads.

The fake runner's cache is the real :class:`KVCache` holding each position's token id,
and its next token is a function of the row's whole cached history: a row that lands in
the wrong slot, or loses a column in a compaction, generates something else than it
would alone, which :func:`alone` computes without any cache.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ortbatch.errors import InvalidInputError, QueueFullError, RequestTimeoutError, SessionClosedError
from ortbatch.generation.cache import KVCache, PrefilledRows, SlotCache
from ortbatch.generation.requests import (
    Completion,
    ExportTokenizer,
    GenerationRequest,
    RequestFactory,
    StreamToken,
    sampling_params,
)
from ortbatch.generation.sampling import SamplingParams
from ortbatch.generation.scheduler import CompactionCost, Scheduler
from ortbatch.generation.stats import GenerationStatsRecorder

VOCAB = 97
EOS = 0


def next_token(history: list[int]) -> int:
    """The fake model: depends on every token so far and on their order."""
    h = 7
    for t in history:
        h = (h * 31 + t + 1) % 1_000_003
    return 1 + h % (VOCAB - 1)  # never EOS unless a test asks for it


def alone(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Prefill and decode on a one-layer cache whose values are the token ids."""

    def __init__(self) -> None:
        self.cache = KVCache.empty(1, 1, 1, np.float64)
        self.decodes = 0

    def history(self, cache: KVCache, row: int) -> list[int]:
        n = int(cache.lens[row])
        return [int(v) for v in cache.tensors[0][row, 0, cache.length - n :, 0]]

    def prefill(self, prompts: list[np.ndarray]) -> tuple[list[int], KVCache]:
        lens = np.array([len(p) for p in prompts], np.int64)
        longest = int(lens.max())
        t = np.zeros((len(prompts), 1, longest, 1))
        for i, p in enumerate(prompts):
            t[i, 0, longest - len(p) :, 0] = p
        cache = KVCache([t, t.copy()], lens, longest)
        return [next_token(self.history(cache, i)) for i in range(cache.rows)], cache

    def decode(self, tokens: list[int]) -> list[int]:
        self.decodes += 1
        c = self.cache
        col = np.array(tokens, np.float64).reshape(-1, 1, 1, 1)
        c.advance([np.concatenate([t, col], axis=2) for t in c.tensors], new=1)
        return [next_token(self.history(c, i)) for i in range(c.rows)]


class FakeSlotRunner:
    """The in-place cache's runs on a one-layer :class:`SlotCache` whose values are the token
    ids: prefill right-pads a group in its own buffer, decode writes each live row's token at
    its length, and the next token is read back from the slot's whole history."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.cache = SlotCache(2, slots, 1, 1, np.float64)
        self.decodes = 0

    def prefill(self, prompts: list[np.ndarray]) -> tuple[list[int], PrefilledRows]:
        lens = np.array([len(p) for p in prompts], np.int64)
        buffer = np.zeros((2, len(prompts), 1, int(lens.max()), 1))
        for i, p in enumerate(prompts):
            buffer[:, i, 0, : len(p), 0] = p
        rows = PrefilledRows([(buffer, i) for i in range(len(prompts))], lens)
        return [next_token([int(v) for v in rows.row(i)[0, 0, :, 0]]) for i in range(rows.rows)], rows

    def decode(self, tokens: list[int]) -> list[int]:
        self.decodes += 1
        c = self.cache
        live = np.flatnonzero(c.lens > 0)
        assert int(c.lens.max()) < c.capacity, "a row outgrew the capacity its plan reserved"
        for i in live:
            c.arena[:, i, 0, c.lens[i], 0] = tokens[i]
        c.lens[live] += 1
        return [next_token([int(v) for v in c.arena[0, i, 0, : c.lens[i], 0]]) for i in range(c.rows)]


class Harness:
    """The step loop of BatchedGenerator, on the fake runner."""

    def __init__(self, max_rows: int = 4, budget: int = 1000, max_queue: int = 100, **kw: Any) -> None:
        self.clock = FakeClock()
        self.stats = GenerationStatsRecorder()
        kw.setdefault("eos_token_ids", [EOS])
        self.sched = Scheduler(
            max_batch_size=max_rows,
            max_tokens_in_flight=budget,
            max_queue=max_queue,
            stats=self.stats,
            clock=self.clock,
            idle_wait_s=0.0,
            **kw,
        )
        self.runner: Any = FakeSlotRunner(max_rows) if kw.get("slots") else FakeRunner()
        self.factory = RequestFactory(
            ExportTokenizer(Path("/nonexistent"), None),
            vocab_size=VOCAB,
            max_context_length=200,
            max_tokens_in_flight=budget,
            default_max_new_tokens=8,
            default_timeout_s=None,
        )

    def submit(self, prompt: list[int], n: int, timeout_s: float | None = None, **kw: Any) -> Future[Completion]:
        on_token = kw.pop("on_token", None)
        req = self.factory.build(prompt, sampling_params(None, n, kw), timeout_s, on_token, self.clock())
        self.sched.put(req)
        return req.future

    def step(self) -> bool:
        """One iteration; False once the scheduler says stop."""
        sched, runner = self.sched, self.runner
        admitted, stop = sched.admit()
        if stop:
            return False
        keep = sched.reap()
        joining: list[KVCache] = []
        joined: list[GenerationRequest] = []
        for group in sched.prefill_groups(admitted):
            tokens, cache = runner.prefill([r.prompt for r in group])
            survivors = [i for i, r in enumerate(group) if not sched.record_token(r, tokens[i])]
            cache.keep(survivors)
            joining.append(cache)
            joined += [group[i] for i in survivors]
        incoming = [(c, r) for c in joining for r in range(c.rows)]
        plan = sched.place(keep, joined, [int(c.lens[r]) for c, r in incoming], runner.cache.length, lambda: 1000)
        if sched.slots:
            self.seat(plan, incoming)
        elif plan.reset:
            runner.cache = KVCache.empty(1, 1, 1, np.float64)
        else:
            for (c, r), slot in zip(incoming, plan.slots, strict=False):
                runner.cache.place(slot, c, r)
            if plan.rebuild is not None:
                runner.cache.rebuild(plan.rebuild, joining if plan.append else ())
        if sched.rows:
            live = sched.live()
            tokens = runner.decode([r.generated[-1] for r in sched.rows])
            for i in live:
                sched.record_token(sched.rows[i], tokens[i])
        if not sched.live():
            sched.rows = []
            runner.cache = (
                SlotCache(2, runner.slots, 1, 1, np.float64) if sched.slots else KVCache.empty(1, 1, 1, np.float64)
            )
        sched.publish(runner.cache.length)
        return True

    def seat(self, plan: Any, incoming: list[tuple[PrefilledRows, int]]) -> None:
        """What InPlaceRuns.seat does, on the fake slot cache."""
        cache = self.runner.cache
        if plan.reset:
            self.runner.cache = SlotCache(2, self.runner.slots, 1, 1, np.float64)
            return
        cache.resize(max(plan.rows, cache.rows))
        cache.reserve(plan.capacity)
        for slot in plan.free:
            cache.free(slot)
        for src, dst in plan.moves:
            cache.move(src, dst)
        for (rows, j), slot in zip(incoming, plan.slots, strict=True):
            cache.place(slot, rows, j)
        cache.resize(plan.rows)

    def run(self, steps: int = 200) -> None:
        for _ in range(steps):
            if not self.step() or (not self.sched.rows and not self.sched.queued):
                return


def test_oldest_first_under_the_token_budget_nobody_overtakes() -> None:
    h = Harness(budget=20)
    big1 = h.submit([5] * 8, 4)  # reserves 12
    big2 = h.submit([6] * 8, 4)  # 12: does not fit beside big1
    small = h.submit([7], 2)  # 3: would fit, but must not overtake big2
    h.step()
    assert [r.future for r in h.sched.rows] == [big1]
    assert h.sched.queued == 2
    h.run()
    for fut, (p, n) in zip([big1, big2, small], [([5] * 8, 4), ([6] * 8, 4), ([7], 2)], strict=True):
        assert list(fut.result(0).token_ids) == alone(p, n)


def test_rows_are_capped_by_max_batch_size() -> None:
    h = Harness(max_rows=2)
    futs = [h.submit([i + 1, i + 2], 5) for i in range(5)]
    h.step()
    assert len(h.sched.rows) == 2
    h.run()
    assert [list(f.result(0).token_ids) for f in futs] == [alone([i + 1, i + 2], 5) for i in range(5)]


def test_rows_that_join_and_leave_keep_their_own_history() -> None:
    """Mixed lengths and budgets: rows join in freed slots, rebuilds and compactions happen,
    and every request still generates exactly what it would alone."""
    rs = np.random.RandomState(0)
    prompts = [rs.randint(1, VOCAB, size=n).tolist() for n in (1, 7, 3, 12, 2, 9, 5, 4, 15, 6)]
    news = [3, 20, 5, 2, 17, 4, 9, 1, 6, 12]
    for cost in (CompactionCost(copy_s_per_byte=1.0), CompactionCost(copy_s_per_byte=0.0, step_s=1.0)):
        h = Harness(max_rows=3, cost=cost)
        futs = [h.submit(p, n) for p, n in zip(prompts[:5], news[:5], strict=True)]
        h.step()
        h.step()
        futs += [h.submit(p, n) for p, n in zip(prompts[5:], news[5:], strict=True)]
        h.run()
        for f, p, n in zip(futs, prompts, news, strict=True):
            assert list(f.result(0).token_ids) == alone(p, n)
        snap = h.stats.snapshot(0)
        assert snap.completed == 10 and snap.slot_reuses >= 1


@pytest.mark.parametrize("copy_s_per_byte", [1.0, 0.0])
def test_rows_in_slots_keep_their_own_history(copy_s_per_byte: float) -> None:
    """The in-place cache: rows join in free slots (or new ones), leave by freeing theirs,
    move down when that pays, and the cache is never rebuilt; every request still generates
    exactly what it would alone."""
    rs = np.random.RandomState(1)
    prompts = [rs.randint(1, VOCAB, size=n).tolist() for n in (1, 7, 3, 12, 2, 9, 5, 4, 15, 6, 8, 3)]
    news = [3, 20, 5, 2, 17, 4, 9, 1, 6, 12, 2, 30]
    h = Harness(max_rows=4, slots=True, cost=CompactionCost(copy_s_per_byte=copy_s_per_byte, step_s=1.0))
    futs = [h.submit(p, n) for p, n in zip(prompts[:6], news[:6], strict=True)]
    h.step()
    h.step()
    futs += [h.submit(p, n) for p, n in zip(prompts[6:], news[6:], strict=True)]
    h.run(400)
    for f, p, n in zip(futs, prompts, news, strict=True):
        assert list(f.result(0).token_ids) == alone(p, n)
    snap = h.stats.snapshot(0)
    assert snap.completed == 12 and snap.slot_reuses >= 1 and snap.cache_copies == 0
    assert (snap.row_moves > 0) == (copy_s_per_byte == 0.0)


def test_plan_in_slots() -> None:
    stats = GenerationStatsRecorder()
    sched = Scheduler(
        max_batch_size=4, max_tokens_in_flight=100, max_queue=4, eos_token_ids=[EOS], stats=stats, slots=True
    )
    f = RequestFactory(ExportTokenizer(Path("/x"), None), VOCAB, 100, 100, 5, None)
    reqs = [f.build([i + 1] * (i + 1), SamplingParams(max_new_tokens=3 + i), None, None, 0.0) for i in range(6)]
    for r in reqs:
        r.generated.append(1)
    sched.rows = reqs[:3]
    # row 1 left; two join: the first takes slot 1, the second a new slot at the end
    plan = sched.place([0, 2], [reqs[3], reqs[4]], [4, 5], 6, lambda: 1000)
    assert plan.slots == [1, 3] and plan.rebuild is None and plan.free == [] and plan.rows == 4
    assert sched.rows == [reqs[0], reqs[3], reqs[2], reqs[4]]
    assert plan.capacity == max(r.reserved_tokens for r in sched.rows)
    # rows 0 and 3 left, nobody joins: slot 3 is dropped for free; slot 0 waits (a move costs)
    sched.cost = CompactionCost(copy_s_per_byte=1.0, step_s=1e-3)
    reqs[0].done = reqs[4].done = True
    plan = sched.place([1, 2], [], [], 6, lambda: 1000)
    assert plan.free == [0, 3] and plan.moves == [] and plan.rows == 3
    assert sched.rows == [reqs[0], reqs[3], reqs[2]]
    # ...until moving row 2 down into slot 0 pays: the batch is then 2 slots
    sched.cost = CompactionCost(copy_s_per_byte=0.0, step_s=1e-3)
    plan = sched.place([1, 2], [], [], 6, lambda: 1000)
    assert plan.free == [0] and plan.moves == [(2, 0)] and plan.rows == 2
    assert sched.rows == [reqs[2], reqs[3]]
    assert sched.place([], [], [], 6, lambda: 1000).reset and sched.rows == []
    snap = stats.snapshot(0)
    assert snap.slot_reuses == 1 and snap.row_moves == 1 and snap.cache_copies == 0


def test_plan_in_place_rebuild_and_reset() -> None:
    stats = GenerationStatsRecorder()
    sched = Scheduler(max_batch_size=4, max_tokens_in_flight=100, max_queue=4, eos_token_ids=[EOS], stats=stats)
    f = RequestFactory(ExportTokenizer(Path("/x"), None), VOCAB, 100, 100, 5, None)
    reqs = [f.build([i + 1], SamplingParams(), None, None, 0.0) for i in range(4)]
    sched.rows = reqs[:3]
    # row 1 left; one joins and fits the cache (length 6): written into slot 1, no copy
    plan = sched.place([0, 2], [reqs[3]], [4], 6, lambda: 1000)
    assert plan.slots == [1] and plan.rebuild is None and sched.rows == [reqs[0], reqs[3], reqs[2]]
    # a joining row longer than the cache: one rebuild keeps 0 and 2 and appends it
    sched.rows = reqs[:3]
    plan = sched.place([0, 2], [reqs[3]], [9], 6, lambda: 1000)
    assert plan.slots == [] and plan.rebuild == [0, 2] and plan.append
    assert sched.rows == [reqs[0], reqs[2], reqs[3]]
    # a row left, nobody joins: dropped only when the copy is worth it
    sched.rows = reqs[:3]
    sched.cost = CompactionCost(copy_s_per_byte=1.0, step_s=1e-3)
    assert sched.place([0, 2], [], [], 6, lambda: 1000).rebuild is None
    sched.cost = CompactionCost(copy_s_per_byte=0.0, step_s=1e-3)
    plan = sched.place([0, 2], [], [], 6, lambda: 1000)
    assert plan.rebuild == [0, 2] and not plan.append and plan.copy_bytes == 1000 * 2 // 3
    # nothing left at all
    assert sched.place([], [], [], 6, lambda: 1000).reset and sched.rows == []
    snap = stats.snapshot(0)
    assert snap.slot_reuses == 1 and snap.cache_copies == 2


def test_deadline_while_queued_and_while_generating() -> None:
    h = Harness(max_rows=1)
    running = h.submit([3, 4], 50, timeout_s=10.0)
    queued = h.submit([5, 6], 5, timeout_s=2.0)
    h.step()
    h.step()
    h.clock.now += 3.0  # the queued one's deadline passes; the running one goes on
    h.step()
    with pytest.raises(RequestTimeoutError, match="while queued"):
        queued.result(0)
    assert not running.done()
    h.clock.now += 10.0
    h.step()
    with pytest.raises(RequestTimeoutError) as info:
        running.result(0)
    partial = info.value.partial  # type: ignore[attr-defined]
    assert partial.finish_reason == "timeout" and list(partial.token_ids) == alone([3, 4], 50)[: len(partial.token_ids)]
    snap = h.stats.snapshot(h.sched.queued)
    assert snap.timed_out == 2 and snap.errors == {"RequestTimeoutError": 2}


def test_cancelled_requests_free_their_row_and_are_counted() -> None:
    h = Harness(max_rows=2)
    a, b = h.submit([1, 2], 30), h.submit([3, 4], 30)
    waiting = h.submit([5], 4)
    h.step()
    assert waiting.cancel() is True  # still queued
    assert a.cancel() is True  # running: its row is freed at the next step
    h.run()
    assert b.done() and list(b.result(0).token_ids) == alone([3, 4], 30)
    snap = h.stats.snapshot(0)
    assert snap.cancelled == 2 and snap.completed == 1 and snap.failed == 0


def test_queue_full_and_closed_are_refused_at_submit() -> None:
    h = Harness(max_queue=2)
    h.submit([1], 2)
    h.submit([2], 2)
    with pytest.raises(QueueFullError):
        h.submit([3], 2)
    assert h.stats.snapshot(h.sched.queued).rejected == 1
    h.sched.close(drain=True)
    with pytest.raises(SessionClosedError):
        h.submit([4], 2)
    h.run()  # draining: what was queued still runs, then the loop stops
    assert not h.step()
    assert h.stats.snapshot(0).completed == 2


def test_close_without_draining_fails_queued_and_active() -> None:
    h = Harness(max_rows=1)
    active, queued = h.submit([1, 2], 40), h.submit([3], 4)
    h.step()
    h.sched.close(drain=False)
    assert not h.step()
    for f in (active, queued):
        with pytest.raises(SessionClosedError, match="without draining"):
            f.result(0)
    assert h.sched.rows == []


def test_eos_stop_and_length_and_a_failing_callback() -> None:
    first = next_token([1, 2])
    h = Harness(eos_token_ids=[first])  # the first generated token is EOS
    stopped = h.submit([1, 2], 10)
    seen: list[StreamToken] = []
    length = h.submit([3], 3, on_token=seen.append)

    def boom(tok: StreamToken) -> None:
        raise RuntimeError("callback failed")

    bad = h.submit([4, 5], 6, on_token=boom)
    h.run()
    assert stopped.result(0).finish_reason == "stop" and list(stopped.result(0).token_ids) == [first]
    assert length.result(0).finish_reason == "length" and [t.token_id for t in seen] == alone([3], 3)
    assert seen[-1].finish_reason == "length" and [t.index for t in seen] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="callback failed"):
        bad.result(0)
    assert h.stats.snapshot(0).errors == {"RuntimeError": 1}


def test_prefill_groups_bound_padding() -> None:
    h = Harness(prefill_padding=0.25)
    reqs = [h.factory.build([1] * n, SamplingParams(), None, None, 0.0) for n in (10, 2, 11, 3, 12, 40)]
    groups = h.sched.prefill_groups(reqs)
    assert [[len(r.prompt) for r in g] for g in groups] == [[2, 3], [10, 11, 12], [40]]
    for g in groups:
        longest = max(len(r.prompt) for r in g)
        assert longest * len(g) <= 1.25 * sum(len(r.prompt) for r in g)


def test_params_are_checked_and_the_keywords_build_them() -> None:
    base = SamplingParams(temperature=0.7, top_p=0.9, stop="\n", seed=3)
    assert base.stop == ("\n",)
    merged = sampling_params(base, 12, {"top_k": 5})
    assert (merged.temperature, merged.top_k, merged.top_p, merged.max_new_tokens, merged.seed) == (0.7, 5, 0.9, 12, 3)
    assert sampling_params(None, None, {"stop": None}) == SamplingParams()
    with pytest.raises(TypeError, match="temprature"):
        sampling_params(None, None, {"temprature": 1.0})
    for bad in ({"temperature": -1}, {"top_k": 0}, {"top_p": 1.5}, {"max_new_tokens": 0}, {"stop": [""]}, {"seed": -1}):
        with pytest.raises(InvalidInputError) as info:
            SamplingParams(**bad)
        assert info.value.input_name == next(iter(bad))
    h = Harness()
    with pytest.raises(InvalidInputError, match="need a tokenizer"):
        h.submit([1], 3, stop="x")
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        h.submit([VOCAB], 3)
    with pytest.raises(InvalidInputError, match="context of 200"):
        h.submit([1] * 190, 20)


def test_the_scheduler_never_imports_onnxruntime() -> None:
    """The scheduler, requests and stats are pure Python: run this module's harness in a
    fresh interpreter and check that onnxruntime was never imported."""
    code = (
        "import sys, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('t', {str(Path(__file__))!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.test_rows_that_join_and_leave_keep_their_own_history()\n"
        "m.test_deadline_while_queued_and_while_generating()\n"
        "assert 'onnxruntime' not in sys.modules, 'onnxruntime was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_stop_string_completed_by_the_last_token_ends_with_stop_not_length() -> None:
    """The last allowed token completes a stop string but ends in half a character: the tail
    decoded at the end holds the match, so the completion stopped on it (finish "stop"), as
    its stop_sequence says."""
    from ortbatch.generation.text import TextTracker

    pieces = {5: b"a", 6: b"b\xc3"}  # "b" and the first byte of "é"
    h = Harness()
    req = h.factory.build([1, 2], sampling_params(None, 2, {}), None, None, h.clock())
    req.tracker = TextTracker(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", "replace"), ["ab"])
    assert not h.sched.record_token(req, 5)
    assert h.sched.record_token(req, 6)
    done = req.future.result(0)
    assert (done.text, done.stop_sequence, done.finish_reason) == ("", "ab", "stop")
