"""``Embedder``: texts in, the checkpoint's own sentence embeddings out, in process.

The export's graph already computes the whole sentence-transformers pipeline (output
``sentence_embedding``); this face tokenizes with the export's tokenizer, prepends the
prompt, sends each text as its own request through a :class:`~ortbatch.BatchedSession`
(so texts from many threads share batches) and applies ``dimensions`` and the encoding
format. Nobody pools by hand. A SPLADE export (output ``sparse_embedding``) answers
:meth:`Embedder.embed_sparse` the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError, ManifestError
from ..manifest import Manifest
from . import ops
from .options import EmbedOptions
from .pipeline import EmbeddingPipeline

__all__ = ["Embedder", "Embeddings", "SparseEmbeddings", "embed"]


@dataclass(frozen=True)
class Embeddings:
    """One call's answer: ``vectors`` (rows in input order; float32, or int8/uint8 for a
    quantized format) and ``tokens``, how many tokens the model saw for each text,
    prompt included (what ``usage`` counts)."""

    vectors: np.ndarray
    tokens: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


@dataclass(frozen=True)
class SparseEmbeddings:
    """A SPLADE call's answer: per text its ``(indices, values)`` (vocabulary order) and
    the tokens the model saw."""

    rows: tuple[tuple[np.ndarray, np.ndarray], ...]
    tokens: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


class Embedder:
    """The pipeline of an export, batched through a :class:`~ortbatch.BatchedSession`.

    ``Embedder(export_dir)`` opens its own session (keyword arguments go to it); pass
    ``session=`` to share one. Thread-safe: call :meth:`encode` from many threads and
    their texts are batched together. ``close()`` (or ``with``) closes a session it opened.
    """

    def __init__(self, export_dir: str | os.PathLike[str], *, session: Any = None, **session_kwargs: Any) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(export_dir)
        self.manifest = Manifest.load(self.directory)
        pipeline = EmbeddingPipeline.from_manifest(self.manifest)
        if pipeline is None:
            raise ManifestError(
                f"{self.directory} records no embedding pipeline (ortbatch.json has no 'embedding'): "
                "re-export it with this ortbatch to get the checkpoint's own pooling"
            )
        self.pipeline = pipeline
        tok_file = self.directory / "tokenizer.json"
        if not tok_file.is_file():
            raise ManifestError(f"{self.directory} has no tokenizer.json to tokenize texts with")
        self._tokenizer = Tokenizer.from_file(str(tok_file))
        self._tokenizer.no_padding()  # one request = one text at its own length; the session pads
        if self.manifest.max_sequence_length:
            self._tokenizer.enable_truncation(self.manifest.max_sequence_length)
        self._prompt_lengths: dict[str, int] = {}
        if session is None:
            from ..runtime.session import BatchedSession

            session = BatchedSession(self.directory, **session_kwargs)
            self._owns = True
        else:
            self._owns = False
        self.session = session
        names = set(session.input_names)
        self._token_types = "token_type_ids" in names
        self._positions = "position_ids" in names
        if pipeline.output not in session.output_names:
            raise ManifestError(f"{self.directory}: the graph has no {pipeline.output!r} output")

    @property
    def dimension(self) -> int:
        return self.pipeline.dimension

    def _prompt_length(self, prompt: str) -> int:
        if prompt not in self._prompt_lengths:
            self._prompt_lengths[prompt] = ops.prompt_length(self._tokenizer, prompt)
        return self._prompt_lengths[prompt]

    def _feed(self, text: str, prompt: str | None) -> dict[str, np.ndarray]:
        enc = self._tokenizer.encode(text if prompt is None else prompt + text)
        ids = np.array([enc.ids], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.array([enc.attention_mask], dtype=np.int64)}
        if self._token_types:
            feed["token_type_ids"] = np.zeros_like(ids)
        if self._positions:
            feed["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None]
        if self.pipeline.needs_prompt_length:
            n = 0 if prompt is None else self._prompt_length(prompt)
            feed["prompt_length"] = np.array([n], dtype=np.int64)
        return feed

    def _run(
        self, texts: Sequence[str], prompt_name: str | None, prompt: str | None
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        """The pipeline's output for ``texts`` (each its own request) and their token counts."""
        if isinstance(texts, str):
            texts = [texts]
        if any(not isinstance(t, str) for t in texts):
            raise InvalidInputError("texts must be strings")
        text_prompt = ops.resolve_prompt(self.pipeline, prompt_name, prompt) or None  # "" is no prompt
        feeds = [self._feed(t, text_prompt) for t in texts]
        futures = [self.session.submit(f, [self.pipeline.output]) for f in feeds]
        rows = [fut.result()[0][0] for fut in futures]
        vectors = (
            np.stack(rows).astype(np.float32, copy=False)
            if rows
            else np.zeros((0, self.pipeline.dimension), dtype=np.float32)
        )
        return vectors, tuple(int(f["input_ids"].shape[1]) for f in feeds)

    def embed(
        self,
        texts: Sequence[str],
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
        encoding_format: str = "float",
    ) -> Embeddings:
        """Embed ``texts`` as sentence-transformers' ``encode(texts, prompt_name=...,
        prompt=..., truncate_dim=...)`` would (re-normalized after truncation when the
        pipeline normalizes), then quantize as ``quantize_embeddings`` when
        ``encoding_format`` is int8/uint8/binary/ubinary. For a SPLADE export: its dense
        vocabulary-wide vectors (``SparseEncoder.encode``, densified); see :meth:`embed_sparse`."""
        opts = EmbedOptions.parse(
            {"dimensions": dimensions, "encoding_format": encoding_format}, formats=("float", *ops.QUANTIZED_FORMATS)
        )
        if self.pipeline.is_sparse:
            opts.refuse_for_sparse()
        vectors, tokens = self._run(texts, prompt_name, prompt)
        if not self.pipeline.is_sparse:
            pipe = self.pipeline
            vectors = ops.finish(
                vectors,
                opts.dimensions,
                opts.encoding_format,
                normalize=pipe.normalize,
                calibration=pipe.calibration,
                ranges=pipe.quantization_ranges,
            )
        return Embeddings(vectors, tokens)

    def embed_sparse(
        self,
        texts: Sequence[str],
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        top_k: int | None = None,
        threshold: float = 0.0,
    ) -> SparseEmbeddings:
        """A SPLADE export's embeddings of ``texts`` as ``(indices, values)`` per text: the
        entries above ``threshold`` (default: the non-zero ones), the ``top_k`` largest
        when given (``SparseEncoder.encode(max_active_dims=top_k)``)."""
        if not self.pipeline.is_sparse:
            raise InvalidInputError(f"{self.directory} is not a sparse (SPLADE) export: use embed()")
        opts = EmbedOptions.parse({"top_k": top_k, "threshold": threshold})
        vectors, tokens = self._run(texts, prompt_name, prompt)
        return SparseEmbeddings(tuple(ops.sparsify(vectors, top_k=opts.top_k, threshold=opts.threshold)), tokens)

    def encode(self, texts: Sequence[str], **kwargs: Any) -> np.ndarray:
        """:meth:`embed`'s vectors only."""
        return self.embed(texts, **kwargs).vectors

    def close(self) -> None:
        if self._owns:
            self.session.close()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def embed(export_dir: str | os.PathLike[str], texts: Sequence[str], **kwargs: Any) -> np.ndarray:
    """One-shot: open the export, embed ``texts`` (keywords as :meth:`Embedder.embed`), close."""
    with Embedder(export_dir) as e:
        return e.encode(texts, **kwargs)
