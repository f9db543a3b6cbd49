"""What the OpenAI completion endpoints do, transport-free: parse a ``/v1/completions``
or ``/v1/chat/completions`` body (:func:`parse_completion_request`,
:func:`parse_chat_request`; the fields are listed in :mod:`ortbatch.serve.http.openai_api`),
render a chat bounded in time and size (:func:`render_bounded`), and submit the prompts
to the generator (:func:`submit_all`, :func:`admitted`). HTTP
(:mod:`ortbatch.serve.http.openai_api`) and gRPC (through :mod:`ortbatch.serve.served.decoupled`)
both call it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidInputError, RequestTooLargeError
from ...generation.chat import ChatTemplate
from ..config import DEFAULT_MAX_TEXT_CHARS
from .model import check_texts

__all__ = [
    "CompletionRequest",
    "admitted",
    "parse_chat_request",
    "parse_completion_request",
    "prompt_char_limit",
    "render_bounded",
    "submit_all",
    "text_or_ids",
    "usage",
]

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Below this a temperature is greedy decoding: dividing logits by 1e-308 overflows to
# inf and the probabilities become NaN (vLLM draws the same line).
_GREEDY_BELOW_TEMPERATURE = 1e-5
_MAX_INT = 2**31 - 1
_MAX_SEED = 2**64 - 1


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
    :func:`~ortbatch.serve.http.app.read_openai_body`); raises :class:`InvalidInputError` (400)
    naming the field, :class:`~ortbatch.serve.served.model.RequestTooLargeError` (413) for a text
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


def submit_all(
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


async def admitted(futures: list[Future[Any]]) -> None:
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


def usage(completions: Sequence[Any]) -> dict[str, int]:
    """OpenAI's ``usage`` of finished completions."""
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
