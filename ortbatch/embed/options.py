"""What an embedding request may ask for, checked once for every face that takes it.

The same fields arrive as a JSON body (``/v1/embeddings``, ``/embed_sparse``), as KServe v2
request parameters (HTTP and gRPC) or as keyword arguments (:class:`~ortbatch.embed.Embedder`);
:meth:`EmbedOptions.parse` reads any of them into one checked value, so a bad value is the
same :class:`~ortbatch.errors.InvalidInputError`, naming the field, on every transport.

=================  =============================  ==================================
ortbatch           sentence-transformers          TEI / Infinity / OpenAI / Cohere
=================  =============================  ==================================
``dimensions``     ``truncate_dim``               ``dimensions`` (OpenAI, TEI, Infinity)
``prompt_name``    ``prompt_name``                ``prompt_name`` (TEI)
``prompt``         ``prompt``                     ``prompt`` (Infinity: ``instruction``)
``encoding_format``  ``quantize_embeddings``      ``encoding_format`` (OpenAI: float,
                   ``precision``                  base64), ``embedding_types`` (Cohere:
                                                  int8, uint8, binary, ubinary)
``top_k``          ``max_active_dims``            (ortbatch's own, for /embed_sparse)
``threshold``      (none)                         (ortbatch's own, for /embed_sparse)
=================  =============================  ==================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError
from .ops import ENCODING_FORMATS

__all__ = ["OPTION_FIELDS", "EmbedOptions"]

#: the request fields :meth:`EmbedOptions.parse` reads (every other field is left alone)
OPTION_FIELDS = ("dimensions", "prompt_name", "prompt", "encoding_format", "top_k", "threshold")


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 64 else "a huge integer"
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(key: str, what: str, value: Any) -> InvalidInputError:
    return InvalidInputError(f"'{key}' must be {what}, got {_shown(value)}", input_name=key)


def _positive_int(doc: Mapping[str, Any], key: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(key, "a positive integer", value)
    return int(value)


def _text(doc: Mapping[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(key, "a string", value)
    return value


@dataclass(frozen=True)
class EmbedOptions:
    """One request's embedding options (the defaults: the pipeline's vectors as they are,
    with the checkpoint's default prompt)."""

    dimensions: int | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    encoding_format: str = "float"
    top_k: int | None = None
    threshold: float = 0.0

    @classmethod
    def parse(cls, doc: Mapping[str, Any], *, formats: Sequence[str] = ENCODING_FORMATS) -> EmbedOptions:
        """Read :data:`OPTION_FIELDS` from ``doc`` (a JSON body or request parameters; a
        field set to ``null`` is absent); ``formats`` are the encodings this face offers."""
        fmt = doc.get("encoding_format")
        if fmt is None:
            fmt = "float"
        if not isinstance(fmt, str) or fmt not in formats:
            raise _bad("encoding_format", f"one of {', '.join(formats)}", fmt)
        threshold = doc.get("threshold")
        if threshold is None:
            threshold = 0.0
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not math.isfinite(threshold)
            or threshold < 0
        ):
            raise _bad("threshold", "a number >= 0", threshold)
        return cls(
            dimensions=_positive_int(doc, "dimensions"),
            prompt_name=_text(doc, "prompt_name"),
            prompt=_text(doc, "prompt"),
            encoding_format=fmt,
            top_k=_positive_int(doc, "top_k"),
            threshold=float(threshold),
        )

    @property
    def asks_prompt(self) -> str | None:
        """The field that asks for a prompt (``prompt`` or ``prompt_name``), if any."""
        if self.prompt is not None:
            return "prompt"
        if self.prompt_name is not None:
            return "prompt_name"
        return None

    def refuse_for_dense(self) -> None:
        """``top_k``/``threshold`` select the entries of a sparse embedding only."""
        if self.top_k is not None or self.threshold:
            field = "top_k" if self.top_k is not None else "threshold"
            raise InvalidInputError(
                f"'{field}' applies to sparse (SPLADE) embeddings only (/embed_sparse)", input_name=field
            )

    def refuse_for_sparse(self) -> None:
        """``dimensions`` and quantized encodings have no meaning for a sparse embedding."""
        if self.dimensions is not None:
            raise InvalidInputError(
                "'dimensions' does not apply to a sparse (SPLADE) embedding: use 'top_k'", input_name="dimensions"
            )
        if self.encoding_format != "float":
            raise InvalidInputError(
                f"'encoding_format' {self.encoding_format!r} does not apply to a sparse (SPLADE) embedding",
                input_name="encoding_format",
            )
