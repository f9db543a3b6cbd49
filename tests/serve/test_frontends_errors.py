"""Typed errors over the front-end boundary give exactly the HTTP and gRPC answers of the
one-process server: the same app served once on a session and once on a ProxySession
whose engine (a FrontEndLink in this process) runs the same scripted session."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_frontends_transport import INFO, Scripted

from ortbatch.runtime.stats import Stats
from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel
from ortbatch.serve.frontends.engine import FrontEndLink
from ortbatch.serve.frontends.proxy import ProxySession
from ortbatch.serve.frontends.transport import Arena

pytestmark = pytest.mark.timeout(120)


class OneProcess(Scripted):
    """The scripted session with the methods a ServedModel needs, served directly."""

    closed = False
    max_batch_size = 4
    manifest = None

    def get_inputs(self) -> list[Any]:
        return list(INFO.inputs)

    def get_outputs(self) -> list[Any]:
        return list(INFO.outputs)

    async def run_async(self, names: Any, feed: Any, *, timeout_s: Any = None) -> Any:
        return await asyncio.wrap_future(self.submit(feed, names, timeout_s=timeout_s))

    def close(self, drain: bool = True) -> None:
        self.closed = True


def _servers(grpc: bool) -> tuple[BackgroundServer, BackgroundServer, FrontEndLink, ProxySession]:
    cfg = {"port": 0, "access_log": False, "log_level": "warning", "grpc_port": 0 if grpc else None}
    direct = BackgroundServer(ServedModel(OneProcess(), "m"), ServeConfig(**cfg)).start()  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    req, resp = Arena.create(1 << 20), Arena.create(1 << 20)
    link = FrontEndLink(Scripted(), ours, Arena(req.handle), Arena(resp.handle))
    proxy = ProxySession(theirs, INFO, req, resp)
    front = BackgroundServer(ServedModel(proxy, "m"), ServeConfig(**cfg)).start()  # type: ignore[arg-type]
    return direct, front, link, proxy


@pytest.fixture(scope="module")
def servers():
    direct, front, link, proxy = _servers(grpc=True)
    yield direct, front
    front.stop()
    direct.stop()
    proxy.shutdown()
    link.closed.wait(10)


CASES = {"ok": 0.5, "queue-full": 1, "deadline": 2, "bad-input": 3, "ort-failed": 4}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_http_answers_are_those_of_one_process(servers, case):
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [CASES[case]] * 3}]}
    got = []
    for srv in servers:
        r = httpx.post(srv.url + "/v2/models/m/infer", json=body, timeout=30)
        got.append((r.status_code, r.json(), r.headers.get("retry-after")))
    assert got[0] == got[1]
    expected = {"ok": 200, "queue-full": 429, "deadline": 504, "bad-input": 400, "ort-failed": 500}[case]
    assert got[1][0] == expected, got[1]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_grpc_status_codes_are_those_of_one_process(servers, case):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    got = []
    for srv in servers:
        with grpcclient.InferenceServerClient(srv.grpc.address) as client:
            x = grpcclient.InferInput("x", [1, 3], "FP32")
            x.set_data_from_numpy(np.full((1, 3), CASES[case], dtype=np.float32))
            try:
                res = client.infer("m", [x])
                got.append(("OK", res.as_numpy("y").tolist()))
            except InferenceServerException as exc:
                got.append((exc.status(), exc.message()))
    assert got[0] == got[1]
    expected = {
        "ok": "OK",
        "queue-full": "StatusCode.RESOURCE_EXHAUSTED",
        "deadline": "StatusCode.DEADLINE_EXCEEDED",
        "bad-input": "StatusCode.INVALID_ARGUMENT",
        "ort-failed": "StatusCode.INTERNAL",
    }[case]
    assert got[1][0] == expected, got[1]


def test_engine_gone_is_503_and_not_ready():
    direct, front, link, proxy = _servers(grpc=False)
    try:
        link.sock.shutdown(socket.SHUT_RDWR)
        for _ in range(200):
            r = httpx.get(front.url + "/v2/health/ready", timeout=10)
            if r.status_code == 503:
                break
            time.sleep(0.02)
        assert r.status_code == 503
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [0.5] * 3}]}
        r = httpx.post(front.url + "/v2/models/m/infer", json=body, timeout=30)
        assert r.status_code == 503 and "engine process is gone" in r.json()["error"]
    finally:
        front.stop()
        direct.stop()
        proxy.shutdown()
        link.closed.wait(10)


def test_background_server_refuses_frontends():
    from ortbatch.errors import ServeError

    with pytest.raises(ServeError, match="frontends must be 1"):
        BackgroundServer(ServedModel(OneProcess(), "m"), ServeConfig(port=0, frontends=2))


class SlowStats(OneProcess):
    """A session whose ``stats()`` blocks until released, as a ProxySession's does while
    the engine is slow to answer its stats request."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()
        self.release = threading.Event()

    def stats(self) -> Any:
        self.asked.set()
        self.release.wait(30)
        return Stats(0, 0, 0, 0, 0, 0, 0.0, 0.0, {}, 0.0, {}, {}, {}, 0, 1)


def test_a_slow_stats_answer_does_not_stall_the_server():
    """/metrics reads the session's stats off the event loop: while a scrape waits on them
    (over --frontends, a round trip to the engine), every other request is still served."""
    session = SlowStats()
    srv = BackgroundServer(ServedModel(session, "m"), ServeConfig(port=0, access_log=False)).start()  # type: ignore[arg-type]
    scrape: dict[str, Any] = {}
    t = threading.Thread(target=lambda: scrape.update(r=httpx.get(srv.url + "/metrics", timeout=60)))
    try:
        t.start()
        assert session.asked.wait(30), "the scrape never asked for the stats"
        r = httpx.get(srv.url + "/v2/health/live", timeout=5)
        assert r.status_code == 200
        assert t.is_alive(), "the scrape ended before its stats were released"
    finally:
        session.release.set()
        t.join(30)
        srv.stop()
    assert scrape["r"].status_code == 200 and "ortbatch_queue_depth" in scrape["r"].text
