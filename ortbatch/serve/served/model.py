"""One served model: a BatchedSession plus what the protocol needs to know about it
(metadata, datatypes, the optional tokenizer and pooling for text requests).

Every request handled here becomes one or more requests to the *same*
BatchedSession, so HTTP callers are batched together exactly like in-process ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..._extras import require
from ...embed import ops
from ...embed.options import EmbedOptions
from ...embed.pipeline import EmbeddingPipeline
from ...errors import InvalidInputError, NonFiniteOutputError, RequestTimeoutError, RequestTooLargeError
from ...manifest import MANIFEST_NAME, Manifest
from .. import tracing
from ..config import DEFAULT_MAX_TEXT_CHARS
from .parameters import ParameterPolicy
from .protocol import DATATYPES, InferRequest, ort_type_to_datatype, short_repr

__all__ = [
    "DEFAULT_MAX_TEXT_CHARS",
    "V2_ENCODING_FORMATS",
    "EmbeddingResult",
    "ServedModel",
    "TensorMetadata",
    "check_texts",
]

log = logging.getLogger("ortbatch.serve")

TOKENIZER_FILE = "tokenizer.json"
#: Name of the BYTES input that carries raw text, for models exported with a tokenizer.
TEXT_INPUT = "text"
#: Suffix of the text-in model entry (``minilm`` -> ``minilm_text``).
TEXT_MODEL_SUFFIX = "_text"
#: ``encoding_format`` a KServe v2 request parameter may name (its outputs are typed
#: tensors: base64 is what ``binary_data_output`` already gives)
V2_ENCODING_FORMATS = ("float", *ops.QUANTIZED_FORMATS)
# Tasks whose exports answer /v1/embeddings (token embeddings, pooled here).
EMBEDDING_TASKS = frozenset({"feature-extraction", "sentence-similarity", "sentence-embeddings"})
# Already-pooled outputs, preferred over pooling token embeddings ourselves.
_POOLED_OUTPUTS = ("sentence_embedding", "sentence_embeddings", "embeddings")
_TOKEN_OUTPUTS = ("last_hidden_state", "token_embeddings")
# With a token limit, a text is cut to this many characters per token it may keep before
# tokenizing (a token rarely spans more than a few), so a 60 MB text costs what its kept
# head costs; never cut below _MIN_CUT_CHARS.
_CHARS_PER_TOKEN = 32
_MIN_CUT_CHARS = 8192
# Texts with fewer characters in all are tokenized on the event loop (a thread hop costs
# more than that); larger batches go to a thread (the tokenizers library releases the GIL).
_INLINE_TOKENIZE_CHARS = 4096


def check_texts(texts: Sequence[str], field: str, cut_at: int | None, max_chars: int) -> list[str]:
    """Texts ready to tokenize: each cut to ``cut_at`` characters when the model truncates
    anyway (``None``: it does not, and a text over ``max_chars`` is a
    :class:`RequestTooLargeError`); a text that is not valid Unicode (a lone surrogate
    such as ``"\ud800"``) is an :class:`InvalidInputError` naming ``field``."""
    out = []
    for i, text in enumerate(texts):
        if cut_at is not None:
            text = text[:cut_at]
        elif len(text) > max_chars:
            raise RequestTooLargeError(
                f"{field}[{i}] has {len(text)} characters; this server takes at most {max_chars} per text",
                input_name=field,
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(
                f"{field}[{i}] is not valid Unicode (it holds a lone surrogate)", input_name=field
            ) from None
        out.append(text)
    return out


def check_finite_outputs(outputs: Sequence[tuple[str, np.ndarray]]) -> None:
    """Raise :class:`NonFiniteOutputError` if any floating-point output holds NaN or Inf."""
    for name, array in outputs:
        if array.dtype.kind in "fc" and array.size and not np.isfinite(array).all():
            raise NonFiniteOutputError(
                f"the model produced non-finite values (NaN or Inf) in output {name!r}; the export may be "
                "damaged (check it with `ortbatch validate`)"
            )


_T = TypeVar("_T")


@dataclass(frozen=True)
class TensorMetadata:
    """One input or output as the protocol describes it (-1 for a dynamic dim)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class EmbeddingResult:
    """Embeddings (one row per input: the export's pipeline output, or pooled here for an
    export that records none) and the number of tokens the model saw, prompts included."""

    embeddings: np.ndarray
    tokens: int


