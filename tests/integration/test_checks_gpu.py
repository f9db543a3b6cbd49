"""Provider parity on a real GPU: the checks on CUDA and TensorRT fp16 (skipped without them)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.export, pytest.mark.gpu, pytest.mark.slow]


def _require(provider: str) -> None:
    # a probe session decides, not get_available_providers(): the onnxruntime-gpu wheel
    # lists TensorRT on machines without its libraries (that is a skip, not a failure)
    pytest.importorskip("onnxruntime")
    from ortbatch._ort.probe import loads

    if not loads(provider):
        pytest.skip(f"{provider} does not load here")


def test_cuda_export_passes_every_check_on_cuda(exported) -> None:
    _require("CUDAExecutionProvider")
    res = exported("bert-cls", device="cuda")
    assert res.report.passed, res.report.format_table(verbose=True)
    by = {(c.name, c.provider): c.status for c in res.report.checks}
    assert by[("provider_parity", "CUDAExecutionProvider")] == "passed"  # really ran on CUDA
    assert by[("batching_invariance", "CUDAExecutionProvider")] == "passed"


def test_tensorrt_fp16_profile_and_caches_work(exported) -> None:
    _require("TensorrtExecutionProvider")
    from ortbatch import validate

    res = exported("bert", trt=True, dtype="fp16", max_batch_size=8, max_sequence_length=128)
    report = validate(res.directory, providers=["trt"])
    assert report.passed, report.format_table(verbose=True)
    parity = next(c for c in report.checks if c.name == "provider_parity")
    assert parity.provider == "TensorrtExecutionProvider" and parity.status == "passed"
    assert parity.cases[0].comparisons[0].tolerance["atol"] == 2e-2  # fp16 engine, fp16 tolerances
    engines = res.directory / res.manifest.providers[0][1]["trt_engine_cache_path"]
    assert engines.is_dir() and any(engines.iterdir())  # the engine was cached under the hashed key


def test_gpu_batched_session_uses_the_manifest_providers(exported) -> None:
    _require("CUDAExecutionProvider")
    from ortbatch import BatchedSession

    res = exported("bert", device="cuda")
    with BatchedSession(res.directory, providers="cuda") as bs:
        assert bs.get_providers()[0] == "CUDAExecutionProvider"
