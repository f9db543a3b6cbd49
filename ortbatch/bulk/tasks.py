"""What ``ortbatch run`` computes for one window of rows: the task interface and its
implementations for each kind of export.

A :class:`Task` takes rows (texts in) and returns, for each row and in the same order,
either a result (a ``dict`` of output fields) or a :class:`RowFailure` (kind and reason);
it never raises for one bad row. The job (:mod:`ortbatch.bulk.job`) owns windows, order,
shards and resume; a task owns only "rows → outcomes", so swapping how a kind of export is
computed is a change here alone.

Encoder exports (:class:`EncoderTask`) tokenize the window at once, sort its rows by token
length, cut the sorted order into batches (at most ``max_batch_size`` rows, and at most
``max_batch_tokens`` padded tokens when the export sets it), pad each batch with the
session's own collator and run it as one request of the :class:`~ortbatch.BatchedSession`
(which keeps several in flight). Batch composition is therefore a function of the input
alone, never of timing, so a resumed run computes exactly what an uninterrupted one does.
A batch whose run fails is split in halves and each half retried, down to the single row
that fails; the others still get their outputs.

Heads turn a row's model outputs into its fields, by the export's task:

* ``feature-extraction`` (and sentence-similarity): ``embedding``, the export's
  sentence-transformers pipeline output (default prompt applied), as ``ortbatch serve``'s
  ``/v1/embeddings`` and :class:`~ortbatch.embed.Embedder` give it (:class:`EmbeddingHead`);
* ``text-classification`` with one logit (a cross-encoder): ``score``, sentence-transformers'
  ``CrossEncoder.predict`` (its activation, Sigmoid by default), as ``/v1/rerank``; with
  several: ``label`` and ``scores`` (transformers' text-classification pipeline's function:
  softmax, or sigmoid for multi-label, the logits for regression), as ``/v1/classify``;
* ``token-classification``: ``entities`` (spans with character offsets);
* ``text-generation``: :class:`GenerationTask`, through a
  :class:`~ortbatch.BatchedGenerator` (continuous batching).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from .._ort.session import cpu_session_options
from ..errors import InferenceError, InvalidInputError, OrtBatchError, UnsupportedModelError
from ..heads import activate, read_heads
from ..manifest import MANIFEST_NAME, Manifest
from .sources import Row

__all__ = [
    "EMBEDDING_TASKS",
    "EncoderTask",
    "Field",
    "GenerationTask",
    "Outcome",
    "RowFailure",
    "Task",
    "TaskOptions",
    "encoder_task",
    "export_kind",
]

EMBEDDING_TASKS = frozenset({"feature-extraction", "sentence-similarity", "sentence-embeddings"})
GENERATION_TASKS = frozenset({"text-generation", "text-generation-with-past"})
# already-pooled outputs first, then token embeddings (pooled here): serve's order
_POOLED_OUTPUTS = ("sentence_embedding", "sentence_embeddings", "embeddings")
_TOKEN_OUTPUTS = ("last_hidden_state", "token_embeddings")
# a text over this many characters is refused before it is tokenized when the export has
# no token limit to cut at; with one, texts are cut to limit x 32 characters (at least
# 8192) first, so tokenizing costs only the part that can be kept (as `ortbatch serve`)
DEFAULT_MAX_TEXT_CHARS = 100_000
_CHARS_PER_TOKEN = 32
_MIN_CUT_CHARS = 8192


@dataclass(frozen=True)
class RowFailure:
    """Why one row has no result: ``kind`` (``too_long``, ``invalid_utf8``,
    ``invalid_input``, ``rejected`` by the model, ``inference`` failed, ...) and a message
    naming what was wrong."""

    kind: str
    message: str
    #: the HTTP status ``ortbatch serve`` would answer this request with (Batch API lines;
    #: None: the kind's usual one)
    status: int | None = None
    #: the request field the failure is about (the OpenAI error's ``param``)
    param: str | None = None


#: one row's result (its output fields) or why it failed
Outcome = dict[str, Any] | RowFailure


@dataclass(frozen=True)
class Field:
    """One output column: ``kind`` is ``int64``, ``float64``, ``string``, ``vector``
    (a fixed-size list of ``size`` numbers of ``dtype``) or ``entities``."""

    name: str
    kind: str
    size: int | None = None
    dtype: str = "float32"


@dataclass(frozen=True)
class TaskOptions:
    """How rows are computed (the parts of :class:`~ortbatch.bulk.RunConfig` a task reads)."""

    truncate: bool = False
    normalize: bool = True
    max_batch_size: int | None = None
    providers: Any = None
    max_new_tokens: int = 64
    #: most rows queued in the runtime at once (at least one window's)
    max_queue: int = 8192
    #: cores the task's sessions share (a Ray worker's share of its node); None: this
    #: machine's, as BatchedSession sizes its threads by itself
    cpus: int | None = None
    #: Batch API completion answers' ``created`` (the input's modification time, so a resumed
    #: job writes the same bytes)
    created: int = 0
    #: a generation job's sampling parameters (:data:`SAMPLING_FIELDS`, as ``/v1/completions``
    #: takes them); None: greedy
    sampling: Mapping[str, Any] | None = None


class Task(abc.ABC):
    """Rows in, one :data:`Outcome` per row out (same order). Never raises for a row."""

    #: the export's task as this job computes it (``embedding``, ``classification``, ...)
    kind: str = ""
    #: the export's name (its directory's), as answers name the model
    model_name: str = "model"

    @property
    @abc.abstractmethod
    def fields(self) -> list[Field]:
        """The output columns every result holds."""

    @abc.abstractmethod
    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        """Compute ``rows``; a row with :attr:`Row.error` fails with that reason."""

    #: real tokens (not padding) the last :meth:`run` used, for the progress line
    last_tokens: int = 0
    #: told ``(rows, tokens)`` as each batch of a :meth:`run` finishes (the progress display
    #: of a local ``ortbatch run``: progress from the first batch, not the first window)
    on_progress: Callable[[int, int], None] | None = None
    #: whether the task honours :attr:`restored` and :attr:`on_outcomes` (checkpoints inside a
    #: window, :mod:`ortbatch.bulk.checkpoint`); a task that does not is resumed per window
    checkpoints: bool = False
    #: outcomes already known for the next :meth:`run` (positions in its rows -> outcome),
    #: restored from a checkpoint: a task that :attr:`checkpoints` returns them as they are
    #: and computes the other rows in the very batches it would have computed them in
    restored: Mapping[int, Outcome] | None = None
    #: told ``(positions, outcomes)`` as each batch of a :meth:`run` finishes, before
    #: :attr:`on_progress`, so the rows the progress shows done are already checkpointed
    on_outcomes: Callable[[list[int], list[Outcome]], None] | None = None

    def batching(self) -> dict[str, Any]:
        """What the task's batches depend on besides the rows (a checkpoint written under other
        settings is not restored: its outcomes came from other batches, so other bytes)."""
        return {}

    def record(self, row: Row, result: dict[str, Any], with_id: bool) -> dict[str, Any]:
        """The output record of a row that succeeded: ``row`` (its number in the input),
        ``id`` (with ``--id-column``), then the task's fields."""
        rec: dict[str, Any] = {"row": row.index}
        if with_id:
            rec["id"] = row.id
        rec.update(result)
        return rec

    def error_record(self, row: Row, failure: RowFailure) -> dict[str, Any]:
        """The errors-file record of a row that failed: its number, id, kind and reason."""
        return {"row": row.index, "id": row.id, "error": failure.kind, "message": failure.message}

    def describe(self) -> dict[str, Any]:
        """What a resumed run must agree on (kept in the run manifest)."""
        return {"kind": self.kind, "fields": [f.__dict__ for f in self.fields]}

    def close(self) -> None:  # noqa: B027 - optional for tasks that own nothing
        """Release the runtime."""


