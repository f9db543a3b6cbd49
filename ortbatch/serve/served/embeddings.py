"""The embedding endpoints' logic, transport-free: each ``*_answer`` takes the request's
JSON document and returns the answer's (the HTTP routes only read the body and send it).

``POST /v1/embeddings`` (OpenAI's shape; :func:`embeddings_answer`)::

    {"input": "text" | ["text", ...] | [ids] | [[ids], ...],
     "dimensions": 128,                 # Matryoshka: the first 128, re-normalized when the
                                        # pipeline normalizes (sentence-transformers' truncate_dim)
     "prompt_name": "query",            # one of the checkpoint's prompts (TEI, sentence-transformers)
     "prompt": "Represent this: ",      # or the prompt itself (Infinity's "instruction")
     "encoding_format": "float",        # float | base64 | int8 | uint8 | binary | ubinary
     "truncate": false}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}],
        "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

``POST /embed`` (text-embeddings-inference's shape; :func:`embed_answer`)::

    {"inputs": "text" | ["text", ...] | [ids] | [[ids], ...],
     "normalize": true,                 # TEI's default: unit vectors
     "dimensions": 128, "prompt_name": "query", "truncate": false, "truncation_direction": "Right"}
    -> [[...], ...]                     # one vector per input

``POST /embed_sparse`` (text-embeddings-inference's shape; :func:`embed_sparse_answer`), for
a SPLADE export::

    {"inputs": "text" | ["text", ...], "truncate": false, "prompt_name": null,
     "top_k": null, "threshold": 0.0}                 # ortbatch's own two options
    -> [[{"index": 1037, "value": 0.82}, ...], ...]   # per input, in vocabulary order

Without ``prompt``/``prompt_name`` a text gets the checkpoint's default prompt, as
``encode`` gives it; ``usage`` counts the tokens the model saw, prompts included. Token-id
inputs are sent as they are (no prompt). The vectors are the export's pipeline output
(:class:`~ortbatch.embed.EmbeddingPipeline`), so they equal sentence-transformers' own.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ...embed import ops
from ...errors import InvalidInputError
from .completions import text_or_ids
from .model import ServedModel
from .task_fields import check_task_fields, truncate_field, truncation_direction

__all__ = ["embed_answer", "embed_sparse_answer", "embeddings_answer", "embedding_json"]


def _tei_request(model: ServedModel, doc: dict[str, Any], endpoint: str, output: str | None, why_not: str) -> bool:
    """What TEI's two embedding routes check first: that ``model`` has the ``output`` they
    need (else ``why_not``), that ``inputs`` is there, that every field is one ``endpoint``
    reads; returns ``truncate`` (with ``truncation_direction`` checked against it)."""
    if output is None:
        raise InvalidInputError(f"model {model.name!r} does not serve {endpoint}: {why_not}")
    check_task_fields(doc, endpoint, model.policy)
    if "inputs" not in doc:
        raise InvalidInputError("'inputs' is required: a string, a list of strings, or token ids", input_name="inputs")
    truncate = truncate_field(doc, model.truncate)
    truncation_direction(doc, truncate)
    return truncate


def embedding_json(row: np.ndarray, encoding_format: str) -> Any:
    """One vector as the answer carries it: base64 of its little-endian float32 bytes
    (OpenAI's ``base64``), else a list of numbers (ints for the quantized formats)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode("ascii")
    return row.tolist()


async def embeddings_answer(model: ServedModel, doc: dict[str, Any]) -> dict[str, Any]:
    """``/v1/embeddings``: the model's embeddings of ``input``, as the request's options ask."""
    check_task_fields(doc, "/v1/embeddings", model.policy)
    inputs = text_or_ids(doc.get("input"), "input")
    options = model.embed_options(doc, ops.ENCODING_FORMATS)
    options.refuse_for_dense()
    prompt = model.resolve_prompt(options, texts=isinstance(inputs[0], str))
    result = await model.embed(inputs, truncate_field(doc, model.truncate), prompt)
    vectors = model.finish_output(result.embeddings, options)
    data = [
        {"object": "embedding", "index": i, "embedding": embedding_json(row, options.encoding_format)}
        for i, row in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model.name,
        "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens},
    }


async def embed_answer(model: ServedModel, doc: dict[str, Any]) -> list[list[float]]:
    """``/embed`` (TEI): a vector per input. ``normalize`` (default true, TEI's) L2-normalizes
    them: the pipeline's vectors then equal ``encode(normalize_embeddings=True)``. ``false``
    gives the pipeline's own, ``encode``'s default; for a pipeline that ends in Normalize
    those are unit vectors all the same, so ``false`` cannot mean what TEI means by it (TEI
    skips the Normalize module) and is refused there, naming the field."""
    truncate = _tei_request(model, doc, "/embed", model.embedding_output, model.embeddings_disabled_reason)
    normalize = doc.get("normalize", True)
    if not isinstance(normalize, bool):
        raise InvalidInputError(f"'normalize' must be true or false, got {str(normalize)[:40]}", input_name="normalize")
    pipe = model.pipeline
    unit = pipe.normalize if pipe is not None else model.normalize_embeddings
    if not normalize and unit:
        why = (
            "its sentence-transformers pipeline ends in Normalize"
            if pipe is not None
            else "the server normalizes this export's vectors (serve it with --no-normalize for its raw ones)"
        )
        raise InvalidInputError(
            f"'normalize': false cannot be honoured for model {model.name!r}: {why}, so its embeddings are unit "
            "vectors either way",
            input_name="normalize",
        )
    inputs = text_or_ids(doc.get("inputs"), "inputs")
    options = model.embed_options(doc, ("float",))
    options.refuse_for_dense()
    prompt = model.resolve_prompt(options, texts=isinstance(inputs[0], str))
    result = await model.embed(inputs, truncate, prompt)
    vectors = model.finish_output(result.embeddings, options)
    if normalize and not unit:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return [row.tolist() for row in vectors.astype(np.float32, copy=False)]


async def embed_sparse_answer(model: ServedModel, doc: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """``/embed_sparse`` (TEI): each input's non-zero SPLADE weights as ``{index, value}``,
    in vocabulary order; ``top_k`` keeps the largest, ``threshold`` those above it."""
    truncate = _tei_request(model, doc, "/embed_sparse", model.sparse_output, model.sparse_disabled_reason)
    inputs = text_or_ids(doc.get("inputs"), "inputs")
    options = model.embed_options(doc, ("float",))
    prompt = model.resolve_prompt(options, texts=isinstance(inputs[0], str))
    result = await model.embed(inputs, truncate, prompt, output=model.sparse_output)
    rows = ops.sparsify(result.embeddings, top_k=options.top_k, threshold=options.threshold)
    return [
        [{"index": int(i), "value": float(v)} for i, v in zip(idx.tolist(), values.tolist(), strict=True)]
        for idx, values in rows
    ]
