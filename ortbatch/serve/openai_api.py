"""The OpenAI-compatible routes: ``/v1/embeddings`` over a :class:`ServedModel`, and
``/v1/completions`` and ``/v1/chat/completions`` over a :class:`ServedGenerator`.

Completions: every HTTP request's prompts join the one generator, so concurrent clients
share decode steps (continuous batching). A client that disconnects, before its answer or
in the middle of a stream, cancels its requests, and their rows are freed at the next step.
Errors are answered in OpenAI's form (``{"error": {"message": ...}}``) with the statuses of
:func:`~ortbatch.serve.http.error_response`: a bad request 400, too large 413, queue full
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
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError
from ..generation.chat import ChatTemplate
from .http import (
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
from .model import DEFAULT_MAX_TEXT_CHARS, RequestTooLargeError, ServedModel, check_texts
from .protocol import dumps_json, loads_json
from .served_generator import ServedGenerator

__all__ = [
    "CHAT_RENDER_TIMEOUT_S",
    "CompletionRequest",
    "completion_routes",
    "embedding_routes",
    "parse_chat_request",
    "parse_completion_request",
    "read_openai_body",
    "render_bounded",
    "text_or_ids",
]

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Below this a temperature is greedy decoding: dividing logits by 1e-308 overflows to
# inf and the probabilities become NaN (vLLM draws the same line).
_GREEDY_BELOW_TEMPERATURE = 1e-5
_MAX_INT = 2**31 - 1
_MAX_SEED = 2**64 - 1
#: seconds a chat template may take to render one request's messages
CHAT_RENDER_TIMEOUT_S = 2.0


async def read_openai_body(request: Any, body: BodyLimits, model_name: str) -> dict[str, Any]:
    """The JSON object body of an OpenAI-style ``request`` (a Starlette ``Request`` or an
    :class:`~ortbatch.serve.http.Incoming`; 400 when it is not one; parsed in a thread
    when large); a ``model`` field naming another model is a 404."""
    data = await body.read(request)
    doc = await offload(len(data), loads_json, data)
    if not isinstance(doc, dict):
        raise InvalidInputError("request body must be a JSON object")
    name = doc.get("model")
    if name is not None and name != model_name:
        raise HTTPError(404, f"unknown model {str(name)[:80]!r}; this server serves {model_name!r}")
    return doc


def text_or_ids(value: Any, field: str) -> list[str] | list[list[int]]:
    """An OpenAI-style text input (``input`` of /v1/embeddings, ``prompt`` of
    /v1/completions): a string, a list of strings, a list of token ids, or a list of
    such lists; always returned as a list."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return value
        if is_ids(value):
            return [value]
        if all(is_ids(x) for x in value):
            return value
    raise InvalidInputError(
        f"'{field}' must be a string, a non-empty list of strings, a list of token ids, or a list of such lists"
    )


def embedding_routes(model: ServedModel, body: BodyLimits) -> list[Any]:
    """``POST /v1/embeddings`` over ``model`` (for :func:`~ortbatch.serve.http.assemble_app`)."""

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


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed ``POST /v1/completions`` body."""

    prompts: list[str] | list[list[int]]
    max_tokens: int | None  # None: up to the model's context
    temperature: float
    top_p: float | None
    top_k: int | None
    stop: list[str] | None
    seed: int | None
    stream: bool
    include_usage: bool


def _shown(value: Any) -> str:
    """A value as an error message may show it: short, and never failing (an integer of
    thousands of digits has no ``repr`` under Python's digit limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {len(str(value)) if value.bit_length() < 13000 else 'thousands of'} digits"
    try:
        text = repr(value)
    except ValueError:
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _number(doc: dict[str, Any], key: str, default: float | None) -> float | None:
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInputError(f"'{key}' must be a number, got {_shown(value)}", input_name=key)
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        raise InvalidInputError(f"'{key}' is out of range, got {_shown(value)}", input_name=key) from None


def _integer(doc: dict[str, Any], key: str, default: int | None, lo: int = -_MAX_INT, hi: int = _MAX_INT) -> int | None:
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"'{key}' must be an integer, got {_shown(value)}", input_name=key)
    if not lo <= value <= hi:
        raise InvalidInputError(f"'{key}' must be in [{lo}, {hi}], got {_shown(value)}", input_name=key)
    return value


