"""Issue 29 over the server: structured output and tool calling through ``ortbatch serve``.

Driven by the official ``openai`` client: ``response_format`` (``json_object``, ``json_schema``),
``client.chat.completions.parse`` / ``client.beta.chat.completions.parse`` with a pydantic model,
vLLM's ``guided_*`` and ``structured_outputs`` on chat and completions, ``tools`` with every
``tool_choice`` (calls checked by ``jsonschema`` against each tool's ``parameters`` and parsed by the
client's own ``pydantic_function_tool`` helpers), streamed calls reassembled by the client's own
stream accumulator (``client.chat.completions.stream``) and equal to the whole answer for the same
seed, a two-turn tool conversation whose prompt equals transformers' ``apply_chat_template``; KServe
v2 ``generate`` and gRPC ``ModelStreamInfer`` with the same fields. Bad schemas, grammars and tool
definitions are 400s naming the field before anything reaches the generator; free rows batched
beside constrained ones still give their tokens alone. Run on an in-process server and (slow) on
``ortbatch serve NAME=DIR --frontends 2`` in a subprocess (a repository over front-end processes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

from ortbatch import BatchedGenerator
from ortbatch.errors import InvalidInputError

from .conftest import TinyModel, random_prompts
from .test_tools import CONVERSATION, TOOLS
from .tool_templates import HERMES

pytest.importorskip("starlette")
pytest.importorskip("jinja2")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

from ortbatch.serve import BackgroundServer, ServeConfig, ServedGenerator  # noqa: E402
from ortbatch.serve.served.parameters import (  # noqa: E402
    CHAT,
    COMPLETIONS,
    STRUCTURED_FIELDS,
    structured_output,
    tool_fields,
)

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Who is it? Answer in JSON."}]
PROMPT = "Once upon a time"
PERSON = {
    "$defs": {"role": {"enum": ["admin", "user", "guest"]}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"$ref": "#/$defs/role"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'
GBNF = 'root ::= "ab" [0-9] [0-9]?'


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)
    admin: bool


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=6)
    unit: Literal["C", "F"]


class Now(pydantic.BaseModel):
    """The time."""

    zone: Literal["UTC", "CET"]


STRICT_TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Now)]


# -- the servers ---------------------------------------------------------------------------------
class Watched:
    """The generator behind the server, watched: every request's tokens are seen on the scheduler
    thread in step order, so a free row's token that comes while a constrained row is between its
    first and last token shared that row's decode step."""

    def __init__(self, generator: BatchedGenerator) -> None:
        self._generator = generator
        self.open: set[int] = set()  # constrained requests seated in the batch
        self.shared: dict[tuple[int, ...], bool] = {}  # free prompt -> decoded beside a constrained row
        self._ids = iter(range(10**9))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def submit_choices(self, prompt: Any, *, params: Any, on_token: Any = None, **kw: Any) -> Any:
        key, free = next(self._ids), tuple(prompt)

        def watch(tok: Any) -> None:
            if params.constraint is not None:
                (self.open.add if tok.finish_reason is None else self.open.discard)(key)
            else:
                self.shared[free] = self.shared.get(free, False) or bool(self.open)
            if on_token is not None:
                on_token(tok)

        return self._generator.submit_choices(prompt, params=params, on_token=watch, **kw)


@dataclass
class Local:
    url: str
    grpc: str
    generator: Watched


def _local(export: Path) -> Iterator[Local]:
    gen = Watched(BatchedGenerator(export, max_batch_size=8, max_queue=64))
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")
    with BackgroundServer(ServedGenerator(gen, NAME), config) as srv:
        assert srv.grpc is not None
        yield Local(srv.url, srv.grpc.address, gen)


@pytest.fixture(scope="module")
def local(tool_exports: dict[str, Path]) -> Iterator[Local]:
    yield from _local(tool_exports["hermes"])


@pytest.fixture(scope="module")
def local_llama3(tool_exports: dict[str, Path]) -> Iterator[Local]:
    yield from _local(tool_exports["llama3"])


