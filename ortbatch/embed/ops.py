"""What an embedding API does to the pipeline's vectors, in numpy, transport-free.

Each function follows the library users compare against: :func:`quantize` is
sentence-transformers' ``quantize_embeddings``, :func:`truncate` its ``truncate_dim``
(re-normalized when the pipeline normalizes, as OpenAI's and TEI's ``dimensions`` are),
:func:`resolve_prompt` its ``prompt_name``/``prompt`` rules, :func:`sparse_pool`
SPLADE's ``log(1 + relu(logits))`` max over tokens. Bad values raise
:class:`~ortbatch.errors.InvalidInputError` naming the field, so a server maps them to a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from .pipeline import EmbeddingPipeline

__all__ = [
    "ENCODING_FORMATS",
    "QUANTIZED_FORMATS",
    "calibration_ranges",
    "finish",
    "keep_top",
    "prompt_length",
    "quantize",
    "resolve_prompt",
    "sparse_pool",
    "sparsify",
    "truncate",
]

QUANTIZED_FORMATS = ("int8", "uint8", "binary", "ubinary")
ENCODING_FORMATS = ("float", "base64", *QUANTIZED_FORMATS)


def truncate(vectors: np.ndarray, dimensions: int | None, *, normalize: bool) -> np.ndarray:
    """Matryoshka: the first ``dimensions`` values of each row, re-normalized to unit length
    when the pipeline normalizes (a truncated unit vector is not one)."""
    if dimensions is None:
        return vectors
    width = vectors.shape[-1]
    if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)) or dimensions < 1:
        raise InvalidInputError(f"dimensions must be a positive integer, got {dimensions!r}", input_name="dimensions")
    if dimensions > width:
        raise InvalidInputError(f"dimensions={dimensions} is more than this model's {width}", input_name="dimensions")
    out = vectors[..., :dimensions]
    if normalize:
        norm = np.linalg.norm(out, axis=-1, keepdims=True)
        out = out / np.maximum(norm, 1e-12)
    return np.ascontiguousarray(out, dtype=np.float32)


def calibration_ranges(vectors: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-dimension (mins, maxs) of calibration embeddings, as ``quantize_embeddings``
    computes from ``calibration_embeddings``: stored in the export for int8/uint8."""
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or v.shape[0] < 1:
        raise ValueError(f"calibration needs a (rows, dimension) array, got shape {v.shape}")
    return tuple(float(x) for x in v.min(axis=0)), tuple(float(x) for x in v.max(axis=0))


