"""The parameter policy of the completion endpoints: every field of OpenAI's Completions and
Chat Completions requests and of vLLM's extra parameters, and what ortbatch does with it.

:data:`FIELDS` is the one table. Each field is

- **honoured**: it does what OpenAI or vLLM define (the sampling ones through
  :class:`~ortbatch.generation.sampling.SamplingParams`, whose :data:`PARAMETERS` says how);
- **accepted**: taken, with no effect on the answer, and the table says why (an end-user id,
  a caching hint for a cache this server does not have);
- **refused**: a 400 naming it and saying why, unless it is null or a value that asks for
  nothing (``n``-like defaults: ``use_beam_search: false``, ``store: false``);
- **structured** (structured output and tool calling: ``response_format``, ``guided_*``,
  ``structured_outputs``, ``tools``, ``tool_choice``, ``parallel_tool_calls``): honoured, mapped
  here too: :func:`structured_output` turns the first three into one constraint of
  :class:`~ortbatch.generation.sampling.SamplingParams` (``json_schema``, ``json_object``,
  ``regex``, ``choice``, ``grammar``) and remembers the field as the client sent it, so an error
  found later (a schema that does not compile) names it; :func:`tool_fields` hands the tool
  fields, chat's only, to :class:`~ortbatch.generation.tools.ToolRequest`.

A field in no row is refused as OpenAI refuses one (``Unrecognized request argument supplied:
X``), or, with ``ortbatch serve --lenient-params``, accepted and logged once per name
(:class:`ParameterPolicy`). The same policy answers ``/v1/completions``, ``/v1/chat/completions``,
gRPC's ``sampling_parameters`` and KServe v2 ``generate`` (the latter two as completions).
docs/serving.md's table is :func:`parameter_table` (a test keeps the two equal).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidInputError
from ...generation.sampling import PARAMETERS

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "FIELDS",
    "STRUCTURED_FIELDS",
    "TOOL_FIELDS",
    "Constrained",
    "Field",
    "ParameterPolicy",
    "parameter_table",
    "structured_output",
    "tool_fields",
]

log = logging.getLogger("ortbatch.serve")

COMPLETIONS, CHAT = "completions", "chat"
HONOURED, ACCEPTED, REFUSED, STRUCTURED = "honoured", "accepted", "refused", "structured"


@dataclass(frozen=True)
class Field:
    """One request field: which APIs take it, whether OpenAI and vLLM define it, and what
    ortbatch does (``handling``, ``note``; ``neutral``: the values of a refused field that ask
    for nothing, so they are taken)."""

    name: str
    apis: frozenset[str]
    openai: str
    vllm: str
    handling: str
    note: str
    neutral: tuple[Any, ...] = ()


_BOTH = frozenset({COMPLETIONS, CHAT})
_C, _H = frozenset({COMPLETIONS}), frozenset({CHAT})
_API_NAMES = {_BOTH: "both", _C: "Completions", _H: "Chat"}


def _sampling(name: str, apis: frozenset[str] = _BOTH, openai: bool = True, extra: str = "") -> Field:
    """A field honoured through SamplingParams: the note is PARAMETERS' own words."""
    p = PARAMETERS[name]
    note = f"{p.meaning} ({p.range}; {p.follows})" + (f"; {extra}" if extra else "")
    return Field(name, apis, _API_NAMES[apis] if openai else "—", "yes", HONOURED, note)


def _f(name: str, apis: frozenset[str], openai: str, vllm: str, handling: str, note: str, *neutral: Any) -> Field:
    return Field(name, apis, openai, vllm, handling, note, neutral)


