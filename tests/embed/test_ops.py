"""The embedding API's ops against sentence-transformers' own definitions (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from ortbatch.embed import EmbeddingPipeline, calibration_ranges, quantize, resolve_prompt, sparse_pool, truncate
from ortbatch.errors import InvalidInputError, ManifestError

RNG = np.random.default_rng(0)
VECS = RNG.standard_normal((7, 20)).astype(np.float32)
CAL = RNG.standard_normal((50, 20)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["int8", "uint8", "binary", "ubinary"])
def test_quantize_equals_quantize_embeddings(fmt):
    util = pytest.importorskip("sentence_transformers.util")
    want = util.quantize_embeddings(VECS, fmt, calibration_embeddings=CAL)
    got = quantize(VECS, fmt, calibration_ranges(CAL))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_quantize_errors():
    with pytest.raises(InvalidInputError, match="calibration ranges"):
        quantize(VECS, "int8", None)
    with pytest.raises(InvalidInputError, match="encoding_format"):
        quantize(VECS, "int4")
    # truncated vectors use the first columns of the stored ranges
    np.testing.assert_array_equal(
        quantize(VECS[:, :5], "uint8", calibration_ranges(CAL)), quantize(VECS, "uint8", calibration_ranges(CAL))[:, :5]
    )


def test_truncate():
    unit = VECS / np.linalg.norm(VECS, axis=1, keepdims=True)
    out = truncate(unit, 4, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(out, unit[:, :4] / np.linalg.norm(unit[:, :4], axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(truncate(VECS, 4, normalize=False), VECS[:, :4])
    assert truncate(VECS, None, normalize=True) is VECS
    for bad in (0, 21, True, 2.5):
        with pytest.raises(InvalidInputError, match="dimensions"):
            truncate(VECS, bad, normalize=False)  # type: ignore[arg-type]


def test_resolve_prompt():
    pipe = EmbeddingPipeline(pooling=("mean",), token_dimension=4, prompts={"q": "query: "}, default_prompt_name="q")
    assert resolve_prompt(pipe, None, None) == "query: "
    assert resolve_prompt(pipe, "q", None) == "query: "
    assert resolve_prompt(pipe, "q", "explicit ") == "explicit "
    assert resolve_prompt(None, None, None) is None
    with pytest.raises(InvalidInputError, match=r"prompt_name 'x'.*'q'"):
        resolve_prompt(pipe, "x", None)


def test_sparse_pool_equals_splade_pooling():
    torch = pytest.importorskip("torch")
    modules = pytest.importorskip("sentence_transformers.sparse_encoder.modules")
    logits = RNG.standard_normal((3, 5, 30)).astype(np.float32) * 3
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=np.int64)
    pool = modules.SpladePooling(pooling_strategy="max").eval()
    with torch.inference_mode():
        want = pool({"token_embeddings": torch.from_numpy(logits.copy()), "attention_mask": torch.from_numpy(mask)})
    dense = want["sentence_embedding"].numpy()
    rows = sparse_pool(logits, mask)
    for row, (idx, val) in zip(dense, rows, strict=True):
        np.testing.assert_array_equal(np.sort(idx), np.flatnonzero(row > 0))
        np.testing.assert_allclose(val, row[idx], rtol=1e-6)
        assert np.all(np.diff(val) <= 0)  # largest first
    top = sparse_pool(logits, mask, top_k=3, threshold=0.5)
    for row, (idx, val) in zip(dense, top, strict=True):
        assert len(idx) <= 3 and np.all(val > 0.5)
        np.testing.assert_allclose(val, np.sort(row[row > 0.5])[::-1][: len(idx)], rtol=1e-6)
    with pytest.raises(InvalidInputError, match="top_k"):
        sparse_pool(logits, mask, top_k=0)
    with pytest.raises(InvalidInputError, match="threshold"):
        sparse_pool(logits, mask, threshold=-1)


def test_pipeline_manifest_round_trip_and_errors():
    pipe = EmbeddingPipeline(pooling=("cls", "mean"), token_dimension=4, normalize=True)
    assert pipe.dimension == 8
    assert EmbeddingPipeline.from_dict(pipe.to_dict()) == pipe
    bad = pipe.to_dict() | {"dimension": 9}
    with pytest.raises(ManifestError, match="dimension 9"):
        EmbeddingPipeline.from_dict(bad)
    with pytest.raises(ManifestError, match="median"):
        EmbeddingPipeline.from_dict(pipe.to_dict() | {"pooling": ["median"]})
