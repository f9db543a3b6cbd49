"""Provider parity on a real GPU: the checks on CUDA and TensorRT fp16 (skipped without
them), and, on any machine, how the checks build their provider sessions."""

from __future__ import annotations

import json

import pytest

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


def _manifest(tmp_path):
    from ortbatch.manifest import Manifest

    data = {
        "format": 1,
        "model": "encoder_model.onnx",
        "source": {"dtype": "fp32"},
        "providers": [[TRT, {"trt_fp16_enable": False, "trt_profile_min_shapes": "input_ids:1x1"}], [CUDA, {}]],
        "components": {
            "encoder_model": {"model": "encoder_model.onnx", "tensorrt": {"trt_profile_min_shapes": "input_ids:1x1"}},
            "decoder_model": {
                "model": "decoder_model.onnx",
                "tensorrt": {
                    "trt_profile_min_shapes": "input_ids:1x1,encoder_hidden_states:1x1x8",
                    "trt_engine_cache_path": "trt_cache/dec/engines",
                },
            },
        },
    }
    (tmp_path / "ortbatch.json").write_text(json.dumps(data))
    return Manifest.load(tmp_path)


def test_fp32_checks_turn_tf32_off_on_cuda_and_use_each_components_profiles(tmp_path, monkeypatch):
    # defects 8 and 6: fp32 parity is checked in fp32 (the CUDA EP runs TF32 by default),
    # and an encoder-decoder's decoder gets its own TensorRT profiles, not the encoder's
    import onnxruntime as ort

    from ortbatch.export import checks

    monkeypatch.setattr(ort, "get_available_providers", lambda: [TRT, CUDA, CPU])
    m = _manifest(tmp_path)
    chain = dict(checks.runner.chain_for(CUDA, m, "encoder_model", "fp32"))
    assert chain[CUDA]["use_tf32"] == "0" and list(chain) == [CUDA, CPU]
    assert "use_tf32" not in dict(checks.runner.chain_for(CUDA, m, "encoder_model", "fp16"))[CUDA]
    dec = dict(checks.runner.chain_for(TRT, m, "decoder_model", "fp32"))
    assert list(dec) == [TRT, CUDA, CPU]
    assert dec[TRT]["trt_profile_min_shapes"] == "input_ids:1x1,encoder_hidden_states:1x1x8"
    assert dec[TRT]["trt_engine_cache_path"] == str(tmp_path / "trt_cache/dec/engines")
    assert dec[TRT]["trt_fp16_enable"] is False  # the manifest's other options still apply


def test_validate_refuses_an_unknown_provider_before_loading_anything(tmp_path):
    from ortbatch.errors import ProviderError
    from ortbatch.export.checks import validate

    _manifest(tmp_path)
    with pytest.raises(ProviderError, match="unknown execution provider 'foo'"):
        validate(tmp_path, providers="cpu,foo")


def _require(provider: str) -> None:
    # a probe session decides, not get_available_providers(): the onnxruntime-gpu wheel
    # lists TensorRT on machines without its libraries (that is a skip, not a failure)
    pytest.importorskip("onnxruntime")
    from ortbatch._ort.probe import loads

    if not loads(provider):
        pytest.skip(f"{provider} does not load here")


@pytest.mark.export
@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_export_passes_every_check_on_cuda(exported) -> None:
    _require("CUDAExecutionProvider")
    res = exported("bert-cls", device="cuda")
    assert res.report.passed, res.report.format_table(verbose=True)
    by = {(c.name, c.provider): c.status for c in res.report.checks}
    assert by[("provider_parity", "CUDAExecutionProvider")] == "passed"  # really ran on CUDA
    assert by[("batching_invariance", "CUDAExecutionProvider")] == "passed"


@pytest.mark.export
@pytest.mark.gpu
@pytest.mark.slow
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


@pytest.mark.export
@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_batched_session_uses_the_manifest_providers(exported) -> None:
    _require("CUDAExecutionProvider")
    from ortbatch import BatchedSession

    res = exported("bert", device="cuda")
    with BatchedSession(res.directory, providers="cuda") as bs:
        assert bs.get_providers()[0] == "CUDAExecutionProvider"