_FIELDS: list[Field] = [
    # -- OpenAI's fields (both APIs unless said) ----------------------------------------------
    _f("model", _BOTH, "both", "yes", HONOURED, "must name the served model when given (else 404)"),
    _f("prompt", _C, "Completions", "yes", HONOURED, "a string, strings, token ids, or lists of token ids"),
    _f(
        "messages",
        _H,
        "Chat",
        "yes",
        HONOURED,
        "rendered by the export's chat template; text content, "
        "assistant turns with `tool_calls` and null content, `tool` turns",
    ),
    _f(
        "max_tokens",
        _BOTH,
        "both",
        "yes",
        HONOURED,
        "most new tokens (Completions default 16; Chat: the rest of the context); 0 with `echo` scores the prompt only",
    ),
    _f("max_completion_tokens", _H, "Chat", "yes", HONOURED, "as `max_tokens` (wins when both are given)"),
    _sampling("temperature", extra="in [0, 2] here as OpenAI's; default 1; below 1e-5 greedy"),
    _sampling("top_p"),
    _sampling("n"),
    _f(
        "best_of",
        _C,
        "Completions",
        "V0 only",
        HONOURED,
        "runs best_of choices (>= n) and answers the n with the highest sum of token logprobs; not streamed",
    ),
    _sampling("stop", extra="a string or a list"),
    _sampling("seed", extra="choice i of n draws from (seed, i)"),
    _sampling("presence_penalty"),
    _sampling("frequency_penalty"),
    _sampling("logit_bias", extra="keys are token ids as strings"),
    _f(
        "logprobs",
        _BOTH,
        "both",
        "yes",
        HONOURED,
        "Completions: k in [0, 20]: `tokens`, `token_logprobs`, "
        "`top_logprobs` (the k most likely and the chosen token), `text_offset`; Chat: true with "
        "`top_logprobs`: `content` with `bytes`. From the model's float32 logits before temperature, "
        "penalties and bias",
    ),
    _f("top_logprobs", _H, "Chat", "yes", HONOURED, "0-20 alternatives per token (needs `logprobs: true`)"),
    _f(
        "echo",
        _BOTH,
        "Completions",
        "yes",
        HONOURED,
        "Completions: the prompt before the completion, with its "
        "token logprobs when `logprobs` is set (the first token's null); Chat (vLLM's): the last message's "
        "content before the reply when it has the reply's role",
    ),
    _f("stream", _BOTH, "both", "yes", HONOURED, "server-sent events, then `data: [DONE]`"),
    _f(
        "stream_options",
        _BOTH,
        "both",
        "yes",
        HONOURED,
        "`include_usage` (a last chunk with usage); "
        "`continuous_usage_stats` (vLLM's: usage so far in every chunk, with `include_usage`); only with `stream`",
    ),
    _f("suffix", _C, "Completions", "—", REFUSED, "refused: insertion (fill-in-the-middle) is not supported", ""),
    _f("user", _BOTH, "both", "ignored", ACCEPTED, "accepted: an end-user id for OpenAI's abuse monitoring; no effect"),
    _f(
        "response_format",
        _BOTH,
        "Chat",
        "yes",
        STRUCTURED,
        '`{"type": "json_object"}`: a JSON object; `{"type": "json_schema", "json_schema": {"name", "schema", '
        '"strict"}}`: JSON valid against `schema`, enforced whether `strict` or not; `{"type": "text"}`: free text',
        {"type": "text"},
    ),
    _f(
        "tools",
        _BOTH,
        "Chat",
        "yes",
        STRUCTURED,
        "Chat: `function` tools, shown to the model through the chat template's `tools` variable; calls parsed "
        "into `message.tool_calls` in the template's format (`hermes` or `llama3_json`); Completions: 400 "
        "(`[]` accepted)",
        [],
    ),
    _f(
        "tool_choice",
        _BOTH,
        "Chat",
        "yes",
        STRUCTURED,
        '`"auto"` (default), `"none"` (tools shown, nothing parsed), `"required"` and a named function '
        "(a call forced by grammar, its arguments valid against the tool's `parameters`)",
        "none",
        "auto",
    ),
    _f(
        "parallel_tool_calls",
        _BOTH,
        "Chat",
        "yes",
        STRUCTURED,
        "`false`: one call at most (forced: exactly one); default true",
        True,
        False,
    ),
    _f(
        "functions",
        _BOTH,
        "Chat (deprecated)",
        "—",
        REFUSED,
        "`[]` accepted; refused: OpenAI's deprecated form, send `tools` instead",
        [],
    ),
    _f(
        "function_call",
        _BOTH,
        "Chat (deprecated)",
        "—",
        REFUSED,
        '`"none"` and `"auto"` accepted; refused: OpenAI\'s deprecated form, send `tool_choice` instead',
        "none",
        "auto",
    ),
    _f("audio", _H, "Chat", "—", REFUSED, "refused: audio output is not supported"),
    _f("modalities", _H, "Chat", "—", REFUSED, '`["text"]` accepted; audio refused: text only', ["text"]),
    _f("prediction", _H, "Chat", "—", REFUSED, "refused: predicted outputs are not supported"),
    _f(
        "reasoning_effort",
        _H,
        "Chat",
        "yes",
        REFUSED,
        "refused: this server has no reasoning models or parser (pass template variables in `chat_template_kwargs`)",
    ),
    _f("verbosity", _H, "Chat", "—", REFUSED, "refused: a reasoning-model setting"),
    _f("web_search_options", _H, "Chat", "—", REFUSED, "refused: no web search"),
    _f("store", _H, "Chat", "—", REFUSED, "`false` accepted; refused: completions are not stored", False),
    _f("metadata", _H, "Chat", "—", ACCEPTED, "accepted: tags of OpenAI's stored completions; nothing is stored"),
    _f(
        "service_tier",
        _H,
        "Chat",
        "—",
        REFUSED,
        '`"auto"` and `"default"` accepted; others refused: one tier',
        "auto",
        "default",
    ),
    _f("prompt_cache_key", _H, "Chat", "—", ACCEPTED, "accepted: a routing hint for OpenAI's prompt cache; no effect"),
    _f(
        "prompt_cache_retention",
        _H,
        "Chat",
        "—",
        ACCEPTED,
        "accepted: how long OpenAI keeps a cached prompt; no effect",
    ),
    _f(
        "safety_identifier",
        _H,
        "Chat",
        "—",
        ACCEPTED,
        "accepted: an end-user id for OpenAI's safety monitoring; no effect",
    ),
    # -- vLLM's extra sampling parameters ------------------------------------------------------
    _f("top_k", _BOTH, "—", "yes", HONOURED, f"{PARAMETERS['top_k'].meaning}; 0 and -1 mean off (vLLM's)"),
    _sampling("min_p", openai=False),
    _sampling("repetition_penalty", openai=False),
    _sampling("min_tokens", openai=False),
    _sampling("stop_token_ids", openai=False, extra="`stop_reason` names the id"),
    _sampling("ignore_eos", openai=False),
    _sampling("include_stop_str_in_output", openai=False),
    _sampling("skip_special_tokens", openai=False),
    _sampling("prompt_logprobs", openai=False, extra="`prompt_logprobs` in vLLM's shape; not streamed"),
    _f("use_beam_search", _BOTH, "—", "yes", REFUSED, "`false` accepted; refused: no beam search", False),
    _f("length_penalty", _BOTH, "—", "yes", REFUSED, "`1` accepted; refused: beam search only", 1, 1.0),
    _f(
        "typical_p",
        _BOTH,
        "—",
        "—",
        REFUSED,
        "`1` accepted; refused: locally typical sampling is not implemented (use `min_p` or `top_p`)",
        1,
        1.0,
    ),
    _f("watermarking", _BOTH, "—", "yes", REFUSED, "`false` accepted; refused: no watermarking", False),
    _f(
        "spaces_between_special_tokens",
        _BOTH,
        "—",
        "yes",
        ACCEPTED,
        "accepted: a slow tokenizer's option; the "
        "export's fast tokenizer decodes the same either way (as vLLM's fast detokenizer)",
    ),
    _f(
        "truncate_prompt_tokens",
        _BOTH,
        "—",
        "yes",
        HONOURED,
        "keep k tokens of the prompt (-1: as many as the context takes); which ones: `truncation_side`",
    ),
    _f("truncation_side", _BOTH, "—", "yes", HONOURED, "`left` (default: the last k tokens) or `right` (the first k)"),
    _f("allowed_token_ids", _BOTH, "—", "yes", REFUSED, "refused: not implemented (use `logit_bias`)"),
    _f("bad_words", _BOTH, "—", "yes", REFUSED, "`[]` accepted; refused: not implemented", []),
    _f("logprob_token_ids", _BOTH, "—", "yes", REFUSED, "refused: not implemented (use `logprobs`)"),
    _f(
        "add_special_tokens",
        _BOTH,
        "—",
        "yes",
        HONOURED,
        "add the tokenizer's special tokens (BOS) to the "
        "prompt (Completions default true; Chat default false: the template holds them)",
    ),
    _f("prompt_embeds", _C, "—", "yes", REFUSED, "refused: prompts are text or token ids"),
    _f("priority", _BOTH, "—", "yes", REFUSED, "`0` accepted; refused: no priority scheduling", 0),
    _f("request_id", _BOTH, "—", "yes", HONOURED, "the answer's `id` is `cmpl-` (chat: `chatcmpl-`) and it"),
    _f("session_id", _BOTH, "—", "yes", ACCEPTED, "accepted: a routing hint; no effect"),
    _f(
        "cache_salt",
        _BOTH,
        "—",
        "yes",
        ACCEPTED,
        "accepted: no cache is shared between requests here, so there is nothing to salt",
    ),
    _f("return_tokens_as_token_ids", _BOTH, "—", "yes", HONOURED, "logprobs name tokens `token_id:N`"),
    _f(
        "return_token_ids",
        _BOTH,
        "—",
        "yes",
        HONOURED,
        "`token_ids` per choice (each chunk's new ones), `prompt_token_ids` (a stream's first chunk)",
    ),
    _f(
        "return_token_offsets",
        _BOTH,
        "—",
        "render only",
        ACCEPTED,
        "accepted: vLLM answers it on its render endpoints only and ignores it here too",
    ),
    _f("return_mm_kwargs", _BOTH, "—", "render only", ACCEPTED, "accepted: as `return_token_offsets`"),
    _f("routed_experts_prompt_start", _BOTH, "—", "yes", REFUSED, "`0` accepted; refused: no expert routing data", 0),
    _f("kv_transfer_params", _BOTH, "—", "yes", REFUSED, "refused: no disaggregated serving"),
    _f("ec_transfer_params", _BOTH, "—", "yes", REFUSED, "refused: no disaggregated serving"),
    _f("vllm_xargs", _BOTH, "—", "yes", REFUSED, "refused: vLLM's plug-in arguments"),
    _f("repetition_detection", _BOTH, "—", "yes", REFUSED, "refused: not implemented"),
    _f("thinking_token_budget", _BOTH, "—", "yes", REFUSED, "refused: no reasoning models"),
    _f("stream_interval", _BOTH, "—", "yes", REFUSED, "`1` accepted; refused: every token is sent as it comes", 1),
    _f(
        "structured_outputs",
        _BOTH,
        "—",
        "yes",
        STRUCTURED,
        "one of `json` (a JSON schema), `regex`, `choice`, `grammar` (Lark or GBNF), `json_object`; "
        "`disable_fallback`, `disable_any_whitespace` accepted (output is compact JSON and never falls back); "
        "`disable_additional_properties: true`, `whitespace_pattern`, `structural_tag`: 400",
    ),
    _f("guided_json", _BOTH, "—", "<= 0.10", STRUCTURED, "a JSON schema: the output is JSON valid against it"),
    _f("guided_regex", _BOTH, "—", "<= 0.10", STRUCTURED, "the output matches the regex (Rust regex syntax)"),
    _f("guided_choice", _BOTH, "—", "<= 0.10", STRUCTURED, "the output is one of the strings"),
    _f("guided_grammar", _BOTH, "—", "<= 0.10", STRUCTURED, "a Lark (llguidance's) or GBNF grammar"),
    _f(
        "guided_decoding_backend",
        _BOTH,
        "—",
        "<= 0.10",
        REFUSED,
        '`"auto"`, `"guidance"` and `"llguidance"` accepted; refused: the one engine is llguidance',
        "auto",
        "guidance",
        "llguidance",
    ),
    _f(
        "guided_whitespace_pattern",
        _BOTH,
        "—",
        "<= 0.10",
        REFUSED,
        "refused: JSON is written compact (a schema's own `x-guidance` options can change it)",
    ),
    _f("structural_tag", _BOTH, "—", "<= 0.10", REFUSED, "refused: structural tags are not implemented"),
    # -- vLLM's chat-only extras -----------------------------------------------------------
    _f("add_generation_prompt", _H, "—", "yes", HONOURED, "the template's assistant header (default true)"),
    _f(
        "continue_final_message",
        _H,
        "—",
        "yes",
        HONOURED,
        "the last message left open for the model to "
        "continue, as transformers' `apply_chat_template` (needs `add_generation_prompt: false`)",
    ),
    _f("chat_template_kwargs", _H, "—", "yes", HONOURED, "variables for the chat template"),
    _f("documents", _H, "—", "yes", HONOURED, "the template's `documents` variable (RAG templates)"),
    _f(
        "chat_template",
        _H,
        "—",
        "opt-in",
        REFUSED,
        "refused: a request may not bring its own template (vLLM needs --trust-request-chat-template)",
    ),
    _f("media_io_kwargs", _H, "—", "yes", REFUSED, "refused: text only"),
    _f("mm_processor_kwargs", _H, "—", "yes", REFUSED, "refused: text only"),
    _f("include_reasoning", _H, "—", "yes", REFUSED, "`true` accepted; refused: no reasoning parser", True),
    _f("return_prompt_text", _H, "—", "yes", REFUSED, "`false` accepted; refused: not implemented", False),
]

