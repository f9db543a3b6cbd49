"""OpenAI Batch API completion and chat lines through ``ortbatch run`` on a tiny random GPT-2
export (with a Hermes-style chat template that knows tools): every output line parses with the
openai package's types (``Completion``, ``ChatCompletion``; errors ``ErrorObject``), and each
body equals what ``ortbatch serve`` (``BackgroundServer(ServedGenerator(...))``) answers over
HTTP to the same body — ``id`` and ``created`` aside, which are per request by nature (and tool
calls' ids) — greedy, seeded-sampled, and sampled without a seed (given the line's derived
one). Errors carry serve's status, message, type and field. A SIGKILLed job, rerun, writes the
uninterrupted bytes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ortbatch
from ortbatch.bulk.batch_completions import STATUSES, line_seed
from ortbatch.bulk.sources import Row

from .conftest import cli, output_bytes, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.export]

openai_types = pytest.importorskip("openai.types")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("jinja2")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 4}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "Once upon a time"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}},
    "required": ["name"],
    "additionalProperties": False,
}


def _request(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


C, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = [
    _request("greedy", C, {"model": "export", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
    _request("seeded", C, {"prompt": "The quick brown", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 7}),
    _request("n", C, {"prompt": ["The lazy", "Héllo"], "n": 2, "max_tokens": 5, "seed": 3, "logprobs": 2}),
    _request("unseeded", C, {"prompt": "Continuous batching", "max_tokens": 6}),
    _request("chat", CHAT, {"messages": USER, "max_tokens": 8, "temperature": 0}),
    _request("chat-sampled", CHAT, {"messages": USER, "max_completion_tokens": 8, "seed": 11, "top_k": 20}),
    _request(
        "tools",
        CHAT,
        {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 120, "temperature": 0},
    ),
    _request(
        "schema",
        CHAT,
        {
            "messages": USER,
            "max_tokens": 30,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        },
    ),
]
BAD = [
    _request("stream", C, {"prompt": "hi", "stream": True}),
    _request("unknown-field", C, {"prompt": "hi", "frobnicate": 1}),
    _request("temperature", CHAT, {"messages": USER, "temperature": 5}),
    _request("long", C, {"prompt": "word " * 1100, "max_tokens": 4}),
    _request("embeddings", "/v1/embeddings", {"input": "hi"}),
    _request("unknown-url", "/v1/moderations", {"input": "hi"}),
]


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.generation.conftest import _build
    from tests.generation.tool_templates import HERMES

    model = _build("gpt2", tmp_path_factory.mktemp("gen"), context=1024)
    d = tmp_path_factory.mktemp("batch") / "export"
    shutil.copytree(model.export, d)
    (d / "chat_template.jinja").write_text(HERMES)
    return d


@pytest.fixture(scope="module")
def server(export: Path) -> Iterator[Any]:
    from ortbatch import BatchedGenerator
    from ortbatch.serve import BackgroundServer, ServedGenerator

    with BackgroundServer(ServedGenerator(BatchedGenerator(export, max_batch_size=4), export.name)) as srv:
        yield srv


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for p in sorted(out.glob("part-*.jsonl")) for x in p.read_text().splitlines()]


def _masked(body: dict[str, Any]) -> dict[str, Any]:
    """``id`` and ``created`` (per request by nature), and tool calls' ids (random in serve)."""
    body = json.loads(json.dumps(body))
    body["id"] = body["id"].split("-")[0]
    body["created"] = 0
    for choice in body["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            call["id"] = "call"
    return body


def _served(server: Any, url: str, body: dict[str, Any], row: Row) -> httpx.Response:
    sent = dict(body)
    if sent.get("seed") is None:
        sent["seed"] = line_seed(row)
    return httpx.post(server.url + url, json=sent, timeout=60)


def test_completion_and_chat_lines_equal_serve(export: Path, server: Any, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "batch.jsonl", GOOD + BAD)
    summary = ortbatch.run(export, src, tmp_path / "out", window=5, progress=False)
    assert (summary.rows, summary.succeeded, summary.failed) == (14, 8, 6)
    out = _lines(tmp_path / "out")
    assert [x["custom_id"] for x in out] == [r["custom_id"] for r in GOOD]
    for index, (line, sent) in enumerate(zip(out, GOOD, strict=True)):
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["model"] == "export"
        if sent["url"] == C:
            assert body["id"].startswith("cmpl-")
            openai_types.Completion.model_validate(body)
        else:
            assert body["id"].startswith("chatcmpl-")
            openai_types.chat.ChatCompletion.model_validate(body)
        got = _served(server, sent["url"], sent["body"], Row(index, sent["custom_id"]))
        assert got.status_code == 200, got.text
        assert _masked(body) == _masked(got.json()), sent["custom_id"]
    by_id = {x["custom_id"]: x["response"]["body"] for x in out}
    (call,) = by_id["tools"]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    assert set(json.loads(by_id["schema"]["choices"][0]["message"]["content"])) == {"name"}
    assert len(by_id["n"]["choices"]) == 4 and by_id["n"]["choices"][0]["logprobs"]["tokens"]


def test_failed_lines_carry_serves_status_and_error(export: Path, server: Any, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "batch.jsonl", BAD)
    summary = ortbatch.run(export, src, tmp_path / "out", progress=False)
    assert summary.failed == len(BAD) and summary.exit_code == 3
    errors = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == [r["custom_id"] for r in BAD]
    by_id = {e["custom_id"]: e["response"] for e in errors}
    for index, sent in enumerate(BAD[:4]):
        response = by_id[sent["custom_id"]]
        error = openai_types.shared.ErrorObject.model_validate(response["body"]["error"])
        if sent["custom_id"] == "stream":  # serve would stream it: a Batch line may not
            assert (response["status_code"], error.param) == (400, "stream")
            continue
        got = _served(server, sent["url"], sent["body"], Row(index, sent["custom_id"]))
        want = got.json()["error"]
        assert response["status_code"] == got.status_code == 400, sent["custom_id"]
        assert (error.message, error.type, error.param) == (want["message"], want["type"], want["param"])
    assert by_id["long"]["body"]["error"]["code"] == "too_long"
    assert by_id["unknown-field"]["body"]["error"]["param"] == "frobnicate"
    assert by_id["embeddings"]["status_code"] == 404 and by_id["unknown-url"]["status_code"] == 404


def test_the_statuses_are_serves() -> None:
    from ortbatch.serve.http.plumbing import error_response

    for cls, status, _ in STATUSES:
        assert error_response(cls.__new__(cls))[0] == status, cls  # an instance, whatever its arguments


def test_sigkill_then_rerun_gives_the_uninterrupted_bytes(export: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "batch.jsonl", GOOD[:6] + BAD[:2])
    args = (str(export), str(src), "--window", "3")
    whole = cli(*args, "-o", str(tmp_path / "whole"))
    assert whole.returncode == 3, whole.stderr
    killed = cli(*args, "-o", str(tmp_path / "out"), env={"ORTBATCH_RUN_KILL_AT": "1:written"})
    assert killed.returncode == -9, killed.stderr
    again = cli(*args, "-o", str(tmp_path / "out"))
    assert again.returncode == 3 and "resumed after 3 rows" in again.stderr
    assert output_bytes(tmp_path / "out") == output_bytes(tmp_path / "whole")


def test_a_job_run_from_inside_an_event_loop(export: Path, tmp_path: Path) -> None:
    """``ortbatch.run`` called where an event loop runs (a notebook's cell): constrained lines
    are compiled all the same."""
    import asyncio

    src = write_jsonl(tmp_path / "batch.jsonl", [r for r in GOOD if r["custom_id"] in ("tools", "schema")])

    async def in_a_loop() -> Any:
        return ortbatch.run(export, src, tmp_path / "out", progress=False)

    summary = asyncio.run(in_a_loop())
    assert (summary.succeeded, summary.failed) == (2, 0)
