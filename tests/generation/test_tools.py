"""Tool calling (issue 29): rendering through the chat template, forcing, parsing, streaming.

Rendering is compared with transformers' ``apply_chat_template(tools=...)`` on the same
template; parsed calls and streamed deltas are validated by the openai client's own types;
forced calls on a tiny random GPT-2 are validated against each tool's schema by ``jsonschema``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from ortbatch import BatchedGenerator
from ortbatch.errors import InvalidInputError
from ortbatch.generation import SamplingParams
from ortbatch.generation.chat import ChatTemplate
from ortbatch.generation.tools import (
    MessageDelta,
    ToolRequest,
    detect_format,
    template_messages,
)

from .conftest import TinyModel
from .tool_templates import HERMES, LLAMA3, PLAIN, XML_CALLS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("jinja2")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 4},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "now",
        "description": "The time.",
        "parameters": {
            "$defs": {"zone": {"enum": ["UTC", "CET"]}},
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, CLOCK]

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Oslo, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": '{"zone": "CET"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def _hf_tokenizer(tiny_gpt2: TinyModel, template: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2.source)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("source", [HERMES, LLAMA3], ids=["hermes", "llama3"])
@pytest.mark.parametrize(
    ("messages", "tools"),
    [
        (CONVERSATION[:2], TOOLS),
        (CONVERSATION[1:2], [WEATHER, NOARGS]),
        (CONVERSATION, TOOLS),
        (CONVERSATION[:2], None),
    ],
    ids=["first-turn", "no-system", "follow-up", "no-tools"],
)
def test_rendering_matches_transformers(
    tiny_gpt2: TinyModel, source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    hf = _hf_tokenizer(tiny_gpt2, source)
    template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    converted = template_messages(messages)
    expected = hf.apply_chat_template(converted, tools=tools, tokenize=False, add_generation_prompt=True)
    assert template.render(converted, tools=tools) == expected
    if tools is not None:
        request = ToolRequest.from_openai(tools, "auto", template=template)
        assert request is not None and request.render(template, messages) == expected
    assert "Oslo" in expected


def test_formats_are_read_from_the_template() -> None:
    assert detect_format(HERMES) == "hermes"
    assert detect_format(ChatTemplate(LLAMA3)) == "llama3_json"
    assert detect_format(PLAIN) is None and detect_format(XML_CALLS) is None
    assert ToolRequest.from_openai(None, template=None) is None
    with pytest.raises(InvalidInputError) as info:
        ToolRequest.from_openai(TOOLS, template=ChatTemplate(PLAIN))
    assert info.value.input_name == "tools" and "does not show the model tools" in str(info.value)
    with pytest.raises(InvalidInputError) as info:
        ToolRequest.from_openai(TOOLS, template=ChatTemplate(XML_CALLS))
    assert info.value.input_name == "tools" and "hermes" in str(info.value)
    # the format can be named when the template does not say it; "none" needs no parser
    assert ToolRequest.from_openai(TOOLS, template=ChatTemplate(XML_CALLS), tool_format="hermes") is not None
    assert ToolRequest.from_openai(TOOLS, "none", template=ChatTemplate(XML_CALLS)) is not None


HERMES_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "now"}\n</tool_call>'
)
LLAMA3_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Ås \\"x\\"", "unit": "F"}}; '
    '{"name": "now", "parameters": {}}'
)


def _request(source: str, choice: Any = "auto", parallel: Any = None) -> ToolRequest:
    request = ToolRequest.from_openai(TOOLS, choice, parallel, template=ChatTemplate(source))
    assert request is not None
    return request


def test_parsing_each_format() -> None:
    from openai.types.chat import ChatCompletionMessageToolCall

    hermes = _request(HERMES).parse(HERMES_TEXT)
    assert hermes.content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in hermes.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}),
        ("now", {"zone": "CET"}),
    ]
    assert hermes.finish_reason("stop") == "tool_calls" and hermes.finish_reason("length") == "length"
    for call in hermes.tool_calls:
        typed = ChatCompletionMessageToolCall.model_validate(call.to_openai())
        assert typed.function.name == call.name and typed.id.startswith("call_")
    assert len({c.id for c in hermes.tool_calls}) == 2

    llama = _request(LLAMA3).parse(LLAMA3_TEXT)
    assert llama.content is None
    assert [(c.name, json.loads(c.arguments)) for c in llama.tool_calls] == [
        ("get_weather", {"city": 'Ås "x"', "unit": "F"}),
        ("now", {}),
    ]
    assert llama.tool_calls[0].arguments == '{"city": "Ås \\"x\\"", "unit": "F"}'  # as the model wrote it

    assert _request(HERMES, parallel=False).parse(HERMES_TEXT).tool_calls[0].name == "get_weather"
    assert len(_request(HERMES, parallel=False).parse(HERMES_TEXT).tool_calls) == 1
    for words in ("Sunny, 20 degrees.", "a { brace", ""):
        for source in (HERMES, LLAMA3):
            message = _request(source).parse(words)
            assert message.tool_calls == () and message.content == (words or None)
            assert message.finish_reason("stop") == "stop"
    assert _request(HERMES, "none").parse(HERMES_TEXT).content == HERMES_TEXT


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "now", "arguments": {"zone": 5}\n</tool_call>',  # object never closed
        '<tool_call>\n{"name": "now"}\n</tool_call>',  # no arguments
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "now", "arguments": [1]}\n</tool_call>',  # arguments not an object
    ],
)
def test_a_malformed_call_is_content(text: str) -> None:
    message = _request(HERMES).parse(text)
    assert message.tool_calls == () and message.content == text


def _reassemble(request: ToolRequest, text: str, pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[Any]]:
    from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

    parser = request.stream_parser()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = ""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if delta is None:
            continue
        assert isinstance(delta, MessageDelta)
        content += delta.content or ""
        for d in delta.tool_calls:
            typed = ChoiceDeltaToolCall.model_validate(d.to_openai())
            if d.id is not None:  # a call begins: its id and whole name first, as OpenAI streams
                assert typed.index == len(calls) and d.name
                calls.append({"id": d.id, "name": d.name, "arguments": ""})
            else:
                assert d.name is None and typed.index < len(calls)
            calls[typed.index]["arguments"] += d.arguments or ""
    return content, calls, deltas


@pytest.mark.parametrize(
    ("source", "text"),
    [
        (HERMES, HERMES_TEXT),
        (LLAMA3, LLAMA3_TEXT),
        (HERMES, "Just words <tool"),
        (LLAMA3, "  plain words {x}"),
        # cut (max_tokens) or malformed before a call's name is whole: parse gives the text as content
        (LLAMA3, '{"nam'),
        (LLAMA3, '<|python_tag|>{"name": "no'),
        (HERMES, 'Sure<tool_call>\n{"na'),
        (HERMES, "Sure<tool_call>\nnot json</tool_call>"),
    ],
)
def test_streamed_deltas_reassemble_to_the_parsed_calls(source: str, text: str) -> None:
    request = _request(source)
    whole = request.parse(text)
    rng = random.Random(7)
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        if trial == 0:
            cuts = list(range(1, len(text)))  # one character at a time
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, calls, _ = _reassemble(request, text, pieces)
        assert content == (whole.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_streamed_content_never_shows_a_call_marker() -> None:
    text = 'Checking<tool_call>\n{"name": "now", "arguments": {"zone": "UTC"}}\n</tool_call>'
    _, _, deltas = _reassemble(_request(HERMES), text, list(text))
    assert "".join(d.content or "" for d in deltas if d is not None) == "Checking"


# -- on a model ----------------------------------------------------------------------------------
def _schema_of(name: str) -> dict[str, Any]:
    return next(t["function"].get("parameters", {}) for t in [*TOOLS, NOARGS] if t["function"]["name"] == name)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
@pytest.mark.parametrize(
    ("choice", "parallel"),
    [("required", False), ("required", True), ({"type": "function", "function": {"name": "now"}}, None)],
    ids=["required", "required-parallel", "named"],
)
def test_forced_calls_validate_and_stream_the_same(
    tool_exports: dict[str, Path], fmt: str, choice: Any, parallel: Any
) -> None:
    template = ChatTemplate.from_export(tool_exports[fmt])
    assert template is not None
    request = ToolRequest.from_openai(TOOLS, choice, parallel, template=template)
    assert request is not None
    with BatchedGenerator(tool_exports[fmt], max_batch_size=8) as gen:
        request.check(gen.grammars)
        prompt = gen.encode(request.render(template, CONVERSATION[:2]), add_special_tokens=False)
        counts = []
        for seed in range(4):
            params = request.apply(SamplingParams(temperature=1.0, seed=seed, max_new_tokens=300))
            pieces: list[str] = []
            done = gen.submit(prompt, params=params, on_token=lambda t, into=pieces: into.append(t.text)).result()
            assert done.finish_reason == "stop", done.text
            message = request.parse(done.text)
            # a named function's call finishes with "stop", as OpenAI and vLLM answer it
            called = "stop" if isinstance(choice, dict) else "tool_calls"
            assert message.tool_calls and message.finish_reason(done.finish_reason) == called, done.text
            if choice != "required" or parallel is False:
                assert len(message.tool_calls) == 1
            for call in message.tool_calls:
                assert choice == "required" or call.name == "now"
                jsonschema.validate(json.loads(call.arguments), _schema_of(call.name))
            content, calls, _ = _reassemble(request, done.text, pieces)
            assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in message.tool_calls]
            assert content == (message.content or "")
            counts.append(len(message.tool_calls))
    if fmt == "hermes" and parallel:
        assert max(counts) > 1  # parallel calls do come (these seeds give 1, 2 and 3)


@pytest.mark.slow
def test_a_two_turn_tool_conversation_renders_and_continues(tool_exports: dict[str, Path]) -> None:
    template = ChatTemplate.from_export(tool_exports["hermes"])
    assert template is not None
    request = ToolRequest.from_openai(TOOLS, "auto", template=template)
    assert request is not None
    with BatchedGenerator(tool_exports["hermes"], max_batch_size=4) as gen:
        prompt = request.render(template, CONVERSATION)
        assert "<tool_response>\n12:00\n</tool_response>" in prompt
        assert '"arguments": {"city": "Oslo", "unit": "C"}' in prompt
        out = gen.generate(gen.encode(prompt, False), params=request.apply(SamplingParams(max_new_tokens=16)))
        assert out.completion_tokens > 0
        message = request.parse(out.text)
        assert message.content is not None or message.tool_calls


BAD_TOOLS: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"name": "now"}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_format": "xml"}, "tool_format"),
]
BAD_PARAMETERS: list[tuple[dict[str, Any], str]] = [
    ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "unknown type"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}, "dangling $ref"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}, "bad pattern"),
    ({"type": "object", "not": {"required": ["a"]}}, "unsupported keyword"),
]


@pytest.mark.parametrize(("fields", "named"), BAD_TOOLS)
def test_bad_tool_definitions_name_the_field(fields: dict[str, Any], named: str) -> None:
    fields = dict(fields)
    with pytest.raises(InvalidInputError) as info:
        ToolRequest.from_openai(
            fields.pop("tools"),
            fields.pop("tool_choice", None),
            fields.pop("parallel_tool_calls", None),
            template=ChatTemplate(HERMES),
            **fields,
        )
    assert info.value.input_name == named
    assert named in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize(("parameters", "why"), BAD_PARAMETERS, ids=[b[1] for b in BAD_PARAMETERS])
def test_bad_parameter_schemas_are_refused_before_anything_runs(
    tool_exports: dict[str, Path], parameters: dict[str, Any], why: str
) -> None:
    tools = [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    template = ChatTemplate(HERMES)
    with BatchedGenerator(tool_exports["hermes"], max_batch_size=2) as gen:
        for choice in ("auto", "required"):
            request = ToolRequest.from_openai(tools, choice, template=template)
            assert request is not None
            with pytest.raises(InvalidInputError) as info:
                request.check(gen.grammars)
            assert info.value.input_name == "tools[1].function.parameters", why
        assert gen.stats().submitted == 0


def test_a_forced_call_cannot_also_follow_a_schema() -> None:
    request = _request(HERMES, "required")
    with pytest.raises(InvalidInputError) as info:
        request.apply(SamplingParams(json_schema={"type": "object"}))
    assert info.value.input_name == "tool_choice"
    assert request.apply(SamplingParams()).grammar is not None
    assert _request(HERMES).apply(SamplingParams()).grammar is None  # auto: free text
    assert _request(HERMES, "none").apply(SamplingParams()) == SamplingParams()


def test_assistant_arguments_must_be_json() -> None:
    bad = [
        CONVERSATION[1],
        {**CONVERSATION[2], "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": "{zone"}}]},
    ]
    with pytest.raises(InvalidInputError) as info:
        template_messages(bad)
    assert info.value.input_name == "messages[1].tool_calls[0].function.arguments"
