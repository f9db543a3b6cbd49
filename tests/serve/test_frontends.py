"""``ortbatch serve DIR --frontends 2`` as users run it (a subprocess): every protocol
through the front ends, answers checked one by one against a direct ONNX Runtime run,
a front end killed under load (issue 15 acceptance 3), SIGTERM draining, and the
front ends leaving when the engine dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.signals import sigint_default

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ARGS = ("--name", "tiny", "--frontends", "2", "--max-batch-size", "8", "--max-delay-ms", "1", "--no-access-log")


@pytest.fixture(scope="module")
def encoder_ort(encoder_dir):
    return ort.InferenceSession(str(encoder_dir / "model.onnx"), providers=["CPUExecutionProvider"])


def frontend_pids(text: str) -> list[int]:
    m = re.search(r"front-end processes \(pids ([\d, ]+)\)", text)
    assert m, text
    return [int(p) for p in m.group(1).split(", ")]


def pid_of_metrics(text: str) -> int:
    m = re.search(r'ortbatch_frontend\{index="\d+",pid="(\d+)"\} 1', text)
    assert m, text
    return int(m.group(1))


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] == "Z"  # a zombie nobody reaps has exited too
    except FileNotFoundError:
        return True


class Requests:
    """Distinct token requests, each with its own expected ``pooled`` output."""

    def __init__(self, session: Any, seed: int) -> None:
        self.session = session
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()

    def make(self) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            n = int(self.rng.integers(2, 15))
            ids = self.rng.integers(4, 20, (1, n)).astype(np.int64)
        mask = np.ones_like(ids)
        (pooled,) = self.session.run(["pooled"], {"input_ids": ids, "attention_mask": mask})
        return ids, pooled


def infer_body(ids: np.ndarray) -> dict[str, Any]:
    shape = list(ids.shape)
    return {
        "inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": shape, "data": ids.reshape(-1).tolist()},
            {"name": "attention_mask", "datatype": "INT64", "shape": shape, "data": [1] * ids.size},
        ],
        "outputs": [{"name": "pooled"}],
    }


class Client(threading.Thread):
    """One keep-alive connection sending distinct requests until told to stop; every
    request sent gets exactly one outcome: ``ok``, ``wrong`` or an error's kind."""

    def __init__(self, url: str, reqs: Requests, stop: threading.Event, timeout: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.url, self.reqs, self.stop = url, reqs, stop
        self.http = httpx.Client(base_url=url, timeout=timeout)
        self.pid = pid_of_metrics(self.http.get("/metrics").text)  # the front end of this connection
        self.sent = 0
        self.outcomes: list[tuple[str, float, float]] = []  # (outcome, sent at, seconds)

    def run(self) -> None:
        while not self.stop.is_set():
            ids, want = self.reqs.make()
            self.sent += 1
            t0 = time.monotonic()
            try:
                r = self.http.post("/v2/models/tiny/infer", json=infer_body(ids))
            except httpx.TimeoutException:
                self.outcomes.append(("timeout", t0, time.monotonic() - t0))
                continue
            except httpx.TransportError:  # the connection closed under the request
                self.outcomes.append(("closed", t0, time.monotonic() - t0))
                continue
            if r.status_code != 200:
                self.outcomes.append((f"http {r.status_code}", t0, time.monotonic() - t0))
                continue
            got = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(want.shape)
            ok = np.allclose(got, want, rtol=1e-5, atol=1e-5)
            self.outcomes.append(("ok" if ok else "wrong", t0, time.monotonic() - t0))
        self.http.close()


def clients_on_both(url: str, reqs: Requests, stop: threading.Event, pids: list[int], n: int) -> list[Client]:
    """At least ``n`` clients, with some connected to every front end."""
    clients: list[Client] = []
    for _ in range(200):
        clients.append(Client(url, reqs, stop))
        if len(clients) >= n and {c.pid for c in clients} == set(pids):
            return clients
    raise AssertionError(f"connections never reached every front end: {[c.pid for c in clients]}")


def test_every_protocol_through_two_front_ends_and_sigterm_drains(serve_process, encoder_dir, encoder_ort):
    httpclient = pytest.importorskip("tritonclient.http")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    srv = serve_process(str(encoder_dir), *ARGS, "--grpc-port", "0")
    text = srv.text()
    pids = frontend_pids(text)
    grpc_addr = re.search(r"gRPC on (\S+)\)", text).group(1)
    host = srv.url.removeprefix("http://")
    ids = np.array([[2, 5, 6, 7, 3]], dtype=np.int64)
    mask = np.ones_like(ids)
    want_lhs, want_pooled = encoder_ort.run(None, {"input_ids": ids, "attention_mask": mask})

    # KServe v2 over HTTP, binary and JSON tensors, and over gRPC (tritonclient, unchanged)
    for binary in (True, False):
        client = httpclient.InferenceServerClient(host)
        a = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
        a.set_data_from_numpy(ids, binary_data=binary)
        b = httpclient.InferInput("attention_mask", list(ids.shape), "INT64")
        b.set_data_from_numpy(mask, binary_data=binary)
        res = client.infer("tiny", [a, b])
        np.testing.assert_allclose(res.as_numpy("last_hidden_state"), want_lhs, rtol=1e-6)
        np.testing.assert_allclose(res.as_numpy("pooled"), want_pooled, rtol=1e-6)
        client.close()
    with grpcclient.InferenceServerClient(grpc_addr) as client:
        assert client.is_server_live() and client.is_model_ready("tiny")
        assert client.get_model_config("tiny").config.max_batch_size == 8
        a = grpcclient.InferInput("input_ids", list(ids.shape), "INT64")
        a.set_data_from_numpy(ids)
        b = grpcclient.InferInput("attention_mask", list(ids.shape), "INT64")
        b.set_data_from_numpy(mask)
        res = client.infer("tiny", [a, b])
        np.testing.assert_allclose(res.as_numpy("pooled"), want_pooled, rtol=1e-6)
        bad = grpcclient.InferInput("input_ids", [1, 2], "INT64")
        bad.set_data_from_numpy(np.array([[1, 10_000]], dtype=np.int64))
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException) as err:
            client.infer("tiny", [bad, b])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    # text in, tokenized in the front end
    emb = httpx.post(srv.url + "/v1/embeddings", json={"input": ["hello world", "the lazy dog"]}).json()
    assert len(emb["data"]) == 2 and len(emb["data"][0]["embedding"]) == 4
    r = httpx.post(srv.url + "/v2/models/tiny/infer", json={"inputs": [{"name": "input_ids"}]})
    assert r.status_code == 400

    # distinct requests from clients on both front ends, each checked against its own run
    reqs = Requests(encoder_ort, seed=1)
    stop = threading.Event()
    clients = clients_on_both(srv.url, reqs, stop, pids, 8)
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while sum(len(c.outcomes) for c in clients) < 400 and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = httpx.get(srv.url + "/metrics").text  # the engine's batching stats, through a front end
    batches = float(re.search(r"^ortbatch_batch_rows_count ([0-9.e+]+)", metrics, re.M).group(1))
    requests = float(re.search(r"^ortbatch_session_requests_total ([0-9.e+]+)", metrics, re.M).group(1))
    assert 0 < batches <= requests and requests >= 400
    srv.terminate()  # SIGTERM with requests in flight on both front ends
    code = srv.wait(60)
    stop.set()
    for c in clients:
        c.join(30)
    assert code == 0, srv.text()
    outcomes = [o for c in clients for o, _, _ in c.outcomes]
    assert sum(c.sent for c in clients) == len(outcomes)
    assert "wrong" not in outcomes and outcomes.count("ok") >= 400
    # after SIGTERM a client finds the connection closed or refused; nothing else
    assert set(outcomes) <= {"ok", "closed"}, set(outcomes)
    m = re.search(r"requests accepted=(\d+) answered=(\d+) .*; by front end: 1: (\d+), 2: (\d+)", srv.text())
    assert m, srv.text()
    accepted, answered, one, two = map(int, m.groups())
    assert accepted == answered >= outcomes.count("ok")
    assert one > 0 and two > 0  # both front ends served


