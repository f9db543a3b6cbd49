"""What the OpenAI completion endpoints do, transport-free: check a ``/v1/completions`` or
``/v1/chat/completions`` body against the parameter policy (:mod:`.parameters`) and map it onto
:class:`~ortbatch.generation.sampling.SamplingParams` (:func:`parse_completion_request`,
:func:`parse_chat_request`: structured output becomes one constraint, chat's tools a
:class:`~ortbatch.generation.tools.ToolRequest` that renders, forces and parses calls), compile
what constrains the output before anything is queued (:func:`compile_constraints`: a schema that
does not compile is a 400 naming the field as sent), render a chat bounded in time and size
(:func:`render_bounded`), tokenize the prompts (:func:`prepare_prompts`) and submit them to the
generator, ``n`` choices each (:func:`submit_all`, :func:`admitted`). What the answers look like
is :mod:`.answers`. HTTP (:mod:`ortbatch.serve.http.openai_api`), gRPC and KServe v2
``generate`` (through :mod:`ortbatch.serve.served.decoupled`) all call it, so a field means the
same on each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidInputError, RequestTooLargeError, UnsupportedError
from ...generation.chat import ChatTemplate
from ...generation.constrained import Constraint
from ...generation.sampling import MAX_LOGPROBS, MAX_N, SamplingParams
from ...generation.tools import ToolRequest, template_messages
from ..config import DEFAULT_MAX_TEXT_CHARS
from .model import check_texts
from .parameters import CHAT, COMPLETIONS, Constrained, ParameterPolicy, structured_output, tool_fields

__all__ = [
    "CHAT_RENDER_TIMEOUT_S",
    "ChatPrompt",
    "CompletionRequest",
    "Prompts",
    "admitted",
    "compile_constraints",
    "parse_chat_request",
    "parse_completion_request",
    "prepare_prompts",
    "prompt_char_limit",
    "render_bounded",
    "submit_all",
    "text_or_ids",
    "usage",
]

#: how long a chat template may take to render one request's messages
CHAT_RENDER_TIMEOUT_S = 2.0
_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Below this a temperature is greedy decoding: dividing logits by 1e-308 overflows to
# inf and the probabilities become NaN (vLLM draws the same line).
_GREEDY_BELOW_TEMPERATURE = 1e-5
_MAX_INT = 2**31 - 1
_MAX_SEED = 2**64 - 1
_STRICT = ParameterPolicy()
# the SamplingParams fields a request's own field of the same name sets
_SAMPLING_FIELDS = (
    "seed",
    "min_p",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)
# chat_template_kwargs may not set what the renderer sets itself
_RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


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
        f"'{field}' must be a string, a non-empty list of strings, a list of token ids, or a list of such lists",
        input_name=field,
    )


@dataclass(frozen=True)
class CompletionRequest:
    """A checked completion request, either API: its prompts and how each is completed.

    ``params`` is what each prompt's choices run with: ``params.n`` of them (``best_of`` when
    it is larger than ``n``), with the logprobs and prompt logprobs the answer needs. What the
    answer shows is said apart: ``n`` choices, ``logprobs`` alternatives (``None``: none),
    ``prompt_logprobs`` (vLLM's field), ``echo``.
    """

    prompts: list[str] | list[list[int]]
    params: SamplingParams
    n: int = 1
    #: most new tokens; None: the rest of the context (chat's default)
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    request_id: str | None = None
    truncate: int | None = None
    truncation_side: str = "left"
    add_special_tokens: bool = True
    chat: bool = False
    #: chat's echo: the last message's content, when it has the reply's role
    echo_text: str = ""
    #: the structured-output field that constrains ``params`` (``response_format``, ``guided_*``, ...)
    constrained: Constrained | None = None
    #: chat's tools (``params`` already forced and set for them: :meth:`ToolRequest.apply`)
    tools: ToolRequest | None = None

    @property
    def runs(self) -> int:
        """Choices run per prompt (``best_of`` when larger than ``n``)."""
        return self.params.n

    @property
    def best_of(self) -> bool:
        return self.runs > self.n


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


def _flag(doc: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    """``doc[key]`` as a bool; ``where``: the object holding it, for the error's name."""
    value = doc.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        name = f"{where}.{key}" if where else key
        raise InvalidInputError(f"'{name}' must be true or false, got {_shown(value)}", input_name=name)
    return value


def _stream_options(doc: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)``; options only with ``stream``, as OpenAI says."""
    options = doc.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise InvalidInputError("'stream_options' must be an object", input_name="stream_options")
    if not stream:
        raise InvalidInputError("'stream_options' is only allowed when 'stream' is true", input_name="stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise InvalidInputError(
            f"Unrecognized request argument supplied: stream_options.{str(unknown[0])[:40]}",
            input_name="stream_options",
        )
    include = _flag(options, "include_usage", False, "stream_options")
    continuous = _flag(options, "continuous_usage_stats", False, "stream_options")
    # vLLM: per-chunk usage only together with include_usage
    return include, include and continuous


def _logprobs(doc: dict[str, Any], chat: bool) -> int | None:
    """The alternatives a request's ``logprobs`` asks for (``None``: no logprobs)."""
    if not chat:
        return _integer(doc, "logprobs", None, 0, MAX_LOGPROBS)
    top = _integer(doc, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not _flag(doc, "logprobs", False):
        if top is not None:
            raise InvalidInputError("'top_logprobs' needs 'logprobs' set to true", input_name="top_logprobs")
        return None
    return top or 0


def _sampling_values(doc: dict[str, Any]) -> dict[str, Any]:
    """temperature, top_p, top_k and stop as OpenAI and vLLM spell them, in SamplingParams' terms."""
    temperature = _number(doc, "temperature", 1.0)
    assert temperature is not None
    if not 0.0 <= temperature <= 2.0:
        raise InvalidInputError(f"'temperature' must be in [0, 2], got {temperature}", input_name="temperature")
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
    _integer(doc, "seed", None, 0, _MAX_SEED)
    # OpenAI's shapes: a map of token ids to biases (SamplingParams also takes pairs, the
    # Python API's), and an end-user id string
    for name, kind, what in (("logit_bias", dict, "an object mapping token ids to biases"), ("user", str, "a string")):
        if doc.get(name) is not None and not isinstance(doc[name], kind):
            raise InvalidInputError(f"'{name}' must be {what}, got {_shown(doc[name])}", input_name=name)
    return {
        "temperature": 0.0 if temperature < _GREEDY_BELOW_TEMPERATURE else temperature,
        "top_p": None if top_p == 1.0 else top_p,
        "top_k": top_k if top_k is not None and top_k > 0 else None,
        "stop": stop or (),
    }


def _max_tokens(doc: dict[str, Any], chat: bool, echo: bool) -> int | None:
    if chat:
        n = _integer(doc, "max_completion_tokens", None, 1)
        return n if n is not None else _integer(doc, "max_tokens", None, 1)
    n = _integer(doc, "max_tokens", _DEFAULT_MAX_TOKENS, 0)
    if n == 0 and not echo:
        raise InvalidInputError("'max_tokens' must be >= 1 (0 only with 'echo')", input_name="max_tokens")
    return n


def _choices(doc: dict[str, Any], chat: bool, stream: bool) -> tuple[int, int]:
    """``(n, runs)``: the choices answered per prompt and those run (``best_of``)."""
    n = _integer(doc, "n", 1, 1, MAX_N)
    assert n is not None
    best_of = None if chat else _integer(doc, "best_of", None, 1, MAX_N)
    if best_of is None or best_of == n:
        return n, n
    if best_of < n:
        raise InvalidInputError(f"'best_of' ({best_of}) must be >= 'n' ({n})", input_name="best_of")
    if stream:
        raise InvalidInputError("'best_of' above 'n' cannot be streamed", input_name="best_of")
    return n, best_of


def _parse(doc: dict[str, Any], prompts: list[Any], chat: bool) -> CompletionRequest:
    """The fields both APIs share (the API's own already checked)."""
    echo = _flag(doc, "echo", False)
    max_tokens = _max_tokens(doc, chat, echo)
    stream = _flag(doc, "stream", False)
    include_usage, continuous = _stream_options(doc, stream)
    n, runs = _choices(doc, chat, stream)
    logprobs = _logprobs(doc, chat)
    prompt_lp = _integer(doc, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    if prompt_lp is not None and stream:
        raise InvalidInputError(
            "'prompt_logprobs' are not available when 'stream' is true", input_name="prompt_logprobs"
        )
    # scored prompts: vLLM's field, echo's logprobs, and echo without new tokens (the prompt only)
    scored = [k for k in (prompt_lp, logprobs if echo and not chat else None) if k is not None]
    if max_tokens == 0 and not scored:
        scored = [0]
    values = {**_sampling_values(doc), **{k: doc.get(k) for k in _SAMPLING_FIELDS}}
    values.update(
        max_tokens=max_tokens,
        n=runs,
        logprobs=0 if logprobs is None and runs > n else logprobs,
        prompt_logprobs=max(scored) if scored else None,
    )
    constrained = structured_output(doc)
    if constrained is not None:
        values[constrained.kind] = constrained.value
    try:
        params = SamplingParams.from_fields(values, {"max_tokens": "max_new_tokens"})
    except InvalidInputError as exc:  # a constraint's error names the field the client sent
        if constrained is None or constrained.kind not in str(exc):
            raise
        raise constrained.renamed(exc) from exc
    request_id = doc.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 200):
        raise InvalidInputError("'request_id' must be a string of 1 to 200 characters", input_name="request_id")
    side = doc.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise InvalidInputError(
            f"'truncation_side' must be 'left' or 'right', got {_shown(side)}", input_name="truncation_side"
        )
    truncate = _integer(doc, "truncate_prompt_tokens", None, -1)
    if truncate == 0:
        raise InvalidInputError(
            "'truncate_prompt_tokens' must be >= 1 (or -1: the context)", input_name="truncate_prompt_tokens"
        )
    _flag(doc, "spaces_between_special_tokens", True)
    return CompletionRequest(
        prompts=prompts,
        params=params,
        n=n,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        echo=echo,
        logprobs=logprobs,
        prompt_logprobs=prompt_lp,
        return_token_ids=_flag(doc, "return_token_ids", False),
        tokens_as_ids=_flag(doc, "return_tokens_as_token_ids", False),
        request_id=request_id,
        truncate=truncate,
        truncation_side=side,
        add_special_tokens=_flag(doc, "add_special_tokens", not chat),
        chat=chat,
        constrained=constrained,
    )


def parse_completion_request(
    doc: dict[str, Any], max_prompt_chars: int = DEFAULT_MAX_TEXT_CHARS, policy: ParameterPolicy | None = None
) -> CompletionRequest:
    """Validate a ``/v1/completions`` body (a JSON object, see
    :func:`~ortbatch.serve.http.openai_api.read_openai_body`) against ``policy`` (default: strict);
    raises :class:`InvalidInputError` (400) naming the field, :class:`RequestTooLargeError` (413)
    for a text prompt over ``max_prompt_chars`` characters."""
    (policy or _STRICT).check(doc, COMPLETIONS)
    tool_fields(doc, COMPLETIONS)  # refuses tools here
    prompts = text_or_ids(doc.get("prompt"), "prompt")
    if prompts and isinstance(prompts[0], str):
        prompts = check_texts(prompts, "prompt", None, max_prompt_chars)
    return _parse(doc, prompts, chat=False)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's messages and how the template renders them."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def _message(message: Any, index: int, as_parts: bool = False) -> dict[str, Any]:
    """A message as the template gets it, as vLLM gives it: text parts joined with newlines for a
    template that reads text, or (``as_parts``: the template loops over content) a list of
    ``{"type": "text", "text": ...}`` parts; an assistant turn with ``tool_calls`` may have null
    content. The deprecated ``function_call`` is a 400 (templates read ``tool_calls``: it would
    vanish from the prompt)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidInputError(f"messages[{index}] must be an object with a string 'role'", input_name="messages")
    if message.get("function_call") is not None:
        raise InvalidInputError(
            f"messages[{index}].function_call is not supported (chat templates read tool_calls): "
            'send the call as "tool_calls": [{"id": ..., "type": "function", "function": {"name": ..., '
            '"arguments": ...}}]',
            input_name=f"messages[{index}].function_call",
        )
    content = message.get("content")
    texts: list[str] = []
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidInputError(
                    f"messages[{index}].content: only text parts are supported, got {_shown(part)}",
                    input_name="messages",
                )
            texts.append(part["text"])
        content = [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(texts)
    elif isinstance(content, str):
        texts = [content]
    if content is None and message["role"] == "assistant" and message.get("tool_calls"):
        if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
            raise InvalidInputError(f"messages[{index}].tool_calls must be a list", input_name="messages")
    elif not isinstance(content, (str, list)):
        raise InvalidInputError(
            f"messages[{index}].content must be a string or text parts (null only in an assistant turn "
            "with tool_calls)",
            input_name="messages",
        )
    check_texts([*texts, message["role"]], f"messages[{index}]", None, sys.maxsize)  # lone surrogates
    return {**message, "content": content}


def _text(content: Any) -> str:
    """A checked message's content as text (parts joined with newlines, as vLLM's echo joins them)."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _template_kwargs(doc: dict[str, Any]) -> dict[str, Any]:
    kwargs = doc.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidInputError("'chat_template_kwargs' must be an object", input_name="chat_template_kwargs")
    reserved = sorted(_RESERVED_TEMPLATE_NAMES.intersection(kwargs))
    if reserved:
        raise InvalidInputError(
            f"'chat_template_kwargs' may not set {reserved[0]!r}: it is a request field of its own",
            input_name="chat_template_kwargs",
        )
    documents = doc.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise InvalidInputError("'documents' must be a list of objects", input_name="documents")
        kwargs = {**kwargs, "documents": documents}
    return dict(kwargs)


def parse_chat_request(
    doc: dict[str, Any], template: ChatTemplate | None, policy: ParameterPolicy | None = None
) -> tuple[ChatPrompt, CompletionRequest]:
    """Validate a ``/v1/chat/completions`` body (every field, before anything is rendered);
    returns how to render its prompt (see :func:`render_bounded`) and the request, whose
    ``prompts`` are filled once the rendered prompt is tokenized."""
    if template is None:
        raise InvalidInputError(
            "this model has no chat template (chat_template in tokenizer_config.json or chat_template.jinja): "
            "use /v1/completions"
        )
    (policy or _STRICT).check(doc, CHAT)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("'messages' must be a non-empty list", input_name="messages")
    checked = [_message(m, i, template.reads_content_parts) for i, m in enumerate(messages)]
    generation_prompt = _flag(doc, "add_generation_prompt", True)
    continue_final = _flag(doc, "continue_final_message", False)
    if continue_final and generation_prompt:
        raise InvalidInputError(
            "'continue_final_message' needs 'add_generation_prompt' set to false (the two are exclusive, "
            "as in transformers' apply_chat_template)",
            input_name="continue_final_message",
        )
    tools = ToolRequest.from_openai(*tool_fields(doc, CHAT), template=template)
    kwargs = _template_kwargs(doc)
    if tools is not None:
        kwargs["tools"] = tools.template_tools
    # assistant tool_calls' arguments (JSON text) become the objects templates read, as vLLM does
    chat = ChatPrompt(template_messages(checked), generation_prompt, continue_final, kwargs)
    req = _parse(doc, [], chat=True)
    if tools is not None:  # special tokens kept for the call markers; a call forced by grammar
        req = dataclasses.replace(req, params=tools.apply(req.params), tools=tools)
    if req.echo:  # vLLM's: the last message, when it has the reply's role
        role = "assistant" if generation_prompt else checked[-1]["role"]
        if checked[-1]["role"] == role:
            req = dataclasses.replace(req, echo_text=_text(checked[-1]["content"]))
    return chat, req


async def compile_constraints(generator: Any, req: CompletionRequest) -> None:
    """Compile what constrains ``req``'s output on the generator's grammar thread (cached, so
    the submit that follows compiles nothing), before anything is submitted: every tool's
    ``parameters`` schema, the grammar that forces a call, the request's own constraint. One
    that does not compile is a 400 naming the field as the client sent it
    (``tools[1].function.parameters``, ``response_format.json_schema.schema``); a server
    without the grammar engine (or an export without ``tokenizer.json``) answers 501."""
    named: list[tuple[str, Constraint]] = list(req.tools.constraints()) if req.tools is not None else []
    own = req.params.constraint
    if own is not None and all(c != own for _, c in named):
        named.append((req.constrained.field if req.constrained is not None else own.kind, own))
    if not named:
        return
    grammars = getattr(generator, "grammars", None)
    if grammars is None:
        raise UnsupportedError("this server's generator cannot constrain its output (it has no grammar compiler)")
    futures = [(where, c, grammars.compile_async(c)) for where, c in named]
    for where, constraint, fut in futures:
        try:
            await asyncio.wrap_future(fut)
        except InvalidInputError as exc:
            if exc.input_name != constraint.kind:
                raise
            raise Constrained(constraint.kind, None, where).renamed(exc) from exc


def render_bounded(
    template: ChatTemplate, chat: ChatPrompt | list[dict[str, Any]], timeout_s: float, max_chars: int
) -> str:
    """``template.render`` of ``chat`` (or of bare messages) that gives up (400 naming ``messages``) after
    ``timeout_s`` seconds or beyond ``max_chars`` characters: the template comes from
    the export, so a loop it runs must not hold a thread forever. Blocking: call it in a
    thread. The deadline is checked on every line the compiled template runs."""
    if not isinstance(chat, ChatPrompt):
        chat = ChatPrompt(chat)
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
        text = template.render(
            chat.messages,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            **chat.template_kwargs,
        )
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


@dataclass(frozen=True)
class Prompts:
    """A request's prompts as token ids, and the text each one's choices begin with when
    ``echo`` is asked ("" otherwise)."""

    ids: list[list[int]]
    echo: list[str]


def prepare_prompts(generator: Any, req: CompletionRequest, rendered: str | None = None) -> Prompts:
    """Tokenize ``req``'s prompts (chat: the ``rendered`` template) and cut them to
    ``truncate_prompt_tokens``. Blocking: call it in a thread. ``""`` stays empty (submit
    refuses it with its own message)."""
    texts: list[Any] = [rendered] if rendered is not None else list(req.prompts)
    ids = [
        generator.encode(t, add_special_tokens=req.add_special_tokens) if isinstance(t, str) and t else t for t in texts
    ]
    if req.truncate is not None:
        k = int(generator.layout.max_context_length) if req.truncate == -1 else req.truncate
        ids = [list(p[-k:]) if req.truncation_side == "left" else list(p[:k]) for p in ids]
    if not req.echo:
        echo = [""] * len(ids)
    elif req.chat:
        echo = [req.echo_text]
    else:  # the prompt as sent; as its tokens say when it was ids or was cut
        echo = [
            t if isinstance(t, str) and req.truncate is None else generator.decode(list(p), skip_special_tokens=False)
            for t, p in zip(texts, ids, strict=True)
        ]
    return Prompts([list(p) for p in ids], echo)


def submit_all(
    generator: Any,
    req: CompletionRequest,
    prompts: Prompts,
    on_token: Callable[[int], Callable[[Any], None]] | None = None,
) -> list[Future[Any]]:
    """Submit every prompt's choices (``req.runs`` each, prefilled once); the futures in
    answer order (prompt ``i``'s choice ``j`` at ``i * runs + j``). ``on_token(i)`` is prompt
    ``i``'s stream callback. If one is refused, cancel those already queued and re-raise."""
    futures: list[Future[Any]] = []
    try:
        for i, prompt in enumerate(prompts.ids):
            params = req.params
            if req.max_tokens is None:
                params = dataclasses.replace(params, max_new_tokens=_rest_of_context(generator, prompt))
            callback = on_token(i) if on_token else None
            futures.extend(generator.submit_choices(prompt, params=params, on_token=callback))
    except BaseException:
        for fut in futures:
            fut.cancel()
        raise
    return futures


async def admitted(futures: list[Future[Any]]) -> None:
    """Wait until every request is queued where its generator is another process's (a
    front end's: the future's ``admitted``), so a refusal there (a full queue) is still
    a JSON error; then, or at once for an in-process generator, return."""
    admissions = list({id(a): a for f in futures if (a := getattr(f, "admitted", None)) is not None}.values())
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


def usage(prompts: Prompts, completions: Sequence[Any]) -> dict[str, int]:
    """OpenAI's ``usage``: each prompt counted once (whatever its ``n``), every answered choice's tokens."""
    prompt = sum(len(p) for p in prompts.ids)
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