def _parse_sampling(
    doc: dict[str, Any], prompts: list[str] | list[list[int]], max_tokens: int | None
) -> CompletionRequest:
    """The fields both APIs share; ``max_tokens`` already read (``None``: up to the context)."""
    for key in ("n", "best_of"):
        if _integer(doc, key, 1) != 1:
            raise InvalidInputError(f"'{key}' above 1 is not supported: send the prompt again instead", input_name=key)
    if doc.get("logit_bias"):
        raise InvalidInputError("'logit_bias' is not supported", input_name="logit_bias")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(doc, key, 0.0) != 0.0:
            raise InvalidInputError(f"'{key}' is not supported (only 0)", input_name=key)
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInputError(f"'max_tokens' must be >= 1, got {max_tokens}", input_name="max_tokens")
    temperature = _number(doc, "temperature", 1.0)
    assert temperature is not None
    if not 0.0 <= temperature <= 2.0:
        raise InvalidInputError(f"'temperature' must be in [0, 2], got {temperature}", input_name="temperature")
    if temperature < _GREEDY_BELOW_TEMPERATURE:
        temperature = 0.0
    top_p = _number(doc, "top_p", None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidInputError(f"'top_p' must be in (0, 1], got {top_p}", input_name="top_p")
    top_k = _integer(doc, "top_k", None)  # bounded: a huge k must not reach numpy
    if top_k is not None and top_k < -1:  # -1 (vLLM's) and 0 mean off
        raise InvalidInputError(f"'top_k' must be >= 0 (or -1 for off), got {top_k}", input_name="top_k")
    stop = doc.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise InvalidInputError(
            f"'stop' must be a string or a list of non-empty strings, got {_shown(stop)}", input_name="stop"
        )
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidInputError(f"'stream' must be true or false, got {_shown(stream)}", input_name="stream")
    options = doc.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidInputError("'stream_options' must be an object", input_name="stream_options")
    return CompletionRequest(
        prompts=prompts,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=None if top_p == 1.0 else top_p,
        top_k=top_k if top_k is not None and top_k > 0 else None,
        stop=stop or None,
        seed=_integer(doc, "seed", None, 0, _MAX_SEED),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def parse_completion_request(doc: dict[str, Any], max_prompt_chars: int = DEFAULT_MAX_TEXT_CHARS) -> CompletionRequest:
    """Validate a ``/v1/completions`` body (a JSON object, see
    :func:`~ortbatch.serve.app.read_openai_body`); raises :class:`InvalidInputError` (400)
    naming the field, :class:`~ortbatch.serve.model.RequestTooLargeError` (413) for a text
    prompt over ``max_prompt_chars`` characters."""
    prompts = text_or_ids(doc.get("prompt"), "prompt")
    if prompts and isinstance(prompts[0], str):
        prompts = check_texts(prompts, "prompt", None, max_prompt_chars)
    if doc.get("echo"):
        raise InvalidInputError("'echo' is not supported", input_name="echo")
    for key in ("logprobs", "suffix"):
        if doc.get(key) is not None:
            raise InvalidInputError(f"'{key}' is not supported", input_name=key)
    return _parse_sampling(doc, prompts, _integer(doc, "max_tokens", _DEFAULT_MAX_TOKENS))


def _message_text(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidInputError(f"messages[{index}] must be an object with a string 'role'", input_name="messages")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidInputError(
                    f"messages[{index}].content: only text parts are supported, got {part!r}", input_name="messages"
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidInputError(f"messages[{index}].content must be a string or text parts", input_name="messages")
    check_texts([content, message["role"]], f"messages[{index}]", None, sys.maxsize)  # lone surrogates
    return {**message, "content": content}


def parse_chat_request(
    doc: dict[str, Any], template: ChatTemplate | None
) -> tuple[list[dict[str, Any]], Callable[[list[int]], CompletionRequest]]:
    """Validate a ``/v1/chat/completions`` body (every field, before anything is
    rendered); returns its messages (text content) and the function that makes the
    request from the token ids of their rendered prompt (see :func:`render_bounded`)."""
    if template is None:
        raise InvalidInputError(
            "this model has no chat template (chat_template in tokenizer_config.json or chat_template.jinja): "
            "use /v1/completions"
        )
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("'messages' must be a non-empty list", input_name="messages")
    if doc.get("logprobs") or doc.get("top_logprobs") is not None:
        raise InvalidInputError("'logprobs' is not supported", input_name="logprobs")
    for key in ("tools", "functions", "response_format"):
        if doc.get(key):
            raise InvalidInputError(f"'{key}' is not supported", input_name=key)
    checked = [_message_text(m, i) for i, m in enumerate(messages)]
    max_tokens = _integer(doc, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _integer(doc, "max_tokens", None)
    _parse_sampling(doc, [[0]], max_tokens)  # every field checked before any rendering

    def with_prompt(ids: list[int]) -> CompletionRequest:
        return _parse_sampling(doc, [ids], max_tokens)

    return checked, with_prompt


def render_bounded(template: ChatTemplate, messages: list[dict[str, Any]], timeout_s: float, max_chars: int) -> str:
    """``template.render(messages)`` that gives up (400 naming ``messages``) after
    ``timeout_s`` seconds or beyond ``max_chars`` characters: the template comes from
    the export, so a loop it runs must not hold a thread forever. Blocking: call it in a
    thread. The deadline is checked on every line the compiled template runs."""
    deadline = time.monotonic() + timeout_s

    def check(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise InvalidInputError(
                f"the chat template took longer than {timeout_s:g} s to render these messages",
                input_name="messages",
            )
        return check

    def calls(frame: Any, event: str, arg: Any) -> Any:
        # only the template's own compiled code (jinja names it "<template>") is traced
        return check(frame, event, arg) if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        text = template.render(messages, add_generation_prompt=True)
    finally:
        sys.settrace(previous)
    if len(text) > max_chars:
        raise RequestTooLargeError(
            f"the chat template rendered {len(text)} characters; at most {max_chars} are taken",
            input_name="messages",
        )
    return text


def prompt_char_limit(generator: Any) -> int:
    """The longest text prompt taken: as long as the context could ever hold, at a
    generous 32 characters a token (and never below the text endpoints' limit)."""
    context = int(getattr(generator.layout, "max_context_length", 0) or 0)
    return max(DEFAULT_MAX_TEXT_CHARS, 32 * context)


def _submit_all(
    generator: Any,
    req: CompletionRequest,
    on_token: Callable[[int], Callable[[Any], None]] | None = None,
) -> list[Future[Any]]:
    """Submit every prompt; if one is refused, cancel those already queued and re-raise."""
    futures: list[Future[Any]] = []
    try:
        for i, prompt in enumerate(req.prompts):
            futures.append(
                generator.submit(
                    prompt,
                    req.max_tokens if req.max_tokens is not None else _rest_of_context(generator, prompt),
                    temperature=req.temperature,
                    top_k=req.top_k,
                    top_p=req.top_p,
                    stop=req.stop,
                    seed=req.seed,
                    on_token=on_token(i) if on_token else None,
                )
            )
    except BaseException:
        for fut in futures:
            fut.cancel()
        raise
    return futures


async def _admitted(futures: list[Future[Any]]) -> None:
    """Wait until every request is queued where its generator is another process's (a
    front end's: the future's ``admitted``), so a refusal there (a full queue) is still
    a JSON error; then, or at once for an in-process generator, return."""
    admissions = [a for f in futures if (a := getattr(f, "admitted", None)) is not None]
    if not admissions:
        return
    try:
        await asyncio.gather(*(asyncio.wrap_future(a) for a in admissions))
    except BaseException:
        for fut in futures:
            fut.cancel()
        raise


def _rest_of_context(generator: Any, prompt: Any) -> int:
    """Room left after a token-id prompt (at least 1: too long a prompt is refused by submit)."""
    return max(1, int(generator.layout.max_context_length) - len(prompt))


def _usage(completions: Sequence[Any]) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


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
        futures = _submit_all(self.generator, req)
        waits = [asyncio.wrap_future(f) for f in futures]  # cancelling one cancels its request
        try:
            results = await run_or_abandon(request.receive, asyncio.gather(*waits))
        except BaseException:  # one failed, or the client left: the others are not wanted
            for fut in futures:
                fut.cancel()
            raise
        choices = [api.choice(i, c.text, c.finish_reason) for i, c in enumerate(results)]
        return json_response({**api.head, "object": api.object, "choices": choices, "usage": _usage(results)})

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
        futures = _submit_all(self.generator, req, on_token)
        await _admitted(futures)

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
            yield api.chunk([], usage=_usage(finished))
        yield b"data: [DONE]\n\n"
    finally:  # the client left (or the response ended): free any row still held
        watcher.cancel()
        for fut in futures:
            fut.cancel()


def completion_routes(served: ServedGenerator, body: BodyLimits) -> list[Any]:
    """``POST /v1/completions`` and ``/v1/chat/completions`` over ``served`` (for
    :func:`~ortbatch.serve.http.assemble_app`)."""
    endpoint = _CompletionsEndpoint(served, body)
    return [
        handled_route("/v1/completions", endpoint.completions, "POST"),
        handled_route("/v1/chat/completions", endpoint.chat_completions, "POST"),
    ]