#: Every field either API takes, by name.
FIELDS: dict[str, Field] = {f.name: f for f in _FIELDS}
#: The structured output and tool calling fields (:func:`structured_output`, :func:`tool_fields`).
STRUCTURED_FIELDS: frozenset[str] = frozenset(f.name for f in _FIELDS if f.handling == STRUCTURED)
#: OpenAI's tool calling fields: only chat takes them (a reply's calls are parsed from a chat turn).
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
#: The fields that name one constraint, and the :class:`SamplingParams` field each sets.
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# structured_outputs' options: the values that ask for what ortbatch does anyway
_OUTPUT_OPTIONS = {
    "disable_fallback": (True, False),  # nothing ever falls back
    "disable_any_whitespace": (True, False),  # JSON is compact: it has no whitespace to disable, and may have none
    "disable_additional_properties": (False,),
    "whitespace_pattern": (),
    "structural_tag": (),
}
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _neutral(value: Any, neutral: Iterable[Any]) -> bool:
    # type-strict: True == 1 and 0 == False must not pass for one another
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


def _bad(name: str, message: str) -> InvalidInputError:
    return InvalidInputError(f"'{name}' {message}", input_name=name)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Constrained:
    """What a request's structured-output field asks for: ``kind``, the
    :class:`~ortbatch.generation.sampling.SamplingParams` field it sets (``json_schema``,
    ``json_object``, ``regex``, ``choice`` or ``grammar``), its ``value``, and ``field``, the
    field as the client sent it (``response_format.json_schema.schema``): errors name it."""

    kind: str
    value: Any
    field: str

    def renamed(self, exc: InvalidInputError) -> InvalidInputError:
        """``exc`` in the client's words (raise it ``from exc``): SamplingParams and the grammar
        compiler call the constraint :attr:`kind`, the client sent :attr:`field`."""
        named = self.field if exc.input_name == self.kind else exc.input_name
        return InvalidInputError(str(exc).replace(self.kind, self.field, 1), input_name=named)


