"""Sentence embeddings as the checkpoint computes them (no torch needed).

* :class:`EmbeddingPipeline`: pooling, dense layers, normalization and prompts, as an
  export's ``ortbatch.json`` records them (``"embedding"``).
* :class:`Embedder` / :func:`embed`: texts in, the pipeline's vectors out, batched
  through a :class:`~ortbatch.BatchedSession`.
* :mod:`ortbatch.embed.ops`: ``dimensions``, quantized encodings, prompts and sparse
  pooling, for in-process callers and the server alike.
"""

from .embedder import Embedder, Embeddings, embed
from .ops import calibration_ranges, quantize, resolve_prompt, sparse_pool, truncate
from .pipeline import POOLING_MODES, DenseSpec, EmbeddingPipeline

__all__ = [
    "Embedder",
    "Embeddings",
    "embed",
    "EmbeddingPipeline",
    "DenseSpec",
    "POOLING_MODES",
    "calibration_ranges",
    "quantize",
    "resolve_prompt",
    "sparse_pool",
    "truncate",
]
