"""An export directory's manifest drives padding: pad values, padding side, limits."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from ortbatch import BatchedSession, ManifestError
from ortbatch.manifest import InputSpec, Manifest, OutputSpec
from tests.runtime.helpers import GatedSession


def write_export(tmp_path, echo_path, side: str) -> None:
    (tmp_path / "model.onnx").write_bytes(echo_path.read_bytes())
    Manifest(
        inputs={
            "input_ids": InputSpec("int64", ("batch", "sequence"), 7),
            "attention_mask": InputSpec("int64", ("batch", "sequence"), 0),
            "extra": InputSpec("float32", ("batch", None), 0),
        },
        outputs={
            "hidden": OutputSpec(("batch", "sequence", None)),
            "pooled": OutputSpec(("batch", None)),
            "extra_out": OutputSpec(("batch", None)),
        },
        padding_side=side,
        limits={"max_batch_size": 16, "max_sequence_length": 64},
    ).save(tmp_path)


def feed(rid: int, n: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.arange(1, n + 1, dtype=np.int64)[None, :] * 10 + rid,
        "attention_mask": np.ones((1, n), np.int64),
        "extra": np.zeros((1, 3), np.float32),
    }


@pytest.mark.parametrize("side", ["left", "right"])
def test_manifest_pads_and_side(tmp_path, echo_path, side):
    write_export(tmp_path, echo_path, side)
    plain = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    gated = GatedSession(plain)
    bs = BatchedSession(str(tmp_path), workers=1)
    # Rebuild around the gated session with the same manifest to observe the padded feed.
    bs.close()
    bs = BatchedSession(gated, workers=1, pad_values=bs.manifest.pad_values, padding_side=side)
    try:
        first = bs.submit(feed(1, 2))
        assert gated.entered.wait(10)
        a = bs.submit(feed(2, 3))
        b = bs.submit(feed(3, 6))
        gated.gate.set()
        first.result(10)
        got_a, got_b = a.result(10), b.result(10)
    finally:
        bs.close()
    batch = gated.batches[1]["input_ids"]
    assert batch.shape == (2, 6)
    short = batch[0]
    if side == "left":
        assert short[:3].tolist() == [7, 7, 7] and short[3:].tolist() == [12, 22, 32]
    else:
        assert short[3:].tolist() == [7, 7, 7] and short[:3].tolist() == [12, 22, 32]
    for f, got in ((feed(2, 3), got_a), (feed(3, 6), got_b)):
        for g, w in zip(got, plain.run(None, f), strict=True):
            assert np.array_equal(g, w)


def test_export_dir_and_sibling_onnx_use_the_manifest(tmp_path, echo_path):
    write_export(tmp_path, echo_path, "left")
    for target in (tmp_path, tmp_path / "model.onnx"):
        with BatchedSession(str(target)) as bs:
            assert bs.max_batch_size == 16
            assert bs.signature.padding_side == "left"
            assert bs.signature.inputs["input_ids"].pad == 7


def test_broken_manifest_is_a_clear_error(tmp_path, echo_path):
    (tmp_path / "model.onnx").write_bytes(echo_path.read_bytes())
    (tmp_path / "ortbatch.json").write_text('{"format": 1, "inputs": {"input_ids": {"dtype": "int65"}}}')
    with pytest.raises(ManifestError, match="int65"):
        BatchedSession(str(tmp_path))
    (tmp_path / "ortbatch.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        BatchedSession(str(tmp_path))
    (tmp_path / "ortbatch.json").write_text('{"format": 99}')
    with pytest.raises(ManifestError, match="newer"):
        BatchedSession(str(tmp_path))
    (tmp_path / "ortbatch.json").unlink()
    with pytest.raises(ManifestError, match="export directory"):
        BatchedSession(str(tmp_path))
