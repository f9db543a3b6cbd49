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


def _matmul_model(path, k: int = 1024) -> str:
    """x [batch, k] @ W [k, k]: TF32 rounds the inputs of this product on CUDA."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, k)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", k])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def test_cuda_sessions_have_fallback_off_and_report_their_device(echo_path):
    from ortbatch._ort import device_of

    with BatchedSession(str(echo_path), providers=[("CUDAExecutionProvider", {"device_id": 0})]) as bs:
        assert bs.session._enable_fallback is False
        assert device_of(bs.session) == ("cuda", 0)
        assert bs._executor.device_id == 0


def test_tf32_is_what_the_tolerances_say(tmp_path):
    # defect 8, on the hardware: CUDA's default (TF32) is within the TF32 tolerance of CPU
    # fp32 and use_tf32=0 within the fp32 one; the output tolerance comes from the provider.
    from ortbatch._ort import output_tolerance

    path = _matmul_model(tmp_path / "mm.onnx")
    x = np.random.default_rng(1).standard_normal((16, 1024)).astype(np.float32) / 32
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    diffs = {}
    for tf32 in ("1", "0"):
        opts = {"use_tf32": tf32}
        with BatchedSession(path, providers=[("CUDAExecutionProvider", opts), "CPUExecutionProvider"]) as bs:
            got = bs.run(None, {"x": x[:1]})[0]
            diffs[tf32] = float(np.abs(got - want[:1]).max())
            assert diffs[tf32] <= output_tolerance("CUDAExecutionProvider", opts), diffs
    assert diffs["0"] <= diffs["1"], diffs
    print("max |CUDA - CPU| on a 1024-deep fp32 MatMul:", diffs)


def test_tensorrt_without_its_libraries_is_a_provider_error_with_the_real_reason(echo_path):
    from ortbatch._ort.probe import loads
    from ortbatch.errors import ProviderError

    if loads("TensorrtExecutionProvider"):
        pytest.skip("TensorRT loads here; nothing to refuse")
    with pytest.raises(ProviderError, match=r"TensorRT|Tensorrt"):
        BatchedSession(str(echo_path), providers="trt")


def test_cuda_warmup_then_serves_exact_results(echo_path):
    feeds = [make_feed(i, 1 + i % 17, 1 + i % 3) for i in range(64)]
    plain = ort.InferenceSession(str(echo_path), providers=["CPUExecutionProvider"])
    with BatchedSession(str(echo_path), providers="cuda", warmup=True) as bs:
        assert not bs.stats().errors
        futs = [bs.submit(f) for f in feeds]
        for f, fut in zip(feeds, futs, strict=True):
            for g, w in zip(fut.result(60), plain.run(None, f), strict=True):
                assert np.array_equal(g, w)
