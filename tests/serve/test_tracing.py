"""OpenTelemetry traces, received by a local OTLP/HTTP collector stand-in
(otlp_receiver.py, decoding ``ExportTraceServiceRequest`` with opentelemetry-proto): one
trace per request (the client's ``traceparent`` honoured, over HTTP and gRPC), its spans
chained under the request's SERVER span, the batch span naming the rows its batch held;
requests that shared a batch (forced with a gate) carry the same batch id; a generation
request's span has TTFT and token counts. Without an endpoint nothing of OpenTelemetry is
imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import onnxruntime as ort
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")
pytest.importorskip("opentelemetry.proto")

from otlp_receiver import OtlpReceiver, Span
from tokenizers import Tokenizer

from ortbatch import BatchedSession
from ortbatch.manifest import Manifest
from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel, tracing
from ortbatch.serve.served.generator import ServedGenerator
from tests.runtime.helpers import GatedSession

REPO = Path(__file__).resolve().parents[2]
SERVER = 2  # SpanKind.SERVER in OTLP
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def traces(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.trace_id, []).append(s)
    return out


def requests_seen(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.kind == SERVER]


def check_chained(trace: list[Span]) -> Span:
    """The trace's one SERVER span; every other span descends from it."""
    (root,) = [s for s in trace if s.kind == SERVER]
    ids = {s.span_id for s in trace}
    for s in trace:
        if s is not root:
            assert s.parent_id in ids, f"{s.name} hangs outside its request's trace"
    return root


def embed(url: str, text: str, headers: dict[str, str] | None = None) -> None:
    response = httpx.post(url + "/v1/embeddings", json={"input": text}, headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx
    tracing.shutdown()  # an in-process test's tracing must not outlive it


def test_a_served_export_sends_one_trace_per_request(serve_process, encoder_dir, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s, not 5
    server = serve_process(str(encoder_dir), "--name", "tiny", "--otlp-endpoint", receiver.url)
    embed(server.url, "a first text")
    embed(server.url, "a second, longer text to embed", {"traceparent": TRACEPARENT})
    doc = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["infer this"]}]}
    assert httpx.post(server.url + "/v2/models/tiny_text/infer", json=doc, timeout=60).status_code == 200
    assert httpx.get(server.url + "/v2/health/ready", timeout=60).status_code == 200

    def complete(spans: list[Span]) -> bool:
        return len(requests_seen(spans)) == 4 and sum(s.name == "ortbatch.batch" for s in spans) == 3

    spans = receiver.wait_for(complete)
    by_trace = traces(spans)
    assert len(by_trace) == 4  # one trace per request, nothing else
    names = sorted(check_chained(t).name for t in by_trace.values())
    assert names == [
        "GET /v2/health/ready",
        "POST /v1/embeddings",
        "POST /v1/embeddings",
        "POST /v2/models/{name}/infer",
    ]
    joined = by_trace[TRACE_ID]  # the client's trace, continued
    root = check_chained(joined)
    assert root.parent_id == PARENT_ID and root.attributes["http.response.status_code"] == 200
    assert sorted(s.name for s in joined) == [
        "POST /v1/embeddings",
        "ortbatch.batch",
        "ortbatch.queue",
        "ortbatch.tokenize",
    ]
    (batch,) = [s for s in joined if s.name == "ortbatch.batch"]
    assert batch.attributes["ortbatch.model"] == "tiny"
    assert batch.attributes["ortbatch.batch.rows"] == 1 and batch.attributes["ortbatch.batch.requests"] == 1
    assert batch.attributes["ortbatch.batch.padded_tokens"] >= batch.attributes["ortbatch.batch.real_tokens"] > 0
    assert root.start_ns <= batch.start_ns <= batch.end_ns <= root.end_ns
    assert {s.service for s in spans} == {"ortbatch"}


@pytest.fixture
def gated_model(encoder_dir) -> Iterator[tuple[ServedModel, GatedSession]]:
    inner = GatedSession(ort.InferenceSession(str(encoder_dir / "model.onnx"), providers=["CPUExecutionProvider"]))
    session = BatchedSession(inner, workers=1)
    tokenizer = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    yield ServedModel(session, "tiny", manifest=Manifest.load(encoder_dir), tokenizer=tokenizer), inner
    inner.gate.set()
    session.close()


