"""The sentence-embedding pipeline an export computes, as its manifest records it.

A sentence-transformers checkpoint is ``Transformer -> Pooling -> (Dense)* -> (Normalize)``;
the exporter appends everything after the transformer to the ONNX graph (output
``sentence_embedding``) and writes this description under ``"embedding"`` in
``ortbatch.json``, so the runtime never guesses how to pool::

    "embedding": {"source": "sentence-transformers", "pooling": ["cls"], "include_prompt": true,
                  "token_dimension": 384, "dense": [{"in_features": 384, "out_features": 128,
                  "bias": true, "activation": "tanh"}], "normalize": true, "dimension": 128,
                  "prompts": {"query": "query: "}, "default_prompt_name": null,
                  "similarity": "cosine", "output": "sentence_embedding",
                  "calibration": [[...], ...], "quantization_ranges": [[...mins], [...maxs]]}

``calibration`` holds the export's sample embeddings (after the default prompt, as
``encode`` gives them): int8/uint8 buckets are computed from them as
``quantize_embeddings(..., calibration_embeddings=...)`` does, after the same
``dimensions`` truncation as the request's vectors. ``quantization_ranges`` (their
per-dimension min and max) is what older exports record instead.

A checkpoint whose ``config_sentence_transformers.json`` sets ``truncate_dim`` records it as
``"truncate_dim": N``: the graph already keeps only the first N values (after Normalize, not
re-normalized, as ``encode`` does) and ``dimension`` is N.

A SPLADE checkpoint (sentence-transformers' ``SparseEncoder``: a masked-LM transformer and
``SpladePooling``) records ``"sparse": {"pooling": "max", "activation": "relu"}`` instead of
pooling modes and Dense layers; its graph's output is ``sparse_embedding`` [batch, vocabulary].

Standard library only (plus nothing): the runtime reads it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError

__all__ = [
    "ACTIVATIONS",
    "EMBEDDING_KEY",
    "POOLING_MODES",
    "SIMILARITY_FUNCTIONS",
    "SPARSE_ACTIVATIONS",
    "SPARSE_POOLING",
    "DenseSpec",
    "EmbeddingPipeline",
    "SparseSpec",
]

# The key in ortbatch.json.
EMBEDDING_KEY = "embedding"
# sentence-transformers' Pooling.POOLING_MODES, in the order its forward() concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# Activations a Dense module may name, by ortbatch's short name.
ACTIVATIONS = ("identity", "tanh", "relu", "sigmoid", "gelu", "silu")
SIMILARITY_FUNCTIONS = ("cosine", "dot", "euclidean", "manhattan")
# sentence-transformers' SpladePooling: pooling_strategy and activation_function
SPARSE_POOLING = ("max", "sum")
SPARSE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class DenseSpec:
    """One Dense module: ``activation(x @ W.T + b)``; the weights live in the graph."""

    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "tanh"

    def to_dict(self) -> dict[str, Any]:
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias,
            "activation": self.activation,
        }


@dataclass(frozen=True)
class SparseSpec:
    """SPLADE pooling of a masked-LM head's logits: ``log(1 + relu(x))`` (twice for
    ``log1p_relu``), padding left out, then ``max`` or ``sum`` over the tokens."""

    pooling: str = "max"
    activation: str = "relu"

    def __post_init__(self) -> None:
        if self.pooling not in SPARSE_POOLING:
            raise ValueError(
                f"unknown SPLADE pooling {self.pooling!r}; sentence-transformers has {list(SPARSE_POOLING)}"
            )
        if self.activation not in SPARSE_ACTIVATIONS:
            raise ValueError(
                f"unknown SPLADE activation {self.activation!r}; sentence-transformers has {list(SPARSE_ACTIVATIONS)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "activation": self.activation}


@dataclass(frozen=True)
class EmbeddingPipeline:
    """What follows the transformer: pooling, dense layers, normalization, prompts.

    ``source`` is ``"sentence-transformers"`` (read from the checkpoint's modules.json) or
    ``"pooling-flag"`` (a plain transformer, pooled as ``--pooling`` said). With
    ``sparse`` set it is a SPLADE pipeline: ``pooling`` is empty, ``token_dimension`` is
    the vocabulary size and the output ``sparse_embedding``.
    """

    pooling: tuple[str, ...]
    token_dimension: int
    include_prompt: bool = True
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity: str = "cosine"
    source: str = "sentence-transformers"
    output: str = "sentence_embedding"
    # int8/uint8 calibration: per-dimension (mins, maxs) of the export's sample embeddings
    quantization_ranges: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    sparse: SparseSpec | None = None
    # int8/uint8 calibration: the export's sample embeddings themselves, one row each
    calibration: tuple[tuple[float, ...], ...] | None = None
    # config_sentence_transformers.json's truncate_dim: encode keeps the first N values
    # (after Normalize, not re-normalized); the graph's output is already that wide
    truncate_dim: int | None = None

    def __post_init__(self) -> None:
        for mode in self.pooling:
            if mode not in POOLING_MODES:
                raise ValueError(f"unknown pooling mode {mode!r}; sentence-transformers has {list(POOLING_MODES)}")
        if self.sparse is not None:
            if self.pooling or self.dense or self.normalize:
                raise ValueError("a sparse (SPLADE) pipeline has no pooling modes, Dense layers or Normalize")
        elif not self.pooling:
            raise ValueError("a pipeline needs at least one pooling mode")
        if self.truncate_dim is not None:
            if isinstance(self.truncate_dim, bool) or not isinstance(self.truncate_dim, int) or self.truncate_dim < 1:
                raise ValueError(f"truncate_dim must be a positive integer, got {self.truncate_dim!r}")
            if self.sparse is not None:
                raise ValueError("a sparse (SPLADE) pipeline has no truncate_dim")
        width = self.token_dimension * len(self.pooling)
        for i, d in enumerate(self.dense):
            if d.activation not in ACTIVATIONS:
                raise ValueError(f"dense[{i}]: unknown activation {d.activation!r}; known: {list(ACTIVATIONS)}")
            if d.in_features != width:
                raise ValueError(f"dense[{i}] takes {d.in_features} features but gets {width}")
            width = d.out_features
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise ValueError(
                f"default prompt {self.default_prompt_name!r} is not among the prompts {sorted(self.prompts)}"
            )
        if self.similarity not in SIMILARITY_FUNCTIONS:
            raise ValueError(f"unknown similarity {self.similarity!r}; known: {list(SIMILARITY_FUNCTIONS)}")

    @property
    def is_sparse(self) -> bool:
        """A SPLADE pipeline (output ``sparse_embedding``, one weight per vocabulary entry)."""
        return self.sparse is not None

    @property
    def dimension(self) -> int:
        """Width of the output (``sentence_embedding``, or the vocabulary for ``sparse_embedding``)."""
        if self.sparse is not None:
            return self.token_dimension
        full = self.dense[-1].out_features if self.dense else self.token_dimension * len(self.pooling)
        return full if self.truncate_dim is None else min(self.truncate_dim, full)

    @property
    def needs_prompt_length(self) -> bool:
        """The graph takes a ``prompt_length`` input (tokens of each row's prompt to leave out of pooling)."""
        return not self.include_prompt

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "source": self.source,
            "pooling": list(self.pooling),
            "include_prompt": self.include_prompt,
            "token_dimension": self.token_dimension,
            "dense": [x.to_dict() for x in self.dense],
            "normalize": self.normalize,
            "dimension": self.dimension,
            "prompts": dict(self.prompts),
            "default_prompt_name": self.default_prompt_name,
            "similarity": self.similarity,
            "output": self.output,
        }
        if self.sparse is not None:
            d["sparse"] = self.sparse.to_dict()
        if self.truncate_dim is not None:
            d["truncate_dim"] = self.truncate_dim
        if self.calibration is not None:
            d["calibration"] = [list(row) for row in self.calibration]
        if self.quantization_ranges is not None:
            d["quantization_ranges"] = [list(self.quantization_ranges[0]), list(self.quantization_ranges[1])]
        return d

    @classmethod
    def from_dict(cls, data: Any, where: str = "embedding") -> EmbeddingPipeline:
        """Parse the manifest's ``embedding`` section; :class:`ManifestError` naming the bad field."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected an object, got {type(data).__name__}")
        try:
            dense = tuple(
                DenseSpec(int(x["in_features"]), int(x["out_features"]), bool(x["bias"]), str(x["activation"]))
                for x in data.get("dense", [])
            )
            ranges = data.get("quantization_ranges")
            sparse = data.get("sparse")
            calibration = data.get("calibration")
            truncate_dim = data.get("truncate_dim")
            pipe = cls(
                pooling=tuple(str(m) for m in data["pooling"]),
                token_dimension=int(data["token_dimension"]),
                include_prompt=bool(data.get("include_prompt", True)),
                dense=dense,
                normalize=bool(data.get("normalize", False)),
                prompts={str(k): str(v) for k, v in (data.get("prompts") or {}).items()},
                default_prompt_name=data.get("default_prompt_name"),
                similarity=str(data.get("similarity") or "cosine"),
                source=str(data.get("source", "sentence-transformers")),
                output=str(data.get("output", "sentence_embedding")),
                quantization_ranges=None
                if ranges is None
                else (tuple(float(v) for v in ranges[0]), tuple(float(v) for v in ranges[1])),
                sparse=None if sparse is None else SparseSpec(str(sparse["pooling"]), str(sparse["activation"])),
                calibration=None if calibration is None else tuple(tuple(float(v) for v in r) for r in calibration),
                truncate_dim=truncate_dim,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ManifestError(f"{where}: {type(exc).__name__}: {exc}") from exc
        recorded = data.get("dimension")
        if recorded is not None and recorded != pipe.dimension:
            raise ManifestError(f"{where}: dimension {recorded} disagrees with the pipeline's {pipe.dimension}")
        if pipe.quantization_ranges is not None and not (
            len(pipe.quantization_ranges[0]) == len(pipe.quantization_ranges[1]) == pipe.dimension
        ):
            raise ManifestError(f"{where}: quantization_ranges must be two rows of {pipe.dimension} values")
        if pipe.calibration is not None and (
            not pipe.calibration or any(len(r) != pipe.dimension for r in pipe.calibration)
        ):
            raise ManifestError(f"{where}: calibration must be rows of {pipe.dimension} values")
        return pipe

    @classmethod
    def from_manifest(cls, manifest: Any) -> EmbeddingPipeline | None:
        """The pipeline an export records, or ``None`` for an export without one."""
        data = manifest.extra.get(EMBEDDING_KEY)
        if data is None:
            return None
        where = f"{manifest.directory}/ortbatch.json: {EMBEDDING_KEY}" if manifest.directory else EMBEDDING_KEY
        return cls.from_dict(data, where)
