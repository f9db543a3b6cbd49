"""Sentence embeddings as the checkpoint computes them (no torch needed).

* :class:`EmbeddingPipeline`: pooling, dense layers, normalization and prompts, as an
  export's ``ortbatch.json`` records them (``"embedding"``).
* :class:`Embedder` / :func:`embed`: texts in, the pipeline's vectors out, batched
  through a :class:`~ortbatch.BatchedSession`.
* :mod:`ortbatch.embed.ops` and :class:`EmbedOptions`: ``dimensions``, quantized
  encodings, prompts and sparse (SPLADE) entries, for in-process callers and the server alike.
"""

from .embedder import Embedder, Embeddings, SparseEmbeddings, embed
from .ops import calibration_ranges, finish, quantize, resolve_prompt, sparse_pool, sparsify, truncate
from .options import EmbedOptions
from .pipeline import POOLING_MODES, DenseSpec, EmbeddingPipeline, SparseSpec

__all__ = [
    "Embedder",
    "Embeddings",
    "SparseEmbeddings",
    "embed",
    "EmbedOptions",
    "EmbeddingPipeline",
    "DenseSpec",
    "SparseSpec",
    "POOLING_MODES",
    "calibration_ranges",
    "finish",
    "quantize",
    "resolve_prompt",
    "sparse_pool",
    "sparsify",
    "truncate",
]