def _response_format(value: Any) -> Constrained | None:
    """OpenAI's ``response_format``: ``text`` (nothing), ``json_object``, ``json_schema``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad("response_format", f'must be an object such as {{"type": "json_object"}}, got {_shown(value)}')
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(str(kind))
    if allowed is None:
        raise _bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {_shown(kind)}")
    _known(value, allowed, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constrained("json_object", True, "response_format")
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, Mapping):
        raise _bad(where, 'must be an object: {"name": ..., "schema": {...}, "strict": true}')
    _known(spec, {"name", "description", "schema", "strict"}, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise _bad(f"{where}.name", f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {_shown(name)}")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _bad(f"{where}.description", "must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad(f"{where}.strict", f"must be true or false, got {_shown(spec['strict'])}")
    if spec.get("schema") is None:
        raise _bad(f"{where}.schema", "is required: the JSON schema the reply follows")
    # strict or not, the schema is enforced by the grammar: strict's promise, kept either way
    return Constrained("json_schema", spec["schema"], f"{where}.schema")


def _structured_outputs(value: Any) -> Constrained | None:
    """vLLM's ``structured_outputs``: one constraint and options ortbatch's output already meets."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad("structured_outputs", f'must be an object such as {{"json": {{...}}}}, got {_shown(value)}')
    _known(value, set(_OUTPUTS) | set(_OUTPUT_OPTIONS), "structured_outputs")
    for option, neutral in _OUTPUT_OPTIONS.items():
        if not _neutral(value.get(option), neutral):
            raise _bad(
                f"structured_outputs.{option}",
                f"is not supported: {_shown(value[option])} asks for what this server does not do "
                "(JSON is compact, never falls back, and follows the schema's own additionalProperties)",
            )
    found = [
        Constrained(kind, value[key], f"structured_outputs.{key}")
        for key, kind in _OUTPUTS.items()
        if value.get(key) is not None and value.get(key) is not False
    ]
    if len(found) > 1:
        raise _bad(found[1].field, f"cannot be combined with '{found[0].field}': one constraint per request")
    if not found:
        raise _bad("structured_outputs", f"must hold one of {', '.join(_OUTPUTS)}")
    return found[0]


