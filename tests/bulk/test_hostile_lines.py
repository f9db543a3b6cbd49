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


# -- item 8: never someone else's files; one run per output -------------------------------------
def _texts(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [{"text": f"row {i}"} for i in range(5)])


@pytest.mark.parametrize("restart", [False, True], ids=["resume", "restart"])
def test_loose_part_files_without_a_job_record_are_refused_and_kept(
    encoder: Path, tmp_path: Path, restart: bool
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    theirs = {"part-000000.jsonl": b'{"mine": 1}\n', "part-000007.jsonl": b'{"mine": 2}\n'}
    for name, data in theirs.items():
        (out / name).write_bytes(data)
    with pytest.raises(ortbatch.bulk.OutputError, match=r"part-000000\.jsonl, part-000007\.jsonl but no _job\.json"):
        ortbatch.run(encoder, _texts(tmp_path), out, output_format="jsonl", restart=restart, progress=False)
    assert {p.name: p.read_bytes() for p in out.glob("part-*")} == theirs  # nothing deleted


def test_a_second_run_on_one_output_is_refused_in_one_line(encoder: Path, tmp_path: Path) -> None:
    import fcntl
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    src = _texts(tmp_path)
    out.mkdir()
    # the lock another run on this output holds while it works
    with open(out / "_lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242\n")
        held.flush()
        with pytest.raises(ortbatch.bulk.OutputError, match=r"in use by another `ortbatch run` \(pid 4242\)"):
            ortbatch.run(encoder, src, out, output_format="jsonl", progress=False)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        cli = [sys.executable, "-m", "ortbatch.cli", "run", str(encoder), str(src), "-o", str(out), "--format", "jsonl"]
        proc = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "in use by another `ortbatch run`" in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not list(out.glob("part-*"))  # it did no work
    # released: the next run works, and its own lock is let go when it ends
    summary = ortbatch.run(encoder, src, out, output_format="jsonl", progress=False)
    assert summary.exit_code == 0 and summary.succeeded == 5
    again = ortbatch.run(encoder, src, out, output_format="jsonl", progress=False)
    assert again.exit_code == 0