def quantize(
    vectors: np.ndarray,
    precision: str,
    ranges: tuple[Sequence[float], Sequence[float]] | np.ndarray | None = None,
) -> np.ndarray:
    """sentence-transformers' ``quantize_embeddings(vectors, precision, ranges=...)``.

    ``int8``/``uint8``: 256 buckets per dimension between the calibration ``ranges``
    (``(mins, maxs)``, truncated to the vectors' width when ``dimensions`` cut them);
    ``binary``/``ubinary``: one bit per dimension (``> 0``), packed, ``binary`` offset by -128.
    """
    v = np.asarray(vectors)
    if v.dtype in (np.int8, np.uint8):
        raise InvalidInputError("embeddings to quantize must be float, not int8 or uint8")
    if v.ndim != 2:
        raise ValueError(f"quantize takes (rows, dimension), got shape {v.shape}")
    if precision in ("float", "float32"):
        return v.astype(np.float32)
    if precision in ("int8", "uint8"):
        if ranges is None:
            raise InvalidInputError(
                f"encoding_format {precision!r} needs calibration ranges, and this export has none "
                "(re-export it with ortbatch to record them)",
                input_name="encoding_format",
            )
        r = np.asarray(ranges, dtype=np.float64)
        if r.ndim != 2 or r.shape[0] != 2 or r.shape[1] < v.shape[1]:
            raise ValueError(f"ranges must be (2, >= {v.shape[1]}), got {r.shape}")
        r = r[:, : v.shape[1]]
        # float32 like sentence-transformers: its ranges come from float32 embeddings
        starts = r[0].astype(np.float32)
        steps = (r[1].astype(np.float32) - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        q = np.clip(np.floor((v - starts) / steps), 0, 255)
        return q.astype(np.uint8) if precision == "uint8" else (q - 128).astype(np.int8)
    if precision == "binary":
        return (np.packbits(v > 0, axis=-1).reshape(v.shape[0], -1) - 128).astype(np.int8)
    if precision == "ubinary":
        return np.packbits(v > 0, axis=-1).reshape(v.shape[0], -1)
    raise InvalidInputError(
        f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {precision!r}", input_name="encoding_format"
    )


def finish(
    vectors: np.ndarray,
    dimensions: int | None,
    encoding_format: str,
    *,
    normalize: bool,
    calibration: np.ndarray | Sequence[Sequence[float]] | None = None,
    ranges: tuple[Sequence[float], Sequence[float]] | None = None,
) -> np.ndarray:
    """Vectors as a request asks for them: :func:`truncate` to ``dimensions`` (re-normalized
    when ``normalize``: the pipeline normalizes), then :func:`quantize` for int8/uint8,
    binary and ubinary. int8/uint8 buckets come from the ``calibration`` embeddings put
    through the same truncation (``quantize_embeddings(..., calibration_embeddings=...)``),
    else from stored ``ranges``. ``float`` and ``base64`` leave them float32 (base64 is how
    a transport writes them)."""
    out = truncate(vectors, dimensions, normalize=normalize)
    if encoding_format in ("int8", "uint8") and calibration is not None:
        cal = truncate(np.asarray(calibration, dtype=np.float32), dimensions, normalize=normalize)
        ranges = calibration_ranges(cal)
    if encoding_format in QUANTIZED_FORMATS:
        out = quantize(out, encoding_format, ranges)
    elif encoding_format not in ("float", "base64"):
        raise InvalidInputError(
            f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {encoding_format!r}",
            input_name="encoding_format",
        )
    return out


def resolve_prompt(pipeline: EmbeddingPipeline | None, prompt_name: str | None, prompt: str | None) -> str | None:
    """The prompt text to prepend, by sentence-transformers' rules: an explicit ``prompt``
    wins over ``prompt_name``, which must name one of the checkpoint's prompts; with
    neither, the checkpoint's ``default_prompt_name`` (if any)."""
    prompts = dict(pipeline.prompts) if pipeline is not None else {}
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a string, got {type(prompt).__name__}", input_name="prompt")
        return prompt
    if prompt_name is not None:
        if prompt_name not in prompts:
            known = ", ".join(repr(k) for k in sorted(prompts)) or "none"
            raise InvalidInputError(
                f"prompt_name {prompt_name!r} is not one of this model's prompts ({known})", input_name="prompt_name"
            )
        return prompts[prompt_name]
    if pipeline is not None and pipeline.default_prompt_name is not None:
        return prompts[pipeline.default_prompt_name]
    return None


def prompt_length(tokenizer: Any, prompt: str) -> int:
    """Tokens of ``prompt`` that ``include_prompt=false`` leaves out of pooling, counted as
    sentence-transformers counts them: the prompt tokenized alone (``tokenizer``: a
    ``tokenizers.Tokenizer``), special tokens included, less a trailing special token
    (SEP/EOS), which the text keeps for itself."""
    enc = tokenizer.encode(prompt)
    n = len(enc.ids)
    if n and enc.special_tokens_mask[-1]:
        n -= 1
    return n


def sparsify(
    vectors: np.ndarray, *, top_k: int | None = None, threshold: float = 0.0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row of SPLADE ``vectors`` (rows, vocabulary) as ``(indices, values)``: the
    entries above ``threshold`` (default: the non-zero ones, as TEI's /embed_sparse), only
    the ``top_k`` largest when given (sentence-transformers' ``max_active_dims``), in
    vocabulary order."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise InvalidInputError(f"top_k must be a positive integer, got {top_k!r}", input_name="top_k")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold < 0:
        raise InvalidInputError(f"threshold must be a number >= 0, got {threshold!r}", input_name="threshold")
    out = []
    for row in np.asarray(vectors, dtype=np.float32):
        idx = np.flatnonzero(row > threshold)
        if top_k is not None and len(idx) > top_k:
            # the k largest (ties: the lower index first), then back in vocabulary order
            keep = np.argsort(-row[idx], kind="stable")[:top_k]
            idx = np.sort(idx[keep])
        out.append((idx.astype(np.int64), row[idx]))
    return out


def keep_top(vectors: np.ndarray, top_k: int | None, threshold: float = 0.0) -> np.ndarray:
    """:func:`sparsify` as a dense array: every other entry set to 0 (what
    ``SparseEncoder.encode(max_active_dims=top_k)`` gives, densified)."""
    if top_k is None and not threshold:
        return vectors
    out = np.zeros_like(vectors, dtype=np.float32)
    for i, (idx, values) in enumerate(sparsify(vectors, top_k=top_k, threshold=threshold)):
        out[i, idx] = values
    return out


def sparse_pool(
    logits: np.ndarray,
    attention_mask: np.ndarray,
    *,
    top_k: int | None = None,
    threshold: float = 0.0,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """SPLADE pooling of a masked-LM head's ``logits`` (rows, tokens, vocab) in numpy:
    ``max over tokens of log(1 + relu(x))`` (padding left out), then :func:`sparsify`.
    (An export's graph does the pooling itself: its ``sparse_embedding`` output.)"""
    act = np.log1p(np.maximum(np.asarray(logits, dtype=np.float32), 0))
    act = act * np.asarray(attention_mask, dtype=np.float32)[..., None]  # log1p(relu) >= 0, so 0 is neutral
    return sparsify(act.max(axis=1), top_k=top_k, threshold=threshold)
