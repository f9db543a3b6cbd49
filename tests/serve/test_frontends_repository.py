"""Several models over front-end processes (``ortbatch serve --repository ROOT --frontends 2``),
as users run it (a subprocess): every model answers through both front ends; reloads and
unloads asked of one front end (over HTTP and gRPC) hold on every front end by the time
they are answered, under load, with nothing lost or mixed; a killed front end lets go of
its models and comes back serving the current ones."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import reloads
from reloads import Clients, changing_repository, swap_in, which
from test_frontends import frontend_pids, pid_of_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ARGS = ("--frontends", "2", "--max-batch-size", "8", "--max-delay-ms", "1", "--no-access-log")
TEXT = "the quick brown fox"


def _generation_export(directory: Path, adder_path: Path) -> None:
    from ortbatch.manifest import InputSpec, Manifest, OutputSpec

    directory.mkdir()
    (directory / "model.onnx").write_bytes(adder_path.read_bytes())
    Manifest(
        model="model.onnx",
        inputs={
            "input_ids": InputSpec("int64", ("batch", "sequence"), 0),
            "past_key_values.0.key": InputSpec("float32", ("batch", None, "past", None), 0),
        },
        outputs={"logits": OutputSpec(("batch", "sequence", None))},
        validation={"passed": True},
    ).save(directory)


@pytest.fixture
def repo(tmp_path: Path, task_dirs: dict[str, Path], adder_path: Path) -> dict[str, Any]:
    """:func:`reloads.changing_repository`, with a broken folder and a generation export
    that does not load."""
    dirs = changing_repository(tmp_path, task_dirs["reranker"])
    (dirs["root"] / "broken").mkdir()
    (dirs["root"] / "broken" / "ortbatch.json").write_text("{not json")
    _generation_export(dirs["root"] / "gen", adder_path)
    return dirs


def _classify(c: httpx.Client) -> httpx.Response:
    return c.post("/v1/classify", json={"model": "cls", "input": reloads.TEXT})


def _on_every_front_end(url: str, pids: list[int]) -> list[tuple[int, httpx.Client]]:
    """Fresh connections until every front end has one (the kernel picks the front end)."""
    conns: list[tuple[int, httpx.Client]] = []
    for _ in range(200):
        c = httpx.Client(base_url=url, timeout=30)
        conns.append((pid_of_metrics(c.get("/metrics").text), c))
        if {p for p, _ in conns} >= set(pids):
            return conns
    raise AssertionError("connections never reached every front end")


def _serves_on_every_front_end(url: str, pids: list[int], expected: dict[str, Any], kind: str) -> None:
    """What every front end answers for ``cls`` right now is ``kind`` ("old", "new", or
    503 for "gone")."""
    conns = _on_every_front_end(url, pids)
    try:
        for pid, c in conns:
            r = _classify(c)
            if kind == "gone":
                assert r.status_code == 503 and "'cls'" in r.text, (pid, r.text)
            else:
                assert r.status_code == 200, (pid, r.text)
                assert which(np.array(r.json()["data"][0]["probs"]), expected) == kind, pid
    finally:
        for _, c in conns:
            c.close()


def test_a_repository_through_two_front_ends_reloaded_and_unloaded_under_load(serve_process, repo):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    expected = repo["expected"]
    srv = serve_process("--repository", str(repo["root"]), *ARGS, "--grpc-port", "0")
    text = srv.text()
    pids = frontend_pids(text)
    grpc_addr = re.search(r"gRPC on (\S+)\)", text).group(1)
    index = {m["name"]: m for m in httpx.post(srv.url + "/v2/repository/index").json()}
    assert index["cls"]["state"] == index["rr"]["state"] == "READY"
    assert index["broken"]["state"] == "UNAVAILABLE" and "not valid JSON" in index["broken"]["reason"]
    # a generation export that cannot load (its model is not a decoder) is listed, not served
    assert index["gen"]["state"] == "UNAVAILABLE" and "failed to load" in index["gen"]["reason"]
    _serves_on_every_front_end(srv.url, pids, expected, "old")

    with Clients(srv.url) as clients:
        with httpx.Client(base_url=srv.url, timeout=60) as admin:
            # reloads over HTTP: when one is answered, every front end serves the new model
            for src, kind in ((repo["new"], "new"), (repo["old"], "old"), (repo["new"], "new")):
                swap_in(src, repo["root"] / "cls")
                r = admin.post("/v2/repository/models/cls/load")
                assert r.status_code == 200, r.text
                _serves_on_every_front_end(srv.url, pids, expected, kind)
            with grpcclient.InferenceServerClient(grpc_addr) as g:
                # unload and load over gRPC, through whichever front end the channel reached
                g.unload_model("cls")
                _serves_on_every_front_end(srv.url, pids, expected, "gone")
                states = {m.name: (m.state, m.reason) for m in g.get_model_repository_index().models}
                assert states["cls"] == ("UNAVAILABLE", "unloaded")
                assert not g.is_model_ready("cls") and g.is_model_ready("rr")
                g.load_model("cls")
                assert g.is_model_ready("cls")
            _serves_on_every_front_end(srv.url, pids, expected, "new")
            assert admin.post("/v2/repository/models/nope/load").status_code == 404
            r = admin.post("/v2/repository/models/gen/load")
            assert r.status_code == 400 and "failed to load" in r.text
            # both models' batching series reach every front end's /metrics
            metrics = admin.get("/metrics").text
            assert re.search(r'^ortbatch_batch_rows_count\{model="rr"\} [1-9]', metrics, re.M), metrics
        clients.wait_for_answers()
    clients.check(expected, last="new")
    srv.terminate()
    assert srv.wait(60) == 0, srv.text()
    m = re.search(r"by front end: 1: (\d+), 2: (\d+)", srv.text())
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, srv.text()


def test_a_killed_front_end_lets_go_of_its_models_and_comes_back_with_the_current_ones(serve_process, repo):
    expected = repo["expected"]
    srv = serve_process("--repository", str(repo["root"]), *ARGS)
    pids = frontend_pids(srv.text())
    victim = pids[0]
    os.kill(victim, signal.SIGKILL)
    # the unload does not wait for the dead front end: its hold on the model went with it
    r = httpx.post(srv.url + "/v2/repository/models/cls/unload", timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while not (m := re.search(r"front end 1 restarted \(pid (\d+)\)", srv.text())):
        assert time.monotonic() < deadline, srv.text()
        time.sleep(0.05)
    pids = [int(m.group(1)), pids[1]]
    _serves_on_every_front_end(srv.url, pids, expected, "gone")  # the restarted one too
    assert httpx.post(srv.url + "/v2/repository/models/cls/load", timeout=60).status_code == 200
    _serves_on_every_front_end(srv.url, pids, expected, "old")
    srv.terminate()
    assert srv.wait(60) == 0, srv.text()