def test_requests_that_shared_a_batch_carry_its_id(gated_model, receiver):
    model, inner = gated_model
    config = ServeConfig(port=0, access_log=False, log_level="warning", otlp_endpoint=receiver.url)
    with BackgroundServer(model, config, close_model=False) as srv:
        headers = {name: {"traceparent": f"00-{(str(i) * 32)[:32]}-{PARENT_ID}-01"} for i, name in enumerate("abc", 1)}
        threads = [threading.Thread(target=embed, args=(srv.url, "first", headers["a"]))]
        threads[0].start()
        assert inner.entered.wait(30)  # the one worker runs "a" and waits at the gate
        for name in "bc":
            threads.append(threading.Thread(target=embed, args=(srv.url, f"text {name}", headers[name])))
            threads[-1].start()
        deadline = time.monotonic() + 30
        while model.session.stats().queued < 2:  # "b" and "c" wait together for the next batch
            assert time.monotonic() < deadline, "b and c never queued"
            time.sleep(0.01)
        inner.gate.set()
        for t in threads:
            t.join(60)
        active = tracing.active()
        assert active is not None and active.flush()
    spans = receiver.wait_for(lambda s: sum(x.name == "ortbatch.batch" for x in s) == 3)
    batch = {s.trace_id[0]: s.attributes for s in spans if s.name == "ortbatch.batch"}
    assert batch["2"]["ortbatch.batch.id"] == batch["3"]["ortbatch.batch.id"] != batch["1"]["ortbatch.batch.id"]
    assert batch["2"]["ortbatch.batch.rows"] == batch["3"]["ortbatch.batch.rows"] == 2
    assert batch["1"]["ortbatch.batch.rows"] == 1
    for t in traces(spans).values():
        check_chained(t)


def test_a_generation_request_has_one_span_with_ttft_and_token_counts(tmp_path, receiver):
    from ortbatch.generation import BatchedGenerator
    from tests.generation.fake_decoder import build

    generator = BatchedGenerator(build(tmp_path / "fake"), max_batch_size=4)
    config = ServeConfig(port=0, access_log=False, log_level="warning", otlp_endpoint=receiver.url)
    with BackgroundServer(ServedGenerator(generator, "gen"), config) as srv:
        doc = {"prompt": [5, 6, 7, 8], "max_tokens": 20, "temperature": 0}
        answer = httpx.post(srv.url + "/v1/completions", json=doc, headers={"traceparent": TRACEPARENT}, timeout=60)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        active = tracing.active()
        assert active is not None and active.flush()
    spans = receiver.wait_for(lambda s: any(x.name == "ortbatch.generate" for x in s) and requests_seen(s))
    (trace,) = traces(spans).values()
    check_chained(trace)
    (gen,) = [s for s in trace if s.name == "ortbatch.generate"]
    assert gen.trace_id == TRACE_ID
    assert gen.attributes["ortbatch.completion_tokens"] == usage["completion_tokens"]
    assert gen.attributes["ortbatch.prompt_tokens"] == usage["prompt_tokens"] == 4
    assert 0 < gen.attributes["ortbatch.ttft_s"] < 60
    events = [name for name, _ in gen.events]
    assert events[0] == "prefill" and "first token" in events
    steps = [attrs["ortbatch.step"] for name, attrs in gen.events if name == "decode step"]
    assert steps and all((s - 1) % tracing.STEP_EVERY == 0 for s in steps)  # sampled


def test_a_grpc_request_joins_the_clients_trace(encoder_dir, receiver):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import numpy as np

    model = ServedModel.load(encoder_dir, name="tiny", session_kwargs={"max_batch_size": 8})
    config = ServeConfig(port=0, access_log=False, log_level="warning", grpc_port=0, otlp_endpoint=receiver.url)
    with BackgroundServer(model, config) as srv:
        assert srv.grpc is not None
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        text = grpcclient.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hello there"], dtype=object))
        client.infer("tiny_text", [text], headers={"traceparent": TRACEPARENT})
        client.close()
        active = tracing.active()
        assert active is not None and active.flush()
    spans = receiver.wait_for(lambda s: any(x.name == "ortbatch.batch" for x in s))
    (trace,) = traces(spans).values()
    root = check_chained(trace)
    assert root.trace_id == TRACE_ID and root.parent_id == PARENT_ID
    assert root.name.endswith("/ModelInfer") and root.attributes["rpc.system"] == "grpc"


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported(encoder_dir):
    script = f"""
import sys
from starlette.testclient import TestClient
from ortbatch.serve import ServeConfig
from ortbatch.serve.assembly import load_app
served, app = load_app({str(encoder_dir)!r}, ServeConfig())
with TestClient(app) as client:
    assert client.post("/v1/embeddings", json={{"input": "hello"}}).status_code == 200
assert served.session.observer is None
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"')) == []


def test_the_environment_alone_turns_tracing_on(monkeypatch, receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    assert tracing.configure(None) is not None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.endpoint_from_env() is None


def test_a_bad_otlp_endpoint_is_one_line_and_exit_2(encoder_dir):
    out = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "serve", str(encoder_dir), "--otlp-endpoint", "localhost:4317"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert "--otlp-endpoint" in out.stderr and "Traceback" not in out.stderr
