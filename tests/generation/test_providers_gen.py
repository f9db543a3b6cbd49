"""BatchedGenerator's sessions come from the one ONNX Runtime layer: the manifest's provider
options merged per key (defect 7), TensorRT refused without profiles that cover the
growing cache, a corrupt model one ModelLoadError (issue 13 item 5)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ortbatch import BatchedGenerator, ModelLoadError
from ortbatch._ort import CPU, build_session
from ortbatch._ort.trt import TrtShapes, tensorrt_provider_options
from ortbatch.errors import ProviderError

from .fake_decoder import reference

CUDA, TRT = "CUDAExecutionProvider", "TensorrtExecutionProvider"


def _export(fake_dir: Path, tmp_path: Path, providers: list) -> Path:
    d = tmp_path / "exp"
    shutil.copytree(fake_dir, d)
    manifest = {"format": 1, "model": "model.onnx", "padding_side": "left", "providers": providers}
    (d / "ortbatch.json").write_text(json.dumps(manifest))
    return d


def test_manifest_provider_options_reach_the_session_merged_per_key(fake_dir, tmp_path):
    d = _export(fake_dir, tmp_path, [[CUDA, {"device_id": 1, "cudnn_conv_algo_search": "HEURISTIC"}], [CPU, {}]])
    seen = []
    real = build_session

    def recording(model, providers, **kw):  # record what was asked; build it on CPU here
        seen.append(providers)
        return real(model, [(CPU, {})], **kw)

    providers = [(CUDA, {"use_tf32": "0"}), CPU]
    with BatchedGenerator(d, providers=providers, last_position_logits=False, session_factory=recording) as gen:
        assert list(gen.generate([5, 6], 4).token_ids) == reference([5, 6], 4)
    assert seen[0][0] == (CUDA, {"device_id": 1, "cudnn_conv_algo_search": "HEURISTIC", "use_tf32": "0"})


def test_tensorrt_without_covering_profiles_is_refused_before_a_session_is_built(fake_dir, tmp_path):
    d = _export(fake_dir, tmp_path, [[TRT, {"trt_fp16_enable": True}], [CUDA, {}], [CPU, {}]])
    with pytest.raises(ProviderError, match="needs optimization profiles"):
        BatchedGenerator(d, providers="trt")


def test_tensorrt_profiles_shorter_than_the_context_are_refused(fake_dir, tmp_path):
    inputs = {
        "input_ids": ["batch", "sequence"],
        "attention_mask": ["batch", "total_sequence"],
        "position_ids": ["batch", "sequence"],
        "past_key_values.0.key": ["batch", 1, "past_sequence", 1],
        "past_key_values.0.value": ["batch", 1, "past_sequence", 1],
    }
    opts = tensorrt_provider_options(inputs, TrtShapes(32, 16), fp16=False, model_digest="x", ort_version="1")
    d = _export(fake_dir, tmp_path, [[TRT, opts], [CUDA, {}], [CPU, {}]])
    with pytest.raises(ProviderError, match="max_context_length=16"):
        BatchedGenerator(d, providers="trt", max_context_length=40)


def test_a_corrupt_decoder_is_one_model_load_error(fake_dir, tmp_path):
    d = _export(fake_dir, tmp_path, [[CPU, {}]])
    model = d / "model.onnx"
    model.write_bytes(model.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="cannot load the ONNX model"):
        BatchedGenerator(d, providers="cpu", last_position_logits=False, attention_rewrite=False)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ("cuda", "0"),  # off unless asked for: PyTorch's generate runs fp32 matmuls in fp32
        ([(CUDA, {"use_tf32": "1"}), CPU], "1"),  # the user's choice stands
    ],
)
def test_generation_runs_cuda_without_tf32_unless_asked(fake_dir, tmp_path, asked, expected):
    # on an H200, TF32 left batched greedy tokens equal to one-at-a-time ones on 2-3 of 32
    # requests, use_tf32=0 on 28-30 (docs/generation.md); the manifest's CUDA options stay
    d = _export(fake_dir, tmp_path, [[CUDA, {"device_id": 0}], [CPU, {}]])
    seen = []
    real = build_session

    def recording(model, providers, **kw):
        seen.append(providers)
        return real(model, [(CPU, {})], **kw)

    with BatchedGenerator(d, providers=asked, last_position_logits=False, session_factory=recording) as gen:
        assert list(gen.generate([5, 6], 4).token_ids) == reference([5, 6], 4)
    assert seen[0][0] == (CUDA, {"device_id": 0, "use_tf32": expected})
    assert seen[0][1] == (CPU, {})