def _known(value: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    unknown = sorted(str(k) for k in set(value) - set(allowed))
    if unknown:
        raise InvalidInputError(f"Unrecognized request argument supplied: {where}.{unknown[0][:40]}", input_name=where)


def structured_output(doc: Mapping[str, Any]) -> Constrained | None:
    """The constraint a request's fields ask for (``None``: free text): OpenAI's
    ``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar`` and ``structured_outputs``, each mapped to one
    :class:`~ortbatch.generation.sampling.SamplingParams` field. Raises
    :class:`InvalidInputError` naming the field for a malformed value or for two constraints
    at once; the constraint's own value is checked (and compiled) later, by SamplingParams and
    the grammar compiler, whose errors :meth:`Constrained.renamed` gives the client's name."""
    found = [
        c
        for c in (
            _response_format(doc.get("response_format")),
            *(Constrained(kind, doc[name], name) for name, kind in _GUIDED.items() if doc.get(name) is not None),
            _structured_outputs(doc.get("structured_outputs")),
        )
        if c is not None
    ]
    if len(found) > 1:
        raise _bad(found[1].field, f"cannot be combined with '{found[0].field}': one constraint per request")
    return found[0] if found else None


def tool_fields(doc: Mapping[str, Any], api: str) -> tuple[Any, Any, Any]:
    """``tools`` (``None`` when absent or ``[]``), ``tool_choice`` and ``parallel_tool_calls`` as
    sent, for :meth:`~ortbatch.generation.tools.ToolRequest.from_openai`; only chat takes them
    (a value that asks for something on Completions is a 400 naming it)."""
    if api != CHAT:
        for name in TOOL_FIELDS:
            if not _neutral(doc.get(name), FIELDS[name].neutral):
                raise _bad(name, "is only taken by /v1/chat/completions: tool calls are parsed from a chat reply")
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"must be true or false, got {_shown(parallel)}")
    tools = doc.get("tools")
    return (None if isinstance(tools, list) and not tools else tools), doc.get("tool_choice"), parallel


