"""Issue 47's hostile-input corpus over every transport: structured-output fields that break
their schema or the grammar engine (integers beyond int64, ``$ref`` cycles, huge repeats and
constants, 100,000 choices), JSON nested thousands deep inside string fields, lone surrogates.
Each body is sent over HTTP (whole and streamed), gRPC's ``ModelStreamInfer``, ``--frontends 2``
and as an ``ortbatch run`` Batch API line: a 400 (gRPC INVALID_ARGUMENT, a Batch API error line)
with the same message everywhere, never a 5xx, a traceback or the engine's internals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

from ortbatch import BatchedGenerator  # noqa: E402
from ortbatch.serve import BackgroundServer, ServeConfig, ServedGenerator  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny"
DEEP = 2000
NESTED = "[" * DEEP + "]" * DEEP  # JSON nested DEEP levels, as a string
MESSAGES = [{"role": "user", "content": "hi"}]
CALL = {"id": "c", "type": "function", "function": {"name": "now", "arguments": NESTED}}
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


DEEP_TOOLS = [{"type": "function", "function": {"name": "now", "parameters": _deep_schema(300)}}]

#: (id, path, body fields, the field the error names, what its message says)
CORPUS: list[tuple[str, str, dict[str, Any], str, str]] = [
    (
        "int-beyond-int64",
        "completions",
        {"guided_json": {"type": "integer", "minimum": 10**300, "maximum": 10**300 + 1}},
        "guided_json",
        "64-bit",
    ),
    (
        "int-max-beyond-int64",
        "completions",
        {"guided_json": {"type": "integer", "maximum": -(2**70)}},
        "guided_json",
        "64-bit",
    ),
    ("nested-guided-json-string", "completions", {"guided_json": NESTED}, "guided_json", "nested"),
    (
        "nested-schema-string",
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED}}},
        "response_format.json_schema.schema",
        "nested",
    ),
    (
        "nested-tool-arguments",
        "chat",
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
            "tools": TOOLS,
        },
        "messages[1].tool_calls[0].function.arguments",
        "nested",
    ),
    ("huge-repeat-regex", "completions", {"guided_regex": "a{1000000}"}, "guided_regex", "guided_regex"),
    ("ref-cycle", "completions", {"guided_json": CYCLE}, "guided_json", "guided_json"),
    ("megabyte-const", "chat", {"guided_json": {"const": "x" * 1_000_000}}, "guided_json", "guided_json"),
    ("100k-choices", "completions", {"guided_choice": [f"c{i}" for i in range(100_000)]}, "guided_choice", "at most"),
    ("deep-schema", "completions", {"guided_json": _deep_schema(300)}, "guided_json", "nested"),
    ("deep-tool-parameters", "chat", {"tools": DEEP_TOOLS}, "tools[0].function.parameters", "nested"),
    ("surrogate-prompt", "completions", {"prompt": "a\ud800b"}, "prompt", "lone surrogate"),
]

INTERNALS = re.compile(r"Traceback|panicked|\.rs:\d|/home/|/root/|/rustc/|RUST_BACKTRACE|Parser Error|stack", re.I)


def _body(path: str, fields: dict[str, Any], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": NAME, "max_tokens": 4, "stream": stream}
    body.update({"prompt": "Once upon a time"} if path == "completions" else {"messages": MESSAGES})
    body.update(fields)
    return body


def _check(case: str, status: int, error: dict[str, Any], named: str, says: str) -> str:
    message = str(error.get("message"))
    assert status == 400, (case, status, message[:500])
    assert error.get("param") == named and named in message, (case, error)
    assert says in message, (case, message[:500])
    assert len(message) < 1000 and not INTERNALS.search(message), (case, message[:1000])
    return message


def _post(url: str, path: str, fields: dict[str, Any], stream: bool) -> tuple[int, dict[str, Any]]:
    # ASCII JSON: the surrogate goes as an escape, as a client would send it
    content = json.dumps(_body(path, fields, stream))
    r = httpx.post(
        f"{url}/v1/{'completions' if path == 'completions' else 'chat/completions'}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    return r.status_code, dict(r.json().get("error") or {})


@pytest.fixture(scope="module")
def local(tool_exports: dict[str, Path]) -> Iterator[Any]:
    gen = BatchedGenerator(tool_exports["hermes"], max_batch_size=8, max_queue=64)
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")
    with BackgroundServer(ServedGenerator(gen, NAME), config) as srv:
        assert srv.grpc is not None
        yield srv


@pytest.mark.parametrize(("case", "path", "fields", "named", "says"), CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_bodies_are_400s_over_http(local: Any, case: str, path: str, fields: dict, named: str, says: str):
    messages = set()
    for stream in (False, True):
        status, error = _post(local.url, path, fields, stream)
        messages.add(_check(case, status, error, named, says))
    assert len(messages) == 1, messages
    assert httpx.get(f"{local.url}/v2/health/ready", timeout=10).status_code == 200


#: the corpus cases a gRPC ModelStreamInfer (a prompt and its sampling parameters) can carry
GRPC_CASES = [c for c in CORPUS if c[1] == "completions" and "prompt" not in c[2]]


def _grpc_error(address: str, fields: dict[str, Any]) -> str:
    import threading

    import numpy as np

    grpcclient = pytest.importorskip("tritonclient.grpc")
    got: list[Any] = []
    done = threading.Event()

    def on_response(result: Any, error: Any) -> None:
        got.append(error if error is not None else result)
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    grpc = grpcclient.InferenceServerClient(address)
    grpc.start_stream(on_response)
    try:
        inputs = []
        sampling = {"max_tokens": 4, **fields}
        for name, value, datatype in (
            ("text_input", b"Once upon a time", "BYTES"),
            ("stream", True, "BOOL"),
            ("sampling_parameters", json.dumps(sampling).encode(), "BYTES"),
        ):
            t = grpcclient.InferInput(name, [1], datatype)
            t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
            inputs.append(t)
        grpc.async_stream_infer(NAME, inputs)
        assert done.wait(120)
    finally:
        grpc.stop_stream()
        grpc.close()
    error = got[-1]
    assert isinstance(error, Exception), got  # a stream's error comes as its response's error message
    return str(error.message())


@pytest.mark.parametrize(("case", "path", "fields", "named", "says"), GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_hostile_bodies_are_invalid_argument_over_grpc_with_https_message(
    local: Any, case: str, path: str, fields: dict, named: str, says: str
) -> None:
    _, error = _post(local.url, path, fields, stream=False)
    message = _grpc_error(local.grpc.address, fields)
    assert not INTERNALS.search(message) and len(message) < 1000, message
    assert error["message"] in message, (message, error["message"])


@pytest.fixture(scope="module")
def frontends(tool_exports: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``ortbatch serve tiny=DIR --frontends 2`` in a subprocess."""
    log = tmp_path_factory.mktemp("hostile-fe") / "serve.log"
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
    text = log.read_text(errors="replace")
    assert code == 0 and "Traceback" not in text, text


