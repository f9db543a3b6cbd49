"""The model repository: many exports behind one server, Triton's repository extension
(index, load, unload), draining on unload and reload, failures reported by name."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from reloads import Clients, changing_repository, swap_in

from ortbatch.errors import ModelNotFoundError, ModelUnavailableError, OrtBatchError
from ortbatch.serve import BackgroundServer, ServeConfig
from ortbatch.serve.served.kinds import ModelKind, register, unregister
from ortbatch.serve.served.repository import LOADING, READY, UNAVAILABLE, ModelRepository, discover, parse_model_args

pytestmark = pytest.mark.timeout(180)

CONFIG = ServeConfig(port=0, access_log=False, log_level="warning", max_batch_size=8)


def _link_models(root: Path, dirs: dict[str, Path]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, d in dirs.items():
        (root / name).symlink_to(d, target_is_directory=True)


@pytest.fixture(scope="module")
def repo_root(tmp_path_factory: pytest.TempPathFactory, task_dirs: dict[str, Path]) -> Path:
    root = tmp_path_factory.mktemp("repository")
    _link_models(root, task_dirs)
    (root / "broken").mkdir()
    (root / "broken" / "ortbatch.json").write_text("{not json")
    (root / "notes").mkdir()  # no ortbatch.json: not a model
    return root


@pytest.fixture(scope="module")
def repo_server(repo_root: Path) -> Iterator[BackgroundServer]:
    repo = ModelRepository(root=repo_root, config=CONFIG)
    failed = repo.load_all()
    assert [name for name, _ in failed] == ["broken"]
    with BackgroundServer(repo, CONFIG) as srv:
        yield srv


def test_discover_and_model_arguments(repo_root, tmp_path):
    assert [n for n, _ in discover(repo_root)] == ["broken", "embedder", "ner", "reranker", "sentiment"]
    (tmp_path / "a").mkdir()
    assert parse_model_args([str(tmp_path / "a"), f"other={tmp_path / 'a'}"]) == [
        ("a", tmp_path / "a"),
        ("other", tmp_path / "a"),
    ]
    with pytest.raises(OrtBatchError, match="two models are named 'a'"):
        parse_model_args([str(tmp_path / "a"), f"a={tmp_path}"])
    with pytest.raises(OrtBatchError, match="no models to serve"):
        ModelRepository(root=tmp_path / "a")


def test_discover_skips_a_folder_it_may_not_read(tmp_path, monkeypatch, caplog):
    # the root of a mounted volume holds a root-only lost+found; the server runs as a user
    # (tests run as root, who may read anything: the refusal is simulated)
    for name in ("a", "lost+found"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ortbatch.json").write_text("{}")
    real = Path.is_file

    def is_file(self: Path) -> bool:
        if self.parent.name == "lost+found":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    with caplog.at_level("WARNING"):
        assert [n for n, _ in discover(tmp_path)] == ["a"]
    assert "lost+found: cannot read it (Permission denied)" in caplog.text


def test_index_lists_every_model_with_state_and_reason(repo_server):
    index = httpx.post(repo_server.url + "/v2/repository/index").json()
    by_name = {m["name"]: m for m in index}
    models = ["embedder", "ner", "reranker", "sentiment"]
    assert sorted(by_name) == sorted(["broken", *models, *(m + "_text" for m in models)])
    assert by_name["embedder"]["state"] == READY and by_name["embedder"]["version"] == "1"
    assert by_name["broken"]["state"] == UNAVAILABLE and "not valid JSON" in by_name["broken"]["reason"]
    ready = httpx.post(repo_server.url + "/v2/repository/index", json={"ready": True}).json()
    assert "broken" not in {m["name"] for m in ready}
    bad = httpx.post(repo_server.url + "/v2/repository/index", json={"ready": "y" * 100_000})
    assert bad.status_code == 400 and "'ready' must be true or false" in bad.json()["error"]
    assert len(bad.json()["error"]) < 200  # the start of the value, not all of it back
    models = httpx.get(repo_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["embedder", "ner", "reranker", "sentiment"]
    assert httpx.get(repo_server.url + "/v2/health/ready").json() == {"ready": True}  # the others serve
    r = httpx.post(repo_server.url + "/v2/models/broken/infer", json={"inputs": []})
    assert r.status_code == 503 and "'broken'" in r.json()["error"] and "not valid JSON" in r.json()["error"]
    assert "model_repository" in httpx.get(repo_server.url + "/v2").json()["extensions"]


def test_each_model_answers_its_own_routes(repo_server, task_dirs):
    url = repo_server.url
    assert httpx.get(url + "/v2/models/sentiment").json()["name"] == "sentiment"
    assert httpx.get(url + "/v2/models/embedder_text/config").json()["input"][0]["name"] == "text"
    assert httpx.get(url + "/v2/models/ner/ready").json() == {"name": "ner", "ready": True}
    r = httpx.get(url + "/v2/models/nope")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
    # the body's model picks the model; alone on its endpoint, it needs no name
    r = httpx.post(url + "/v1/embeddings", json={"input": "hello world"})
    assert r.status_code == 200 and r.json()["model"] == "embedder"
    r = httpx.post(url + "/v1/rerank", json={"query": "a", "documents": ["hello"]})
    assert r.status_code == 200 and r.json()["model"] == "reranker"
    r = httpx.post(url + "/v1/classify", json={"input": "a"})
    assert r.status_code == 400 and "'model' is required" in r.text and "sentiment" in r.text
    r = httpx.post(url + "/v1/classify", json={"model": "sentiment", "input": "a"})
    assert r.status_code == 200 and r.json()["model"] == "sentiment"
    r = httpx.post(url + "/v1/rerank", json={"model": "sentiment", "query": "a", "documents": ["b"]})
    assert r.status_code == 400 and "3 labels" in r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": "a"})
    assert r.status_code == 400 and "no model on this server serves /v1/completions" in r.text
    r = httpx.post(url + "/v1/embeddings", json={"model": "ghost", "input": "a"})
    assert r.status_code == 404 and "unknown model 'ghost'" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/embeddings", json={"model": 3, "input": "a"})
    assert r.status_code == 400 and "'model' must be a string" in r.text
    r = httpx.post(url + "/v1/embeddings", content=b"[1]")
    assert r.status_code == 400 and "JSON object" in r.text
    # gzip bodies are decompressed once and handed on
    import gzip

    body = gzip.compress(b'{"model": "embedder", "input": "hello"}')
    r = httpx.post(url + "/v1/embeddings", content=body, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text


def test_metrics_carry_each_models_batching_series(repo_server):
    httpx.post(repo_server.url + "/v1/embeddings", json={"input": "hello"})
    text = httpx.get(repo_server.url + "/metrics").text
    assert 'ortbatch_session_requests_total{model="embedder"}' in text
    assert 'ortbatch_queue_depth{model="sentiment"}' in text
    assert 'endpoint="/v1/embeddings"' in text


def test_reload_and_unload_under_load(tmp_path, task_dirs):
    """Acceptance 3: clients on two models while one is reloaded (changed export) and
    unloaded: the other never fails; the reloaded one answers the old or the new model's
    result, or a 503 while it is absent; nothing is lost or mixed."""
    repo_dirs = changing_repository(tmp_path, task_dirs["reranker"])
    live = repo_dirs["root"] / "cls"
    repo = ModelRepository(root=repo_dirs["root"], config=CONFIG)
    assert repo.load_all() == []
    srv = BackgroundServer(repo, CONFIG).start()
    try:
        with Clients(srv.url) as clients, httpx.Client(base_url=srv.url, timeout=60) as admin:
            for src in (repo_dirs["new"], repo_dirs["old"], repo_dirs["new"]):
                swap_in(src, live)
                r = admin.post("/v2/repository/models/cls/load")
                assert r.status_code == 200, r.text
            assert admin.post("/v2/repository/models/cls/unload").status_code == 200
            assert admin.post("/v2/repository/index").json()[0] == {
                "name": "cls",
                "state": UNAVAILABLE,
                "reason": "unloaded",
            }
            assert admin.post("/v2/repository/models/cls/load").status_code == 200
            clients.wait_for_answers()  # let every client see the final model
    finally:
        srv.stop()
    clients.check(repo_dirs["expected"], last="new")


class _FakeServed:
    """A served model whose close() is observed."""

    def __init__(self) -> None:
        self.closed = False
        self.inputs: list[Any] = []
        self.session = self

    def run(self, names: Any, feed: Any) -> list[Any]:
        return []

    @property
    def ready(self) -> bool:
        return not self.closed

    def close(self, drain: bool = True) -> None:
        self.closed = True


class _FakeKind(ModelKind):
    """What a repository's loader returning a :class:`_FakeServed` serves: a kind of its own,
    with no routes and no endpoints (a loader's model must be of a registered kind)."""

    name = "fake"
    description = "a fake export"
    served_type = _FakeServed


@pytest.fixture
def fake_kind() -> Iterator[ModelKind]:
    yield register(_FakeKind())
    unregister("fake")


@pytest.mark.usefixtures("fake_kind")
def test_unload_waits_for_in_flight_requests(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    made: list[_FakeServed] = []

    def loader(directory: Path, name: str) -> _FakeServed:
        made.append(_FakeServed())
        return made[-1]

    monkeypatch.setattr("ortbatch.serve.http.app.build_app", lambda served, *a, **k: object())
    repo = ModelRepository([("m", tmp_path / "m")], loader=loader)

    async def scenario() -> None:
        assert repo.load_all() == []
        held = repo.acquire("m")
        unload = asyncio.ensure_future(repo.unload("m"))
        await asyncio.sleep(0.05)
        assert not unload.done() and not made[0].closed  # the request on it is still running
        with pytest.raises(ModelUnavailableError):
            repo.acquire("m")  # new requests are refused at once (HTTP 503)
        repo.release(held)
        await asyncio.wait_for(unload, 10)
        assert made[0].closed
        # reload: the new one serves at once; the old closes after its last request
        await repo.load("m")
        first = repo.acquire("m")
        await repo.load("m")
        second = repo.acquire("m")
        assert second.served is made[2] and not made[1].closed
        repo.release(first)
        for _ in range(100):
            if made[1].closed:
                break
            await asyncio.sleep(0.01)
        assert made[1].closed and not made[2].closed
        repo.release(second)

    asyncio.run(scenario())
    repo.close()
    assert made[2].closed


def test_a_failed_reload_keeps_the_loaded_model_serving(tmp_path, task_dirs):
    live = tmp_path / "cls"
    shutil.copytree(task_dirs["sentiment"], live)
    repo = ModelRepository([("cls", live)], config=CONFIG)
    assert repo.load_all() == []
    with BackgroundServer(repo, CONFIG) as srv:
        (live / "model.onnx").write_bytes(b"not onnx")
        r = httpx.post(srv.url + "/v2/repository/models/cls/load")
        assert r.status_code == 400 and "keeps serving" in r.json()["error"]
        assert httpx.post(srv.url + "/v1/classify", json={"input": "hello"}).status_code == 200
        r = httpx.post(srv.url + "/v2/repository/models/cls/load", json={"parameters": {"config": "{}"}})
        assert r.status_code == 400 and "'config'" in r.json()["error"]
        r = httpx.post(srv.url + "/v2/repository/models/ghost/load")
        assert r.status_code == 404


def test_a_folder_added_later_loads_by_name(tmp_path, task_dirs):
    root = tmp_path / "repo"
    _link_models(root, {"a": task_dirs["sentiment"]})
    repo = ModelRepository(root=root, config=CONFIG)
    repo.load_all()
    with BackgroundServer(repo, CONFIG) as srv:
        assert httpx.post(srv.url + "/v1/rerank", json={"query": "a", "documents": ["b"]}).status_code == 400
        _link_models(root, {"b": task_dirs["reranker"]})
        assert httpx.post(srv.url + "/v2/repository/models/b/load").status_code == 200
        r = httpx.post(srv.url + "/v1/rerank", json={"query": "a", "documents": ["b"]})
        assert r.status_code == 200 and r.json()["model"] == "b"
    # nothing outside the root is reachable by name
    (tmp_path / "ortbatch.json").write_text("{}")
    for name in ("..", "."):
        with pytest.raises(ModelNotFoundError):
            asyncio.run(repo.load(name))  # HTTP 404


def test_strict_refuses_to_start_naming_the_model(repo_root):
    repo = ModelRepository(root=repo_root, config=CONFIG, strict=True)
    with pytest.raises(OrtBatchError, match="model 'broken'"):
        repo.load_all()
    assert repo.closed


@pytest.mark.usefixtures("fake_kind")
def test_ready_after_the_startup_load_and_while_others_serve(tmp_path, monkeypatch):
    monkeypatch.setattr("ortbatch.serve.http.app.build_app", lambda served, *a, **k: object())
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    repo = ModelRepository([("a", tmp_path / "a"), ("b", tmp_path / "b")], loader=lambda d, n: _FakeServed())
    assert not repo.ready  # nothing loaded yet
    repo.load_all()
    assert repo.ready
    repo._entries["b"].state = LOADING  # a later load of one model
    assert repo.ready
    repo.close()
    assert not repo.ready


def test_cli_serves_a_repository_and_reports_a_broken_model(serve_process, repo_root):
    proc = serve_process("--repository", str(repo_root))
    log = proc.text()
    assert "model 'broken'" in log and "UNAVAILABLE" in log and "model 'embedder'" in log
    r = httpx.post(proc.url + "/v1/rerank", json={"query": "a", "documents": ["b"]})
    assert r.status_code == 200, r.text
    assert httpx.get(proc.url + "/v2/health/ready").json() == {"ready": True}


def test_cli_strict_and_bad_arguments_exit_2_without_a_traceback(repo_root, task_dirs, tmp_path):
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ortbatch.cli", "serve", *args, "--port", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    for args, message in [
        (("--repository", str(repo_root), "--strict"), "model 'broken'"),
        ((str(task_dirs["sentiment"]), f"x={tmp_path / 'missing'}"), "does not exist"),
        ((str(task_dirs["sentiment"]), str(task_dirs["sentiment"])), "two models are named"),
        ((str(task_dirs["sentiment"]), str(task_dirs["reranker"]), "--name", "x"), "NAME=DIR"),
        ((), "give an export DIR"),
    ]:
        p = run(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert message in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_api_key_locks_every_model(task_dirs):
    key = "k" * 32
    config = ServeConfig(port=0, access_log=False, log_level="warning", api_key=key)
    repo = ModelRepository([("sentiment", task_dirs["sentiment"])], config=config)
    assert repo.load_all() == []
    with BackgroundServer(repo, config) as srv:
        body = {"model": "sentiment", "input": "hello"}
        assert httpx.post(srv.url + "/v1/classify", json=body).status_code == 401
        assert httpx.post(srv.url + "/v2/repository/models/sentiment/unload").status_code == 401
        r = httpx.post(srv.url + "/v1/classify", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        assert httpx.get(srv.url + "/v2/health/ready").status_code == 200  # health stays open
