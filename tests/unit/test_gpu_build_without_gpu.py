"""onnxruntime-gpu installed, no usable GPU (CI runs this in the GPU check's dry run, with
the real 1.31.1 wheel; elsewhere it is skipped): everything runs on CPU and says so once;
an explicit GPU request is a ProviderError naming what is missing."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from ortbatch._ort import providers
from ortbatch._ort.probe import loads


def _gpu_build_without_gpu() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers() and not loads("CUDAExecutionProvider")


pytestmark = pytest.mark.skipif(not _gpu_build_without_gpu(), reason="needs onnxruntime-gpu on a machine without a GPU")


@pytest.fixture(autouse=True)
def _fresh_default():
    providers._default_names.cache_clear()
    yield
    providers._default_names.cache_clear()


def test_batched_session_runs_on_cpu_and_says_so_once(echo_path, caplog):
    from ortbatch import BatchedSession

    feed = {
        "input_ids": np.array([[1, 2]], np.int64),
        "attention_mask": np.ones((1, 2), np.int64),
        "extra": np.zeros((1, 3), np.float32),
    }
    with caplog.at_level(logging.WARNING, logger="ortbatch"):
        for _ in range(2):
            with BatchedSession(str(echo_path)) as bs:
                assert bs.get_providers() == ["CPUExecutionProvider"]
                assert bs.run(["pooled"], feed)[0].tolist() == [[3]]
    assert len([r for r in caplog.records if "running on CPU" in r.getMessage()]) == 1


@pytest.mark.parametrize("spec", [["cuda"], "cuda", ["CUDAExecutionProvider"]])
def test_an_explicit_cuda_request_names_what_is_missing(echo_path, spec):
    from ortbatch import BatchedSession
    from ortbatch.errors import ProviderError

    with pytest.raises(ProviderError, match="CUDAExecutionProvider"):
        BatchedSession(str(echo_path), providers=spec)


def test_tensorrt_request_surfaces_the_real_reason(echo_path):
    from ortbatch import BatchedSession
    from ortbatch.errors import ProviderError

    with pytest.raises(ProviderError, match=r"TensorRT|Tensorrt|not active"):
        BatchedSession(str(echo_path), providers="trt")


def test_batched_generator_runs_on_cpu(tmp_path):
    pytest.importorskip("onnx")
    from ortbatch import BatchedGenerator
    from ortbatch.errors import ProviderError
    from tests.generation.fake_decoder import build, reference

    d = build(tmp_path / "dec")
    with BatchedGenerator(d) as gen:
        assert gen.runner.session.get_providers() == ["CPUExecutionProvider"]
        assert list(gen.generate([5, 6], 4).token_ids) == reference([5, 6], 4)
    with pytest.raises(ProviderError, match="CUDAExecutionProvider"):
        BatchedGenerator(d, providers="cuda")
    shutil.rmtree(d)
