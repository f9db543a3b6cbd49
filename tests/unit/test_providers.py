"""Provider resolution: one shortcut table, spellings, manifest options merged per key,
the probed default, fallback checks."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ortbatch._ort import check_active, parse_provider_names, providers, resolve_providers
from ortbatch.errors import ProviderError

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
TRT_OPTS = {"trt_fp16_enable": True, "trt_engine_cache_enable": True, "trt_profile_min_shapes": "input_ids:1x1"}


def test_shortcuts():
    assert resolve_providers("cpu") == [(CPU, {})]
    assert [n for n, _ in resolve_providers("cuda")] == [CUDA, CPU]
    assert [n for n, _ in resolve_providers("gpu")] == [CUDA, CPU]
    assert [n for n, _ in resolve_providers("tensorrt")] == [TRT, CUDA, CPU]
    assert [n for n, _ in resolve_providers("TRT")] == [TRT, CUDA, CPU]


@pytest.mark.parametrize(
    "spec", ["cpu,cuda,trt", "cpu, cuda, tensorrt", "CPU,gpu,TensorrtExecutionProvider", [CPU, "cuda", "trt"]]
)
def test_every_spelling_names_the_same_providers(spec):
    assert parse_provider_names(spec) == [CPU, CUDA, TRT]


def test_a_comma_list_is_a_chain_in_order():
    assert [n for n, _ in resolve_providers("cuda, cpu")] == [CUDA, CPU]
    assert [n for n, _ in resolve_providers("trt,cpu")] == [TRT, CUDA, CPU]


@pytest.mark.parametrize("spec", ["foo", "cpu,foo", "cpu,,cuda", "", "FooExecutionProvider"])
def test_unknown_or_empty_provider_is_refused_naming_the_valid_ones(spec):
    with pytest.raises(ProviderError, match=r"cpu, cuda \(or gpu\), tensorrt \(or trt\)"):
        parse_provider_names(spec)
    with pytest.raises(ProviderError):
        resolve_providers(spec)


@pytest.mark.parametrize(
    "entry",
    [
        ["TensorrtExecutionProvider", TRT_OPTS],
        {"name": "TensorrtExecutionProvider", "options": TRT_OPTS},
        {"provider": "TensorrtExecutionProvider", "options": TRT_OPTS},
    ],
)
def test_manifest_options_fill_in_for_a_bare_request(entry):
    got = resolve_providers("trt", [entry, "CUDAExecutionProvider"])
    assert got[0] == (TRT, TRT_OPTS)
    assert got[1] == (CUDA, {})


def test_user_options_override_the_manifest_one_key_at_a_time():
    # defect 10: the user's dict used to replace the manifest's, dropping profiles and caches
    mine = {"trt_fp16_enable": False}
    got = resolve_providers([(TRT, mine)], [[TRT, TRT_OPTS]])
    assert got[0] == (TRT, {**TRT_OPTS, "trt_fp16_enable": False})
    assert got[0][1]["trt_profile_min_shapes"] == "input_ids:1x1"


def test_fallback_detected():
    sess = SimpleNamespace(get_providers=lambda: [CPU])
    with pytest.raises(ProviderError, match="TensorrtExecutionProvider"):
        check_active(sess, resolve_providers("trt"))
    check_active(sess, resolve_providers("cpu"))


def test_bad_entry():
    with pytest.raises(ProviderError, match="cannot read"):
        resolve_providers([42])


def test_relative_trt_cache_paths_resolve_under_the_export_dir(tmp_path):
    entry = [TRT, {"trt_engine_cache_enable": True, "trt_engine_cache_path": "trt/engines"}]
    got = resolve_providers("trt", [entry], tmp_path)
    assert got[0][1]["trt_engine_cache_path"] == str(tmp_path / "trt" / "engines")
    assert (tmp_path / "trt" / "engines").is_dir()
    assert got[1] == (CUDA, {})


@pytest.fixture
def gpu_build_without_gpu(monkeypatch):
    """onnxruntime-gpu on a machine without CUDA: the build lists CUDA, a probe gets CPU."""
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: [TRT, CUDA, CPU])
    probes = []

    def probe(names):
        probes.append(names)
        return (CPU,), "libcublasLt.so.13: cannot open shared object file"

    monkeypatch.setattr(providers, "probe_providers", probe)
    providers._default_names.cache_clear()
    yield probes
    providers._default_names.cache_clear()


def test_default_is_cpu_when_the_gpu_build_cannot_load_cuda_said_once(gpu_build_without_gpu, caplog):
    # defect 11: the default used to read get_available_providers() and then fail
    with caplog.at_level(logging.WARNING, logger="ortbatch"):
        assert resolve_providers(None) == [(CPU, {})]
        assert resolve_providers(None) == [(CPU, {})]
    said = [r for r in caplog.records if "running on CPU" in r.getMessage()]
    assert len(said) == 1 and "libcublasLt" in said[0].getMessage()
    assert gpu_build_without_gpu == [(CUDA, CPU)]  # probed once


def test_batched_session_from_a_path_runs_on_cpu_without_a_usable_gpu(gpu_build_without_gpu, echo_path):
    import numpy as np

    from ortbatch import BatchedSession

    with BatchedSession(str(echo_path)) as bs:
        assert bs.get_providers() == [CPU]
        feed = {
            "input_ids": np.array([[1, 2]], np.int64),
            "attention_mask": np.array([[1, 1]], np.int64),
            "extra": np.zeros((1, 3), np.float32),
        }
        assert bs.run(["pooled"], feed)[0].tolist() == [[3]]


def test_default_is_cuda_when_a_probe_session_gets_it(monkeypatch):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(providers, "probe_providers", lambda names: ((CUDA, CPU), ""))
    providers._default_names.cache_clear()
    try:
        assert [n for n, _ in resolve_providers(None)] == [CUDA, CPU]
    finally:
        providers._default_names.cache_clear()


def test_the_probe_model_is_the_identity_model_it_claims_to_be():
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], producer_name="ortbatch")
    m.ir_version = 8
    onnx.checker.check_model(m)
    assert m.SerializeToString() == providers._PROBE_MODEL
    assert providers.probe_providers((CPU,)) == ((CPU,), "")
