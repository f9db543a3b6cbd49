"""Every request ends in its outputs or one typed error; bad input never hurts others."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import textwrap
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ortbatch import (
    BatchedSession,
    InferenceError,
    InvalidInputError,
    ModelContractError,
    OrtBatchError,
    ProviderError,
    QueueFullError,
    RequestTimeoutError,
    SessionClosedError,
)
from tests.models import echo_reference, fixed_batch_model, scalar_output_model
from tests.runtime.helpers import GatedSession, PoisonSession


def good(rid: int = 1, length: int = 4, rows: int = 1) -> dict:
    return {
        "input_ids": np.full((rows, length), rid, np.int64),
        "attention_mask": np.ones((rows, length), np.int64),
        "extra": np.zeros((rows, 3), np.float32),
    }


def with_(**changes) -> dict:
    f = good()
    for k, v in changes.items():
        if v is _DROP:
            del f[k]
        else:
            f[k] = v
    return f


_DROP = object()

BAD_INPUTS = {
    "missing input": (with_(extra=_DROP), "extra"),
    "unknown input": ({**good(), "token_type_ids": np.zeros((1, 4), np.int64)}, "token_type_ids"),
    "wrong dtype": (with_(input_ids=np.ones((1, 4), np.int32)), "input_ids"),
    "float for int": (with_(attention_mask=np.ones((1, 4), np.float32)), "attention_mask"),
    "wrong rank": (with_(input_ids=np.ones((4,), np.int64)), "input_ids"),
    "rank too high": (with_(extra=np.zeros((1, 3, 1), np.float32)), "extra"),
    "batch dims differ": (with_(extra=np.zeros((2, 3), np.float32)), "extra"),
    "ragged lengths differ": (with_(attention_mask=np.ones((1, 5), np.int64)), "attention_mask"),
    "fixed dim wrong": (with_(extra=np.zeros((1, 4), np.float32)), "extra"),
    "zero rows": (
        {
            "input_ids": np.ones((0, 4), np.int64),
            "attention_mask": np.ones((0, 4), np.int64),
            "extra": np.zeros((0, 3), np.float32),
        },
        "input_ids",
    ),
    "empty sequence": (
        with_(input_ids=np.ones((1, 0), np.int64), attention_mask=np.ones((1, 0), np.int64)),
        "input_ids",
    ),
    "None": (with_(input_ids=None), "input_ids"),
    "not an array": (with_(input_ids="hello"), "input_ids"),
    "object array": (with_(extra=np.array([[object(), 1, 2]], dtype=object)), "extra"),
    "too many rows": (good(rows=40), "input_ids"),
}


@pytest.fixture(scope="module")
def bs(echo_path):
    with BatchedSession(str(echo_path), max_batch_size=32) as s:
        yield s


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_named_and_session_keeps_serving(bs, case):
    feed, name = BAD_INPUTS[case]
    with pytest.raises(InvalidInputError) as info:
        bs.run(None, feed)
    assert isinstance(info.value, ValueError)
    assert name in str(info.value), str(info.value)
    assert info.value.input_name == name
    out = bs.run(["pooled"], good(rid=3, length=5))
    assert out[0].tolist() == [[15]]


def test_not_a_mapping(bs):
    with pytest.raises(InvalidInputError, match="mapping"):
        bs.run(None, [np.ones((1, 4))])


def test_unknown_output_name(bs):
    with pytest.raises(InvalidInputError, match="unknown output 'nope'"):
        bs.run(["nope"], good())
    with pytest.raises(InvalidInputError, match="list of names"):
        bs.run("hidden", good())
    with pytest.raises(InvalidInputError, match="unknown output"):
        bs.run([["pooled"]], good())  # not a name (unhashable): typed, not a TypeError


def test_empty_output_names_mean_all_as_in_onnxruntime(bs, echo_path):
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    want = plain.run([], good())
    for got in (bs.run([], good()), bs.submit(good(), []).result(10)):
        assert len(got) == len(want) == 3
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g, w)


def test_over_the_length_limit(tmp_path, echo_path):
    from ortbatch.manifest import InputSpec, Manifest, OutputSpec

    (tmp_path / "model.onnx").write_bytes(echo_path.read_bytes())
    Manifest(
        inputs={
            "input_ids": InputSpec("int64", ("batch", "sequence"), 0),
            "attention_mask": InputSpec("int64", ("batch", "sequence"), 0),
            "extra": InputSpec("float32", ("batch", None), 0),
        },
        outputs={"hidden": OutputSpec(("batch", "sequence", None))},
        limits={"max_batch_size": 8, "max_sequence_length": 16},
    ).save(tmp_path)
    with BatchedSession(str(tmp_path)) as s:
        assert s.max_batch_size == 8
        s.run(None, good(length=16))
        with pytest.raises(InvalidInputError, match=r"input_ids.*17.*limit of 16"):
            s.run(None, good(length=17))


def test_lists_are_accepted_when_they_convert_exactly(bs):
    f = good()
    f["input_ids"] = [[1, 1, 1, 1]]
    assert bs.run(["pooled"], f)[0].tolist() == [[4]]


def test_list_values_that_do_not_fit_the_dtype_are_refused(bs, tmp_path):
    f = good()
    f["extra"] = [[1e300, 0.0, 0.0]]  # float32 would make it inf
    with pytest.raises(InvalidInputError, match="does not fit") as info:
        bs.run(None, f)
    assert info.value.input_name == "extra"
    f["extra"] = [[0.1, 2, 3]]  # rounding to float32 is fine
    assert np.array_equal(bs.run(["extra_out"], f)[0], np.array([[0.2, 4, 6]], np.float32))
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.INT32, ["batch", 2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT32, ["batch", 2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "id32", [x], [y])
    path = tmp_path / "id32.onnx"
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    with BatchedSession(str(path)) as s:
        assert s.run(None, {"x": [[1, -2]]})[0].tolist() == [[1, -2]]
        with pytest.raises(InvalidInputError, match="does not fit"):
            s.run(None, {"x": [[2**31, 0]]})  # would wrap around to -2**31
        # a list of booleans is refused for a number input, as an array of them is
        for value in ([[True, False]], np.array([[True, False]])):
            with pytest.raises(InvalidInputError, match="bool") as info:
                s.run(None, {"x": value})
            assert info.value.input_name == "x"


def test_queue_full_carries_numbers(echo_path):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    with BatchedSession(sess, workers=1, max_queue=2) as s:
        first = s.submit(good())
        assert sess.entered.wait(10)
        queued = [s.submit(good(2)), s.submit(good(3))]
        with pytest.raises(QueueFullError) as info:
            s.submit(good(4))
        assert (info.value.queued, info.value.max_queue) == (2, 2)
        sess.gate.set()
        for f in [first, *queued]:
            f.result(10)
        s.run(None, good(5))  # serving again


def test_deadline_passes_while_queued(echo_path):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    with BatchedSession(sess, workers=1) as s:
        first = s.submit(good())
        assert sess.entered.wait(10)
        with pytest.raises(RequestTimeoutError) as info:
            s.run(None, good(2), timeout_s=0.05)  # the worker is held: it cannot start
        assert isinstance(info.value, TimeoutError)
        late = s.submit(good(3), timeout_s=0.01)
        keep = s.submit(good(4))
        with pytest.raises(concurrent.futures.TimeoutError):
            late.result(0.05)  # still held, deadline passed meanwhile
        sess.gate.set()
        first.result(10)
        with pytest.raises(RequestTimeoutError):
            late.result(10)  # reaped by the worker, never run
        keep.result(10)
        ran = [int(b["input_ids"].max()) for b in sess.batches]
        assert 2 not in ran and 3 not in ran
        assert s.stats().errors.get("RequestTimeoutError") == 2


@pytest.mark.timeout(60)
def test_deadline_passes_with_nothing_else_queued(echo_path):
    # The worker reaps the expired request and finds the queue empty: the request must
    # hear of its timeout then, not when some later batch (or close) comes along.
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    with BatchedSession(sess, workers=1) as s:
        first = s.submit(good())
        assert sess.entered.wait(10)
        late = s.submit(good(3), timeout_s=1e-9)  # expired before the worker is free
        sess.gate.set()
        first.result(10)
        with pytest.raises(RequestTimeoutError):
            late.result(10)
        with BatchedSession(str(echo_path), workers=1) as idle, pytest.raises(RequestTimeoutError):
            idle.submit(good(), timeout_s=1e-9).result(10)


@pytest.mark.timeout(60)
def test_caller_may_refill_its_arrays_once_submitted(echo_path):
    # submit, submit_many, submit_each and run_async return before the batch is built:
    # a caller reusing its buffers must still get the answer for what it sent.
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    with BatchedSession(sess, workers=1) as s:
        first = s.submit(good(9))
        assert sess.entered.wait(10)
        buf = good(1)
        futs = [s.submit(buf), *s.submit_many([buf]), *s.submit_each([(buf, None, None)])]

        async def main():
            built = asyncio.Event()

            async def call():
                built.set()  # run_async builds its request in this same step
                return await s.run_async(None, buf)

            task = asyncio.ensure_future(call())
            await built.wait()
            buf["input_ids"][:] = 42
            buf["extra"][:] = 5.0
            sess.gate.set()
            return await task

        result = asyncio.run(main())
        first.result(10)
        want = echo_reference(*good(1).values())
        for out in [result] + [f.result(10) for f in futs]:
            for g, w in zip(out, want, strict=True):
                assert np.array_equal(g, w)


@pytest.mark.timeout(60)
def test_run_from_a_done_callback_on_the_only_worker(echo_path):
    # A done-callback runs on the worker settling the batch; a run() there used to queue
    # its request for that same worker, which waited for it forever.
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    s = BatchedSession(sess, workers=1)
    try:
        first = s.submit(good(1))
        assert sess.entered.wait(10)
        second = s.submit(good(2))
        got: list = []
        done = threading.Event()

        def chained(_fut):
            try:
                got.append(s.run(["pooled"], good(7)))
            finally:
                done.set()

        second.add_done_callback(chained)
        sess.gate.set()
        assert done.wait(10), "run() in a done-callback never returned"
        assert got[0][0].tolist() == [[28]]
        first.result(10)
        assert s.run(["pooled"], good(3))[0].tolist() == [[12]]  # still serving
        assert s.stats().requests == 4 and s.stats().completed == 4
    finally:
        s.close(drain=False, timeout=10)


def test_async_deadline(echo_path):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    with BatchedSession(sess, workers=1) as s:
        first = s.submit(good())
        assert sess.entered.wait(10)

        async def main():
            with pytest.raises(RequestTimeoutError):
                await s.run_async(None, good(2), timeout_s=0.05)

        asyncio.run(main())
        sess.gate.set()
        first.result(10)


def test_cancelled_future_and_task_are_dropped_before_running(echo_path):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    with BatchedSession(sess, workers=1) as s:
        first = s.submit(good())
        assert sess.entered.wait(10)
        doomed = s.submit(good(7))
        assert doomed.cancel()

        async def main():
            task = asyncio.ensure_future(s.run_async(None, good(8)))
            await asyncio.sleep(0)  # let it enqueue
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        survivor = s.submit(good(9))
        sess.gate.set()
        first.result(10)
        survivor.result(10)
        ran = {int(v) for b in sess.batches for v in b["input_ids"].max(axis=1)}
        assert 7 not in ran and 8 not in ran and 9 in ran


def test_poisoned_row_fails_alone(echo_path):
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    poison = PoisonSession(plain)
    gate = GatedSession(poison)
    with BatchedSession(gate, workers=1) as s:
        first = s.submit(good())
        assert gate.entered.wait(10)
        futs = {i: s.submit(good(i, length=3 + i % 5)) for i in range(10, 26)}
        bad = s.submit(good(-7, length=4))
        gate.gate.set()
        first.result(10)
        with pytest.raises(InferenceError, match="poisoned"):
            bad.result(10)
        for i, f in futs.items():
            assert f.result(10)[1].tolist() == [[i * (3 + i % 5)]]
        st = s.stats()
        assert st.errors == {"InferenceError": 1}
        assert st.completed == 17


def test_real_ort_failure_out_of_vocab_fails_alone(embed_path):
    sess = GatedSession(ort.InferenceSession(str(embed_path), providers=["CPUExecutionProvider"]))
    with BatchedSession(sess, workers=1) as s:
        first = s.submit({"input_ids": np.ones((1, 3), np.int64), "attention_mask": np.ones((1, 3), np.int64)})
        assert sess.entered.wait(10)
        ok = [
            s.submit({"input_ids": np.full((1, n), n, np.int64), "attention_mask": np.ones((1, n), np.int64)})
            for n in range(1, 9)
        ]
        bad = s.submit({"input_ids": np.array([[5, 100000]], np.int64), "attention_mask": np.ones((1, 2), np.int64)})
        sess.gate.set()
        first.result(10)
        # ORT's INVALID_ARGUMENT maps to the more specific InvalidInputError (a 400, not a 500)
        with pytest.raises(InvalidInputError, match="out of data bounds") as info:
            bad.result(10)
        assert type(info.value.__cause__).__name__ == "InvalidArgument"  # the original ORT exception
        for f in ok:
            f.result(10)


def test_close_drain_completes_queued(echo_path, no_thread_leak):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    s = BatchedSession(sess, workers=2)
    futs = [s.submit(good(i)) for i in range(1, 50)]
    releaser = threading.Timer(0.05, sess.gate.set)
    releaser.start()
    s.close(drain=True)
    releaser.join()
    assert all(f.done() and f.exception() is None for f in futs)
    with pytest.raises(SessionClosedError):
        s.submit(good())
    with pytest.raises(SessionClosedError):
        s.run(None, good())
    s.close()  # twice is fine
    assert s.closed


def test_close_without_drain_fails_queued(echo_path, no_thread_leak):
    sess = GatedSession(ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"]))
    s = BatchedSession(sess, workers=1)
    first = s.submit(good())
    assert sess.entered.wait(10)
    queued = [s.submit(good(i)) for i in range(2, 12)]
    closer = threading.Thread(target=s.close, kwargs={"drain": False})
    closer.start()
    for f in queued:
        with pytest.raises(SessionClosedError):
            f.result(10)
    sess.gate.set()  # the running batch still completes
    closer.join(10)
    assert first.result(10)[1].tolist() == [[4]]
    assert not closer.is_alive()


def test_process_exits_without_close(echo_path):
    code = textwrap.dedent(
        f"""
        import numpy as np
        from ortbatch import BatchedSession
        bs = BatchedSession({str(echo_path)!r}, workers=2)
        f = {{"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64),
              "extra": np.zeros((1, 3), np.float32)}}
        futs = [bs.submit(f) for _ in range(100)]
        print(bs.run(["pooled"], f)[0].tolist())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[4]]"