@pytest.fixture(scope="module")
def frontends(tool_exports: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``ortbatch serve tiny=DIR --frontends 2`` as users run it: a repository of one generation
    export served by two front-end processes over one engine."""
    log = tmp_path_factory.mktemp("structured-fe") / "serve.log"
    cmd = [sys.executable, "-m", "ortbatch.cli", "serve", f"{NAME}={tool_exports['hermes']}", "--frontends", "2"]
    cmd += ["--port", "0", "--log-level", "warning", "--no-access-log"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        yield m.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    assert code == 0, log.read_text(errors="replace")


@pytest.fixture(params=["local", pytest.param("frontends", marks=pytest.mark.slow)])
def url(request: pytest.FixtureRequest) -> str:
    """Each server the client tests run against."""
    got = request.getfixturevalue(request.param)
    return got.url if isinstance(got, Local) else str(got)


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


# -- the answers, whole or gathered from a stream --------------------------------------------------
@dataclass
class Answer:
    text: str | None
    calls: list[tuple[str, str]]
    finish_reason: str | None


def _ask(url: str, api: str, fields: dict[str, Any], stream: bool, messages: Any = None) -> list[Answer]:
    """One request through the openai client (every field in ``extra_body``): its choices."""
    c = client(url)
    if api == COMPLETIONS:
        out = c.completions.create(model=NAME, prompt=PROMPT, stream=stream, extra_body=fields)
    else:
        out = c.chat.completions.create(model=NAME, messages=messages or MESSAGES, stream=stream, extra_body=fields)
    if not stream:
        if api == COMPLETIONS:
            return [Answer(ch.text, [], ch.finish_reason) for ch in out.choices]
        return [
            Answer(
                ch.message.content,
                [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []],
                ch.finish_reason,
            )
            for ch in out.choices
        ]
    texts: dict[int, str] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    reasons: dict[int, str | None] = {}
    for chunk in out:
        for ch in chunk.choices:
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
            if api == COMPLETIONS:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
                continue
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            for t in ch.delta.tool_calls or []:
                call = calls.setdefault(ch.index, {}).setdefault(t.index, ["", ""])
                if t.id is not None:  # a call's first delta: id and whole name
                    assert t.function.name and not call[0]
                call[0] += t.function.name or ""
                call[1] += t.function.arguments or ""
    return [
        Answer(texts[i] or None, [tuple(c) for _, c in sorted(calls.get(i, {}).items())], reasons[i])  # type: ignore[misc]
        for i in sorted(texts)
    ]


def _schema_of(name: str, tools: list[dict[str, Any]] = TOOLS) -> dict[str, Any]:
    return next(t["function"].get("parameters", {}) for t in tools if t["function"]["name"] == name)


def _valid_calls(answer: Answer, tools: list[dict[str, Any]] = TOOLS, reason: str = "tool_calls") -> bool:
    for name, arguments in answer.calls:
        jsonschema.validate(json.loads(arguments), _schema_of(name, tools))
    return answer.finish_reason == reason and bool(answer.calls)


def _json(text: str | None) -> Any:
    return json.loads(text or "")


@dataclass(frozen=True)
class Case:
    """A structured field's request and what its answer must be (``check`` of each choice)."""

    fields: dict[str, Any]
    check: Callable[[Answer], bool]
    apis: tuple[str, ...] = (COMPLETIONS, CHAT)


_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
CASES: dict[str, list[Case]] = {
    "response_format": [
        Case({"response_format": {"type": "json_object"}}, lambda a: isinstance(_json(a.text), dict)),
        Case({"response_format": _SCHEMA_FORMAT}, lambda a: jsonschema.validate(_json(a.text), PERSON) is None),
        Case(  # strict or not, the schema is followed
            {"response_format": {**_SCHEMA_FORMAT, "json_schema": {"name": "p", "schema": PERSON, "strict": False}}},
            lambda a: jsonschema.validate(_json(a.text), PERSON) is None,
        ),
    ],
    "guided_json": [Case({"guided_json": PERSON}, lambda a: jsonschema.validate(_json(a.text), PERSON) is None)],
    "guided_regex": [Case({"guided_regex": REGEX}, lambda a: re.fullmatch(REGEX, a.text or "") is not None)],
    "guided_choice": [Case({"guided_choice": CHOICES}, lambda a: a.text in CHOICES)],
    "guided_grammar": [
        Case(
            {"guided_grammar": LARK}, lambda a: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", a.text or "") is not None
        ),
        Case({"guided_grammar": GBNF}, lambda a: re.fullmatch(r"ab[0-9]{1,2}", a.text or "") is not None),
    ],
    "structured_outputs": [
        Case({"structured_outputs": {"json": PERSON}}, lambda a: jsonschema.validate(_json(a.text), PERSON) is None),
        Case({"structured_outputs": {"regex": REGEX, "disable_any_whitespace": True}}, lambda a: bool(a.text)),
        Case({"structured_outputs": {"choice": CHOICES, "disable_fallback": True}}, lambda a: a.text in CHOICES),
        Case({"structured_outputs": {"json_object": True}}, lambda a: isinstance(_json(a.text), dict)),
    ],
    "tools": [Case({"tools": TOOLS, "tool_choice": "required"}, _valid_calls, (CHAT,))],
    "tool_choice": [
        Case(
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}},
            # a named function's call finishes with "stop", as OpenAI and vLLM answer it
            lambda a: _valid_calls(a, reason="stop") and [n for n, _ in a.calls] == ["now"],
            (CHAT,),
        ),
        # none: the tools are shown, nothing is parsed (the text is the content)
        Case({"tools": TOOLS, "tool_choice": "none", "max_tokens": 12}, lambda a: not a.calls, (CHAT,)),
        Case({"tools": TOOLS, "tool_choice": "auto", "max_tokens": 12}, lambda a: a.finish_reason is not None, (CHAT,)),
    ],
    "parallel_tool_calls": [
        Case(
            {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
            lambda a: _valid_calls(a) and len(a.calls) == 1,
            (CHAT,),
        )
    ],
}


