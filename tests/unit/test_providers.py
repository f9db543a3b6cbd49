"""Provider resolution: shortcuts, manifest options (TensorRT profiles), checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ortbatch.errors import ProviderError
from ortbatch.runtime.executor import check_providers, resolve_providers

TRT_OPTS = {"trt_fp16_enable": True, "trt_engine_cache_enable": True, "trt_profile_min_shapes": "input_ids:1x1"}


def test_shortcuts():
    assert resolve_providers("cpu") == [("CPUExecutionProvider", {})]
    assert [n for n, _ in resolve_providers("cuda")] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert [n for n, _ in resolve_providers("tensorrt")] == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]


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
    assert got[0] == ("TensorrtExecutionProvider", TRT_OPTS)
    assert got[1] == ("CUDAExecutionProvider", {})


def test_explicit_options_win_over_the_manifest():
    mine = {"trt_fp16_enable": False}
    got = resolve_providers([("TensorrtExecutionProvider", mine)], [["TensorrtExecutionProvider", TRT_OPTS]])
    assert got[0] == ("TensorrtExecutionProvider", mine)


def test_auto_is_cpu_without_cuda():
    import onnxruntime as ort

    names = [n for n, _ in resolve_providers(None)]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert names[0] == "CUDAExecutionProvider"
    else:
        assert names == ["CPUExecutionProvider"]


def test_fallback_detected():
    sess = SimpleNamespace(get_providers=lambda: ["CPUExecutionProvider"])
    with pytest.raises(ProviderError, match="TensorrtExecutionProvider"):
        check_providers(sess, resolve_providers("trt"))
    check_providers(sess, resolve_providers("cpu"))


def test_bad_entry():
    with pytest.raises(ProviderError, match="cannot read"):
        resolve_providers([42])


def test_relative_trt_cache_paths_resolve_under_the_export_dir(tmp_path):
    entry = ["TensorrtExecutionProvider", {"trt_engine_cache_enable": True, "trt_engine_cache_path": "trt/engines"}]
    got = resolve_providers("trt", [entry], tmp_path)
    assert got[0][1]["trt_engine_cache_path"] == str(tmp_path / "trt" / "engines")
    assert (tmp_path / "trt" / "engines").is_dir()
    assert got[1] == ("CUDAExecutionProvider", {})