def test_model_contract_errors_at_construction(tmp_path, echo_path):
    with pytest.raises(ModelContractError, match="'total' is a scalar"):
        BatchedSession(str(scalar_output_model(tmp_path / "s.onnx")))
    with pytest.raises(ModelContractError, match="fixed batch dimension of 1"):
        BatchedSession(str(fixed_batch_model(tmp_path / "f.onnx")))
    with pytest.raises(ModelContractError, match="unknown input"):
        BatchedSession(str(echo_path), pad_values={"nope": 1})
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchedSession(str(echo_path), max_batch_size=0)
    with pytest.raises(ValueError, match="padding_side"):
        BatchedSession(str(echo_path), padding_side="middle")
    with pytest.raises(FileNotFoundError):
        BatchedSession(str(tmp_path / "missing.onnx"))


def test_gpu_provider_fallback_is_an_error(echo_path):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here: no fallback to provoke")
    with pytest.raises(ProviderError, match="CUDAExecutionProvider"):
        BatchedSession(str(echo_path), providers="cuda")
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    with pytest.raises(ProviderError):
        BatchedSession(plain, providers=["CUDAExecutionProvider"])


def test_every_error_is_an_ortbatch_error():
    for cls in (InvalidInputError, QueueFullError, RequestTimeoutError, SessionClosedError, InferenceError):
        assert issubclass(cls, OrtBatchError)


def test_out_of_vocab_on_the_default_path_is_typed_and_fails_alone(embed_path):
    # The real executor path (no wrapper); on a device IOBinding would report a plain RuntimeError.
    with BatchedSession(str(embed_path), workers=1) as s:
        good_futs = [
            s.submit({"input_ids": np.full((1, n), n, np.int64), "attention_mask": np.ones((1, n), np.int64)})
            for n in range(1, 30)
        ]
        bad = s.submit({"input_ids": np.array([[5, 100000]], np.int64), "attention_mask": np.ones((1, 2), np.int64)})
        more = [
            s.submit({"input_ids": np.full((1, n), n, np.int64), "attention_mask": np.ones((1, n), np.int64)})
            for n in range(1, 30)
        ]
        with pytest.raises(InvalidInputError, match="out of data bounds"):
            bad.result(30)
        for f in good_futs + more:
            f.result(30)
        assert s.stats().errors == {"InvalidInputError": 1}