@pytest.mark.slow
def test_hostile_bodies_through_the_front_ends_answer_as_one_process(local: Any, frontends: str) -> None:
    for case, path, fields, named, says in CORPUS:
        _, alone = _post(local.url, path, fields, stream=False)
        for stream in (False, True):
            status, error = _post(frontends, path, fields, stream)
            assert _check(case, status, error, named, says) == alone["message"]
    assert httpx.get(f"{frontends}/v2/health/ready", timeout=10).status_code == 200


def test_hostile_batch_api_lines_are_their_error_lines_with_serves_message(
    local: Any, tool_exports: dict[str, Path], tmp_path: Path
) -> None:
    import ortbatch

    lines = []
    for case, path, fields, _named, _says in CORPUS:
        body = {k: v for k, v in _body(path, fields, stream=False).items() if k != "stream"}
        url = "/v1/completions" if path == "completions" else "/v1/chat/completions"
        lines.append({"custom_id": case, "method": "POST", "url": url, "body": body})
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))  # ASCII: surrogates as escapes
    summary = ortbatch.run(tool_exports["hermes"], src, tmp_path / "out", progress=False)
    assert summary.failed == len(CORPUS) and summary.succeeded == 0
    errors = {
        e["custom_id"]: e["response"]
        for e in map(json.loads, (tmp_path / "out" / "_errors.jsonl").read_text().splitlines())
    }
    for case, path, fields, named, _says in CORPUS:
        status, served = _post(local.url, path, fields, stream=False)
        got = errors[case]
        assert got["status_code"] == status == 400, (case, got)
        assert got["body"]["error"]["message"] == served["message"], (case, got, served)
        assert got["body"]["error"]["param"] == named, (case, got)


def test_a_grammar_failing_while_decoding_is_the_requests_400_without_the_engines_state() -> None:
    """A grammar that passes the compile-time walk and fails later: the row's error is a
    GrammarFailedError (an InvalidInputError too), mapped to 400 naming the constraint, and
    the engine's parser state and grammar are cut from its message."""
    import numpy as np

    from ortbatch.errors import InferenceError, InvalidInputError
    from ortbatch.generation.constrained import GrammarFailedError, RowGrammar, mask_rows
    from ortbatch.serve.http.plumbing import error_response

    class Failing:
        def is_error(self) -> bool:
            return True

        def get_error(self) -> str:
            return 'lexer error: too many expressions\n<state>\nTokens: ⟦a⟧\n</state><grammar>{"x": 1}</grammar>'

    errors = mask_rows(np.zeros((1, 40), np.float32), [RowGrammar(Failing(), 2, "regex")])
    assert errors == ["lexer error: too many expressions"]
    exc = GrammarFailedError(f"regex failed while decoding: {errors[0]}", input_name="regex")
    assert isinstance(exc, InferenceError) and isinstance(exc, InvalidInputError)
    status, body, _ = error_response(exc, openai=True)
    assert status == 400 and body["error"]["param"] == "regex"
    assert "<state>" not in body["error"]["message"] and "grammar>" not in body["error"]["message"]
