"""Tool calling, transport-free: the tools a request offers, how the model is shown them, how a
call is forced, and how the model's text becomes OpenAI tool calls (whole or streamed).

One request's tools are a :class:`ToolRequest`, built from OpenAI's fields by
:meth:`ToolRequest.from_openai` (``tools``, ``tool_choice``, ``parallel_tool_calls``) against
the export's :class:`~.chat.ChatTemplate`:

- **rendering**: the template's ``tools`` variable gets the tools as sent
  (``[{"type": "function", "function": {...}}]``), as transformers' ``apply_chat_template(
  tools=...)`` passes them; :func:`template_messages` turns the conversation's assistant
  ``tool_calls`` (whose ``arguments`` OpenAI sends as JSON text) into the objects templates
  read, as vLLM does, so a follow-up turn with ``role: "tool"`` results renders;
- **forcing**: with ``tool_choice`` ``"required"`` or a named function, :meth:`ToolRequest.apply`
  adds a grammar (:class:`~.sampling.SamplingParams` ``grammar``) that admits only calls in
  the model's format whose arguments match each tool's ``parameters`` schema;
- **parsing**: :meth:`ToolRequest.parse` splits a completion's text into content and
  :class:`ToolCall` s; :meth:`ToolRequest.stream_parser` does the same incrementally, giving
  the :class:`MessageDelta` s OpenAI streams (a call's id and name first, then its arguments in
  pieces). The streamed pieces join into the same calls :meth:`~ToolRequest.parse` returns.

The format is the template's: :func:`detect_format` reads the template's source
(:data:`FORMATS`):

- ``hermes``: the template mentions ``<tool_call>``; the model writes
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call
  (Hermes 2 Pro, Qwen 2.5 and many fine-tunes);
- ``llama3_json``: the template mentions ``<|python_tag|>``; the model's whole answer is
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too), several joined by
  ``"; "``, optionally after ``<|python_tag|>`` (Llama 3.1-3.3's JSON tool calling).

A call's ``arguments`` is the JSON text of the arguments object exactly as the model wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInputError
from .chat import ChatTemplate
from .constrained import MAX_JSON_DEPTH, Constraint, GrammarCompiler, json_depth
from .sampling import SamplingParams

__all__ = [
    "FORMATS",
    "MessageDelta",
    "ParsedMessage",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolRequest",
    "ToolStreamParser",
    "detect_format",
    "template_messages",
]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
#: How forced calls lay out their JSON: as the templates' ``tojson`` (json.dumps) writes it.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# -- what a request sends ---------------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and parameters' JSON schema."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(_EMPTY_PARAMETERS))
    #: The tool as sent (what the chat template's ``tools`` variable holds).
    spec: Mapping[str, Any] = field(default_factory=dict, compare=False)


def _bad(name: str, message: str) -> InvalidInputError:
    return InvalidInputError(f"{name}: {message}", input_name=name)


def _parse_tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping):
        raise _bad(where, f"must be an object, got {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise _bad(f"{where}.type", f"only 'function' tools are supported, got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise _bad(f"{where}.function", "must be an object with the function's name and parameters")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{where}.function.name", f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description", "must be a string")
    parameters = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(parameters, Mapping):
        raise _bad(f"{where}.function.parameters", f"must be a JSON schema object, got {type(parameters).__name__}")
    if parameters.get("type", "object") != "object":
        raise _bad(f"{where}.function.parameters", f"must describe an object, got type {parameters.get('type')!r}")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.function.strict", "must be a bool")
    if json_depth(parameters) > MAX_JSON_DEPTH:
        raise _bad(f"{where}.function.parameters", f"is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    try:
        json.dumps(parameters, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _bad(f"{where}.function.parameters", f"is not JSON: {exc}") from exc
    spec = {"type": "function", "function": dict(fn)}
    return Tool(name, description, dict(parameters), spec)


def _parse_tools(tools: Any) -> tuple[Tool, ...]:
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise _bad("tools", f"must be a list of tools, got {type(tools).__name__}")
    if not tools:
        raise _bad("tools", "must hold at least one tool")
    parsed = tuple(_parse_tool(i, t) for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, t in enumerate(parsed):
        if t.name in seen:
            raise _bad(f"tools[{i}].function.name", f"{t.name!r} is given twice")
        seen.add(t.name)
    return parsed


def _parse_choice(choice: Any, tools: Sequence[Tool]) -> tuple[str, str | None]:
    """``(mode, function name)``: mode ``auto``, ``none``, ``required`` or ``function``."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad("tool_choice", f"must be 'auto', 'none', 'required' or a named function, got {choice!r}")
        return choice, None
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or not isinstance(name, str):
        raise _bad(
            "tool_choice", f'a named choice is {{"type": "function", "function": {{"name": ...}}}}, got {choice!r}'
        )
    if name not in {t.name for t in tools}:
        raise _bad("tool_choice", f"names function {name!r}, which is not among the tools")
    return "function", name


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat templates read them: each assistant ``tool_calls``
    entry's ``function.arguments`` (JSON text in OpenAI's format) becomes the object it
    encodes (templates write it with ``tojson``; vLLM converts it the same way). A message
    that is not an object, or arguments that are not a JSON object, are an
    :class:`InvalidInputError` naming ``messages[i]...``."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise _bad(f"messages[{i}]", f"must be an object, got {type(message).__name__}")
        m = dict(message)
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
                raise _bad(f"messages[{i}].tool_calls", "must be a list")
            m["tool_calls"] = [_template_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
        out.append(m)
    return out


#: tool-call arguments whose JSON nests past Python's recursion limit
_TOO_DEEP = object()


def _template_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise _bad(where, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
    fn = dict(call["function"])
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except RecursionError:
            args = _TOO_DEEP  # refused below
        except ValueError as exc:
            raise _bad(f"{where}.function.arguments", f"is not JSON: {exc}") from exc
        if args is _TOO_DEEP or json_depth(args) > MAX_JSON_DEPTH:
            raise _bad(f"{where}.function.arguments", f"is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    if not isinstance(args, Mapping):
        raise _bad(f"{where}.function.arguments", "must be a JSON object")
    fn["arguments"] = dict(args)
    return {**call, "function": fn}


# -- what the model answers ----------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's ``{"id", "type": "function", "function": {"name",
    "arguments"}}``; ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    """A completion's text split into ``content`` (``None`` when there is none) and its calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    #: the finish reason of a call made: ``"stop"`` when ``tool_choice`` named the function, as
    #: OpenAI (and vLLM) answer it; ``"tool_calls"`` otherwise
    called_reason: str = "tool_calls"

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: :attr:`called_reason` when the model called a tool and stopped
        by itself, else the completion's own (``"length"`` stays ``"length"``)."""
        return self.called_reason if self.tool_calls and reason == "stop" else reason


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call ``index``: the first carries ``id`` and ``name`` (and
    ``arguments=""``), the next ones pieces of ``arguments``, as OpenAI streams them."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclass(frozen=True)
class MessageDelta:
    """What one piece of streamed text adds: content, and/or pieces of tool calls."""

    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


def new_call_id() -> str:
    """An id for a tool call in OpenAI's style (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


# -- reading JSON as it arrives ---------------------------------------------------------------
@dataclass
class _Value:
    start: int
    end: int | None  # None: not complete yet


@dataclass
class _Object:
    """A JSON object scanned in ``text`` from ``start``: its top-level values' spans, and its end."""

    fields: dict[str, _Value]
    end: int | None  # one past the closing brace; None while it is open


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """One past the string starting at ``text[i] == '"'``, or ``None`` if it is not closed yet."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """One past the JSON value starting at ``i``, or ``None`` while it is incomplete."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def _scan_object(text: str, start: int) -> _Object | None:
    """The object at ``text[start] == '{'``, as far as it has arrived (``None``: not an object)."""
    if start >= len(text) or text[start] != "{":
        return None
    obj = _Object({}, None)
    i = _skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            obj.end = i + 1
            return obj
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        key_end = _string_end(text, i) if text[i] == '"' else None
        if key_end is None:
            return obj
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return obj
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return obj
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return obj
        end = _value_end(text, i)
        obj.fields[key] = _Value(i, end)
        if end is None:
            return obj
        i = _skip_ws(text, end)
    return obj


@dataclass
class _CallState:
    """A call as far as its text has arrived: its name (once complete) and its arguments' text."""

    name: str | None
    arguments: str
    complete: bool  # the call's JSON object is closed
    valid: bool  # ... and holds a name and an arguments object


def _call_state(text: str, start: int, argument_keys: Sequence[str]) -> tuple[_CallState | None, int | None]:
    """The call whose object starts at ``start``; and one past its end (``None`` while open)."""
    obj = _scan_object(text, start)
    if obj is None:
        return None, None
    name: str | None = None
    named = obj.fields.get("name")
    if named is not None and named.end is not None:
        try:
            value = json.loads(text[named.start : named.end])
            name = value if isinstance(value, str) else None
        except ValueError:
            name = None
    args = next((obj.fields[k] for k in argument_keys if k in obj.fields), None)
    arguments = "" if args is None else text[args.start : len(text) if args.end is None else args.end]
    valid = False
    if obj.end is not None and name is not None and args is not None and args.end is not None:
        try:
            valid = isinstance(json.loads(arguments), dict) and isinstance(json.loads(text[start : obj.end]), dict)
        except ValueError:
            valid = False
    return _CallState(name, arguments, obj.end is not None, valid), obj.end


# -- the formats --------------------------------------------------------------------------------
class _Format:
    """How one family of chat templates lays out tool calls."""

    name = ""
    marker = ""  # what in a template's source says it uses this format
    argument_key = "arguments"

    def split(self, text: str, final: bool) -> tuple[str, list[_CallState]]:
        """The content and the calls in ``text`` so far; content that could still turn out to
        be the start of a call is held back unless ``final``."""
        raise NotImplementedError

    def call_rule(self) -> str:
        """The Lark rule that lays out one call, around ``head`` (name) and ``args`` (arguments)."""
        raise NotImplementedError

    def separator(self) -> str:
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with ``%json`` schemas) admitting only calls of ``tools``."""
        alternatives = []
        rules = []
        for k, tool in enumerate(tools):
            head = json.dumps(f'{{"name": {json.dumps(tool.name)}, "{self.argument_key}": ')
            alternatives.append(f'{head} args_{k} "}}"')
            schema = {**tool.parameters, "x-guidance": _JSON_STYLE}
            rules.append(f"args_{k}: %json {json.dumps(schema)}")
        body = "body: " + " | ".join(alternatives)
        more = f" ({json.dumps(self.separator())} call)*" if parallel else ""
        return "\n".join([f"start: call{more}", self.call_rule(), body, *rules])


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _Hermes(_Format):
    name = "hermes"
    marker = "<tool_call>"
    open, close = "<tool_call>", "</tool_call>"

    def call_rule(self) -> str:
        return f"call: {json.dumps(self.open + chr(10))} body {json.dumps(chr(10) + self.close)}"

    def separator(self) -> str:
        return "\n"

    def split(self, text: str, final: bool) -> tuple[str, list[_CallState]]:
        first = text.find(self.open)
        if first < 0:
            keep = 0 if final else _held_back(text, self.open)
            return text[: len(text) - keep], []
        calls: list[_CallState] = []
        at = first
        while at >= 0:
            start = _skip_ws(text, at + len(self.open))
            state, end = _call_state(text, start, ("arguments", "parameters"))
            if state is None:
                if start < len(text):  # something other than an object: a malformed call
                    calls.append(_CallState(None, "", True, False))
                break
            calls.append(state)
            if end is None:
                break
            at = text.find(self.open, end)
        return text[:first], calls


class _Llama3Json(_Format):
    name = "llama3_json"
    marker = "<|python_tag|>"
    argument_key = "parameters"

    def call_rule(self) -> str:
        return "call: body"

    def separator(self) -> str:
        return "; "

    def split(self, text: str, final: bool) -> tuple[str, list[_CallState]]:
        i = _skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or (self.marker.startswith(rest) and rest != self.marker)):
            return "", []  # not known yet whether this is a call
        if rest.startswith(self.marker):
            i = _skip_ws(text, i + len(self.marker))
            if i >= len(text):  # the tag, and the call not begun yet
                return "", []
        if i >= len(text) or text[i] != "{":
            return text, []  # an answer in words
        calls: list[_CallState] = []
        while True:
            state, end = _call_state(text, i, ("parameters", "arguments"))
            if state is None:
                break
            calls.append(state)
            if end is None:
                break
            j = _skip_ws(text, end)
            if j >= len(text) or text[j] != ";":
                break
            i = _skip_ws(text, j + 1)
            if i >= len(text):
                break
        return "", calls


#: The tool-call formats ortbatch parses, by name.
FORMATS: dict[str, _Format] = {f.name: f for f in (_Hermes(), _Llama3Json())}


def detect_format(template: ChatTemplate | str) -> str | None:
    """The tool-call format a chat template uses (a key of :data:`FORMATS`), read from its
    source: ``<tool_call>`` means ``hermes``, ``<|python_tag|>`` ``llama3_json``; ``None``
    when neither appears."""
    source = template if isinstance(template, str) else template.source
    for name, fmt in FORMATS.items():
        if fmt.marker in source:
            return name
    return None


# -- one request's tools ------------------------------------------------------------------------
class ToolStreamParser:
    """Turns a completion's text, fed as it streams, into :class:`MessageDelta` s: content
    as it becomes certain, each call's id and name once its name is complete, then its
    arguments' text as it arrives. The deltas join into what :meth:`ToolRequest.parse`
    returns for the whole text (ids aside), for every well-formed call; a call malformed or cut
    (``max_tokens``) before any call's name was streamed ends the stream with the held-back
    text as content, as :meth:`~ToolRequest.parse` gives it."""

    def __init__(self, fmt: _Format | None, parallel: bool = True, called_reason: str = "tool_calls") -> None:
        self._format = fmt
        self._parallel = parallel
        self._called_reason = called_reason
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        """Whether a tool call was streamed (then the finish reason is ``"tool_calls"``)."""
        return bool(self._ids)

    def finish_reason(self, reason: str) -> str:
        """The stream's finish reason as OpenAI gives it (see :meth:`ParsedMessage.finish_reason`)."""
        return self._called_reason if self._ids and reason == "stop" else reason

    def feed(self, text: str) -> MessageDelta | None:
        """What ``text`` (the next piece of the completion) adds, or ``None`` when nothing yet."""
        self._text += text
        return self._delta(final=False)

    def finish(self) -> MessageDelta | None:
        """What is left once the completion ended (content held back in case it began a call)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> MessageDelta | None:
        calls: list[_CallState] = []
        if self._format is None:
            content = self._text
        else:
            content, calls = self._format.split(self._text, final)
            if final and calls and not self._ids and not all(c.valid for c in calls):
                # a malformed or cut call, none of it streamed: the text is content, as parse gives it
                content, calls = self._text, []
        piece = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[ToolCallDelta] = []
        for k, call in enumerate(calls if self._parallel else calls[:1]):
            if k == len(self._ids):
                if call.name is None:
                    break  # a call's name is sent whole, first (as OpenAI does)
                self._ids.append(new_call_id())
                self._args_sent.append(len(call.arguments))
                deltas.append(ToolCallDelta(k, self._ids[k], call.name, call.arguments))
                continue
            more = call.arguments[self._args_sent[k] :]
            if more:
                self._args_sent[k] = len(call.arguments)
                deltas.append(ToolCallDelta(k, arguments=more))
        if not piece and not deltas:
            return None
        return MessageDelta(piece or None, tuple(deltas))


@dataclass(frozen=True)
class ToolRequest:
    """One request's tools, how the model must use them (``mode``: ``auto``, ``none``,
    ``required`` or ``function``, naming ``function``), whether it may call several at once,
    and the template's call ``format`` (a key of :data:`FORMATS`, ``None`` only with ``none``)."""

    tools: tuple[Tool, ...]
    mode: str = "auto"
    function: str | None = None
    parallel: bool = True
    format: str | None = None

    @classmethod
    def from_openai(
        cls,
        tools: Any,
        tool_choice: Any = None,
        parallel_tool_calls: Any = None,
        *,
        template: ChatTemplate | None,
        tool_format: str | None = None,
    ) -> ToolRequest | None:
        """From OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (``None``: not
        sent) for a model with ``template``; ``None`` when no tools were sent. ``tool_format``
        overrides the format read from the template. Raises :class:`InvalidInputError` naming
        the field for malformed tools or choices, a template that does not render tools, or
        a format ortbatch does not parse."""
        if tools is None:
            if tool_choice not in (None, "auto", "none"):
                raise _bad("tool_choice", f"{tool_choice!r} needs tools")
            return None
        parsed = _parse_tools(tools)
        mode, function = _parse_choice(tool_choice, parsed)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise _bad("parallel_tool_calls", f"must be a bool, got {parallel_tool_calls!r}")
        if template is None or not template.renders_tools:
            raise _bad("tools", "this model's chat template does not show the model tools (it has no 'tools' variable)")
        if tool_format is not None and tool_format not in FORMATS:
            raise _bad("tool_format", f"must be one of {sorted(FORMATS)}, got {tool_format!r}")
        fmt = tool_format or detect_format(template)
        if fmt is None and mode != "none":
            raise _bad("tools", f"this model's tool-call format is not one ortbatch reads ({', '.join(FORMATS)})")
        return cls(parsed, mode, function, parallel_tool_calls is not False, fmt)

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template's ``tools`` variable gets them (as sent)."""
        return [dict(t.spec) for t in self.tools]

    def render(self, template: ChatTemplate, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """The prompt: ``messages`` (OpenAI's, see :func:`template_messages`) and the tools
        through ``template``."""
        return template.render(template_messages(messages), tools=self.template_tools, **kwargs)

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools a call is forced among (``required``: all; a named function: it), or ()."""
        if self.mode == "required":
            return self.tools
        if self.mode == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return ()

    def grammar(self) -> str | None:
        """The grammar that forces a call (``None`` unless ``required`` or a named function)."""
        if not self.forced or self.format is None:
            return None
        return FORMATS[self.format].grammar(self.forced, self.parallel and self.mode == "required")

    def constraints(self) -> list[tuple[str, Constraint]]:
        """What has to compile for this request, each with the field an error names: every
        tool's parameters schema, then the forcing grammar."""
        out = [
            (f"tools[{i}].function.parameters", Constraint("json_schema", json.dumps(t.parameters)))
            for i, t in enumerate(self.tools)
        ]
        grammar = self.grammar()
        if grammar is not None:
            out.append(("tool_choice", Constraint("grammar", grammar)))
        return out

    def check(self, compiler: GrammarCompiler) -> None:
        """Compile :meth:`constraints` (cached by ``compiler``); one that does not compile is an
        :class:`InvalidInputError` naming its field (``tools[2].function.parameters``)."""
        for where, constraint in self.constraints():
            try:
                compiler.compile(constraint)
            except InvalidInputError as exc:
                message = str(exc).replace(constraint.kind, where, 1)
                raise InvalidInputError(message, input_name=where) from exc

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` for this request: special tokens kept in the text (a call's markers may be
        special tokens, as vLLM keeps them), and the forcing grammar when a call is forced."""
        if self.mode == "none":
            return params
        changes: dict[str, Any] = {"skip_special_tokens": False}
        grammar = self.grammar()
        if grammar is not None:
            if params.constraint is not None:
                raise _bad("tool_choice", f"{self.mode!r} cannot be combined with {params.constraint.kind}")
            changes["grammar"] = grammar
        return dataclasses.replace(params, **changes)

    def parse(self, text: str) -> ParsedMessage:
        """The completion's ``text`` as content and tool calls. When a call is malformed (not
        JSON, no name, arguments not an object), the whole text is content and there are no
        calls, as vLLM answers; with ``parallel_tool_calls=False`` only the first call is kept."""
        if self.mode == "none" or self.format is None:
            return ParsedMessage(text or None)
        content, calls = FORMATS[self.format].split(text, final=True)
        if not calls or not all(c.valid for c in calls):
            return ParsedMessage(text or None)
        kept = calls if self.parallel else calls[:1]
        made = tuple(ToolCall(new_call_id(), c.name or "", c.arguments) for c in kept)
        return ParsedMessage(content or None, made, self._called_reason)

    @property
    def _called_reason(self) -> str:
        return "stop" if self.mode == "function" else "tool_calls"

    def stream_parser(self) -> ToolStreamParser:
        """A parser of this request's streamed text (see :class:`ToolStreamParser`)."""
        fmt = None if self.mode == "none" or self.format is None else FORMATS[self.format]
        return ToolStreamParser(fmt, self.parallel, self._called_reason)
