"""OpenAI Batch API files through ``ortbatch run``: each output line has the Batch API's
shape (its body parses as the openai package's CreateEmbeddingResponse, errors as its
ErrorObject / BatchError) and the body equals what ``ortbatch serve`` answers."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ortbatch

from .conftest import serve_embeddings, write_jsonl

openai_types = pytest.importorskip("openai.types")
pytest.importorskip("starlette")

LINES: list[Any] = [
    {"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hello world"}},
    {
        "custom_id": "many",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"input": ["the quick brown fox", "a lazy dog", "one run split back"]},
    },
    {
        "custom_id": "b64",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"input": "many callers", "encoding_format": "base64"},
    },
    {"custom_id": "ids", "method": "POST", "url": "/v1/embeddings", "body": {"input": [[2, 5, 6, 3]]}},
    {"custom_id": "long", "method": "POST", "url": "/v1/embeddings", "body": {"input": " ".join(["fox"] * 30)}},
    {
        "custom_id": "cut",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"input": " ".join(["fox"] * 30), "truncate": True},
    },
    {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    },
    # a field serve's /v1/embeddings does not read (vLLM's): refused here as serve refuses it
    {"custom_id": "extra", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi", "normalize": False}},
    b"{not json",
]


def test_batch_api_lines_in_the_batch_output_format_equal_to_serve(encoder: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "batch.jsonl", LINES)
    summary = ortbatch.run(encoder, src, tmp_path / "out", window=3, progress=False)
    assert summary.rows == 9 and summary.succeeded == 5 and summary.failed == 4 and summary.exit_code == 3
    out = [json.loads(x) for p in sorted((tmp_path / "out").glob("part-*.jsonl")) for x in p.read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["one", "many", "b64", "ids", "cut"]
    for line, sent in zip(out, [LINES[i] for i in (0, 1, 2, 3, 5)], strict=True):
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"].startswith("req_")
        assert line["response"]["status_code"] == 200
        raw = json.loads(json.dumps(line["response"]["body"]))
        for item in raw["data"]:
            if isinstance(item["embedding"], str):  # base64: the openai client decodes it first, so do we
                item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").tolist()
        body = openai_types.CreateEmbeddingResponse.model_validate(raw)
        assert body.object == "list" and len(body.data) == len(
            sent["body"]["input"] if isinstance(sent["body"]["input"], list) else [1]
        )
        status, served = serve_embeddings(encoder, sent["body"])
        assert status == 200 and line["response"]["body"] == served
    errors = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    by_id = {e["custom_id"]: e for e in errors}
    long_err = by_id["long"]["response"]
    assert long_err["status_code"] == 400
    err = openai_types.shared.ErrorObject.model_validate(long_err["body"]["error"])
    assert err.code == "too_long" and "limit of 16 tokens" in err.message
    # the remedy a Batch API line has: the field (serve's words), or the job's flag
    assert 'send "truncate": true' in err.message and "--truncate" in err.message
    status, served = serve_embeddings(encoder, LINES[4]["body"])
    assert status == 400  # serve refuses it too
    assert by_id["chat"]["response"]["status_code"] == 404
    extra = by_id["extra"]["response"]
    assert extra["status_code"] == 400
    assert extra["body"]["error"]["message"] == "Unrecognized request argument supplied: normalize"
    status, served = serve_embeddings(encoder, LINES[7]["body"])
    # serve answers the same (its "code" is the HTTP status; a batch file's, the failure's kind)
    assert status == 400
    assert {k: served["error"][k] for k in ("message", "type", "param")} == {
        k: extra["body"]["error"][k] for k in ("message", "type", "param")
    }
    bad = by_id[None]
    assert bad["response"] is None
    batch_error = openai_types.BatchError.model_validate(bad["error"])
    assert batch_error.line == 9 and batch_error.code == "invalid_json"


def test_batch_api_truncate_flag_is_the_lines_default_as_serve_truncate(encoder: Path, tmp_path: Path) -> None:
    """``ortbatch run --truncate`` on a Batch API file: a line without ``truncate`` is cut, as
    ``serve --truncate`` cuts it; a line that says ``"truncate": false`` still fails."""
    long_text = " ".join(["fox"] * 30)
    lines = [
        {"custom_id": "default", "method": "POST", "url": "/v1/embeddings", "body": {"input": long_text}},
        {
            "custom_id": "no",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": long_text, "truncate": False},
        },
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    summary = ortbatch.run(encoder, src, tmp_path / "out", truncate=True, progress=False)
    assert summary.succeeded == 1 and summary.failed == 1
    out = [json.loads(x) for p in sorted((tmp_path / "out").glob("part-*.jsonl")) for x in p.read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["default"]
    status, served = serve_embeddings(encoder, lines[0]["body"], truncate=True)
    assert status == 200 and out[0]["response"]["body"] == served
    errors = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in errors] == [("no", "too_long")]
    status, served = serve_embeddings(encoder, lines[1]["body"], truncate=True)
    assert status == 400  # serve --truncate refuses it too


def test_batch_api_input_needs_jsonl_output(encoder: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "batch.jsonl", LINES[:1])
    with pytest.raises(ortbatch.bulk.OutputError, match="--format jsonl"):
        ortbatch.run(encoder, src, tmp_path / "out", output_format="parquet", progress=False)
