"""The KServe infer routes are answered ahead of Starlette (http.FastRoutes): every answer
must be the one Starlette's own routing of the same route gives, and the requests that
are not infer requests (or only partly match one) must still reach Starlette. The
server's writes of one loop turn leave in one send (http.connection.CoalescingTransport)."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from ortbatch.serve import ServedModel, build_app
from ortbatch.serve.http.connection import CoalescingTransport
from ortbatch.serve.http.plumbing import FastRoutes, RequestObserver


@pytest.fixture(scope="module")
def adder(adder_path: Path):
    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    yield model
    model.close()


def _json_infer(x: list[list[float]], k: list[list[int]]) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [len(x), 3], "data": [v for row in x for v in row]},
                {"name": "k", "datatype": "INT32", "shape": [len(k), 1], "data": [v for row in k for v in row]},
            ]
        }
    ).encode()


def _binary_infer() -> tuple[bytes, dict[str, str]]:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    k = np.array([[1], [2]], dtype=np.int32)
    head = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": x.nbytes}},
                {"name": "k", "datatype": "INT32", "shape": [2, 1], "parameters": {"binary_data_size": k.nbytes}},
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}, {"name": "n"}],
        }
    ).encode()
    return head + x.tobytes() + k.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


_OK = _json_infer([[1, 2, 3]], [[4]])
_BINARY, _BINARY_HEADERS = _binary_infer()

#: (method, path, body, headers): answers, refusals, and requests the fast routes must pass on
CASES: list[tuple[str, str, bytes, dict[str, str]]] = [
    ("POST", "/v2/models/adder/infer", _OK, {"Content-Type": "application/json"}),
    ("POST", "/v2/models/adder/versions/1/infer", _OK, {}),
    ("POST", "/v2/models/adder/infer", _BINARY, _BINARY_HEADERS),
    ("POST", "/v2/models/adder/infer", gzip.compress(_OK), {"Content-Encoding": "gzip"}),
    ("POST", "/v2/models/adder/infer", _OK, {"Content-Encoding": "br"}),
    ("POST", "/v2/models/adder/infer", b"{not json", {}),
    ("POST", "/v2/models/adder/infer", _json_infer([[1, 2]], [[4]]), {}),
    ("POST", "/v2/models/adder/infer", _OK, {"Inference-Header-Content-Length": "x"}),
    ("POST", "/v2/models/adder/infer", b"x" * 2000, {}),  # over this app's 1 KiB limit
    ("POST", "/v2/models/nobody/infer", _OK, {}),
    ("POST", "/v2/models/adder/versions/7/infer", _OK, {}),
    ("GET", "/v2/models/adder/infer", b"", {}),  # Starlette's 405
    ("POST", "/v2/models/adder/infer/", _OK, {}),  # Starlette's trailing-slash redirect
    ("GET", "/v2/models/adder", b"", {}),
    ("POST", "/v2/models/adder/infer/more", _OK, {}),
]


_KEPT = ("content-type", "inference-header-content-length", "allow", "location")


async def _answers(app: Any, cases: list[tuple[str, str, bytes, dict[str, str]]]) -> list[tuple[Any, ...]]:
    out = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", follow_redirects=False) as client:
        for method, path, body, headers in cases:
            r = await client.request(method, path, content=body, headers=headers)
            kept = {k: r.headers.get(k) for k in _KEPT}
            out.append((method, path, r.status_code, kept, r.content))
    return out


def test_fast_routes_answer_what_starlette_answers(adder):
    from ortbatch.serve.http.plumbing import BodyLimits

    app = build_app(adder, BodyLimits(max_bytes=1024))
    assert isinstance(app, RequestObserver) and isinstance(app.app, FastRoutes)
    starlette_only = RequestObserver(app.app.app, app.metrics, app.counts)  # the same routes, no fast path
    fast, slow = asyncio.run(_answers(app, CASES)), asyncio.run(_answers(starlette_only, CASES))
    assert fast == slow
    statuses = [a[2] for a in fast]
    # the cases are what they say: two answers, each refusal with its own status
    assert statuses == [200, 200, 200, 200, 415, 400, 400, 400, 413, 404, 404, 405, 307, 200, 404]
    assert json.loads(fast[0][4])["outputs"][0]["data"] == [6.0, 8.0, 10.0]
    assert fast[0][3]["content-type"] == "application/json"
    # the binary answer: its JSON header's length in the header, then y's raw bytes
    binary = fast[2]
    hlen = int(binary[3]["inference-header-content-length"])
    head = json.loads(binary[4][:hlen])
    assert [o["name"] for o in head["outputs"]] == ["y", "n"]
    y = np.frombuffer(binary[4][hlen:], dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(y, np.arange(6, dtype=np.float32).reshape(2, 3) * 2 + [[1], [2]])
    assert binary[3]["content-type"] == "application/octet-stream"


def test_only_the_infer_requests_skip_starlette(adder):
    app = build_app(adder)
    starlette = app.app.app
    reached: list[str] = []

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            reached.append(scope["path"])
        await starlette(scope, receive, send)

    app.app.app = counting
    cases = [CASES[0], CASES[1], CASES[2], CASES[11], CASES[13]]
    statuses = [a[2] for a in asyncio.run(_answers(app, cases))]
    assert statuses == [200, 200, 200, 405, 200]
    assert reached == ["/v2/models/adder/infer", "/v2/models/adder"]  # the GET 405 and the metadata


def test_a_fast_infer_is_counted_under_its_route(adder):
    app = build_app(adder)
    asyncio.run(_answers(app, [CASES[0], CASES[1], CASES[5]]))
    text = app.metrics.render()[0].decode()
    assert 'endpoint="/v2/models/{name}/infer",method="POST",status="200"} 1.0' in text
    assert 'endpoint="/v2/models/{name}/versions/{version}/infer",method="POST",status="200"} 1.0' in text
    assert 'endpoint="/v2/models/{name}/infer",method="POST",status="400"} 1.0' in text
    assert app.counts.answered == 3


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_writes_of_one_turn_leave_together_and_close_flushes_first():
    async def main() -> tuple[list[bytes], list[bytes], list[bytes], int]:
        real = _Recorder()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.write(b"body")
        during = list(real.writes)
        size = t.get_write_buffer_size()
        await asyncio.sleep(0)
        after_turn = list(real.writes)
        t.write(b"last")
        t.close()
        return during, after_turn, list(real.writes), size

    during, after_turn, at_close, size = asyncio.run(main())
    assert during == [] and size == 23
    assert after_turn == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    assert at_close == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"last"]


def test_an_abort_drops_what_is_unsent_and_other_calls_reach_the_transport():
    async def main() -> tuple[_Recorder, str]:
        real = _Recorder()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"never sent")
        t.abort()
        await asyncio.sleep(0)
        return real, t.get_extra_info("peername")

    real, info = asyncio.run(main())
    assert real.writes == [] and real.aborted and info == "info:peername"


def test_pipelined_requests_are_answered_in_order_over_one_connection(adder_server):
    """Two requests in one packet: both answers, in order, each whole (the coalesced
    writes of several responses keep their order and their bytes)."""
    host, port = adder_server.url.removeprefix("http://").split(":")
    bodies = [_json_infer([[1, 2, 3]], [[1]]), _json_infer([[0, 0, 0]], [[5]])]
    wire = b"".join(
        b"POST /v2/models/adder/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b) for b in bodies
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(wire)
        reader = sock.makefile("rb")
        docs = []
        for _ in bodies:
            status = reader.readline()
            assert status.startswith(b"HTTP/1.1 200"), status
            length = None
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            assert length is not None
            docs.append(json.loads(reader.read(length)))
    assert [d["outputs"][0]["data"] for d in docs] == [[3.0, 5.0, 7.0], [5.0, 5.0, 5.0]]


@pytest.fixture(scope="module")
def encoder(encoder_dir: Path):
    model = ServedModel.load(encoder_dir, name="tiny", session_kwargs={"max_batch_size": 8})
    yield model
    model.close()


def test_fast_embeddings_answer_what_starlette_answers(encoder):
    def doc(**kw: Any) -> bytes:
        return json.dumps(kw).encode()

    json_type = {"Content-Type": "application/json"}
    cases: list[tuple[str, str, bytes, dict[str, str]]] = [
        ("POST", "/v1/embeddings", doc(input="hello world"), json_type),
        ("POST", "/v1/embeddings", doc(input=["a b", "c"], encoding_format="base64", model="tiny"), json_type),
        ("POST", "/v1/embeddings", gzip.compress(doc(input="hello")), {"Content-Encoding": "gzip"}),
        ("POST", "/v1/embeddings", doc(input="x", encoding_format="hex"), json_type),
        ("POST", "/v1/embeddings", doc(input="x", model="other"), json_type),
        ("POST", "/v1/embeddings", doc(input=[]), json_type),
        ("POST", "/v1/embeddings", b"[1, 2]", json_type),
        ("POST", "/v1/embeddings", b"{oops", json_type),
        ("GET", "/v1/embeddings", b"", {}),
    ]
    app = build_app(encoder)
    starlette_only = RequestObserver(app.app.app, app.metrics, app.counts)
    fast, slow = asyncio.run(_answers(app, cases)), asyncio.run(_answers(starlette_only, cases))
    assert fast == slow
    assert [a[2] for a in fast] == [200, 200, 200, 400, 404, 400, 400, 400, 405]
    first = json.loads(fast[0][4])
    assert first["object"] == "list" and len(first["data"]) == 1 and first["model"] == "tiny"
    assert len(json.loads(fast[1][4])["data"]) == 2
    error = json.loads(fast[3][4])["error"]  # OpenAI's error shape under /v1/
    assert error["type"] == "invalid_request_error" and error["param"] == "encoding_format"