def test_a_killed_front_end_comes_back_and_only_its_requests_fail(serve_process, encoder_dir, encoder_ort):
    srv = serve_process(str(encoder_dir), *ARGS)
    pids = frontend_pids(srv.text())
    victim, survivor = pids
    reqs = Requests(encoder_ort, seed=2)
    stop = threading.Event()
    clients = clients_on_both(srv.url, reqs, stop, pids, 6)
    for c in clients:
        c.start()
    try:
        while sum(len(c.outcomes) for c in clients) < 100:
            time.sleep(0.02)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (m := re.search(r"front end 1 restarted \(pid (\d+)\)", srv.text())):
            assert time.monotonic() < deadline, srv.text()
            time.sleep(0.05)
        new_pid = int(m.group(1))
        after = sum(len(c.outcomes) for c in clients)
        while sum(len(c.outcomes) for c in clients) < after + 100:
            time.sleep(0.02)
    finally:
        stop.set()
        for c in clients:
            c.join(30)
    assert "died (signal 9)" in srv.text()
    for c in clients:
        assert c.sent == len(c.outcomes)  # every request got exactly one outcome
        kinds = [o for o, _, _ in c.outcomes]
        assert "wrong" not in kinds and "timeout" not in kinds, kinds
        if c.pid == survivor:
            assert set(kinds) == {"ok"}, kinds  # untouched by the other's death
        else:
            # only what was on the dead front end failed, at once, and the client's next
            # connection was served
            failed = [(t, s) for o, t, s in c.outcomes if o != "ok"]
            assert len(failed) <= 1, c.outcomes[-5:]
            assert all(s < 10 and t >= killed_at - 1 for t, s in failed)
            assert kinds[-1] == "ok"
    # the restarted front end serves new connections
    for _ in range(200):
        with httpx.Client(base_url=srv.url, timeout=10) as h:
            if pid_of_metrics(h.get("/metrics").text) == new_pid:
                r = h.post("/v2/models/tiny/infer", json=infer_body(np.array([[2, 5, 3]])))
                assert r.status_code == 200
                break
    else:
        pytest.fail("the restarted front end never answered")
    srv.terminate()
    assert srv.wait(60) == 0, srv.text()