def test_every_structured_field_has_a_case() -> None:
    assert set(CASES) == STRUCTURED_FIELDS


def _cases() -> list[Any]:
    return [
        pytest.param(name, case, api, id=f"{name}{k}-{api}")
        for name, cases in CASES.items()
        for k, case in enumerate(cases)
        for api in case.apis
    ]


@pytest.mark.parametrize(("name", "case", "api"), _cases())
def test_each_structured_field_constrains_whole_and_streamed_alike(url: str, name: str, case: Case, api: str) -> None:
    # json_object bounds nothing: a random model may write one string forever; with this seed
    # every choice of every case ends by itself within 300 tokens
    fields = {"temperature": 1.0, "seed": 3, "max_tokens": 300, "n": 2, **case.fields}
    whole = _ask(url, api, fields, stream=False)
    streamed = _ask(url, api, fields, stream=True)
    assert len(whole) == 2
    for answer in whole:
        constrained = "tool_choice" not in case.fields or case.fields["tool_choice"] not in ("none", "auto")
        assert not constrained or answer.finish_reason in ("stop", "tool_calls"), answer
        assert case.check(answer), answer
    assert streamed == whole  # the same seed: the same text, the same calls (ids aside)


# -- the openai client's own helpers ---------------------------------------------------------------
def test_parse_returns_the_pydantic_object(url: str) -> None:
    c = client(url)
    for parse in (c.chat.completions.parse, c.beta.chat.completions.parse):
        for seed in range(3):
            out = parse(
                model=NAME, messages=MESSAGES, response_format=Person, temperature=1.0, seed=seed, max_tokens=200
            )
            parsed = out.choices[0].message.parsed
            assert isinstance(parsed, Person), out
            assert parsed == Person.model_validate_json(out.choices[0].message.content)


