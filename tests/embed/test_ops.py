"""The embedding API's ops against sentence-transformers' own definitions (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from ortbatch.embed import (
    EmbeddingPipeline,
    EmbedOptions,
    calibration_ranges,
    finish,
    quantize,
    resolve_prompt,
    sparse_pool,
    sparsify,
    truncate,
)
from ortbatch.embed.ops import keep_top
from ortbatch.embed.pipeline import SparseSpec
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


def test_finish_calibrates_after_truncation():
    """int8 of truncated, re-normalized vectors: buckets from the calibration embeddings put
    through the same truncation, as quantize_embeddings(calibration_embeddings=...) is called
    on encode(truncate_dim=..., normalize_embeddings=True) output."""
    util = pytest.importorskip("sentence_transformers.util")
    unit = VECS / np.linalg.norm(VECS, axis=1, keepdims=True)
    cal = CAL / np.linalg.norm(CAL, axis=1, keepdims=True)
    got = finish(unit, 6, "int8", normalize=True, calibration=cal)
    small = truncate(unit, 6, normalize=True)
    want = util.quantize_embeddings(small, "int8", calibration_embeddings=truncate(cal, 6, normalize=True))
    np.testing.assert_array_equal(got, want)
    # the full-width ranges cut to 6 columns would bucket them differently
    assert not np.array_equal(finish(unit, 6, "int8", normalize=True, ranges=calibration_ranges(cal)), want)
    np.testing.assert_array_equal(finish(unit, None, "float", normalize=True), unit)
    with pytest.raises(InvalidInputError, match="encoding_format"):
        finish(unit, None, "int4", normalize=True)


def test_options_name_the_field():
    assert EmbedOptions.parse({}) == EmbedOptions()
    opts = EmbedOptions.parse({"dimensions": 8, "prompt_name": "q", "encoding_format": "ubinary", "model": "x"})
    assert (opts.dimensions, opts.prompt_name, opts.encoding_format) == (8, "q", "ubinary")
    for doc, field in [
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"dimensions": "8"}, "dimensions"),
        ({"prompt_name": 3}, "prompt_name"),
        ({"prompt": ["a"]}, "prompt"),
        ({"encoding_format": "int4"}, "encoding_format"),
        ({"top_k": -1}, "top_k"),
        ({"threshold": -0.5}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
    ]:
        with pytest.raises(InvalidInputError, match=f"'{field}'") as err:
            EmbedOptions.parse(doc)
        assert err.value.input_name == field
    with pytest.raises(InvalidInputError, match="encoding_format"):
        EmbedOptions.parse({"encoding_format": "base64"}, formats=("float", "int8"))
    with pytest.raises(InvalidInputError, match="'top_k' applies to sparse"):
        EmbedOptions.parse({"top_k": 3}).refuse_for_dense()
    with pytest.raises(InvalidInputError, match="'dimensions' does not apply to a sparse"):
        EmbedOptions.parse({"dimensions": 3}).refuse_for_sparse()


def test_sparsify_and_keep_top():
    vecs = np.array([[0.0, 0.5, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    rows = sparsify(vecs)
    np.testing.assert_array_equal(rows[0][0], [1, 3, 4])
    np.testing.assert_array_equal(rows[0][1], [0.5, 2.0, 1.0])
    assert rows[1][0].size == 0
    np.testing.assert_array_equal(sparsify(vecs, top_k=2)[0][0], [3, 4])
    np.testing.assert_array_equal(sparsify(vecs, threshold=0.75)[0][0], [3, 4])
    np.testing.assert_array_equal(keep_top(vecs, 1), [[0, 0, 0, 2.0, 0], [0, 0, 0, 0, 0]])
    assert keep_top(vecs, None) is vecs


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
        np.testing.assert_array_equal(idx, np.flatnonzero(row > 0))  # vocabulary order, as TEI answers
        np.testing.assert_allclose(val, row[idx], rtol=1e-6)
    top = sparse_pool(logits, mask, top_k=3, threshold=0.5)
    for row, (idx, val) in zip(dense, top, strict=True):
        assert len(idx) <= 3 and np.all(val > 0.5) and np.all(np.diff(idx) > 0)
        np.testing.assert_allclose(np.sort(val)[::-1], np.sort(row[row > 0.5])[::-1][: len(idx)], rtol=1e-6)
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
    with pytest.raises(ManifestError, match="calibration"):
        EmbeddingPipeline.from_dict(pipe.to_dict() | {"calibration": [[1.0, 2.0]]})
    cal = pipe.to_dict() | {"calibration": [[0.5] * 8, [0.25] * 8]}
    assert EmbeddingPipeline.from_dict(cal).calibration == ((0.5,) * 8, (0.25,) * 8)
    sparse = EmbeddingPipeline(
        pooling=(), token_dimension=30, sparse=SparseSpec("sum", "log1p_relu"), output="sparse_embedding"
    )
    assert sparse.is_sparse and sparse.dimension == 30
    assert EmbeddingPipeline.from_dict(sparse.to_dict()) == sparse
    with pytest.raises(ManifestError, match="SPLADE pooling 'mean'"):
        EmbeddingPipeline.from_dict(sparse.to_dict() | {"sparse": {"pooling": "mean", "activation": "relu"}})
    with pytest.raises(ValueError, match="no pooling modes"):
        EmbeddingPipeline(pooling=("mean",), token_dimension=30, sparse=SparseSpec())
