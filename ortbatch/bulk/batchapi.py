"""OpenAI Batch API files: each line ``{"custom_id", "method", "url", "body"}`` is answered
with one line of the Batch API's output format::

    {"id": "batch_req_...", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "req_...", "body": {...}}, "error": null}

``body`` is what ``ortbatch serve`` answers to the same request at ``url``. Lines that
succeed go to the output (``part-*.jsonl``); lines that fail go to the errors file in the
same shape, with the status ``ortbatch serve`` would answer (400 a bad request, 404 a url
this export does not serve, 413 too large, 501 a constraint the export cannot compile, 500
the model failed) and an OpenAI error object as the body (``param``: the field at fault;
``code``: the failure's kind, e.g. ``too_long``) — the split OpenAI makes between a batch's
output and error files. A line that is not a request at all (not JSON, no ``custom_id``) has
``response: null`` and ``error: {code, message, line}``. The ``id`` and ``request_id`` are
derived from the line's number and ``custom_id``, so a resumed run writes the same bytes as
an uninterrupted one.

Served: ``/v1/embeddings`` by an embedding export (``input``: a string, strings, token ids
or lists of them; ``encoding_format`` ``float`` or ``base64``; ``dimensions`` equal to the
model's; ``truncate``, an ortbatch extension, by default off, on with ``--truncate`` as ``serve --truncate``
sets it); ``/v1/completions`` and
``/v1/chat/completions`` by a text-generation export, every field as ``ortbatch serve``
takes it (:mod:`ortbatch.bulk.batch_completions`, which drives serve's transport-free core;
``stream`` is refused, and answers' ids, ``created`` and a missing ``seed`` are derived from
the line, so a resumed job writes the same bytes).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..embed.options import EmbedOptions
from ..errors import InvalidInputError
from ..serve.served.parameters import ParameterPolicy
from .batch_completions import COMPLETION_URLS, CompletionLines, failure_of
from .sources import Row
from .tasks import EmbeddingHead, EncoderTask, Field, Outcome, RowFailure, Task

__all__ = ["BatchApiTask", "batch_error_line"]

EMBEDDINGS_URL = "/v1/embeddings"
_STATUS = {"unsupported_url": 404, "inference": 500}
#: how a too-long embeddings line asks to be cut (serve's words; the job's --truncate is the default)
_TOO_LONG_REMEDY = 'send "truncate": true to cut it to the limit (or run the job with --truncate)'
#: an error's ``type`` by status, as ``ortbatch serve`` names them
_ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_exceeded", 503: "service_unavailable", 504: "timeout_error"}


def _ids(row: Row) -> tuple[str, str]:
    seed = f"{row.index}\0{row.id}".encode()
    digest = hashlib.sha256(seed).hexdigest()
    return "batch_req_" + digest[:24], "req_" + digest[24:48]


def _line(row: Row, status: int, body: dict[str, Any]) -> dict[str, Any]:
    line_id, request_id = _ids(row)
    return {
        "id": line_id,
        "custom_id": row.id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def batch_error_line(row: Row, failure: RowFailure) -> dict[str, Any]:
    """The Batch API output line of a line that failed."""
    line_id, _ = _ids(row)
    if row.body is None and failure.kind in ("invalid_json", "invalid_utf8", "invalid_request") and row.id is None:
        return {
            "id": line_id,
            "custom_id": None,
            "response": None,
            "error": {"code": failure.kind, "message": failure.message, "line": row.index + 1},
        }
    status = failure.status or _STATUS.get(failure.kind, 400)
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": failure.message, "type": kind, "param": failure.param, "code": failure.kind}}
    return _line(row, status, body)


class BatchApiTask(Task):
    """Batch API lines: ``/v1/embeddings`` over an embedding :class:`EncoderTask` (``inner``, its
    encoder and head), ``/v1/completions`` and ``/v1/chat/completions`` over
    :class:`~ortbatch.bulk.batch_completions.CompletionLines` (``completions``, a text-generation
    export's). ``reason``: why the kind of line the export does not serve is not served."""

    kind = "openai-batch"

    def __init__(
        self,
        inner: EncoderTask | None,
        model_name: str,
        reason: str = "",
        completions: CompletionLines | None = None,
    ) -> None:
        self.inner = inner
        self.completions = completions
        self.model_name = model_name
        self.reason = reason
        # a field /v1/embeddings does not read fails its line, as `ortbatch serve` answers it
        self._policy = ParameterPolicy()

    @property
    def fields(self) -> list[Field]:
        return [Field("line", "json")]

    def record(self, row: Row, result: dict[str, Any], with_id: bool) -> dict[str, Any]:
        line: dict[str, Any] = result["line"]
        return line

    def error_record(self, row: Row, failure: RowFailure) -> dict[str, Any]:
        return batch_error_line(row, failure)

    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(rows)
        embed: list[int] = []
        complete: list[int] = []
        for i, row in enumerate(rows):
            if row.error is not None:
                out[i] = RowFailure(*row.error)
            elif row.text == EMBEDDINGS_URL and self.inner is not None:
                embed.append(i)
            elif row.text in COMPLETION_URLS and self.completions is not None:
                complete.append(i)
            else:
                out[i] = RowFailure("unsupported_url", self._unserved(row.text))
        self.last_tokens = 0
        for i, outcome in zip(embed, self._embeddings([rows[i] for i in embed]), strict=True):
            out[i] = outcome
        if self.completions is not None and complete:
            answers = self.completions.run([rows[i] for i in complete])
            for i, answer in zip(complete, answers, strict=True):
                if isinstance(answer, RowFailure):
                    out[i] = answer
                    continue
                self.last_tokens += answer["tokens"]
                out[i] = {"line": _line(rows[i], 200, answer["body"])}
        return [o if o is not None else RowFailure("inference", "no result") for o in out]

    def _unserved(self, url: str | None) -> str:
        served = [EMBEDDINGS_URL] if self.inner is not None else list(COMPLETION_URLS)
        if url in (EMBEDDINGS_URL, *COMPLETION_URLS):
            return f"this export does not serve {url}: {self.reason}"
        return f"unknown url {str(url)[:80]!r}; served: {', '.join(served)}"

    def _embeddings(self, rows: Sequence[Row]) -> list[Outcome]:
        """Embedding lines: every input of every line encoded (grouped by truncation and prompt)
        and run together, then each line's vectors finished as its options ask."""
        out: list[Outcome | None] = [None] * len(rows)
        # every input of every line, flattened: (row position, (truncate, prompt), input)
        flat: list[tuple[int, tuple[bool, str | None], Any]] = []
        options: dict[int, EmbedOptions] = {}
        for i, row in enumerate(rows):
            checked = self._check(row.body or {})
            if isinstance(checked, RowFailure):
                out[i] = checked
                continue
            inputs, options[i], how = checked
            flat.extend((i, how, x) for x in inputs)
        if flat and self.inner is not None:
            for i, parts in self._vectors(rows, flat).items():
                out[i] = self._finished(rows[i], parts, options[i])
        return [o if o is not None else RowFailure("inference", "no result") for o in out]

    def _vectors(
        self, rows: Sequence[Row], flat: list[tuple[int, tuple[bool, str | None], Any]]
    ) -> dict[int, list[Any]]:
        """Per line, each input's ``(vector, tokens)`` or failure."""
        assert self.inner is not None
        head = self.inner.head
        assert isinstance(head, EmbeddingHead)
        encoded: list[Any] = [None] * len(flat)
        for how in sorted({h for _, h, _ in flat}, key=lambda h: (h[0], h[1] or "")):
            where = [k for k, (_, h, _) in enumerate(flat) if h == how]
            items = [flat[k][2] for k in where]
            encoded_items = self.inner.encoder.encode(items, *how, remedy=_TOO_LONG_REMEDY)
            for k, e in zip(where, encoded_items, strict=True):
                encoded[k] = e
        outs = self.inner.encoder.infer(encoded, [head.output])
        per_row: dict[int, list[Any]] = {}
        for (i, _, _), enc, res in zip(flat, encoded, outs, strict=True):
            bucket = per_row.setdefault(i, [])
            if isinstance(res, RowFailure):
                bucket.append(res)
                continue
            try:
                bucket.append((head.value(res[0], enc, rows[i])["embedding"], enc.tokens))
            except Exception as exc:
                bucket.append(RowFailure("inference", str(exc)))
        return per_row

    def _finished(self, row: Row, parts: list[Any], options: EmbedOptions) -> Outcome:
        """A line's answer from its inputs' vectors, or its first input's failure."""
        from ..serve.served.embeddings import embedding_json

        failed = next((p for p in parts if isinstance(p, RowFailure)), None)
        if failed is not None:
            k = next(n for n, p in enumerate(parts) if isinstance(p, RowFailure))
            return RowFailure(failed.kind, f"input[{k}]: {failed.message}")
        assert self.inner is not None and isinstance(self.inner.head, EmbeddingHead)
        try:
            vectors = self.inner.head.finish(
                np.stack([v for v, _ in parts]), options.dimensions, options.encoding_format
            )
        except InvalidInputError as exc:
            return failure_of(exc)
        used = sum(t for _, t in parts)
        self.last_tokens += used
        data = [
            {"object": "embedding", "index": k, "embedding": embedding_json(v, options.encoding_format)}
            for k, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": used, "total_tokens": used}
        body = {"object": "list", "data": data, "model": self.model_name, "usage": usage}
        return {"line": _line(row, 200, body)}

    def _check(self, body: dict[str, Any]) -> tuple[list[Any], EmbedOptions, tuple[bool, str | None]] | RowFailure:
        """A line's inputs, its :class:`~ortbatch.embed.EmbedOptions` (the fields serve's
        ``/v1/embeddings`` takes, checked by the same code) and ``(truncate, prompt)``."""
        from ..embed import ops
        from ..serve.served.completions import text_or_ids
        from ..serve.served.model import check_texts
        from ..serve.served.task_fields import check_task_fields, truncate_field

        assert self.inner is not None
        head = self.inner.head
        assert isinstance(head, EmbeddingHead)
        try:
            inputs = text_or_ids(body.get("input"), "input")
            check_task_fields(body, "/v1/embeddings", self._policy)  # a field serve refuses, refused here
            options = EmbedOptions.parse(body, formats=ops.ENCODING_FORMATS)
            options.refuse_for_dense()
            # absent: the job's --truncate, as `serve --truncate` sets the field's default
            truncate = truncate_field(body, self.inner.options.truncate)
            texts = isinstance(inputs[0], str)
            if texts:  # a lone surrogate ("\ud800"): serve's 400, word for word, not the tokenizer's TypeError
                check_texts([x for x in inputs if isinstance(x, str)], "input", None, sys.maxsize)
            if not texts and options.asks_prompt is not None:
                raise InvalidInputError(
                    f"'{options.asks_prompt}' needs text inputs: token ids are sent to the model as they are",
                    input_name=options.asks_prompt,
                )
            prompt = head.resolve_prompt(options.prompt_name, options.prompt) if texts else None
        except InvalidInputError as exc:
            return failure_of(exc)
        return list(inputs), options, (truncate, prompt)

    def describe(self) -> dict[str, Any]:
        inner = self.inner.describe() if self.inner is not None else None
        if self.completions is not None:
            inner = {"kind": "completions"}
        return {"kind": self.kind, "inner": inner}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        if self.completions is not None:
            self.completions.close()
