"""Several models over front-end processes (``ortbatch serve --repository ROOT --frontends 2``),
as users run it (a subprocess): every model answers through both front ends; reloads and
unloads asked of one front end (over HTTP and gRPC) hold on every front end by the time
they are answered, under load, with nothing lost or mixed; a killed front end lets go of
its models and comes back serving the current ones."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_frontends import frontend_pids, pid_of_metrics
from tinytasks import build_classifier, run_alone
from tokenizers import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ARGS = ("--frontends", "2", "--max-batch-size", "8", "--max-delay-ms", "1", "--no-access-log")
TEXT = "the quick brown fox"


def _probs(d: Path, text: str = TEXT) -> np.ndarray:
    e = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text)
    logits = run_alone(d, e.ids, e.type_ids).astype(np.float64)
    p = np.exp(logits - logits.max())
    return p / p.sum()


def _swap_in(src: Path, dst: Path) -> None:
    """Replace the export in ``dst`` with ``src``'s, each file atomically."""
    for f in ("model.onnx", "ortbatch.json", "config.json", "tokenizer.json"):
        tmp = dst / (f + ".new")
        shutil.copy(src / f, tmp)
        tmp.replace(dst / f)


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
    """A repository: ``cls`` (a copy of an old classifier, to be replaced by a new one),
    ``rr`` (a reranker), a broken folder and a generation export that does not load."""
    old_src = build_classifier(tmp_path / "old-src", 3, seed=1)
    new_src = build_classifier(tmp_path / "new-src", 3, seed=7)
    root = tmp_path / "repo"
    (root / "cls").mkdir(parents=True)
    for f in old_src.iterdir():
        shutil.copy(f, root / "cls" / f.name)
    (root / "rr").symlink_to(task_dirs["reranker"], target_is_directory=True)
    (root / "broken").mkdir()
    (root / "broken" / "ortbatch.json").write_text("{not json")
    _generation_export(root / "gen", adder_path)
    rr = task_dirs["reranker"]
    e = Tokenizer.from_file(str(rr / "tokenizer.json")).encode("q", TEXT)
    expected = {"old": _probs(old_src), "new": _probs(new_src), "rr": float(run_alone(rr, e.ids, e.type_ids)[0])}
    assert not np.allclose(expected["old"], expected["new"], atol=1e-3)
    return {"root": root, "old": old_src, "new": new_src, "expected": expected}


def _classify(c: httpx.Client) -> httpx.Response:
    return c.post("/v1/classify", json={"model": "cls", "input": TEXT})


def _which(probs: np.ndarray, expected: dict[str, Any]) -> str:
    for kind in ("old", "new"):
        if np.allclose(probs, expected[kind], atol=1e-5):
            return kind
    return "neither"


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
                assert _which(np.array(r.json()["data"][0]["probs"]), expected) == kind, pid
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

    stop = threading.Event()
    seen: dict[str, list[Any]] = {"cls": [], "rr": []}
    problems: list[str] = []

    def client(model: str) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while not stop.is_set():
                if model == "cls":
                    r = _classify(c)
                else:
                    r = c.post(
                        "/v1/rerank", json={"model": "rr", "query": "q", "documents": [TEXT], "raw_scores": True}
                    )
                if r.status_code != 200:
                    seen[model].append(r.status_code)
                    if model != "cls" or r.status_code != 503 or "'cls'" not in r.text:
                        problems.append(f"{model}: {r.status_code} {r.text}")
                    continue
                body = r.json()
                if model == "cls":
                    seen[model].append(np.array(body["data"][0]["probs"]))
                else:
                    seen[model].append(body["results"][0]["relevance_score"])

    threads = [threading.Thread(target=client, args=(m,)) for m in ("cls", "rr") for _ in range(4)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as admin:
            # reloads over HTTP: when one is answered, every front end serves the new model
            for src, kind in ((repo["new"], "new"), (repo["old"], "old"), (repo["new"], "new")):
                _swap_in(src, repo["root"] / "cls")
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
        while sum(isinstance(x, np.ndarray) for x in seen["cls"][-8:]) < 8:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not problems, problems[:5]
    answers = [x for x in seen["cls"] if isinstance(x, np.ndarray)]
    assert {_which(a, expected) for a in answers} == {"old", "new"}  # both seen, nothing else
    assert _which(answers[-1], expected) == "new"
    assert seen["rr"] and all(not isinstance(x, int) for x in seen["rr"])  # never failed
    np.testing.assert_allclose(seen["rr"], expected["rr"], atol=1e-5)
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