# -- the encoder core ----------------------------------------------------------------------
class _Encoded:
    """One tokenized item: the session feed, its real token count, the Encoding."""

    __slots__ = ("encoding", "feed", "tokens")

    def __init__(self, feed: dict[str, np.ndarray], tokens: int, encoding: Any) -> None:
        self.feed = feed
        self.tokens = tokens
        self.encoding = encoding


class Encoder:
    """An encoder export's :class:`~ortbatch.BatchedSession` and tokenizer, and the
    deterministic batching described in the module docs."""

    def __init__(self, export_dir: Path, options: TaskOptions) -> None:
        from ..runtime.session import BatchedSession

        self.directory = export_dir
        self.manifest = Manifest.load(export_dir) if (export_dir / MANIFEST_NAME).is_file() else None
        tok_path = export_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise UnsupportedModelError(f"{export_dir} has no tokenizer.json: `ortbatch run` needs one to read text")
        tokenizers = require("tokenizers", "bulk")
        self.tokenizer = tokenizers.Tokenizer.from_file(str(tok_path))
        self.tokenizer.no_padding()  # each row is padded by the session's collator
        self.max_length = self.manifest.max_sequence_length if self.manifest is not None else None
        self._cut_at: int | None = None
        if self.max_length:
            self.tokenizer.enable_truncation(max_length=self.max_length)
            self._cut_at = max(self.max_length * _CHARS_PER_TOKEN, _MIN_CUT_CHARS)
        tuned = self.manifest.runtime if self.manifest is not None else {}
        session_options = None
        if options.cpus is not None:
            # BatchedSession's batches in flight: the export's tuned setting, else its default of 2
            session_options = cpu_session_options(options.cpus, int(tuned.get("workers") or 2))
        self.session = BatchedSession(
            export_dir,
            max_batch_size=options.max_batch_size,
            max_queue=options.max_queue,
            providers=options.providers,
            session_options=session_options,
            # one session: a batch that runs alone must compute what it computes in a
            # loaded one, so results never depend on timing
            latency_session=False,
        )
        self.input_names = list(self.session.input_names)
        # prompt_length: a pipeline's include_prompt=false (the prompt's tokens left out of pooling);
        # position_ids: a decoder embedder's (Qwen2/Llama/GPT-2 feature-extraction), each row's own 0..n-1
        known = {"input_ids", "attention_mask", "token_type_ids", "position_ids", "prompt_length"}
        if "input_ids" not in self.input_names or not known.issuperset(self.input_names):
            self.session.close()
            raise UnsupportedModelError(
                f"the model's inputs {self.input_names} are not input_ids/attention_mask/token_type_ids/"
                "position_ids, so text cannot be tokenized for it"
            )
        self._prompt_lengths: dict[str, int] = {}
        self._dtypes = {i.name: _ort_dtype(i.type) for i in self.session.get_inputs()}
        self.vocab_limit = _config_vocab(export_dir / "config.json")
        # what `ortbatch tune` chose caps a batch's padded tokens, as it caps the session's
        self.max_batch_tokens: int | None = tuned.get("max_batch_tokens")

    @property
    def task(self) -> str | None:
        task = self.manifest.source.get("task") if self.manifest is not None else None
        return task if isinstance(task, str) else None

    def outputs(self) -> list[Any]:
        return list(self.session.get_outputs())

    def encode(
        self,
        items: Sequence[str | tuple[str, str] | list[int]],
        truncate: bool,
        prompt: str | None = None,
        remedy: str = "pass --truncate to cut it",
    ) -> list[_Encoded | RowFailure]:
        """Tokenize texts (after ``prompt``, when given), ``(first, second)`` pairs or token-id
        lists; an item over the model's limit is a ``too_long`` failure unless ``truncate``
        (its message ends with ``remedy``: how the user asks for the cut)."""
        prompt_length = self._prompt_length(prompt)
        out: list[_Encoded | RowFailure | None] = [None] * len(items)
        texts: list[Any] = []
        where: list[int] = []
        for i, item in enumerate(items):
            if isinstance(item, list):
                ids = item
                if self.max_length and len(ids) > self.max_length:
                    if not truncate:
                        out[i] = RowFailure("too_long", self._too_long(len(ids), remedy))
                        continue
                    ids = ids[: self.max_length]
                if self.vocab_limit and any(not 0 <= t < self.vocab_limit for t in ids):
                    bad = next(t for t in ids if not 0 <= t < self.vocab_limit)
                    out[i] = RowFailure(
                        "invalid_input", f"token id {bad} is outside the vocabulary [0, {self.vocab_limit})"
                    )
                    continue
                if not ids:
                    out[i] = RowFailure("invalid_input", "an empty list of token ids")
                    continue
                out[i] = _Encoded(self._feed(ids, None, None, 0), len(ids), None)
                continue
            parts = item if isinstance(item, tuple) else (item,)
            cut = []
            failed = False
            for t in parts:
                if self._cut_at is not None:
                    t = t[: self._cut_at]
                elif len(t) > DEFAULT_MAX_TEXT_CHARS:
                    out[i] = RowFailure(
                        "too_long", f"the text has {len(t)} characters; at most {DEFAULT_MAX_TEXT_CHARS} are taken"
                    )
                    failed = True
                    break
                cut.append(t)
            if failed:
                continue
            texts.append(tuple(cut) if len(cut) == 2 else (prompt or "") + cut[0])
            where.append(i)
        if texts:
            for i, enc in zip(where, self.tokenizer.encode_batch(texts), strict=True):
                if enc.overflowing and not truncate:
                    out[i] = RowFailure("too_long", self._too_long(None, remedy))
                    continue
                feed = self._feed(enc.ids, enc.attention_mask, enc.type_ids, prompt_length)
                out[i] = _Encoded(feed, int(sum(enc.attention_mask)), enc)
        return [o if o is not None else RowFailure("invalid_input", "not computed") for o in out]

    def _too_long(self, n: int | None, remedy: str) -> str:
        got = f" ({n} tokens)" if n is not None else ""
        return f"the input is longer than the model's limit of {self.max_length} tokens{got}; {remedy}"

    def _prompt_length(self, prompt: str | None) -> int:
        """Tokens of ``prompt`` a pipeline with ``include_prompt=false`` leaves out of pooling
        (counted as sentence-transformers counts them); 0 when the model does not ask."""
        if not prompt or "prompt_length" not in self.input_names:
            return 0
        if prompt not in self._prompt_lengths:
            from ..embed.ops import prompt_length

            self._prompt_lengths[prompt] = prompt_length(self.tokenizer, prompt)
        return self._prompt_lengths[prompt]

    def _feed(
        self, ids: Sequence[int], mask: Sequence[int] | None, types: Sequence[int] | None, prompt_length: int
    ) -> dict[str, np.ndarray]:
        n = len(ids)
        cols = {
            "input_ids": ids,
            "attention_mask": mask if mask is not None else [1] * n,
            "token_type_ids": types if types is not None else [0] * n,
            "position_ids": range(n),
        }
        feed = {
            name: np.asarray(cols[name], dtype=self._dtypes[name]).reshape(1, n)
            for name in self.input_names
            if name != "prompt_length"
        }
        if "prompt_length" in self.input_names:  # one value per row: [batch]
            feed["prompt_length"] = np.array([prompt_length], dtype=self._dtypes["prompt_length"])
        return feed

    def infer(
        self,
        items: Sequence[_Encoded | RowFailure],
        names: list[str],
        on_batch: Callable[[int, int], None] | None = None,
        skip: Container[int] = (),
        on_chunk: Callable[[list[int], list[Any]], None] | None = None,
    ) -> list[list[np.ndarray] | RowFailure]:
        """Run every encoded item (failures pass through): per item, its outputs
        (``names`` order, trimmed to its own length) or why it failed. ``on_batch`` is told
        ``(rows, tokens)`` of each batch as its outputs are collected, after ``on_chunk``
        (the batch's item positions and the list of every item's outputs so far). A batch
        whose every item is in ``skip`` (known from a checkpoint) is not run: its items'
        places say ``RowFailure("inference", "no result")`` for the caller to fill; the
        batches are cut as if it ran, so the others are the very batches they would be."""
        out: list[list[np.ndarray] | RowFailure | None] = [None] * len(items)
        collator = self.session.collator
        prepared: dict[int, Any] = {}
        for i, item in enumerate(items):
            if isinstance(item, RowFailure):
                out[i] = item
                continue
            try:
                prepared[i] = collator.prepare(item.feed)
            except InvalidInputError as exc:
                out[i] = RowFailure("invalid_input", str(exc))
        order = sorted(prepared, key=lambda i: (prepared[i].length, i))
        chunks = self._chunks(order, prepared)
        todo = [chunk for chunk in chunks if not all(i in skip for i in chunk)]
        pending = [(chunk, self._submit(chunk, prepared, names)) for chunk in todo]
        for chunk, fut in pending:
            self._collect(chunk, fut, prepared, names, out)
            if on_chunk is not None:
                on_chunk(chunk, out)
            if on_batch is not None:
                on_batch(len(chunk), sum(getattr(items[i], "tokens", 0) for i in chunk))
        return [o if o is not None else RowFailure("inference", "no result") for o in out]

    def _chunks(self, order: list[int], prepared: dict[int, Any]) -> list[list[int]]:
        limit_rows = self.session.max_batch_size
        limit_tokens = self.max_batch_tokens
        chunks: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            length = prepared[i].length  # rows ascend in length, so this row is the longest
            if cur and (len(cur) + 1 > limit_rows or (limit_tokens and (len(cur) + 1) * length > limit_tokens)):
                chunks.append(cur)
                cur = []
            cur.append(i)
        if cur:
            chunks.append(cur)
        return chunks

    def _submit(self, chunk: list[int], prepared: dict[int, Any], names: list[str]) -> Any:
        feed, state = self.session.collator.collate([prepared[i] for i in chunk])
        try:
            return self.session.submit(feed, names), state
        except OrtBatchError as exc:
            return exc, state

    def _collect(self, chunk: list[int], sub: Any, prepared: dict[int, Any], names: list[str], out: list[Any]) -> None:
        fut, state = sub
        try:
            if isinstance(fut, BaseException):
                raise fut
            outs = fut.result()
            per_row = self.session.collator.split(dict(zip(names, outs, strict=True)), state)
        except (InferenceError, InvalidInputError) as exc:
            if len(chunk) == 1:
                # the runtime maps values ONNX Runtime refuses (ids past the vocabulary) to
                # InvalidInputError: the model rejected this row; InferenceError: it failed
                kind = "inference" if isinstance(exc, InferenceError) else "rejected"
                out[chunk[0]] = RowFailure(kind, f"the model failed on this row: {exc}")
                return
            # split and retry: only the row that fails fails
            half = len(chunk) // 2
            for part in (chunk[:half], chunk[half:]):
                self._collect(part, self._submit(part, prepared, names), prepared, names, out)
            return
        for i, res in zip(chunk, per_row, strict=True):
            out[i] = [res[n] for n in names]

    def close(self) -> None:
        self.session.close(drain=False)