def _metadata(node: Any) -> TensorMetadata:
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (node.shape or ()))
    return TensorMetadata(node.name, ort_type_to_datatype(node.type), shape)


class ServedModel:
    """A BatchedSession behind the Open Inference Protocol.

    Text is bounded before it is tokenized: with the export's ``max_sequence_length``
    each text is cut to ``max_sequence_length * 32`` characters (at least 8192) first,
    so truncation costs only the kept part; without one, a text over ``max_text_chars``
    is refused (413). More texts in one request than the session's ``max_queue`` can
    never be admitted (413); the texts of a request are queued as one unit. Large
    batches of text are tokenized in a thread, never on the event loop.

    Args:
        session: the :class:`~ortbatch.BatchedSession` every request goes through.
        name: the model name in URLs (``/v2/models/{name}``).
        version: the one version served (``/v2/models/{name}/versions/{version}``).
        manifest: the export's manifest (default: the session's own).
        tokenizer: a ``tokenizers.Tokenizer`` for BYTES text inputs and
            ``/v1/embeddings``; ``None`` disables text input.
        normalize_embeddings: L2-normalize ``/v1/embeddings`` vectors of an export that
            records no embedding pipeline (an export that does answers its pipeline's own
            vectors, normalized exactly when the checkpoint has a Normalize module).
        id_limits: exclusive upper bound of the ids each integer input may carry
            (``{"input_ids": 30522, "token_type_ids": 2}``), checked before a request is
            queued: an out-of-range id fails inside ONNX Runtime's embedding lookup,
            where it can only surface as an InferenceError. Default: ``input_ids`` below
            the tokenizer's vocabulary size. :meth:`load` reads them from the export's
            ``config.json`` (``vocab_size``, ``type_vocab_size``).
        truncate: the default of the text endpoints' ``truncate`` field: cut an input
            longer than the model's limit to the limit (True) or refuse it with a 400
            (False, the default; text sent to ``/v2/.../infer`` is always cut).
        lenient_params: a JSON field the embedding and text-task endpoints do not read is
            accepted and logged once per name (``--lenient-params``) instead of a 400
            (:mod:`~ortbatch.serve.served.task_fields`).
    """

    def __init__(
        self,
        session: Any,
        name: str,
        *,
        version: str = "1",
        manifest: Manifest | None = None,
        tokenizer: Any = None,
        normalize_embeddings: bool = True,
        id_limits: dict[str, int] | None = None,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
        truncate: bool = False,
        lenient_params: bool = False,
    ) -> None:
        self.session = session
        #: what the JSON endpoints do with a field they do not read (task_fields)
        self.policy = ParameterPolicy(lenient=lenient_params)
        #: longest text taken when the export sets no sequence length to truncate at
        self.max_text_chars = max_text_chars
        self._cut_at: int | None = None
        self.truncate = truncate
        self.name = name
        self.version = version
        self.manifest = manifest if manifest is not None else getattr(session, "manifest", None)
        self.inputs = [_metadata(n) for n in session.get_inputs()]
        self.outputs = [_metadata(n) for n in session.get_outputs()]
        self._input_types = {m.name: m.datatype for m in self.inputs}
        self._output_names = [m.name for m in self.outputs]
        self.normalize_embeddings = normalize_embeddings
        #: the sentence-transformers pipeline the export records (``None``: an older export)
        self.pipeline = EmbeddingPipeline.from_manifest(self.manifest) if self.manifest is not None else None
        self._prompt_lengths: dict[str, int] = {}
        self._read_once: dict[Hashable, Any] = {}
        self.tokenizer: Any = None
        self.text_input: str | None = None
        self.text_disabled_reason = "the export has no tokenizer.json"
        self.id_limits: dict[str, int] = {}
        if tokenizer is not None:
            self._setup_tokenizer(tokenizer)
        self.id_limits.update(
            {k: v for k, v in (id_limits or {}).items() if k in self._input_types and isinstance(v, int) and v > 0}
        )
        self.embedding_output, self.embeddings_disabled_reason = self._pick_embedding_output()
        self.sparse_output, self.sparse_disabled_reason = self._pick_sparse_output()

    # -- construction ----------------------------------------------------------------
    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        name: str | None = None,
        session_kwargs: dict[str, Any] | None = None,
        normalize_embeddings: bool = True,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
        truncate: bool = False,
        lenient_params: bool = False,
    ) -> ServedModel:
        """Build the BatchedSession for an export directory (or a bare ``.onnx`` file)
        and load its tokenizer when ``tokenizer.json`` sits next to the model."""
        from ...runtime.session import BatchedSession

        path = Path(directory)
        session = BatchedSession(path, **(session_kwargs or {}))
        try:
            return cls.for_export(
                session,
                path,
                name=name,
                normalize_embeddings=normalize_embeddings,
                max_text_chars=max_text_chars,
                truncate=truncate,
                lenient_params=lenient_params,
            )
        except BaseException:
            session.close(drain=False)
            raise

    @classmethod
    def for_export(
        cls,
        session: Any,
        directory: str | Path,
        *,
        name: str | None = None,
        normalize_embeddings: bool = True,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
        truncate: bool = False,
        lenient_params: bool = False,
    ) -> ServedModel:
        """Serve ``session`` with what the export ``directory`` holds beside the model (its
        tokenizer, the id limits of its ``config.json``, its name): :meth:`load` without
        building the session (a front-end process hands in a proxy of the engine's)."""
        path = Path(directory)
        base = path if path.is_dir() else path.parent
        tokenizer = None
        if (base / TOKENIZER_FILE).is_file() and (path.is_dir() or (base / MANIFEST_NAME).is_file()):
            tokenizers = require("tokenizers")
            tokenizer = tokenizers.Tokenizer.from_file(str(base / TOKENIZER_FILE))
        if name is None:
            name = _default_name(path)
        return cls(
            session,
            name,
            tokenizer=tokenizer,
            normalize_embeddings=normalize_embeddings,
            id_limits=_config_id_limits(base / "config.json"),
            max_text_chars=max_text_chars,
            truncate=truncate,
            lenient_params=lenient_params,
        )

    def _setup_tokenizer(self, tokenizer: Any) -> None:
        # position_ids: 0..n-1 for each text, what the model computes for one unpadded row
        known = {"input_ids", "attention_mask", "token_type_ids", "position_ids"}
        if self.pipeline is not None and self.pipeline.needs_prompt_length:
            known.add("prompt_length")  # filled here: the tokens of the prompt, left out of pooling
        unknown = [n for n in self._input_types if n not in known]
        if "input_ids" not in self._input_types or unknown:
            self.text_disabled_reason = (
                f"the model's inputs {sorted(self._input_types)} are not input_ids/attention_mask/"
                "token_type_ids/position_ids, so text cannot be tokenized for it"
            )
            log.warning("text input disabled: %s", self.text_disabled_reason)
            return
        # Each text is its own request (the session pads batches itself), so the
        # tokenizer must not pad; it truncates to the export's length limit.
        tokenizer.no_padding()
        max_len = self.manifest.max_sequence_length if self.manifest is not None else None
        if max_len:
            tokenizer.enable_truncation(max_length=max_len)
            self._cut_at = max(max_len * _CHARS_PER_TOKEN, _MIN_CUT_CHARS)
        self.tokenizer = tokenizer
        self.id_limits["input_ids"] = tokenizer.get_vocab_size(with_added_tokens=True)
        self.text_input = TEXT_INPUT if TEXT_INPUT not in self._input_types else "text_input"

    def _pick_embedding_output(self) -> tuple[str | None, str]:
        task = (self.manifest.source.get("task") if self.manifest is not None else None) or None
        if self.tokenizer is None:
            return None, self.text_disabled_reason
        pipe = self.pipeline
        if pipe is not None:
            if pipe.is_sparse:
                return None, "it is a sparse (SPLADE) export: use /embed_sparse"
            if pipe.output not in self._output_names:
                return None, f"the graph has no {pipe.output!r} output, which its manifest's pipeline names"
            return pipe.output, ""
        if task not in EMBEDDING_TASKS:
            return None, f"the export's task is {task!r}, not one of {sorted(EMBEDDING_TASKS)}"
        by_name = {m.name: m for m in self.outputs}
        for n in (*_POOLED_OUTPUTS, *_TOKEN_OUTPUTS):
            if n in by_name and len(by_name[n].shape) in (2, 3):
                return n, ""
        for m in self.outputs:
            if len(m.shape) == 3:
                return m.name, ""
        return None, f"no output looks like embeddings (outputs: {self._output_names})"

    def _pick_sparse_output(self) -> tuple[str | None, str]:
        pipe = self.pipeline
        if self.tokenizer is None:
            return None, self.text_disabled_reason
        if pipe is None or not pipe.is_sparse:
            return None, "it is not a sparse (SPLADE) export"
        if pipe.output not in self._output_names:
            return None, f"the graph has no {pipe.output!r} output, which its manifest's pipeline names"
        return pipe.output, ""

    # -- protocol views --------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the session accepts requests (and has finished its warm-up)."""
        return not getattr(self.session, "closed", False) and bool(getattr(self.session, "ready", True))

    def metadata(self) -> dict[str, Any]:
        """The model metadata response (``GET /v2/models/{name}``)."""
        # Exactly the tensors a request must carry: a metadata-driven client (perf_analyzer,
        # generic v2 clients) sends one tensor per listed input. Text-in is its own model
        # entry (``text_model_name``), though text alone is still accepted here.
        inputs = [m.to_dict() for m in self.inputs]
        doc: dict[str, Any] = {
            "name": self.name,
            "versions": [self.version],
            "platform": "onnxruntime_onnx",
            "inputs": inputs,
            "outputs": [m.to_dict() for m in self.outputs],
        }
        params: dict[str, Any] = {"max_batch_size": getattr(self.session, "max_batch_size", None)}
        if self.manifest is not None:
            params["task"] = self.manifest.source.get("task")
            source = self.manifest.source.get("model")
            # a hub id says what the model is; a local path only says where the exporter ran
            if isinstance(source, str) and not Path(source).is_absolute():
                params["source_model"] = source
            params["max_sequence_length"] = self.manifest.max_sequence_length
        if self.text_input is not None:
            params["text_input"] = self.text_input
            params["text_model"] = self.text_model_name
        pipe = self.pipeline
        if pipe is not None:  # what the embedding request parameters may name
            params["embedding_output"] = pipe.output
            params["embedding_dimension"] = pipe.dimension
            params["prompt_names"] = sorted(pipe.prompts)
            params["default_prompt_name"] = pipe.default_prompt_name
        doc["parameters"] = {k: v for k, v in params.items() if v is not None}
        return doc

    def triton_config(self) -> dict[str, Any]:
        """A Triton-style model configuration (``GET /v2/models/{name}/config``), for
        tools such as perf_analyzer that read it: dims exclude the batch dim."""

        def entry(m: TensorMetadata) -> dict[str, Any]:
            dtype = "TYPE_STRING" if m.datatype == "BYTES" else f"TYPE_{m.datatype}"
            return {"name": m.name, "data_type": dtype, "dims": list(m.shape[1:])}

        return {
            "name": self.name,
            "platform": "onnxruntime_onnx",
            "backend": "onnxruntime",
            "max_batch_size": getattr(self.session, "max_batch_size", 0),
            "input": [entry(m) for m in self.inputs],
            "output": [entry(m) for m in self.outputs],
            "dynamic_batching": {},
        }

    # -- inference -------------------------------------------------------------------
    def _output_names_for(self, req: InferRequest) -> list[str]:
        if not req.outputs:
            return list(self._output_names)
        names = [o.name for o in req.outputs]
        for n in names:
            if n not in self._output_names:
                raise InvalidInputError(f"unknown output {short_repr(n)}; the model's outputs are {self._output_names}")
        return names

    async def infer(self, req: InferRequest) -> list[tuple[str, np.ndarray]]:
        """Run a decoded request through the BatchedSession; returns ``(name, array)``
        pairs in the order the request asked for (model order by default). For an export
        with an embedding pipeline, the request's parameters ``dimensions``,
        ``encoding_format``, ``prompt_name``/``prompt`` (text inputs only; the checkpoint's
        default prompt otherwise) and, for SPLADE, ``top_k``/``threshold`` shape its
        pipeline output as they do on ``/v1/embeddings`` (:meth:`finish_output`)."""
        names = self._output_names_for(req)
        # an export without a pipeline reads no embedding parameters (v2 parameters are free-form)
        options = self.embed_options(req.parameters, V2_ENCODING_FORMATS) if self.pipeline is not None else None
        if self.text_input is not None and self.text_input in req.inputs:
            if len(req.inputs) != 1:
                raise InvalidInputError(
                    f"send either the text input {self.text_input!r} alone or the tensor inputs "
                    f"{sorted(self._input_types)}, not both"
                )
            if req.datatypes[self.text_input] != "BYTES":
                raise InvalidInputError(
                    f"input {self.text_input!r}: expected datatype BYTES, got {req.datatypes[self.text_input]}"
                )
            texts = _texts(req.inputs[self.text_input], self.text_input)
            prompt = self.resolve_prompt(options, texts=True) if options is not None else None
            coro = self._run_texts(texts, names, prompt)
        else:
            if options is not None:
                self.resolve_prompt(options, texts=False)  # refuses a prompt asked for token ids
            feed = self._tensor_feed(req)
            coro = self.session.run_async(names, feed)
        if req.timeout_s is None:
            outs = await coro
        else:
            try:
                outs = await asyncio.wait_for(coro, req.timeout_s)
            except asyncio.TimeoutError:
                raise RequestTimeoutError(
                    f"the request's timeout of {req.timeout_s * 1e3:g} ms passed before it finished"
                ) from None
        pairs = list(zip(names, outs, strict=True))
        check_finite_outputs(pairs)
        if options is not None and self.pipeline is not None:
            out = self.pipeline.output
            pairs = [(n, self.finish_output(a, options) if n == out else a) for n, a in pairs]
        return pairs

    def embed_options(self, fields: dict[str, Any], formats: Sequence[str]) -> EmbedOptions:
        """A request's embedding options (:class:`~ortbatch.embed.EmbedOptions`), checked
        against what this export is: top_k/threshold only for SPLADE, dimensions and
        quantized encodings only for dense pipelines; an export without a pipeline takes none
        of them but ``dimensions`` equal to its width (as OpenAI's clients may send)."""
        options = EmbedOptions.parse(fields, formats=formats)
        if self.pipeline is None:
            return options
        if self.pipeline.is_sparse:
            options.refuse_for_sparse()
        else:
            options.refuse_for_dense()
        return options

    def finish_output(self, vectors: np.ndarray, options: EmbedOptions) -> np.ndarray:
        """Embedding rows as ``options`` ask: truncated (re-normalized when the pipeline
        normalizes) and quantized, or for SPLADE all but the ``top_k`` largest / those over
        ``threshold`` zeroed. An export without a pipeline: its vectors are normalized when
        ``normalize_embeddings``, and it has no int8/uint8 calibration ranges."""
        pipe = self.pipeline
        if pipe is not None and pipe.is_sparse:
            return ops.keep_top(vectors, options.top_k, options.threshold)
        return ops.finish(
            vectors,
            options.dimensions,
            options.encoding_format,
            normalize=pipe.normalize if pipe is not None else self.normalize_embeddings,
            calibration=pipe.calibration if pipe is not None else None,
            ranges=pipe.quantization_ranges if pipe is not None else None,
        )

    def _tensor_feed(self, req: InferRequest) -> dict[str, np.ndarray]:
        missing = [n for n in self._input_types if n not in req.inputs]
        unknown = [n for n in req.inputs if n not in self._input_types]
        if unknown:
            hint = f" (or the text input {self.text_input!r} alone)" if self.text_input else ""
            named = "[" + ", ".join(short_repr(n) for n in unknown[:8]) + (", ..." if len(unknown) > 8 else "") + "]"
            raise InvalidInputError(f"unknown input(s) {named}; the model's inputs are {list(self._input_types)}{hint}")
        if missing:
            raise InvalidInputError(f"missing input(s) {missing}; the model's inputs are {list(self._input_types)}")
        for n in req.inputs:
            want = self._input_types[n]
            if req.datatypes[n] != want:
                raise InvalidInputError(f"input {n!r}: expected datatype {want}, got {req.datatypes[n]}")
            if want not in DATATYPES:
                raise InvalidInputError(f"input {n!r}: datatype {want} is not supported by this server")
        self._check_ids(req.inputs)
        return req.inputs

    def _check_ids(self, feed: dict[str, np.ndarray]) -> None:
        # An out-of-range id makes the embedding Gather fail inside ORT, which the
        # session can only report as an InferenceError; it is the request's fault (400).
        for name, limit in self.id_limits.items():
            ids = feed.get(name)
            if ids is None or ids.size == 0 or ids.dtype.kind not in "iu":
                continue
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise InvalidInputError(
                    f"input {name!r}: id {bad} is outside the model's range [0, {limit})", input_name=name
                )

    # -- text ------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], prompt: str | None = None) -> list[dict[str, np.ndarray]]:
        """One feed (1 row each) per text (after ``prompt``, as sentence-transformers
        prepends it), in the model's input dtypes (blocking; texts as they are, see
        :meth:`tokenize_async` for the bounded, non-blocking form)."""
        if self.tokenizer is None:
            raise InvalidInputError(f"this model takes no text: {self.text_disabled_reason}")
        full = list(texts) if not prompt else [prompt + t for t in texts]
        encodings = self.tokenizer.encode_batch(full)
        n = self.prompt_length(prompt)
        return [self._feed_from_ids(e.ids, e.attention_mask, e.type_ids, n) for e in encodings]

    async def tokenize_async(
        self, texts: Sequence[str], field: str, prompt: str | None = None
    ) -> list[dict[str, np.ndarray]]:
        """:meth:`tokenize` for a request's ``field``: the count and each text bounded
        first (see the class docs), and a large batch tokenized in a thread."""
        if self.tokenizer is None:
            raise InvalidInputError(f"this model takes no text: {self.text_disabled_reason}")
        self.check_count(len(texts), field)
        bounded = check_texts(texts, field, self._cut_at, self.max_text_chars)
        with tracing.span("ortbatch.tokenize", {"ortbatch.texts": len(bounded)}):
            if sum(map(len, bounded)) <= _INLINE_TOKENIZE_CHARS:
                return self.tokenize(bounded, prompt)
            return await asyncio.to_thread(self.tokenize, bounded, prompt)

    def check_count(self, count: int, field: str) -> None:
        """Refuse (413) a request of more items than the session can ever queue at once."""
        limit = getattr(self.session, "max_queue", None)
        if isinstance(limit, int) and count > limit:
            raise RequestTooLargeError(
                f"{field} has {count} items; this server queues at most {limit} at once (--max-queue): "
                "send them in smaller requests",
                input_name=field,
            )

    def encode(self, items: Sequence[str | tuple[str, str]], truncate: bool, field: str) -> list[Any]:
        """Tokenize texts (or ``(first, second)`` pairs, as the tokenizer pairs them) into
        ``tokenizers.Encoding`` objects, each text bounded first (see the class docs); an
        input the tokenizer had to cut to the model's limit is an InvalidInputError naming
        ``field[i]`` unless ``truncate``."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidInputError(f"model {self.name!r} takes no text: {self.text_disabled_reason}")
        self.check_count(len(items), field)
        flat = [t for item in items for t in (item if isinstance(item, tuple) else (item,))]
        bounded = iter(check_texts(flat, field, self._cut_at, self.max_text_chars))
        ready = [(next(bounded), next(bounded)) if isinstance(item, tuple) else next(bounded) for item in items]
        encodings: list[Any] = tok.encode_batch(ready)
        if not truncate:
            for i, e in enumerate(encodings):
                if e.overflowing:
                    limit = (tok.truncation or {}).get("max_length")
                    raise InvalidInputError(
                        f"'{field}'[{i}] is longer than the model's limit of {limit} tokens; "
                        'send "truncate": true to cut it to the limit',
                        input_name=field,
                    )
        return encodings

    async def encode_async(self, items: Sequence[str | tuple[str, str]], truncate: bool, field: str) -> list[Any]:
        """:meth:`encode`, in a thread when the request is large."""
        chars = sum(len(x) if isinstance(x, str) else len(x[0]) + len(x[1]) for x in items)
        with tracing.span("ortbatch.tokenize", {"ortbatch.texts": len(items)}):
            if chars <= _INLINE_TOKENIZE_CHARS:
                return self.encode(items, truncate, field)
            return await asyncio.to_thread(self.encode, items, truncate, field)

    def _feed_from_ids(
        self,
        ids: Sequence[int],
        mask: Sequence[int] | None = None,
        type_ids: Sequence[int] | None = None,
        prompt_length: int = 0,
    ) -> dict[str, np.ndarray]:
        n = len(ids)
        columns = {
            "input_ids": ids,
            "attention_mask": mask if mask is not None else [1] * n,
            "token_type_ids": type_ids if type_ids is not None else [0] * n,
            "position_ids": range(n),
        }
        try:
            feed = {
                name: np.asarray(columns[name], dtype=DATATYPES[dt]).reshape(1, n)
                for name, dt in self._input_types.items()
                if name != "prompt_length"
            }
        except OverflowError:
            raise InvalidInputError("a token id is out of range for the model's input dtype") from None
        if "prompt_length" in self._input_types:  # one value per row: [batch]
            feed["prompt_length"] = np.array([prompt_length], dtype=DATATYPES[self._input_types["prompt_length"]])
        return feed

    def prompt_length(self, prompt: str | None) -> int:
        """Tokens of ``prompt`` the pipeline leaves out of pooling (``include_prompt``
        false; else 0), counted as sentence-transformers counts them."""
        if not prompt or self.pipeline is None or not self.pipeline.needs_prompt_length:
            return 0
        n = self._prompt_lengths.get(prompt)
        if n is None:
            assert self.tokenizer is not None
            n = self._prompt_lengths[prompt] = ops.prompt_length(self.tokenizer, prompt)
        return n

    def read_once(self, key: Hashable, read: Callable[[], _T]) -> _T:
        """``read()`` on the first call for ``key``, then its value again: what the export's
        files say (label names, a head's activation) is read once per loaded model, not per
        request (a reload loads a new model)."""
        try:
            return self._read_once[key]
        except KeyError:
            value = self._read_once[key] = read()
            return value

    def resolve_prompt(self, options: EmbedOptions, texts: bool) -> str | None:
        """The prompt to put before each text: the request's ``prompt``, or the
        ``prompt_name`` it names, or the checkpoint's default prompt (sentence-transformers'
        rules). Token-id inputs are what the model sees: none is added to them, and asking
        for one with them is an InvalidInputError."""
        if not texts:
            field = options.asks_prompt
            if field is not None:
                raise InvalidInputError(
                    f"'{field}' needs text inputs: token ids are sent to the model as they are", input_name=field
                )
            return None
        return ops.resolve_prompt(self.pipeline, options.prompt_name, options.prompt) or None

    async def _run_texts(self, texts: Sequence[str], names: list[str], prompt: str | None) -> list[np.ndarray]:
        if not texts:
            raise InvalidInputError(f"input {self.text_input!r} has no texts")
        feeds = await self.tokenize_async(texts, f"input {self.text_input!r}", prompt)
        results = await self._gather(feeds, names)
        return [_stack_ragged([r[i] for r in results]) for i in range(len(names))]

    async def _gather(self, feeds: list[dict[str, np.ndarray]], names: list[str]) -> list[list[np.ndarray]]:
        """Run every feed as its own request, admitted as one unit (``submit_many``: all
        queued, or a 429 for all). At the first error the rest are cancelled (dropped
        before they run) and the error is raised."""
        self.check_count(len(feeds), "the request")
        submit_many = getattr(self.session, "submit_many", None)
        tasks: list[asyncio.Future[list[np.ndarray]]]
        if len(feeds) > 1 and submit_many is not None:
            tasks = [asyncio.wrap_future(f) for f in submit_many(feeds, names)]
        else:  # one feed (its deadline handled by run_async), or a duck-typed session
            tasks = [asyncio.ensure_future(self.session.run_async(names, f)) for f in feeds]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        for t in pending:
            t.cancel()
        for t in tasks:
            if t in done and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]

    async def embed(
        self,
        inputs: Sequence[str] | Sequence[Sequence[int]],
        truncate: bool | None = None,
        prompt: str | None = None,
        *,
        output: str | None = None,
    ) -> EmbeddingResult:
        """Embeddings, one row per input: the export's pipeline output (``output``, default
        :attr:`embedding_output`), or for an export without a pipeline its token embeddings
        mean-pooled here (L2-normalized unless ``normalize_embeddings`` is off). Texts are
        tokenized here, after ``prompt`` (see :meth:`resolve_prompt`); token-id lists are
        used as they are. An input longer than the model's limit is cut to it when
        ``truncate`` (default: ``self.truncate``), else refused with an InvalidInputError
        naming it."""
        output = output or self.embedding_output
        if output is None:
            raise LookupError(self.embeddings_disabled_reason)
        if not inputs:
            raise InvalidInputError("'input' must not be empty")
        feeds = await self._embedding_feeds(inputs, self.truncate if truncate is None else truncate, prompt)
        results = await self._gather(feeds, [output])
        rows = []
        tokens = 0
        for feed, (out,) in zip(feeds, results, strict=True):
            mask = feed.get("attention_mask")
            if mask is None:
                mask = np.ones(feed["input_ids"].shape, dtype=np.int64)
            tokens += int(mask.sum())
            rows.append(_pool(out, mask))
        emb = np.concatenate(rows, axis=0).astype(np.float32, copy=False)
        check_finite_outputs([(output, emb)])
        if self.normalize_embeddings and self.pipeline is None:
            norms = np.linalg.norm(emb, axis=1, keepdims=True)
            emb = emb / np.maximum(norms, 1e-12)
        return EmbeddingResult(emb, tokens)

    async def _embedding_feeds(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], truncate: bool, prompt: str | None
    ) -> list[dict[str, np.ndarray]]:
        if all(isinstance(x, str) for x in inputs):
            texts: list[str] = list(inputs)  # type: ignore[arg-type]
            full = texts if not prompt else [prompt + t for t in texts]
            encodings = await self.encode_async(full, truncate, "input")
            n = self.prompt_length(prompt)
            return [self._feed_from_ids(e.ids, e.attention_mask, e.type_ids, n) for e in encodings]
        self.check_count(len(inputs), "input")
        limit = self.manifest.max_sequence_length if self.manifest is not None else None
        id_rows: list[list[int]] = [list(ids) for ids in inputs]  # type: ignore[arg-type]
        if truncate and limit:
            id_rows = [r[:limit] for r in id_rows]
        feeds = [self._feed_from_ids(r) for r in id_rows]
        for feed in feeds:
            self._check_ids(feed)
        return feeds

    @property
    def text_model_name(self) -> str | None:
        """The KServe v2 model entry that takes text (one BYTES input), when the export
        has a tokenizer: ``{name}_text``."""
        return self.name + TEXT_MODEL_SUFFIX if self.text_input is not None else None

    @property
    def closed(self) -> bool:
        return bool(self.session.closed)

    def close(self, drain: bool = True) -> None:
        """Close the session (draining queued requests by default)."""
        self.session.close(drain=drain)


def _pool(out: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean of token embeddings over the attention mask (sentence-transformers' mean
    pooling); a 2-D output is already pooled."""
    if out.ndim == 2:
        return out.astype(np.float32, copy=False)
    m = mask[:, : out.shape[1], None].astype(np.float32)
    summed = (out.astype(np.float32) * m).sum(axis=1)
    return summed / np.maximum(m.sum(axis=1), 1e-9)


