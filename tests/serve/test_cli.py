"""``ortbatch serve`` as users run it: a subprocess on a free loopback port.

Acceptance 3: a bounded load test from a second process (benchmarks/serve_load.py,
>= 2000 requests, concurrent clients): zero lost or mismatched responses.
Acceptance 4: SIGTERM during load: every accepted request is answered, exit 0.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from scripted import start_script_server

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LOAD = REPO / "benchmarks" / "serve_load.py"


def load_command(url, export, out, *extra):
    return [
        sys.executable,
        str(LOAD),
        "--url",
        url,
        "--export",
        str(export),
        "--model",
        "tiny",
        "--lengths",
        "3-14",
        "--json",
        str(out),
        *extra,
    ]


def infer_count(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(
        r'ortbatch_http_requests_total\{endpoint="/v2/models/\{name\}/infer",method="POST",'
        r'status="200"\} ([0-9.e+]+)',
        text,
    )
    return int(float(m.group(1))) if m else 0


def served_counts(log: str) -> tuple[int, int]:
    m = re.search(r"requests accepted=(\d+) answered=(\d+)", log)
    assert m, log
    return int(m.group(1)), int(m.group(2))


def test_load_from_a_second_process_loses_nothing(serve_process, encoder_dir, tmp_path):
    # a 2 ms batching window: on an idle machine the trivial model is otherwise done
    # before the next request arrives, and every batch would hold one row
    srv = serve_process(
        str(encoder_dir), "--name", "tiny", "--max-batch-size", "8", "--max-delay-ms", "2", "--no-access-log"
    )
    out = tmp_path / "load.json"
    t0 = time.monotonic()
    subprocess.run(
        load_command(srv.url, encoder_dir, out, "--requests", "2000", "--concurrency", "32"),
        check=True,
        timeout=150,
        capture_output=True,
    )
    summary = json.loads(out.read_text())
    print("load:", summary, f"({time.monotonic() - t0:.1f}s)")
    assert summary["sent"] == 2000
    assert summary["ok"] == 2000, summary
    assert summary["mismatched"] == 0 and summary["http_errors"] == {} and summary["connection_errors"] == 0
    metrics = httpx.get(srv.url + "/metrics").text
    batches = float(re.search(r"ortbatch_batch_rows_count ([0-9.e+]+)", metrics).group(1))
    assert 0 < batches < 2000  # concurrent HTTP requests really were batched together
    srv.terminate()
    assert srv.wait(60) == 0
    accepted, answered = served_counts(srv.text())
    assert accepted == answered >= 2000


def test_sigterm_during_load_answers_every_accepted_request(serve_process, encoder_dir, tmp_path):
    srv = serve_process(str(encoder_dir), "--name", "tiny", "--max-batch-size", "8", "--no-access-log")
    out = tmp_path / "load.json"
    load = subprocess.Popen(
        load_command(
            srv.url,
            encoder_dir,
            out,
            "--requests",
            "100000",
            "--concurrency",
            "32",
            "--duration",
            "60",
            "--stop-on-disconnect",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    polls = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            polls += 1
            if infer_count(srv.url) >= 300:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the load never got going")
        srv.terminate()  # SIGTERM with ~32 requests in flight
        code = srv.wait(60)
        _, err = load.communicate(timeout=90)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    assert code == 0, srv.text()
    assert load.returncode == 0, err.decode()
    accepted, answered = served_counts(srv.text())
    summary = json.loads(out.read_text())
    print("server:", accepted, answered, "client:", summary)
    assert accepted == answered  # nothing the server took in went unanswered
    # every answer reached its client and was right; the rest were refused connections
    assert summary["mismatched"] == 0 and summary["http_errors"] == {}, summary
    assert summary["ok"] == answered - polls
    assert summary["ok"] >= 300
    assert summary["sent"] == summary["ok"] + summary["connection_errors"]


def test_cli_rejects_a_missing_directory(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "serve", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_cli_help_lists_the_flags():
    r = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "serve", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert r.returncode == 0
    for flag in ("--host", "--port", "--max-batch-size", "--max-queue", "--max-body-bytes", "--name"):
        assert flag in r.stdout


SLOW_SERVER = """
import asyncio, sys
from types import SimpleNamespace
import numpy as np
from ortbatch.serve import server
from ortbatch.serve.served.model import ServedModel