def _ort_dtype(type_str: str) -> Any:
    return {"tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(type_str, np.int64)


def _config_vocab(config: Path) -> int | None:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("vocab_size") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# -- heads: a row's outputs -> its fields -----------------------------------------------------
class Head(abc.ABC):
    output: str
    #: put before each text (an embedding pipeline's default prompt)
    prompt: str | None = None
    #: put before the first text of each pair (a cross-encoder's default prompt)
    query_prompt: str = ""

    @property
    @abc.abstractmethod
    def fields(self) -> list[Field]: ...

    @abc.abstractmethod
    def value(self, out: np.ndarray, item: _Encoded, row: Row) -> dict[str, Any]: ...


class EmbeddingHead(Head):
    """Sentence embeddings as ``ortbatch serve``'s ``/v1/embeddings`` makes them.

    An export whose manifest records its sentence-transformers pipeline
    (:class:`~ortbatch.embed.EmbeddingPipeline`: pooling, Dense, Normalize, all inside the graph;
    prompts) gives that pipeline's output as it is, each text after the checkpoint's default
    prompt (:attr:`prompt`): sentence-transformers' ``encode``, as :class:`~ortbatch.embed.Embedder`
    gives it; :meth:`finish` applies a request's ``dimensions`` and encoding with the same
    :func:`ortbatch.embed.ops.finish` serve uses. An older export without a pipeline gives its pooled
    output, else the mean of its token embeddings over the attention mask, L2-normalized unless
    ``normalize`` is off (what serve does for such an export). Nothing else in ``ortbatch.bulk``
    knows how a vector is made.
    """

    def __init__(self, encoder: Encoder, normalize: bool) -> None:
        from ..embed.pipeline import EmbeddingPipeline

        manifest = encoder.manifest
        self.pipeline = EmbeddingPipeline.from_manifest(manifest) if manifest is not None else None
        if self.pipeline is None:
            self.output, self.dim = self.pick_output(encoder)
            self.normalize = normalize
            return
        pipe = self.pipeline
        if pipe.is_sparse:
            raise UnsupportedModelError(
                f"{encoder.directory} is a sparse (SPLADE) export: `ortbatch run` computes dense embeddings"
            )
        if pipe.output not in {o.name for o in encoder.outputs()}:
            raise UnsupportedModelError(f"{encoder.directory}: the graph has no {pipe.output!r} output")
        if pipe.normalize and not normalize:
            raise InvalidInputError(
                "--no-normalize: this export's pipeline normalizes inside its graph (sentence-transformers' "
                "Normalize module); its vectors are the checkpoint's own",
                input_name="normalize",
            )
        self.output, self.dim, self.normalize = pipe.output, pipe.dimension, pipe.normalize
        self.prompt = self.resolve_prompt(None, None)

    def resolve_prompt(self, prompt_name: str | None, prompt: str | None) -> str | None:
        """The prompt before each text: ``prompt``, the checkpoint's prompt ``prompt_name``, or
        its default one (sentence-transformers' rules; ``""`` is none)."""
        from ..embed import ops

        return ops.resolve_prompt(self.pipeline, prompt_name, prompt) or None

    def finish(self, vectors: np.ndarray, dimensions: int | None, encoding_format: str) -> np.ndarray:
        """``vectors`` as a request asks: truncated to ``dimensions`` (re-normalized when the
        pipeline normalizes) and quantized for the int8/uint8/binary formats, as serve does."""
        from ..embed import ops

        pipe = self.pipeline
        return ops.finish(
            vectors,
            dimensions,
            encoding_format,
            normalize=self.normalize,
            calibration=pipe.calibration if pipe is not None else None,
            ranges=pipe.quantization_ranges if pipe is not None else None,
        )

    @staticmethod
    def pick_output(encoder: Encoder) -> tuple[str, int | None]:
        outs = {o.name: o for o in encoder.outputs()}
        for name in (*_POOLED_OUTPUTS, *_TOKEN_OUTPUTS):
            node = outs.get(name)
            if node is not None and len(node.shape or ()) in (2, 3):
                return name, _static(node.shape[-1])
        for node in outs.values():
            if len(node.shape or ()) == 3:
                return node.name, _static(node.shape[-1])
        raise UnsupportedModelError(f"no output of {encoder.directory} looks like embeddings (outputs: {sorted(outs)})")

    @property
    def fields(self) -> list[Field]:
        return [Field("embedding", "vector", self.dim, "float32")]

    def vector(self, out: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if self.pipeline is not None:  # the pipeline's own vector, computed in the graph
            return np.asarray(out.reshape(-1), dtype=np.float32)
        if out.ndim == 2:
            v = out.astype(np.float32, copy=False)
        else:
            m = mask[:, : out.shape[1], None].astype(np.float32)
            v = (out.astype(np.float32) * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        v = v.astype(np.float32, copy=False)
        if self.normalize:
            # the norm of a [1, dim] row along axis 1, as serve takes it: a 1-D norm is a
            # BLAS dot product and can differ in the last bit
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return np.asarray(v[0], dtype=np.float32)

    def value(self, out: np.ndarray, item: _Encoded, row: Row) -> dict[str, Any]:
        mask = item.feed.get("attention_mask")
        if mask is None:
            mask = np.ones(item.feed["input_ids"].shape, dtype=np.int64)
        v = self.vector(out, mask)
        if not np.isfinite(v).all():
            raise InferenceError("the model produced non-finite values (NaN or Inf) for this row")
        if self.dim is None:
            self.dim = int(v.shape[0])
        return {"embedding": v}


def _static(dim: Any) -> int | None:
    return dim if isinstance(dim, int) and dim > 0 else None


def _logits(encoder: Encoder) -> tuple[str, int]:
    outs = encoder.outputs()
    by = {o.name: o for o in outs}
    node = by.get("logits") or (outs[0] if len(outs) == 1 else None)
    if node is None:
        raise UnsupportedModelError(f"no logits output in {encoder.directory} (outputs: {sorted(by)})")
    width = _static(node.shape[-1]) if node.shape else None
    if width is None:
        raise UnsupportedModelError(f"the logits output of {encoder.directory} has no fixed number of labels")
    return node.name, width


def _softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return np.asarray(e / e.sum(axis=-1, keepdims=True))


class ScoreHead(Head):
    """A cross-encoder's relevance: ``score`` = its activation of the logit, as
    sentence-transformers' ``CrossEncoder.predict`` applies it (:mod:`ortbatch.heads`) and
    ``/v1/rerank`` answers."""

    def __init__(self, encoder: Encoder) -> None:
        self.output, _ = _logits(encoder)
        heads = read_heads(encoder.directory, 1)
        if heads.score is None:
            raise UnsupportedModelError(f"{encoder.directory}: {heads.score_refused}")
        self.function = heads.score
        self.query_prompt = heads.query_prompt  # as CrossEncoder.predict puts it

    @property
    def fields(self) -> list[Field]:
        return [Field("score", "float64")]

    def value(self, out: np.ndarray, item: _Encoded, row: Row) -> dict[str, Any]:
        return {"score": float(activate(self.function, out.reshape(-1)[:1])[0])}


class LabelHead(Head):
    """Sequence classification: the best ``label`` and every label's score, as transformers'
    text-classification pipeline computes them (softmax; sigmoid for multi-label; the
    logits for regression: :mod:`ortbatch.heads`) and ``/v1/classify`` answers."""

    def __init__(self, encoder: Encoder) -> None:
        self.output, self.width = _logits(encoder)
        heads = read_heads(encoder.directory, self.width)
        self.labels = list(heads.label_names)
        self.function = heads.labels

    @property
    def fields(self) -> list[Field]:
        return [Field("label", "string"), Field("scores", "vector", self.width, "float64")]

    def value(self, out: np.ndarray, item: _Encoded, row: Row) -> dict[str, Any]:
        probs = activate(self.function, out.reshape(-1))
        return {"label": self.labels[int(probs.argmax())], "scores": probs}


class SpanHead(Head):
    """Token classification: entity spans as transformers' token-classification pipeline
    gives them with ``aggregation_strategy="simple"`` (special tokens and ``O`` dropped,
    ``B-X``/``I-X`` tokens joined into one ``X`` span, score the mean probability,
    ``start``/``end`` character offsets into the text)."""

    def __init__(self, encoder: Encoder) -> None:
        self.output, self.width = _logits(encoder)
        self.labels = list(read_heads(encoder.directory, self.width).label_names)

    @property
    def fields(self) -> list[Field]:
        return [Field("entities", "entities")]

    def value(self, out: np.ndarray, item: _Encoded, row: Row) -> dict[str, Any]:
        enc = item.encoding
        probs = _softmax(out.reshape(-1, self.width)[: len(enc.ids)])
        text = row.text or ""
        spans: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None
        scores: list[float] = []
        for t, (special, (start, end)) in enumerate(zip(enc.special_tokens_mask, enc.offsets, strict=True)):
            best = int(probs[t].argmax())
            label = self.labels[best]
            prefix, kind = (label[:1], label[2:]) if label[:2] in ("B-", "I-") else ("", label)
            joins = current is not None and not special and kind != "O" and current["label"] == kind and prefix != "B"
            if joins:
                assert current is not None
                current["end"] = end
                scores.append(float(probs[t, best]))
                continue
            if current is not None:
                spans.append(_span(current, scores, text))
                current, scores = None, []
            if special or kind == "O":
                continue
            current = {"label": kind, "start": start, "end": end}
            scores = [float(probs[t, best])]
        if current is not None:
            spans.append(_span(current, scores, text))
        return {"entities": spans}


def _span(span: dict[str, Any], scores: list[float], text: str) -> dict[str, Any]:
    return {
        "label": span["label"],
        "score": float(np.mean(scores)),
        "start": int(span["start"]),
        "end": int(span["end"]),
        "text": text[span["start"] : span["end"]],
    }


class EncoderTask(Task):
    """An encoder export's task (embeddings, scores, labels or spans) over an :class:`Encoder`."""

    checkpoints = True

    def __init__(self, encoder: Encoder, head: Head, kind: str, options: TaskOptions) -> None:
        self.encoder = encoder
        self.head = head
        self.kind = kind
        self.options = options
        self.model_name = encoder.directory.resolve().name or "model"

    @property
    def fields(self) -> list[Field]:
        return self.head.fields

    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        items: list[Any] = []
        for r in rows:
            if r.error is not None:
                items.append(RowFailure(*r.error))
            elif r.text is None:
                items.append(RowFailure("invalid_input", "the row has no text"))
            else:
                pair = r.pair is not None
                items.append((self.head.query_prompt + r.text, r.pair) if pair else r.text)
        texts = [x for x in items if not isinstance(x, RowFailure)]
        encoded = iter(self.encoder.encode(texts, self.options.truncate, self.head.prompt))
        enc: list[_Encoded | RowFailure] = [x if isinstance(x, RowFailure) else next(encoded) for x in items]
        self.last_tokens = sum(e.tokens for e in enc if isinstance(e, _Encoded))
        restored = self.restored or {}
        done: dict[int, Outcome] = dict(restored)
        on_outcomes = self.on_outcomes

        def finished(chunk: list[int], outs: list[Any]) -> None:
            outcomes = [self._outcome(rows[i], enc[i], outs[i]) for i in chunk]
            done.update(zip(chunk, outcomes, strict=True))
            if on_outcomes is not None:
                on_outcomes(chunk, outcomes)

        outs = self.encoder.infer(enc, [self.head.output], self.on_progress, restored, finished)
        return [
            done[i] if i in done else self._outcome(row, item, res)
            for i, (row, item, res) in enumerate(zip(rows, enc, outs, strict=True))
        ]

    def _outcome(self, row: Row, item: _Encoded | RowFailure, res: list[np.ndarray] | RowFailure) -> Outcome:
        if isinstance(res, RowFailure):
            return res
        assert isinstance(item, _Encoded)
        try:
            return self.head.value(res[0], item, row)
        except OrtBatchError as exc:
            return RowFailure("inference", str(exc))

    def batching(self) -> dict[str, Any]:
        # the rows sorted by length are cut into batches by these two limits alone; the
        # providers' kernels (CUDA's, CPU's) round differently, so they are named too
        session = self.encoder.session
        return {
            "max_batch_size": session.max_batch_size,
            "max_batch_tokens": self.encoder.max_batch_tokens,
            "providers": session.get_providers(),
        }

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "truncate": self.options.truncate, "normalize": self.options.normalize}

    def close(self) -> None:
        self.encoder.close()


#: the fields ``--sampling`` takes: ``/v1/completions``' sampling fields, as ``ortbatch serve`` reads them
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


def job_sampling(sampling: Mapping[str, Any] | None, max_new_tokens: int) -> Any:
    """The :class:`~ortbatch.generation.SamplingParams` of a generation job: greedy without
    ``sampling``; else its fields read as ``ortbatch serve`` reads them in a ``/v1/completions``
    body (the same checks and defaults: ``temperature`` 1 when not given). Raises
    :class:`InvalidInputError` naming a field that is not one of :data:`SAMPLING_FIELDS` or a
    value that is refused."""
    from ..generation.sampling import SamplingParams

    if sampling is None:
        return SamplingParams(max_new_tokens=max_new_tokens)
    if not isinstance(sampling, Mapping):
        raise InvalidInputError("sampling must be a JSON object of sampling parameters")
    unknown = [k for k in sampling if k not in SAMPLING_FIELDS]
    if unknown:
        hint = " (use --max-new-tokens)" if unknown[0] in ("max_tokens", "max_completion_tokens") else ""
        raise InvalidInputError(
            f"sampling: unknown parameter {str(unknown[0])[:40]!r}{hint}; a generation job takes "
            + ", ".join(SAMPLING_FIELDS),
            input_name=str(unknown[0]),
        )
    from ..serve.served.completions import parse_completion_request

    doc = {**sampling, "prompt": "-", "max_tokens": max_new_tokens}
    try:
        return parse_completion_request(doc).params
    except InvalidInputError as exc:
        raise InvalidInputError(f"sampling: {exc}", input_name=exc.input_name) from None


def row_seed(seed: int | None, row: Row) -> int:
    """The seed row ``row`` of a sampled generation job draws with: derived from the job's
    ``seed`` (0 when not given) and the row's number, so a rerun or a resumed job repeats it."""
    digest = hashlib.sha256(f"{seed or 0}\0{row.index}".encode()).hexdigest()
    return int(digest[:16], 16)


def open_generator(export_dir: Path, options: TaskOptions) -> Any:
    """The :class:`~ortbatch.BatchedGenerator` a generation job runs on (one per worker)."""
    from ..generation import BatchedGenerator

    kwargs: dict[str, Any] = {"max_queue": options.max_queue, "providers": options.providers}
    if options.cpus is not None:
        kwargs["session_options"] = cpu_session_options(options.cpus, 1)  # one decode step at a time
    if options.max_batch_size:
        kwargs["max_batch_size"] = options.max_batch_size
    return BatchedGenerator(export_dir, **kwargs)


class GenerationTask(Task):
    """Generations through a :class:`~ortbatch.BatchedGenerator`: each window's prompts are
    queued at once (shortest first, so prefill groups similar lengths) and decoded with
    continuous batching, ``max_new_tokens`` each: greedy, or sampled with ``options.sampling``
    (:func:`job_sampling`), each row with its own seed (:func:`row_seed`). Fields: ``text``,
    ``finish_reason``, ``prompt_tokens``, ``completion_tokens``."""

    kind = "generation"
    # each row generates what it would alone, so a restored row changes no other row's text
    checkpoints = True

    def __init__(self, export_dir: Path, options: TaskOptions) -> None:
        self.params = job_sampling(options.sampling, options.max_new_tokens)
        self.generator = open_generator(export_dir, options)
        self.options = options
        self.model_name = export_dir.resolve().name or "model"

    @property
    def fields(self) -> list[Field]:
        return [
            Field("text", "string"),
            Field("finish_reason", "string"),
            Field("prompt_tokens", "int64"),
            Field("completion_tokens", "int64"),
        ]

    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(rows)
        prompts: dict[int, list[int]] = {}
        tokens = 0
        for i, outcome in (self.restored or {}).items():
            out[i] = outcome
            if isinstance(outcome, dict):
                tokens += int(outcome["prompt_tokens"]) + int(outcome["completion_tokens"])
        for i, r in enumerate(rows):
            if out[i] is not None:
                continue
            if r.error is not None:
                out[i] = RowFailure(*r.error)
            elif not r.text:
                out[i] = RowFailure("invalid_input", "the prompt is empty")
            else:
                prompts[i] = self.generator.encode(r.text)
        futures = {}
        for i in sorted(prompts, key=lambda i: (len(prompts[i]), i)):
            try:
                futures[i] = self.generator.submit(prompts[i], params=self._params(rows[i]))
            except InvalidInputError as exc:
                kind = "too_long" if "long" in str(exc) or "context" in str(exc) else "invalid_input"
                out[i] = RowFailure(kind, str(exc))
        for i, fut in futures.items():
            try:
                c = fut.result()
            except OrtBatchError as exc:
                out[i] = RowFailure("inference", str(exc))
                continue
            tokens += c.prompt_tokens + c.completion_tokens
            out[i] = outcome = {
                "text": c.text,
                "finish_reason": c.finish_reason,
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
            }
            if self.on_outcomes is not None:
                self.on_outcomes([i], [outcome])
            if self.on_progress is not None:
                self.on_progress(1, c.prompt_tokens + c.completion_tokens)
        self.last_tokens = tokens
        return [o if o is not None else RowFailure("inference", "no result") for o in out]

    def _params(self, row: Row) -> Any:
        if self.options.sampling is None:
            return self.params
        return dataclasses.replace(self.params, seed=row_seed(self.params.seed, row))

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "max_new_tokens": self.options.max_new_tokens}
        if self.options.sampling is not None:
            described["sampling"] = dict(self.options.sampling)
        return described

    def close(self) -> None:
        self.generator.close(drain=False)


def export_task(export_dir: Path) -> str | None:
    """The export's task from its manifest; without one (an optimum export), a causal-LM
    ``config.json`` is a text-generation export (BatchedGenerator reads those too)."""
    if (export_dir / MANIFEST_NAME).is_file():
        task = Manifest.load(export_dir).source.get("task")
        return task if isinstance(task, str) else None
    try:
        config = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    archs = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(archs, list) and any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "text-generation-with-past"
    return None


def export_kind(export_dir: Path) -> Any:
    """The export's model kind (``ortbatch.serve.served.kinds``, the declaration ``serve`` and
    ``generate`` read too); :class:`~ortbatch.serve.served.kinds.UnservedExportError` (one line,
    exit 2) for an export no registered kind serves, e.g. an encoder-decoder export."""
    from ..serve.served.kinds import kind_for_export

    return kind_for_export(export_dir)


def encoder_task(path: Path, options: TaskOptions) -> Task:
    """An encoder export's task, by its manifest's task: embeddings, scores, labels or spans."""
    task = export_task(path)
    encoder = Encoder(path, options)
    try:
        if task in EMBEDDING_TASKS or task is None:
            return EncoderTask(encoder, EmbeddingHead(encoder, options.normalize), "embedding", options)
        if task == "text-classification":
            _, width = _logits(encoder)
            if width == 1:
                return EncoderTask(encoder, ScoreHead(encoder), "score", options)
            return EncoderTask(encoder, LabelHead(encoder), "classification", options)
        if task == "token-classification":
            return EncoderTask(encoder, SpanHead(encoder), "token-classification", options)
        raise UnsupportedModelError(
            f"`ortbatch run` does not compute the {task!r} task yet (it runs embeddings, text- and "
            "token-classification and text generation)"
        )
    except BaseException:
        encoder.close()
        raise
