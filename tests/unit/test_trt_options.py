"""TensorRT provider options: profile shapes from the limits, cache keys, relocatable paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ortbatch.export.trt import TrtShapes, model_hash, resolve_cache_paths, tensorrt_provider_options

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


def test_explicit_opt_shapes_and_fixed_and_past_axes() -> None:
    o = _opts(DECODER, TrtShapes(8, 1024, opt_batch_size=4, opt_sequence_length=256), fp16=True)
    assert o["trt_profile_min_shapes"] == (
        "input_ids:1x1,attention_mask:1x1,past_key_values.0.key:1x12x0x64"
    )  # empty cache at prefill
    assert o["trt_profile_opt_shapes"] == "input_ids:4x256,attention_mask:4x256,past_key_values.0.key:4x12x256x64"
    assert o["trt_profile_max_shapes"].endswith("past_key_values.0.key:8x12x1024x64")
    assert o["trt_fp16_enable"] is True


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