def test_json_object_and_json_schema_with_create(url: str) -> None:
    c = client(url)
    out = c.chat.completions.create(
        model=NAME, messages=MESSAGES, response_format={"type": "json_object"}, temperature=1.0, seed=0, max_tokens=300
    )
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)
    out = c.chat.completions.create(
        model=NAME, messages=MESSAGES, response_format=_SCHEMA_FORMAT, temperature=1.0, seed=2, max_tokens=300
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_forced_calls_parse_with_the_clients_tools_and_stream_to_the_same_calls(url: str) -> None:
    """``tool_choice="required"`` with the client's strict pydantic tools: ``parse`` gives each call's
    arguments as the tool's model; ``stream`` (the client's accumulator of ``delta.tool_calls``)
    reassembles the same calls as the whole answer for the same seed, for each of ``n`` choices."""
    c = client(url)
    ask = {"model": NAME, "messages": CONVERSATION[:2], "tools": STRICT_TOOLS, "tool_choice": "required"}
    ask.update(temperature=1.0, seed=3, max_tokens=300, n=2)
    whole = c.chat.completions.parse(**ask)
    with c.chat.completions.stream(**ask) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    models = {"GetWeather": GetWeather, "Now": Now}
    for w, s in zip(whole.choices, streamed.choices, strict=True):
        assert w.finish_reason == s.finish_reason == "tool_calls"
        assert w.message.tool_calls and w.message.content is None
        for call in w.message.tool_calls:
            assert isinstance(call.function.parsed_arguments, models[call.function.name])
            assert call.id.startswith("call_") and call.type == "function"
        assert [(t.function.name, t.function.arguments) for t in s.message.tool_calls] == [
            (t.function.name, t.function.arguments) for t in w.message.tool_calls
        ]
    assert len({t.id for ch in whole.choices for t in ch.message.tool_calls}) == sum(
        len(ch.message.tool_calls) for ch in whole.choices
    )


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_required_calls_in_each_format_validate(request: pytest.FixtureRequest, fmt: str) -> None:
    served = request.getfixturevalue("local" if fmt == "hermes" else "local_llama3")
    for seed in range(4):
        fields = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed, "max_tokens": 300}
        whole = _ask(served.url, CHAT, fields, stream=False, messages=CONVERSATION[:2])
        assert all(_valid_calls(a) for a in whole), whole
        assert _ask(served.url, CHAT, fields, stream=True, messages=CONVERSATION[:2]) == whole


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_a_forced_call_cut_by_max_tokens_streams_what_it_answers_whole(
    request: pytest.FixtureRequest, fmt: str
) -> None:
    """Cut before the call's name is whole: the whole answer is the text as content with
    finish_reason "length"; the stream gives the same (it once held the text back and ended empty)."""
    served = request.getfixturevalue("local" if fmt == "hermes" else "local_llama3")
    fields = {"tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 3}
    (whole,) = _ask(served.url, CHAT, fields, stream=False, messages=CONVERSATION[:2])
    assert whole.calls == [] and whole.text and whole.finish_reason == "length"
    assert _ask(served.url, CHAT, fields, stream=True, messages=CONVERSATION[:2]) == [whole]


def test_a_two_turn_tool_conversation_completes(url: str, tiny_gpt2_long: TinyModel) -> None:
    """Turn one forces calls; turn two sends them back with ``role: "tool"`` results and completes.
    The second prompt's token ids are those of transformers' ``apply_chat_template`` (the
    arguments as objects, as templates read them)."""
    from transformers import AutoTokenizer

    c = client(url)
    first = c.chat.completions.create(
        model=NAME,
        messages=CONVERSATION[:2],
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=5,
        max_tokens=300,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    results = [{"role": "tool", "tool_call_id": t.id, "content": '{"ok": true}'} for t in message.tool_calls]
    messages = [*CONVERSATION[:2], message.model_dump(exclude_none=True), *results]
    second = c.chat.completions.create(
        model=NAME, messages=messages, tools=TOOLS, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls

    tok = AutoTokenizer.from_pretrained(tiny_gpt2_long.source)
    tok.chat_template = HERMES
    reference = [*CONVERSATION[:2], _with_argument_objects(message.model_dump(exclude_none=True)), *results]
    text = tok.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>" in text and '"arguments": {' in text
    assert second.model_extra["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    assert second.usage.prompt_tokens == len(second.model_extra["prompt_token_ids"])


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = [
        {**t, "function": {**t["function"], "arguments": json.loads(t["function"]["arguments"])}}
        for t in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


# -- KServe v2 generate and gRPC take the same fields --------------------------------------------
def test_kserve_generate_and_grpc_take_the_structured_fields(local: Local) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    fields = {"guided_json": PERSON, "max_tokens": 200, "temperature": 1.0, "seed": 11}
    want = _ask(local.url, COMPLETIONS, fields, stream=False)[0].text
    jsonschema.validate(json.loads(want or ""), PERSON)
    body = {"text_input": PROMPT, "parameters": fields}
    assert httpx.post(f"{local.url}/v2/models/{NAME}/generate", json=body, timeout=60).json()["text_output"] == want
    pieces = []
    with httpx.stream("POST", f"{local.url}/v2/models/{NAME}/generate_stream", json=body, timeout=60) as r:
        pieces = [json.loads(line[6:])["text_output"] for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(pieces) == want

    got: list[Any] = []
    done = threading.Event()

    def on_response(result: Any, error: Any) -> None:
        got.append(error if error is not None else result.as_numpy("text_output")[0].decode())
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    grpc = grpcclient.InferenceServerClient(local.grpc)
    grpc.start_stream(on_response)
    try:
        for sampling, expect_error in ((fields, False), ({**fields, "guided_json": {"type": "strnig"}}, True)):
            got.clear()
            done.clear()
            inputs = []
            for name, value, datatype in (
                ("text_input", PROMPT.encode(), "BYTES"),
                ("stream", True, "BOOL"),
                ("sampling_parameters", json.dumps(sampling).encode(), "BYTES"),
            ):
                t = grpcclient.InferInput(name, [1], datatype)
                t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
                inputs.append(t)
            grpc.async_stream_infer(NAME, inputs)
            assert done.wait(60)
            if expect_error:
                assert "guided_json cannot be compiled" in str(got[-1])
            else:
                assert "".join(got) == want
    finally:
        grpc.stop_stream()


# -- bad input: a 400 naming the field, before anything reaches the generator -------------------
_BAD_REF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}
_WITH_BAD_SCHEMA = [*TOOLS, {"type": "function", "function": {"name": "bad", "parameters": _BAD_REF}}]
BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _BAD_REF}}},
        "response_format.json_schema.schema",
    ),
    (
        COMPLETIONS,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
        "response_format.json_schema.name",
    ),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (COMPLETIONS, {"response_format": "json"}, "response_format"),
    (
        COMPLETIONS,
        {
            "guided_json": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                "required": ["a"],
            }
        },
        "guided_json",
    ),
    (COMPLETIONS, {"guided_regex": "(["}, "guided_regex"),
    (CHAT, {"guided_choice": []}, "guided_choice"),
    (COMPLETIONS, {"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    (CHAT, {"guided_grammar": "root ::= ("}, "guided_grammar"),
    (COMPLETIONS, {"structured_outputs": {"json": PERSON, "regex": "a"}}, "structured_outputs.regex"),
    (
        CHAT,
        {"structured_outputs": {"json": PERSON, "whitespace_pattern": " "}},
        "structured_outputs.whitespace_pattern",
    ),
    (COMPLETIONS, {"structured_outputs": {"json_schema": PERSON}}, "structured_outputs"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_json": PERSON}, "guided_json"),
    (COMPLETIONS, {"guided_json": PERSON, "ignore_eos": True}, "ignore_eos"),
    (CHAT, {"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    (
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
        "tools[0].function.parameters",
    ),
    (CHAT, {"tools": _WITH_BAD_SCHEMA, "tool_choice": "auto"}, "tools[2].function.parameters"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    (COMPLETIONS, {"tools": TOOLS}, "tools"),
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
]
_BAD_MESSAGES = [
    CONVERSATION[1],
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{zone"}}],
    },
]


@pytest.mark.parametrize(("api", "fields", "named"), BAD, ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field_before_anything_runs(
    local: Local, api: str, fields: dict, named: str
) -> None:
    before = local.generator.stats().submitted
    for stream in (False, True):
        error = _refused(local.url, api, fields, stream)
        assert error["param"] == named and named in error["message"], error
    assert local.generator.stats().submitted == before  # nothing reached the generator
    assert httpx.get(f"{local.url}/v2/health/ready", timeout=10).status_code == 200


def _refused(url: str, api: str, fields: dict[str, Any], stream: bool) -> dict[str, Any]:
    body = {"model": NAME, "max_tokens": 4, "stream": stream, **fields}
    body.update({"prompt": PROMPT} if api == COMPLETIONS else {"messages": MESSAGES})
    r = httpx.post(f"{url}/v1/{'completions' if api == COMPLETIONS else 'chat/completions'}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    return dict(r.json()["error"])


@pytest.mark.slow
def test_bad_input_through_the_front_ends_is_refused_there(frontends: str) -> None:
    """The front end compiles every constraint itself (its own grammar compiler): the same 400s."""
    for api, fields, named in BAD:
        error = _refused(frontends, api, fields, stream=True)
        assert error["param"] == named and named in error["message"], error
    assert httpx.get(f"{frontends}/v2/health/ready", timeout=10).status_code == 200


def test_bad_tool_call_arguments_in_a_follow_up_turn_name_the_message(local: Local) -> None:
    body = {"model": NAME, "messages": _BAD_MESSAGES, "tools": TOOLS}
    r = httpx.post(f"{local.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize(
    ("doc", "kind", "field"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        ({"response_format": _SCHEMA_FORMAT}, "json_schema", "response_format.json_schema.schema"),
        ({"guided_json": PERSON}, "json_schema", "guided_json"),
        ({"guided_regex": "a"}, "regex", "guided_regex"),
        ({"guided_choice": ["a"]}, "choice", "guided_choice"),
        ({"guided_grammar": LARK}, "grammar", "guided_grammar"),
        ({"structured_outputs": {"json": "{}"}}, "json_schema", "structured_outputs.json"),
        (
            {"structured_outputs": {"grammar": GBNF, "disable_additional_properties": False}},
            "grammar",
            "structured_outputs.grammar",
        ),
        ({"structured_outputs": {"json_object": True, "regex": None}}, "json_object", "structured_outputs.json_object"),
    ],
)
def test_the_policy_maps_each_form_to_one_constraint(doc: dict, kind: str | None, field: str | None) -> None:
    got = structured_output(doc)
    assert (got.kind, got.field) == (kind, field) if got is not None else kind is None


def test_tool_fields_belong_to_chat() -> None:
    assert tool_fields({"tools": [], "tool_choice": "none", "parallel_tool_calls": True}, COMPLETIONS) == (
        None,
        "none",
        True,
    )
    assert tool_fields({"tools": TOOLS}, CHAT) == (TOOLS, None, None)
    for doc in ({"tools": TOOLS}, {"tool_choice": "required"}):
        with pytest.raises(InvalidInputError, match="only taken by /v1/chat/completions"):
            tool_fields(doc, COMPLETIONS)


# -- free rows beside constrained ones ------------------------------------------------------------
def test_free_rows_beside_constrained_ones_give_their_tokens_alone(local: Local) -> None:
    """Long constrained streams (chat and completions) are running when free completions (greedy
    and seeded sampling) arrive: each free one gives exactly the tokens it gives alone, and every
    free row decoded in steps holding a constrained row."""
    free = random_prompts([3, 7, 5, 9, 4, 6], seed=8)
    sampling = [
        {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.9, "seed": 40 + i} for i in range(6)
    ]

    def ask(i: int) -> list[int]:
        body = {"model": NAME, "prompt": free[i], "max_tokens": 20, "return_token_ids": True, **sampling[i]}
        return httpx.post(f"{local.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]

    alone = [ask(i) for i in range(len(free))]
    long = {"max_tokens": 1500, "temperature": 1.0, "guided_regex": "[a-z]{1200}", "stream": True}
    started = [threading.Event() for _ in range(4)]
    leave = threading.Event()

    def constrained(k: int) -> None:
        route, body = ("chat/completions", {"messages": MESSAGES}) if k % 2 else ("completions", {"prompt": PROMPT})
        with httpx.stream("POST", f"{local.url}/v1/{route}", json={**long, **body, "seed": k}, timeout=120) as r:
            for line in r.iter_lines():
                choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
                if any(ch.get("text") or ch.get("delta", {}).get("content") for ch in choices):
                    started[k].set()  # its first token came: the row is seated
                if leave.is_set():
                    return  # the client leaves: its row is freed

    local.generator.shared.clear()
    local.generator.open.clear()
    with ThreadPoolExecutor(len(started) + len(free)) as pool:
        streams = [pool.submit(constrained, k) for k in range(len(started))]
        assert all(e.wait(120) for e in started)
        together = list(pool.map(ask, range(len(free))))
        leave.set()
        for s in streams:
            s.result()
    assert together == alone
    assert all(local.generator.shared[tuple(p)] for p in free), local.generator.shared


def test_the_docs_example_runs(local: Local) -> None:
    """docs/serving.md's structured-output example, as written, against the local server."""
    text = (REPO / "docs" / "serving.md").read_text()
    start = text.index("```python\n", text.index("<!-- run by tests/generation/test_serve_structured.py -->"))
    code = text[start + len("```python\n") : text.index("```\n", start + 10)]
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    # dont_inherit: not this module's "from __future__ import annotations" (pydantic reads the hints)
    exec(compile(code.replace("http://127.0.0.1:8000", local.url), "docs/serving.md", "exec", dont_inherit=True), {})