class Slow:
    closed = False
    max_batch_size = 4
    manifest = None
    def get_inputs(self):
        return [SimpleNamespace(name="x", type="tensor(float)", shape=["batch", 3])]
    def get_outputs(self):
        return [SimpleNamespace(name="y", type="tensor(float)", shape=["batch", 3])]
    async def run_async(self, names, feed):
        await asyncio.sleep(float(sys.argv[1]))
        return [feed["x"]]
    def stats(self):
        return SimpleNamespace(queued=0, padding_fraction=0.0, requests=0, batches=0, errors={},
                               rows_histogram={}, rows=0)
    def close(self, drain=True):
        self.closed = True

ServedModel.load = classmethod(lambda cls, d, **kw: ServedModel(Slow(), "slow"))
cfg = server.ServeConfig(port=0, access_log=False, log_level="warning", graceful_timeout_s=float(sys.argv[2]))
sys.exit(server.serve(".", cfg))
"""


@pytest.mark.parametrize(
    ("work_s", "grace_s", "code"),
    [(1.0, 30.0, 0), (30.0, 0.5, 1)],
    ids=["in-flight-answered", "grace-exceeded"],
)
def test_sigterm_drains_in_flight_requests(tmp_path, work_s, grace_s, code):
    """SIGTERM while a request is being computed: it is answered before exit (0), or,
    if it outlives --graceful-timeout-s, the exit code says it was not (1)."""
    import signal
    import threading

    proc, url, log = start_script_server(SLOW_SERVER, tmp_path, str(work_s), str(grace_s))
    try:
        result = {}

        def call():
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
            try:
                result["r"] = httpx.post(url + "/v2/models/slow/infer", json=body, timeout=60)
            except httpx.HTTPError as exc:
                result["err"] = exc

        t = threading.Thread(target=call)
        t.start()

        def in_flight() -> float:  # counts this /metrics request itself too
            text = httpx.get(url + "/metrics").text
            return float(re.search(r"^ortbatch_http_requests_in_flight ([0-9.]+)", text, re.M).group(1))

        while in_flight() < 2:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == code, log.read_text()
        t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code == 0:
        assert result["r"].status_code == 200 and result["r"].json()["outputs"][0]["data"] == [1.0, 2.0, 3.0]
        accepted, answered = served_counts(log.read_text())
        assert accepted == answered
    else:
        assert "err" in result or result["r"].status_code >= 500
        assert "cancelled unanswered" in log.read_text()


def test_loopback_unless_told_otherwise():
    from ortbatch.cli import build_parser
    from ortbatch.serve import ServeConfig
    from ortbatch.serve.listen import is_loopback

    args = build_parser().parse_args(["serve", "exports/minilm"])
    assert args.host == "127.0.0.1" and ServeConfig().host == "127.0.0.1" and args.port == 8000
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1") and not is_loopback("example.org")


def test_no_latency_session_reaches_the_batched_session(adder_path):
    from ortbatch.cli import build_parser
    from ortbatch.serve import ServeConfig
    from ortbatch.serve.served.model import ServedModel

    args = build_parser().parse_args(["serve", "exports/minilm", "--no-latency-session"])
    assert args.no_latency_session
    assert "latency_session" not in ServeConfig().session_kwargs()  # BatchedSession's default
    kwargs = ServeConfig(latency_session=False).session_kwargs()
    model = ServedModel.load(adder_path, session_kwargs=kwargs)
    try:
        assert model.session.latency_session is None
    finally:
        model.close()
