"""TensorRT provider options: profile shapes from the limits, cache keys, relocatable paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ortbatch._ort.trt import (
    TRT_PROVIDER,
    TrtShapes,
    check_generation_profiles,
    check_trt_graph,
    parse_profile_shapes,
    resolve_cache_paths,
    tensorrt_provider_options,
)
from ortbatch.errors import ProviderError
from ortbatch.manifest import model_hash

ENCODER = {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
DECODER = {
    "input_ids": ["batch", "sequence"],
    "attention_mask": ["batch", "total_sequence"],
    "past_key_values.0.key": ["batch", 12, "past_sequence", 64],
}


def _opts(inputs=ENCODER, shapes=None, **kw):
    args = {"fp16": False, "model_digest": "abc", "ort_version": "1.32.0", **kw}
    return tensorrt_provider_options(inputs, shapes or TrtShapes(64, 512), **args)


def test_profile_spans_one_to_the_limits_and_optimises_for_full_batches() -> None:
    o = _opts()
    assert o["trt_profile_min_shapes"] == "input_ids:1x1,attention_mask:1x1"
    assert o["trt_profile_opt_shapes"] == "input_ids:64x128,attention_mask:64x128"
    assert o["trt_profile_max_shapes"] == "input_ids:64x512,attention_mask:64x512"
    assert o["trt_fp16_enable"] is False
    assert o["trt_engine_cache_enable"] is True and o["trt_timing_cache_enable"] is True


def test_explicit_opt_shapes_and_fixed_axes_and_two_decoder_profiles() -> None:
    o = _opts(DECODER, TrtShapes(8, 1024, opt_batch_size=4, opt_sequence_length=256), fp16=True)
    prefill, decode = (
        "input_ids:1x1,attention_mask:1x1,past_key_values.0.key:1x12x0x64",
        ("input_ids:1x1,attention_mask:1x2,past_key_values.0.key:1x12x1x64"),
    )
    assert o["trt_profile_min_shapes"] == f"{prefill},{decode}"  # empty cache at prefill
    assert o["trt_profile_opt_shapes"] == (
        "input_ids:4x256,attention_mask:4x256,past_key_values.0.key:4x12x0x64,"
        "input_ids:4x1,attention_mask:4x256,past_key_values.0.key:4x12x255x64"
    )
    assert o["trt_profile_max_shapes"].endswith("past_key_values.0.key:8x12x1023x64")
    assert o["trt_fp16_enable"] is True


@pytest.mark.parametrize("limits", [(64, 512, None, None), (8, 1024, 4, 256), (2, 2, 1, 1), (16, 128, 16, 1)])
def test_every_decoder_profile_shape_satisfies_mask_equals_past_plus_new(limits) -> None:
    # defect 6: at the opt shape the mask was shorter than past + input_ids (kOPT violates
    # the graph's shape constraints, so TensorRT refused to build)
    shapes = TrtShapes(*limits)
    o = _opts(DECODER, shapes)
    seen_past = set()
    for key in ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"):
        prof = parse_profile_shapes(o[key])
        assert len(prof["input_ids"]) == len(prof["attention_mask"]) == len(prof["past_key_values.0.key"]) == 2
        for ids, mask, past in zip(
            prof["input_ids"], prof["attention_mask"], prof["past_key_values.0.key"], strict=True
        ):
            assert mask[1] == past[2] + ids[1], (key, ids, mask, past)
            assert ids[0] == mask[0] == past[0]  # one batch size per shape
            seen_past.add(past[2])
    assert 0 in seen_past and shapes.max_sequence_length - 1 in seen_past  # prefill .. full context


def test_generation_refuses_tensorrt_without_profiles_covering_the_context() -> None:
    past = {"past_key_values.0.key": 2}
    good = _opts(DECODER, TrtShapes(8, 1024))
    check_generation_profiles([(TRT_PROVIDER, good)], past, 1024, 8)
    check_generation_profiles([("CUDAExecutionProvider", {})], past, 1024, 8)  # not TensorRT: nothing to check
    with pytest.raises(ProviderError, match="needs optimization profiles"):
        check_generation_profiles([(TRT_PROVIDER, {"trt_fp16_enable": True})], past, 1024, 8)
    with pytest.raises(ProviderError, match="max_context_length=1024"):
        check_generation_profiles([(TRT_PROVIDER, good)], past, 2048, 8)
    with pytest.raises(ProviderError, match="max_batch_size=8"):
        check_generation_profiles([(TRT_PROVIDER, good)], past, 1024, 32)


def test_tensorrt_with_fused_o2_graphs_is_refused() -> None:
    check_trt_graph(None)
    check_trt_graph("O1")
    for level in ("O2", "O3", "O4"):
        with pytest.raises(ValueError, match="split"):
            check_trt_graph(level)


@pytest.mark.parametrize(
    "change",
    [
        {"model_digest": "other"},
        {"ort_version": "1.33.0"},
        {"fp16": True},
        {"shapes": TrtShapes(32, 512)},
    ],
)
def test_cache_key_changes_with_model_runtime_shapes_and_precision(change) -> None:
    base = _opts()
    other = _opts(**change)
    assert base["trt_engine_cache_path"] != other["trt_engine_cache_path"]
    assert base["trt_timing_cache_path"] != other["trt_timing_cache_path"]
    assert _opts()["trt_engine_cache_path"] == base["trt_engine_cache_path"]  # deterministic


def test_cache_paths_are_relative_and_resolve_under_the_export(tmp_path: Path) -> None:
    o = _opts()
    assert not os.path.isabs(o["trt_engine_cache_path"]) and o["trt_engine_cache_path"].startswith("trt_cache/")
    r = resolve_cache_paths(o, tmp_path)
    assert r["trt_engine_cache_path"] == os.fspath(tmp_path / o["trt_engine_cache_path"])
    assert Path(r["trt_timing_cache_path"]).is_dir()  # TensorRT does not create it
    assert resolve_cache_paths(r, "/elsewhere") == r  # absolute paths are left alone


def test_invalid_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="opt_batch_size=65"):
        TrtShapes(64, 512, opt_batch_size=65)
    with pytest.raises(ValueError, match="positive"):
        TrtShapes(0, 512)
    with pytest.raises(ValueError, match="no role"):
        _opts({"x": ["batch", None]})


def test_model_hash_covers_external_data(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"graph")
    h1 = model_hash(tmp_path / "model.onnx")
    (tmp_path / "model.onnx_data").write_bytes(b"weights")
    h2 = model_hash(tmp_path / "model.onnx")
    (tmp_path / "model.onnx_data").write_bytes(b"weights2")
    assert len({h1, h2, model_hash(tmp_path / "model.onnx")}) == 3