def test_front_ends_exit_when_the_engine_dies(serve_process, encoder_dir):
    srv = serve_process(str(encoder_dir), *ARGS)
    pids = frontend_pids(srv.text())
    assert httpx.get(srv.url + "/v2/health/ready").status_code == 200
    srv.proc.kill()
    srv.proc.wait(10)
    deadline = time.monotonic() + 20
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"front ends still alive after the engine died:\n{srv.text()}"
        time.sleep(0.1)
    assert "the engine process is gone; exiting" in srv.text()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--frontends", "0"), "--frontends must be 1 or more, got 0"),
        (("--frontends", "2", "--ray"), "--frontends and --ray do not go together"),
    ],
    ids=["zero", "ray"],
)
def test_cli_refuses_bad_frontends(encoder_dir, extra, message):
    r = _cli(str(encoder_dir), *extra)
    assert r.returncode == 2 and message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_ctrl_c_stops_the_whole_group_without_a_traceback(tmp_path, encoder_dir):
    """A terminal's Ctrl-C sends SIGINT to every process of the group at once."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ortbatch.cli", "serve", str(encoder_dir), *ARGS, "--port", "0"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=sigint_default,  # SIGINT must not stay ignored when the suite runs in a background job
        )
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert httpx.post(m.group(1) + "/v2/models/tiny/infer", json=infer_body(np.array([[2, 5, 3]]))).is_success
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert re.search(r"stopped; requests accepted=1 answered=1 ", text), text


def test_sigterm_answers_a_request_still_queued_in_the_engine(serve_process, encoder_dir):
    """A 2 s batching window holds the request in the engine's queue while SIGTERM
    arrives: the front end waits for its answer, the session drains before it closes."""
    srv = serve_process(str(encoder_dir), "--name", "tiny", "--frontends", "2", "--max-delay-ms", "2000")
    result: dict[str, Any] = {}

    def call() -> None:
        result["r"] = httpx.post(srv.url + "/v2/models/tiny/infer", json=infer_body(np.array([[2, 5, 3]])), timeout=60)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 30
    while not re.search(r"^ortbatch_queue_depth 1\.0", httpx.get(srv.url + "/metrics").text, re.M):
        assert time.monotonic() < deadline, "the request never reached the engine's queue"
        time.sleep(0.02)
    srv.terminate()
    assert srv.wait(60) == 0, srv.text()
    t.join(30)
    assert result["r"].status_code == 200, result["r"].text
    assert re.search(r"requests accepted=(\d+) answered=\1 ", srv.text()), srv.text()