def _texts(array: np.ndarray, name: str) -> list[str]:
    texts = []
    for i, item in enumerate(array.reshape(-1).tolist()):
        try:
            texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError:
            raise InvalidInputError(f"input {name!r}: element {i} is not valid UTF-8") from None
    return texts


def _stack_ragged(arrays: list[np.ndarray]) -> np.ndarray:
    """Concatenate per-request outputs along the batch axis, zero-padding any axis on
    which they differ (a ragged axis trimmed per request) to the longest."""
    if len(arrays) == 1:
        return arrays[0]
    ndim = arrays[0].ndim
    if ndim == 0 or any(a.ndim != ndim for a in arrays):
        return np.concatenate([np.atleast_1d(a) for a in arrays], axis=0)
    target = [max(a.shape[d] for a in arrays) for d in range(1, ndim)]
    padded = []
    for a in arrays:
        pad = [(0, 0)] + [(0, t - s) for t, s in zip(target, a.shape[1:], strict=True)]
        padded.append(np.pad(a, pad) if any(p[1] for p in pad) else a)
    return np.concatenate(padded, axis=0)


def _config_id_limits(config: Path) -> dict[str, int]:
    """``vocab_size`` / ``type_vocab_size`` from a Hugging Face ``config.json``, if any."""
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    limits = {}
    for key, name in (("vocab_size", "input_ids"), ("type_vocab_size", "token_type_ids")):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            limits[name] = value
    return limits


def _default_name(path: Path) -> str:
    """The directory's name (``exports/minilm`` -> ``minilm``), or a bare file's stem."""
    base = path if path.is_dir() else path.with_suffix("")
    return base.resolve().name or "model"
