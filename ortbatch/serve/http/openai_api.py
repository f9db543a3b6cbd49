"""The OpenAI-compatible routes: ``/v1/embeddings`` over a :class:`ServedModel`, and
``/v1/completions`` and ``/v1/chat/completions`` over a :class:`ServedGenerator`.

Completions: every HTTP request's prompts join the one generator, so concurrent clients
share decode steps (continuous batching). A client that disconnects, before its answer or
in the middle of a stream, cancels its requests, and their rows are freed at the next step.
Errors are answered in OpenAI's form (``{"error": {"message": ...}}``) with the statuses of
:func:`~ortbatch.serve.http.plumbing.error_response`: a bad request 400, too large 413, queue full
429, deadline 504, shutting down 503.

Request fields: ``prompt`` (a string, a list of strings, a list of token ids, or a list
of such lists), ``max_tokens`` (default 16, as OpenAI's), ``temperature`` (default 1.0,
as OpenAI's; 0, or below 1e-5, is greedy), ``top_p``, ``top_k`` (an extension), ``stop``,
``seed``, ``stream``, ``stream_options.include_usage``, ``model`` (must name the served
model when given). ``n``, ``best_of`` above 1, ``echo``, ``logprobs``, ``suffix``,
``logit_bias`` and non-zero penalties are refused with a 400 rather than silently ignored.

Chat requests take ``messages`` (text content, as a string or text parts), rendered with the
export's chat template (:class:`~ortbatch.generation.chat.ChatTemplate`) into one prompt, in
a thread, bounded in time and size (:func:`render_bounded`); ``max_completion_tokens`` or
``max_tokens`` (default: the rest of the context); the same sampling fields; ``tools``,
``functions``, ``response_format`` and ``logprobs`` are refused. An export without a chat
template answers chat requests with a 400.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from ...errors import InvalidInputError, ModelNotFoundError, RequestTooLargeError
from .. import tracing
from ..served.completions import (
    CompletionRequest,
    admitted,
    parse_chat_request,
    parse_completion_request,
    prompt_char_limit,
    render_bounded,
    submit_all,
    text_or_ids,
    usage,
)
from ..served.generator import ServedGenerator
from ..served.model import ServedModel
from ..served.protocol import dumps_json, loads_json
from .plumbing import (
    BodyLimits,
    HTTPError,
    Incoming,
    Reply,
    asgi_route,
    disconnected,
    error_response,
    handled_route,
    json_response,
    offload,
    run_or_abandon,
)

__all__ = ["CHAT_RENDER_TIMEOUT_S", "completion_routes", "embedding_routes", "read_openai_body"]

#: seconds a chat template may take to render one request's messages
CHAT_RENDER_TIMEOUT_S = 2.0


async def read_openai_body(request: Any, body: BodyLimits, model_name: str) -> dict[str, Any]:
    """The JSON object body of an OpenAI-style ``request`` (a Starlette ``Request`` or an
    :class:`~ortbatch.serve.http.plumbing.Incoming`; 400 when it is not one; parsed in a thread
    when large); a ``model`` field naming another model is a 404."""
    data = await body.read(request)
    doc = await offload(len(data), loads_json, data)
    if not isinstance(doc, dict):
        raise InvalidInputError("request body must be a JSON object")
    name = doc.get("model")
    if name is not None and name != model_name:
        raise ModelNotFoundError(f"unknown model {str(name)[:80]!r}; this server serves {model_name!r}")
    return doc


def embedding_routes(model: ServedModel, body: BodyLimits) -> list[Any]:
    """``POST /v1/embeddings`` over ``model`` (for :func:`~ortbatch.serve.http.plumbing.assemble_app`)."""

    async def embeddings(request: Incoming) -> Reply:
        doc = await read_openai_body(request, body, model.name)
        if model.embedding_output is None:
            raise HTTPError(404, f"model {model.name!r} does not serve embeddings: {model.embeddings_disabled_reason}")
        inputs = text_or_ids(doc.get("input"), "input")
        fmt = doc.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise InvalidInputError(
                f"encoding_format must be 'float' or 'base64', got {str(fmt)[:40]!r}", input_name="encoding_format"
            )
        truncate = doc.get("truncate", model.truncate)
        if not isinstance(truncate, bool):
            raise InvalidInputError(
                f"'truncate' must be true or false, got {str(truncate)[:40]}", input_name="truncate"
            )
        result = await run_or_abandon(request.receive, model.embed(inputs, truncate))
        emb = result.embeddings
        dims = doc.get("dimensions")
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims != emb.shape[1]):
            raise InvalidInputError(
                f"dimensions: this model's embeddings have {emb.shape[1]} dimensions, got {str(dims)[:40]}",
                input_name="dimensions",
            )
        data = []
        for i, row in enumerate(emb):
            value: Any = (
                base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" else row.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        doc = {
            "object": "list",
            "data": data,
            "model": model.name,
            "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens},
        }
        return Reply(dumps_json(doc), "application/json")

    # the route an embedding server's traffic takes: bare ASGI (http.FastRoutes)
    return [asgi_route("/v1/embeddings", embeddings, "POST")]


class _AnswerShape:
    """How one of the two APIs (completions, chat) names and shapes its answers."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        prefix = "chatcmpl-" if chat else "cmpl-"
        self.head = {"id": prefix + secrets.token_hex(12), "created": int(time.time()), "model": model}

    def choice(self, i: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        return {"text": text, "index": i, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, i: int, text: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self.choice(i, text or "", finish_reason)

    def event(self, data: dict[str, Any]) -> bytes:
        """One server-sent event."""
        return b"data: " + json.dumps(data, separators=(",", ":")).encode("utf-8") + b"\n\n"

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        """One stream chunk carrying ``choices``."""
        return self.event({**self.head, "object": self.chunk_object, "choices": choices, **extra})


# queue item index meaning: the client disconnected
_CLIENT_GONE = -1


class _CompletionsEndpoint:
    """The two completion routes over one served generator."""

    def __init__(self, served: ServedGenerator, body: BodyLimits) -> None:
        self.served = served
        self.generator = served.generator
        self.template = served.chat_template
        self.body = body
        self.max_chars = prompt_char_limit(self.generator)

    async def completions(self, request: Any) -> Any:
        doc = await read_openai_body(request, self.body, self.served.name)
        req = parse_completion_request(doc, self.max_chars)
        self._check_count(len(req.prompts))
        if isinstance(req.prompts[0], str):  # tokenized here, off the event loop ("" is refused by submit)
            texts: list[Any] = list(req.prompts)
            encode = self.generator.encode
            with tracing.span("ortbatch.tokenize", {"ortbatch.texts": len(texts)}):
                ids = await asyncio.to_thread(lambda: [encode(t) if t else t for t in texts])
            req = dataclasses.replace(req, prompts=ids)
        return await self._answer(request, req, _AnswerShape(False, self.served.name))

    async def chat_completions(self, request: Any) -> Any:
        doc = await read_openai_body(request, self.body, self.served.name)
        messages, with_prompt = parse_chat_request(doc, self.template)
        template = self.template
        assert template is not None  # parse_chat_request refuses a model without one

        def prompt_ids() -> list[int]:
            text = render_bounded(template, messages, CHAT_RENDER_TIMEOUT_S, self.max_chars)
            return list(self.generator.encode(text, add_special_tokens=False))

        with tracing.span("ortbatch.tokenize", {"ortbatch.texts": 1}):
            req = with_prompt(await asyncio.to_thread(prompt_ids))
        return await self._answer(request, req, _AnswerShape(True, self.served.name))

    def _check_count(self, count: int) -> None:
        limit = getattr(self.generator, "max_queue", None)
        if isinstance(limit, int) and count > limit:
            raise RequestTooLargeError(
                f"'prompt' has {count} prompts; this server queues at most {limit} at once (--max-queue)",
                input_name="prompt",
            )

    async def _answer(self, request: Any, req: CompletionRequest, api: _AnswerShape) -> Any:
        if req.stream:
            return await self._stream(request, req, api)
        futures = submit_all(self.generator, req)
        waits = [asyncio.wrap_future(f) for f in futures]  # cancelling one cancels its request
        try:
            results = await run_or_abandon(request.receive, asyncio.gather(*waits))
        except BaseException:  # one failed, or the client left: the others are not wanted
            for fut in futures:
                fut.cancel()
            raise
        choices = [api.choice(i, c.text, c.finish_reason) for i, c in enumerate(results)]
        return json_response({**api.head, "object": api.object, "choices": choices, "usage": usage(results)})

    async def _stream(self, request: Any, req: CompletionRequest, api: _AnswerShape) -> Any:
        from starlette.responses import StreamingResponse

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        def put(item: tuple[int, Any]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        def on_token(i: int) -> Callable[[Any], None]:
            return lambda tok: put((i, tok))

        # Submission errors (bad prompt, queue full) are answered as JSON errors, before
        # any byte of the stream is sent.
        futures = submit_all(self.generator, req, on_token)
        await admitted(futures)

        def ended(i: int) -> Callable[[Future[Any]], None]:
            return lambda _fut: put((i, None))

        for i, fut in enumerate(futures):
            # tokens are put before the future settles, on the same thread: the end
            # marker (token None) comes after the request's last token
            fut.add_done_callback(ended(i))
        events = _stream_events(request, req, api, futures, queue)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream_events(
    request: Any, req: CompletionRequest, api: _AnswerShape, futures: list[Future[Any]], queue: asyncio.Queue[Any]
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer, from the ``(index, token)`` items the
    generator's callbacks put on ``queue`` (token ``None``: that request settled)."""
    sent = [""] * len(futures)
    finished: list[Any] = []
    still_open = len(futures)

    async def watch() -> None:
        # A client that leaves while no token is due would otherwise be noticed only at
        # the next send: its rows would stay held and the request unsettled.
        await disconnected(request.receive)
        queue.put_nowait((_CLIENT_GONE, None))

    watcher = asyncio.ensure_future(watch())
    try:
        if api.chat:  # OpenAI's chat streams open each choice with the role
            for i in range(len(futures)):
                yield api.chunk([api.delta(i, "", None, first=True)])
        while still_open:
            i, tok = await queue.get()
            if i == _CLIENT_GONE:
                return
            if tok is not None:
                if tok.text:
                    sent[i] += tok.text
                    yield api.chunk([api.delta(i, tok.text, None)])
                continue
            still_open -= 1
            fut = futures[i]
            if fut.cancelled():
                continue
            exc = fut.exception()
            if exc is not None:
                _status, error_body, _headers = error_response(exc, openai=True)
                yield api.event(error_body)
                continue
            completion = fut.result()
            finished.append(completion)
            # what the stream has not carried yet (text held back until the end)
            rest = completion.text[len(sent[i]) :] if completion.text.startswith(sent[i]) else ""
            if rest:
                yield api.chunk([api.delta(i, rest, None)])
            yield api.chunk([api.delta(i, None if api.chat else "", completion.finish_reason)])
        if req.include_usage:
            yield api.chunk([], usage=usage(finished))
        yield b"data: [DONE]\n\n"
    finally:  # the client left (or the response ended): free any row still held
        watcher.cancel()
        for fut in futures:
            fut.cancel()


def completion_routes(served: ServedGenerator, body: BodyLimits) -> list[Any]:
    """``POST /v1/completions`` and ``/v1/chat/completions`` over ``served`` (for
    :func:`~ortbatch.serve.http.plumbing.assemble_app`)."""
    endpoint = _CompletionsEndpoint(served, body)
    return [
        handled_route("/v1/completions", endpoint.completions, "POST"),
        handled_route("/v1/chat/completions", endpoint.chat_completions, "POST"),
    ]
