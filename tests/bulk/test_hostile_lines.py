"""Issue 47 in ``ortbatch run``: a bad Batch API line is that line's error (item 5), never a
traceback that stops the job; the output folder is never someone else's files, and two runs
on one output cannot both work (item 8)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import ortbatch

from .conftest import write_jsonl

pytest.importorskip("starlette")


def _serve(export: Path, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What ``ortbatch serve``'s /v1/embeddings answers ``body`` sent as ASCII JSON (a lone
    surrogate as its escape, as a client sends it)."""
    import httpx

    from ortbatch.serve import ServedModel, create_app

    app = create_app(ServedModel.load(export, name=export.name))

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"content-type": "application/json"}
            return await client.post("/v1/embeddings", content=json.dumps(body), headers=headers)

    r = asyncio.run(go())
    return r.status_code, r.json()


@pytest.mark.parametrize("value", ["\ud800", ["ok", "a\udfffb"]], ids=["one", "in-a-list"])
def test_a_lone_surrogate_is_that_lines_error_with_serves_message(encoder: Path, tmp_path: Path, value: Any) -> None:
    lines = [
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": value}},
        {"custom_id": "good", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello"}},
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)  # json.dumps: the surrogate as an escape
    summary = ortbatch.run(encoder, src, tmp_path / "out", progress=False)
    assert summary.succeeded == 1 and summary.failed == 1
    errors = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"]
    got = errors[0]["response"]
    status, served = _serve(encoder, lines[0]["body"])
    assert got["status_code"] == status == 400
    assert got["body"]["error"]["message"] == served["error"]["message"]
    assert "lone surrogate" in served["error"]["message"]
    # a rerun resumes the finished job: nothing left to fail on
    again = ortbatch.run(encoder, src, tmp_path / "out", progress=False)
    assert again.exit_code == summary.exit_code
