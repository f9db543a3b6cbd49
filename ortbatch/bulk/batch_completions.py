"""OpenAI Batch API ``/v1/completions`` and ``/v1/chat/completions`` lines, answered with the
body ``ortbatch serve`` answers to the same request.

Nothing of what a completion request means is decided here: each line's body goes through
serve's transport-free core (:mod:`ortbatch.serve.served`): the parameter policy and the
mapping onto :class:`~ortbatch.generation.SamplingParams`
(:func:`~ortbatch.serve.served.completions.parse_completion_request`,
:func:`~ortbatch.serve.served.completions.parse_chat_request`), the chat template, tools and
structured output (:func:`~ortbatch.serve.served.completions.compile_constraints`), the prompts
(:func:`~ortbatch.serve.served.completions.prepare_prompts`), the submission of every choice
(:func:`~ortbatch.serve.served.completions.submit_all`) and the answer's JSON
(:class:`~ortbatch.serve.served.answers.OpenAIAnswer`). This module only drives it a window at a
time: every line of a window is checked and tokenized, then all are submitted together (shortest
prompt first) to one :class:`~ortbatch.BatchedGenerator`, which decodes them with continuous
batching, and the answers are collected in line order.

What differs from ``ortbatch serve``, so that a resumed job writes the same bytes:

* ``stream: true`` is refused (400 naming ``stream``; OpenAI's Batch API refuses it too);
* the answer's ``id`` (after ``cmpl-`` / ``chatcmpl-``) is derived from the line's number and
  ``custom_id`` (a body's ``request_id`` still wins, as in serve), ``created`` is the input's
  modification time, and a tool call's ``id`` is derived from the line, the choice and the call;
* a line without a ``seed`` is given one derived from its number and ``custom_id``
  (:func:`line_seed`), so its sampled answer is the same on every run of the job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import (
    InferenceError,
    InvalidInputError,
    OrtBatchError,
    QueueFullError,
    RequestTimeoutError,
    RequestTooLargeError,
    SessionClosedError,
    UnsupportedError,
)
from .sources import Row
from .tasks import Outcome, RowFailure, TaskOptions, open_generator

__all__ = ["COMPLETION_URLS", "CompletionLines", "failure_of", "line_digest", "line_seed"]

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
COMPLETION_URLS = (COMPLETIONS_URL, CHAT_URL)

#: the status ``ortbatch serve`` answers each error with (``http.plumbing.error_response``'s;
#: tests/bulk/test_batch_completions.py checks they agree), most specific class first
STATUSES: tuple[tuple[type[BaseException], int, str], ...] = (
    (RequestTooLargeError, 413, "too_large"),
    (InvalidInputError, 400, "invalid_request"),
    (UnsupportedError, 501, "unsupported"),
    (QueueFullError, 429, "queue_full"),
    (RequestTimeoutError, 504, "timeout"),
    (SessionClosedError, 503, "closed"),
    (InferenceError, 500, "inference"),
)


def line_digest(row: Row, purpose: str) -> str:
    """64 hex digits that only this line (its number and ``custom_id``) and ``purpose`` give."""
    return hashlib.sha256(f"{purpose}\0{row.index}\0{row.id}".encode()).hexdigest()


def line_seed(row: Row) -> int:
    """The ``seed`` a line without one samples with (64 bits of :func:`line_digest`)."""
    return int(line_digest(row, "seed")[:16], 16)


def failure_of(exc: BaseException) -> RowFailure:
    """A request's error as a line's failure: ``ortbatch serve``'s status for it, the field it
    names (``param``), and the message (a prompt past the context is ``too_long``)."""
    for cls, status, kind in STATUSES:
        if isinstance(exc, cls):
            message = str(exc)
            if status == 400 and ("too long" in message or "exceeds the model's context" in message):
                kind = "too_long"
            return RowFailure(kind, message, status, getattr(exc, "input_name", None))
    return RowFailure("inference", f"{type(exc).__name__}: {exc}", 500)


@dataclass
class _Line:
    """One line between its check and its answer."""

    position: int
    row: Row
    req: Any  # serve's CompletionRequest
    prompts: Any  # serve's Prompts
    futures: list[concurrent.futures.Future[Any]]


class CompletionLines:
    """Completion and chat lines over one :class:`~ortbatch.BatchedGenerator` of a text-generation
    export, served under ``model_name`` (the export's folder name, as ``ortbatch serve`` names it)."""

    def __init__(self, export_dir: Path, options: TaskOptions, model_name: str) -> None:
        from ..serve.served.completions import prompt_char_limit
        from ..serve.served.generator import ServedGenerator

        self.served = ServedGenerator(open_generator(export_dir, options), model_name)
        self.generator = self.served.generator
        self.max_chars = prompt_char_limit(self.generator)
        self.created = options.created

    def run(self, rows: Sequence[Row]) -> list[Outcome]:
        """One outcome per line (each has its url in ``Row.text`` and its body in ``Row.body``):
        ``{"body": the answer, "tokens": its prompt and completion tokens}`` or a failure."""
        out: list[Outcome | None] = [None] * len(rows)
        lines: list[_Line] = []
        for i, row in enumerate(rows):
            try:
                req, prompts = self._prepare(row)
            except Exception as exc:  # a line's failure, whatever it is, is that line's alone
                out[i] = failure_of(exc)
                continue
            lines.append(_Line(i, row, req, prompts, []))
        for line in sorted(lines, key=lambda x: (sum(len(p) for p in x.prompts.ids), x.position)):
            failed = self._submit(line, lines)
            if failed is not None:
                out[line.position] = failed
        for line in lines:
            if out[line.position] is None:
                out[line.position] = self._answer(line)
        return [o if o is not None else RowFailure("inference", "no result", 500) for o in out]

    def _prepare(self, row: Row) -> tuple[Any, Any]:
        """Check a line's body and tokenize its prompts, as serve's routes do before submitting."""
        from ..serve.served.completions import (
            CHAT_RENDER_TIMEOUT_S,
            compile_constraints,
            parse_chat_request,
            parse_completion_request,
            prepare_prompts,
            render_bounded,
        )

        doc = dict(row.body or {})
        if doc.get("stream") is True:
            raise InvalidInputError(
                "'stream' is not available in a Batch API file: each line is answered whole", input_name="stream"
            )
        if doc.get("seed") is None:
            doc["seed"] = line_seed(row)
        policy = self.served.policy
        if row.text == CHAT_URL:
            chat, req = parse_chat_request(doc, self.served.chat_template, policy)
            if req.tools is not None or req.params.constraint is not None:
                _wait(compile_constraints(self.generator, req))
            template = self.served.chat_template
            assert template is not None  # parse_chat_request refuses a model without one
            text = render_bounded(template, chat, CHAT_RENDER_TIMEOUT_S, self.max_chars)
            return req, prepare_prompts(self.generator, req, text)
        req = parse_completion_request(doc, self.max_chars, policy)
        if req.params.constraint is not None:
            _wait(compile_constraints(self.generator, req))
        return req, prepare_prompts(self.generator, req)

    def _submit(self, line: _Line, lines: Sequence[_Line]) -> RowFailure | None:
        """Queue the line's choices; a full queue first waits for the lines already queued."""
        from ..serve.served.completions import submit_all

        for attempt in (0, 1):
            try:
                line.futures = submit_all(self.generator, line.req, line.prompts)
                return None
            except QueueFullError as exc:
                if attempt:
                    return failure_of(exc)
                concurrent.futures.wait([f for x in lines for f in x.futures])
            except OrtBatchError as exc:
                return failure_of(exc)
        return None  # pragma: no cover - the loop returns

    def _answer(self, line: _Line) -> Outcome:
        from ..serve.served.answers import OpenAIAnswer, whole_pieces

        try:
            results = [f.result() for f in line.futures]
        except Exception as exc:
            for f in line.futures:
                f.cancel()
            return failure_of(exc)
        req, prompts = line.req, line.prompts
        ident = line_digest(line.row, "answer")[:24]
        shape = OpenAIAnswer(req, prompts, self.served.token_texts, self.served.name, ident=ident, created=self.created)
        body = shape.whole(whole_pieces(req, prompts, results))
        _derive_call_ids(body, line.row)
        return {"body": body, "tokens": int(body["usage"]["total_tokens"])}

    def close(self) -> None:
        self.served.close(drain=False)


def _wait(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run one of the core's coroutines to its end from this blocking code: on a thread of its
    own when this thread already runs an event loop (``ortbatch.run`` called from a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coroutine)
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coroutine).result()


def _derive_call_ids(body: dict[str, Any], row: Row) -> None:
    """Tool calls' ids (random in serve) derived from the line, the choice and the call."""
    for choice in body.get("choices", ()):
        for k, call in enumerate((choice.get("message") or {}).get("tool_calls") or ()):
            call["id"] = "call_" + line_digest(row, f"call\0{choice['index']}\0{k}")[:24]
