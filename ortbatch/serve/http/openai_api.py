"""The OpenAI-compatible routes: ``/v1/embeddings`` over a :class:`ServedModel` (its fields:
:mod:`ortbatch.serve.served.embeddings`), and
``/v1/completions`` and ``/v1/chat/completions`` over a :class:`ServedGenerator`.

Completions: every HTTP request's prompts join the one generator, so concurrent clients
share decode steps (continuous batching). A client that disconnects, before its answer or
in the middle of a stream, cancels its requests, and their rows are freed at the next step.
Errors are answered in OpenAI's form (``{"error": {"message": ...}}``) with the statuses of
:func:`~ortbatch.serve.http.plumbing.error_response`: a bad request 400, too large 413, queue full
429, deadline 504, shutting down 503.

Request fields: every field of OpenAI's Completions and Chat Completions requests and of
vLLM's extra parameters is honoured, accepted without effect, or refused with a 400 naming it
and saying why, by one policy (:mod:`ortbatch.serve.served.parameters`, the table in
docs/serving.md); a field no API defines is answered as OpenAI answers it ("Unrecognized
request argument supplied: X") unless the server runs with ``--lenient-params``. Among those
honoured: ``logprobs`` (Completions: ``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``; Chat: ``logprobs: true`` + ``top_logprobs`` with ``bytes``), ``echo`` (with
prompt logprobs and ``max_tokens: 0``), ``n`` and ``best_of``, the penalties, ``logit_bias``,
vLLM's ``min_p``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, and chat's
``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``. The logic is
the transport-free core (:mod:`~ortbatch.serve.served.completions` parses,
:mod:`~ortbatch.serve.served.answers` shapes, :mod:`~ortbatch.serve.served.streaming` streams);
this module only carries it over HTTP.

Chat requests take ``messages`` (text content, as a string or text parts, given to the template as vLLM
gives them; assistant turns with
``tool_calls`` and null content, ``tool`` turns with their results), rendered with the export's
chat template (:class:`~ortbatch.generation.chat.ChatTemplate`) into one prompt, in a thread,
bounded in time and size (:func:`~ortbatch.serve.served.completions.render_bounded`). An export
without a chat template answers chat requests with a 400.

Structured output: ``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs``, on both
routes, constrain the output by grammar (:mod:`ortbatch.generation.constrained`); chat's
``tools``, ``tool_choice`` and ``parallel_tool_calls`` show the model its tools through the
template, force a call when asked, and answer ``message.tool_calls`` (streamed as OpenAI's
``delta.tool_calls``) with ``finish_reason: "tool_calls"`` (:mod:`ortbatch.generation.tools`).
Every constraint is compiled off the event loop before anything is submitted
(:func:`~ortbatch.serve.served.completions.compile_constraints`): one that does not compile is
a 400 naming the field as it was sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ...errors import InvalidInputError, ModelNotFoundError, RequestTooLargeError
from .. import tracing
from ..served.answers import OpenAIAnswer, whole_pieces
from ..served.completions import (
    CHAT_RENDER_TIMEOUT_S,
    CompletionRequest,
    Prompts,
    compile_constraints,
    parse_chat_request,
    parse_completion_request,
    prepare_prompts,
    prompt_char_limit,
    render_bounded,
    submit_all,
)
from ..served.embeddings import embeddings_answer
from ..served.generator import ServedGenerator
from ..served.model import ServedModel
from ..served.protocol import dumps_json, loads_json
from ..served.streaming import PieceStream
from .plumbing import (
    BodyLimits,
    HTTPError,
    Incoming,
    Reply,
    asgi_route,
    disconnected,
    error_response,
    event_stream_response,
    handled_route,
    json_response,
    offload,
    run_or_abandon,
)

# CHAT_RENDER_TIMEOUT_S (seconds a chat template may take to render one request's messages) is the
# core's, shared with `ortbatch run`; still exported here for those who import it from here
__all__ = ["CHAT_RENDER_TIMEOUT_S", "completion_routes", "embedding_routes", "read_openai_body"]


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
    """``POST /v1/embeddings`` over ``model`` (for :func:`~ortbatch.serve.http.plumbing.assemble_app`);
    the request's fields and the answer are :func:`~ortbatch.serve.served.embeddings.embeddings_answer`'s."""

    async def embeddings(request: Incoming) -> Reply:
        doc = await read_openai_body(request, body, model.name)
        if model.embedding_output is None:
            raise HTTPError(404, f"model {model.name!r} does not serve embeddings: {model.embeddings_disabled_reason}")
        answer = await run_or_abandon(request.receive, embeddings_answer(model, doc))
        return Reply(dumps_json(answer), "application/json")

    # the route an embedding server's traffic takes: bare ASGI (http.FastRoutes)
    return [asgi_route("/v1/embeddings", embeddings, "POST")]


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
        req = parse_completion_request(doc, self.max_chars, self.served.policy)
        self._check_count(len(req.prompts))
        await compile_constraints(self.generator, req)
        # tokenized here, off the event loop ("" is refused by submit)
        with tracing.span("ortbatch.tokenize", {"ortbatch.texts": len(req.prompts)}):
            prompts = await asyncio.to_thread(prepare_prompts, self.generator, req)
        return await self._answer(request, req, prompts)

    async def chat_completions(self, request: Any) -> Any:
        doc = await read_openai_body(request, self.body, self.served.name)
        chat, req = parse_chat_request(doc, self.template, self.served.policy)
        await compile_constraints(self.generator, req)
        template = self.template
        assert template is not None  # parse_chat_request refuses a model without one

        def rendered() -> Prompts:
            text = render_bounded(template, chat, CHAT_RENDER_TIMEOUT_S, self.max_chars)
            return prepare_prompts(self.generator, req, text)

        with tracing.span("ortbatch.tokenize", {"ortbatch.texts": 1}):
            prompts = await asyncio.to_thread(rendered)
        return await self._answer(request, req, prompts)

    def _check_count(self, count: int) -> None:
        limit = getattr(self.generator, "max_queue", None)
        if isinstance(limit, int) and count > limit:
            raise RequestTooLargeError(
                f"'prompt' has {count} prompts; this server queues at most {limit} at once (--max-queue)",
                input_name="prompt",
            )

    async def _answer(self, request: Any, req: CompletionRequest, prompts: Prompts) -> Any:
        shape = OpenAIAnswer(req, prompts, self.served.token_texts, self.served.name)
        if req.stream:
            return await self._stream(request, req, prompts, shape)
        futures = submit_all(self.generator, req, prompts)
        waits = [asyncio.wrap_future(f) for f in futures]  # cancelling one cancels its request
        try:
            results = await run_or_abandon(request.receive, asyncio.gather(*waits))
        except BaseException:  # one failed, or the client left: the others are not wanted
            for fut in futures:
                fut.cancel()
            raise
        return json_response(shape.whole(whole_pieces(req, prompts, results)))

    async def _stream(self, request: Any, req: CompletionRequest, prompts: Prompts, shape: OpenAIAnswer) -> Any:
        stream = PieceStream(self.generator, req, prompts)
        # Submission errors (bad prompt, queue full) are answered as JSON errors, before
        # any byte of the stream is sent.
        await stream.start()
        events = _stream_events(request, stream, shape)
        return event_stream_response(events, on_stall=stream.stop, headers={"Cache-Control": "no-cache"})


def _event(data: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + dumps_json(data) + b"\n\n"


async def _stream_events(request: Any, stream: PieceStream, shape: OpenAIAnswer) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer: one chunk per piece, the usage chunk when
    asked, then ``[DONE]``; an error that ends a choice is an ``{"error": ...}`` event."""
    finished: list[Any] = []

    async def watch() -> None:
        # A client that leaves while no token is due would otherwise be noticed only at
        # the next send: its rows would stay held and the request unsettled.
        await disconnected(request.receive)
        stream.abandon()

    watcher = asyncio.ensure_future(watch())
    try:
        if shape.chat:  # OpenAI's chat streams open each choice with the role
            for i in range(len(stream.futures)):
                yield _event(shape.role_chunk(i))
        async for piece in stream.pieces():
            if piece.error is not None:
                _status, error_body, _headers = error_response(piece.error, openai=True)
                yield _event(error_body)
                continue
            if piece.completion is not None:
                finished.append(piece.completion)
            chunk = shape.piece_chunk(piece)
            if chunk is not None:
                yield _event(chunk)
        if not watcher.done():
            if shape.req.include_usage:
                yield _event(shape.usage_chunk(finished))
            yield b"data: [DONE]\n\n"
    finally:  # the client left (or the response ended): free any row still held
        watcher.cancel()
        stream.cancel()


def completion_routes(served: ServedGenerator, body: BodyLimits) -> list[Any]:
    """``POST /v1/completions`` and ``/v1/chat/completions`` over ``served`` (for
    :func:`~ortbatch.serve.http.plumbing.assemble_app`)."""
    endpoint = _CompletionsEndpoint(served, body)
    return [
        handled_route("/v1/completions", endpoint.completions, "POST"),
        handled_route("/v1/chat/completions", endpoint.chat_completions, "POST"),
    ]