class ParameterPolicy:
    """Checks a request's fields against :data:`FIELDS` for one API. ``lenient``: a field in
    no row is accepted (and ignored), logged once per name, instead of a 400."""

    def __init__(self, lenient: bool = False) -> None:
        self.lenient = lenient
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, doc: Mapping[str, Any], api: str) -> None:
        """Raise :class:`InvalidInputError` naming the first field refused: unknown (as OpenAI
        says it), or refused with its reason. The structured fields are mapped (and their
        values checked) by :func:`structured_output` and :func:`tool_fields`."""
        for name in doc:
            field = FIELDS.get(name)
            if field is None or api not in field.apis:
                self.unknown(str(name))
        for name, value in doc.items():
            field = FIELDS.get(name)
            if field is not None and field.handling == REFUSED and not _neutral(value, field.neutral):
                reason = field.note.split("refused: ", 1)[-1]
                raise InvalidInputError(f"'{name}' is not supported: {reason}", input_name=name)

    def unknown(self, name: str) -> None:
        """A field no API defines here: a 400 naming it, or (lenient) logged once per name."""
        if not self.lenient:
            raise InvalidInputError(f"Unrecognized request argument supplied: {name}", input_name=name)
        with self._lock:
            first = name not in self._logged
            self._logged.add(name)
        if first:
            log.warning("ignoring the unrecognized request field %r (--lenient-params; logged once)", name[:80])


def parameter_table() -> str:
    """docs/serving.md's table of every field: field, OpenAI, vLLM, ortbatch."""
    lines = ["| field | OpenAI | vLLM | ortbatch |", "|---|---|---|---|"]
    for f in sorted(_FIELDS, key=lambda f: (f.openai == "—", f.name)):
        said = f.handling == REFUSED or f.note.startswith(ACCEPTED)  # the note names its handling itself
        handling = HONOURED if f.handling == STRUCTURED else f.handling
        lines.append(f"| `{f.name}` | {f.openai} | {f.vllm} | {f.note if said else f'{handling}: {f.note}'} |")
    return "\n".join(lines) + "\n"
