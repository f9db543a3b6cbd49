"""gRPC on the model repository server (``ortbatch serve --repository ROOT --grpc-port P``),
against the real Triton client: the repository RPCs mirror the HTTP repository API (index,
load, unload), ModelReady/Metadata/Config/Infer reach each model by name and version, an
unknown model is NOT_FOUND, one being loaded or unloaded UNAVAILABLE, a text-generation
export UNIMPLEMENTED (naming /v1/completions), the API key locks it, and fuzzed ModelInfer
fields never come back INTERNAL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
from fakegen import FakeGenerator  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tinytasks import run_alone  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ortbatch.serve import BackgroundServer, ServeConfig  # noqa: E402
from ortbatch.serve.served.generator import ServedGenerator  # noqa: E402
from ortbatch.serve.served.loading import load_served  # noqa: E402
from ortbatch.serve.served.repository import LOADING, READY, UNAVAILABLE, ModelRepository  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CONFIG = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning", max_batch_size=8)
KEY = "repo-key-" + "r" * 24


def _loader(config: ServeConfig, gate: dict[str, threading.Event] | None = None) -> Any:
    """Real exports, but the folder ``gen`` is a (fake) generation export, and a name in
    ``gate`` loads only once its event is set."""

    def load(directory: Path, name: str) -> Any:
        if gate is not None and name in gate:
            assert gate[name].wait(60)
        if name == "gen":
            return ServedGenerator(FakeGenerator(), name)
        return load_served(directory, name, config)

    return load


def _repository_root(root: Path, task_dirs: dict[str, Path], names: tuple[str, ...]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).symlink_to(task_dirs[name], target_is_directory=True)
    (root / "gen").mkdir()
    (root / "gen" / "ortbatch.json").write_text("{}")  # found as a model; the loader builds it
    return root


@pytest.fixture(scope="module")
def repo_srv(tmp_path_factory: pytest.TempPathFactory, task_dirs: dict[str, Path]) -> Iterator[BackgroundServer]:
    root = _repository_root(tmp_path_factory.mktemp("grpc-repo"), task_dirs, ("embedder", "sentiment"))
    repo = ModelRepository(root=root, config=CONFIG, loader=_loader(CONFIG))
    assert repo.load_all() == []
    with BackgroundServer(repo, CONFIG) as srv:
        yield srv


@pytest.fixture
def client(repo_srv: BackgroundServer) -> Iterator[Any]:
    assert repo_srv.grpc is not None
    c = grpcclient.InferenceServerClient(repo_srv.grpc.address)
    yield c
    c.close()


def _status(err: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(err.value.status()).removeprefix("StatusCode.")


def _index(client: Any) -> list[tuple[str, str, str, str]]:
    return [(m.name, m.version, m.state, m.reason) for m in client.get_model_repository_index().models]


def _http_index(url: str, **body: Any) -> list[tuple[str, str, str, str]]:
    doc = httpx.post(url + "/v2/repository/index", json=body).json()
    return [(m["name"], m.get("version", ""), m["state"], m["reason"]) for m in doc]


def _tensor_inputs(d: Path, text: str) -> tuple[list[Any], list[int], list[int]]:
    e = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text)
    inputs = []
    for name, values in (("input_ids", e.ids), ("attention_mask", [1] * len(e.ids)), ("token_type_ids", e.type_ids)):
        t = grpcclient.InferInput(name, [1, len(values)], "INT64")
        t.set_data_from_numpy(np.array([values], np.int64))
        inputs.append(t)
    return inputs, e.ids, e.type_ids


def test_index_metadata_and_infer_on_two_models(repo_srv, client, task_dirs):
    url = repo_srv.url
    assert client.is_server_live() and client.is_server_ready()
    assert "model_repository" in client.get_server_metadata().extensions
    # the index is the HTTP index, entry for entry (text-in entries included)
    index = _index(client)
    assert index == _http_index(url)
    assert {name for name, *_ in index} == {"embedder", "embedder_text", "gen", "sentiment", "sentiment_text"}
    assert all(state == READY for _, _, state, _ in index)
    with grpc.insecure_channel(repo_srv.grpc.address) as channel:
        ready_only = channel.unary_unary(
            "/inference.GRPCInferenceService/RepositoryIndex",
            request_serializer=service_pb2.RepositoryIndexRequest.SerializeToString,
            response_deserializer=service_pb2.RepositoryIndexResponse.FromString,
        )(service_pb2.RepositoryIndexRequest(ready=True), timeout=30)
    assert [m.name for m in ready_only.models] == [m[0] for m in _http_index(url, ready=True)]

    # each model by name (and version), the same metadata and config as over HTTP
    for name in ("sentiment", "embedder_text"):
        assert client.is_model_ready(name) and client.is_model_ready(name, "1")
        meta = client.get_model_metadata(name)
        http_meta = httpx.get(f"{url}/v2/models/{name}").json()
        assert meta.name == name
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            (t["name"], t["datatype"], t["shape"]) for t in http_meta["inputs"]
        ]
        config = client.get_model_config(name, "1").config
        assert config.name == name and [i.name for i in config.input] == [
            i["name"] for i in httpx.get(f"{url}/v2/models/{name}/config").json()["input"]
        ]

    # infer on two models: tensors to one (equal to ORT run alone), text to the other (equal to HTTP)
    text = "the quick brown fox"
    inputs, ids, type_ids = _tensor_inputs(task_dirs["sentiment"], text)
    r = client.infer("sentiment", inputs, model_version="1", outputs=[grpcclient.InferRequestedOutput("logits")])
    assert r.get_response().model_name == "sentiment"
    np.testing.assert_allclose(r.as_numpy("logits")[0], run_alone(task_dirs["sentiment"], ids, type_ids), atol=1e-5)
    t = grpcclient.InferInput("text", [2], "BYTES")
    t.set_data_from_numpy(np.array([text, "hello"], dtype=object))
    r = client.infer("embedder_text", [t], outputs=[grpcclient.InferRequestedOutput("last_hidden_state")])
    body = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": [text, "hello"]}],
        "outputs": [{"name": "last_hidden_state"}],
    }
    out = httpx.post(url + "/v2/models/embedder_text/infer", json=body).json()["outputs"][0]
    np.testing.assert_array_equal(
        r.as_numpy("last_hidden_state"), np.array(out["data"], np.float32).reshape(out["shape"])
    )


def test_unknown_models_versions_and_generation_exports(client):
    assert not client.is_model_ready("nope") and not client.is_model_ready("sentiment", "7")
    for call in (
        lambda: client.get_model_metadata("nope"),
        lambda: client.get_model_config("sentiment_text_x"),
        lambda: client.infer("nope", [grpcclient.InferInput("x", [1], "INT64")]),
    ):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert _status(err) == "NOT_FOUND" and "unknown model" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("sentiment", "7")
    assert _status(err) == "NOT_FOUND" and "unknown version '7'" in err.value.message()
    # a text-generation export: a decoupled model, so no unary ModelInfer, and it says where to go
    assert client.is_model_ready("gen")
    assert client.get_model_config("gen").config.model_transaction_policy.decoupled
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array(["hi"], dtype=object))
    with pytest.raises(InferenceServerException) as err:
        client.infer("gen", [t])
    assert _status(err) == "UNIMPLEMENTED"
    assert "ModelStreamInfer" in err.value.message() and "/v1/completions" in err.value.message()


def test_repository_name_and_load_parameters_are_refused_as_over_http(repo_srv):
    with grpc.insecure_channel(repo_srv.grpc.address) as channel:

        def call(method: str, request: Any) -> Any:
            return channel.unary_unary(f"/inference.GRPCInferenceService/{method}")(
                request.SerializeToString(), timeout=30
            )

        with pytest.raises(grpc.RpcError) as err:
            call("RepositoryIndex", service_pb2.RepositoryIndexRequest(repository_name="other"))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "repository_name" in err.value.details()
        load = service_pb2.RepositoryModelLoadRequest(model_name="sentiment")
        load.parameters["config"].string_param = "{}"
        with pytest.raises(grpc.RpcError) as err:
            call("RepositoryModelLoad", load)
        http = httpx.post(
            repo_srv.url + "/v2/repository/models/sentiment/load", json={"parameters": {"config": "{}"}}
        ).json()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == http["error"]
        with pytest.raises(grpc.RpcError) as err:
            call("RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_name" in err.value.details()


def test_unload_and_load_over_grpc(repo_srv, client, task_dirs):
    inputs, ids, type_ids = _tensor_inputs(task_dirs["sentiment"], "hello")
    with pytest.raises(InferenceServerException) as err:
        client.load_model("ghost")
    assert _status(err) == "NOT_FOUND" and "unknown model 'ghost'" in err.value.message()
    client.unload_model("sentiment")  # tritonclient sends unload_dependents: accepted
    try:
        assert not client.is_model_ready("sentiment") and not client.is_model_ready("sentiment_text")
        assert ("sentiment", "", UNAVAILABLE, "unloaded") in _index(client)
        assert _index(client) == _http_index(repo_srv.url)
        for call in (lambda: client.infer("sentiment", inputs), lambda: client.get_model_metadata("sentiment")):
            with pytest.raises(InferenceServerException) as err:
                call()
            assert _status(err) == "UNAVAILABLE" and "'sentiment'" in err.value.message()
        # the other model never noticed
        assert client.infer("embedder", _tensor_inputs(task_dirs["embedder"], "hi")[0][:2]) is not None
    finally:
        client.load_model("sentiment")
    assert client.is_model_ready("sentiment")
    r = client.infer("sentiment", inputs, outputs=[grpcclient.InferRequestedOutput("logits")])
    np.testing.assert_allclose(r.as_numpy("logits")[0], run_alone(task_dirs["sentiment"], ids, type_ids), atol=1e-5)
    # a reload of a loaded model over gRPC: the same as HTTP's, it keeps serving
    client.load_model("sentiment")
    assert client.is_model_ready("sentiment")


def test_a_model_being_loaded_is_unavailable(tmp_path, task_dirs):
    root = _repository_root(tmp_path / "repo", task_dirs, ("sentiment",))
    gate = {"late": threading.Event()}
    repo = ModelRepository(root=root, config=CONFIG, loader=_loader(CONFIG, gate))
    assert repo.load_all() == []
    with BackgroundServer(repo, CONFIG) as srv:
        assert srv.grpc is not None
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        errors: list[BaseException] = []

        def load() -> None:
            try:
                client.load_model("late")
            except BaseException as exc:
                errors.append(exc)

        try:
            (root / "late").symlink_to(task_dirs["sentiment"], target_is_directory=True)
            loader = threading.Thread(target=load)
            loader.start()
            while ("late", "", LOADING, "loading") not in _index(client):
                threading.Event().wait(0.02)
            assert not client.is_model_ready("late")
            inputs = _tensor_inputs(task_dirs["sentiment"], "hi")[0]
            with pytest.raises(InferenceServerException) as err:
                client.infer("late", inputs)
            assert _status(err) == "UNAVAILABLE" and "'late'" in err.value.message()
            assert client.infer("sentiment", inputs) is not None  # the others serve meanwhile
            gate["late"].set()
            loader.join(60)
            assert not errors, errors
            assert client.is_model_ready("late") and client.infer("late", inputs) is not None
        finally:
            gate["late"].set()
            client.close()


def test_api_key_locks_the_repository_over_grpc(tmp_path, task_dirs):
    root = _repository_root(tmp_path / "repo", task_dirs, ("sentiment",))
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning", api_key=KEY)
    repo = ModelRepository(root=root, config=config, loader=_loader(config))
    assert repo.load_all() == []
    with BackgroundServer(repo, config) as srv:
        assert srv.grpc is not None
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        inputs = _tensor_inputs(task_dirs["sentiment"], "hi")[0]
        try:
            assert client.is_server_ready()  # health stays open
            for call in (
                lambda h: client.get_model_repository_index(headers=h),
                lambda h: client.unload_model("sentiment", headers=h),
                lambda h: client.infer("sentiment", inputs, headers=h),
                lambda h: client.get_model_metadata("sentiment", headers=h),
            ):
                for headers in (None, {"authorization": "Bearer wrong"}):
                    with pytest.raises(InferenceServerException) as err:
                        call(headers)
                    assert _status(err) == "UNAUTHENTICATED"
            assert client.is_model_ready("sentiment", headers={"authorization": f"Bearer {KEY}"})
            headers = {"authorization": f"Bearer {KEY}"}
            assert client.infer("sentiment", inputs, headers=headers) is not None
            assert [m.name for m in client.get_model_repository_index(headers=headers).models][:1] == ["gen"]
        finally:
            client.close()
        # the refusals are counted, under the RPC they refused
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        for method in ("RepositoryIndex", "RepositoryModelUnload", "ModelInfer", "ModelMetadata"):
            assert f'ortbatch_grpc_requests_total{{code="UNAUTHENTICATED",method="{method}"}} 2.0' in metrics


_NAMES = ["sentiment", "sentiment_text", "embedder", "gen", "nope", "", "sentiment_textx"]


@st.composite
def _fuzzed_request(draw: Any) -> Any:
    request = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from(_NAMES)))
    request.model_version = draw(st.sampled_from(["", "1", "2"]))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        t = request.inputs.add(
            name=draw(st.sampled_from(["input_ids", "attention_mask", "token_type_ids", "text", ""])),
            datatype=draw(st.sampled_from(["INT64", "INT32", "BYTES", "FP32", "BF16", "x"])),
            shape=draw(st.lists(st.integers(-2, 2**33), max_size=3)),
        )
        if raw:
            request.raw_input_contents.append(draw(st.binary(max_size=40)))
        else:
            field = draw(st.sampled_from(["int64_contents", "bytes_contents", "fp32_contents"]))
            values = {
                "int64_contents": st.integers(-(2**63), 2**63 - 1),
                "bytes_contents": st.binary(max_size=6),
                "fp32_contents": st.floats(width=32),
            }[field]
            getattr(t.contents, field).extend(draw(st.lists(values, max_size=6)))
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(["logits", "last_hidden_state", "", "q"])))
    return request


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_fuzzed_request())
def test_fuzzed_model_infer_on_the_repository_never_internal(repo_srv, request):
    with grpc.insecure_channel(repo_srv.grpc.address) as channel:
        try:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(request.SerializeToString(), timeout=30)
        except grpc.RpcError as err:
            assert err.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.UNIMPLEMENTED,  # the generation export
            ), err.details()


def test_grpc_requests_on_the_repository_are_in_metrics(repo_srv, client):
    client.is_model_ready("sentiment")
    with pytest.raises(InferenceServerException):
        client.get_model_metadata("nope")
    text = httpx.get(repo_srv.url + "/metrics").text
    assert 'ortbatch_grpc_requests_total{code="OK",method="ModelReady"}' in text
    assert 'ortbatch_grpc_requests_total{code="NOT_FOUND",method="ModelMetadata"}' in text


def test_cli_serves_grpc_on_a_repository(serve_process, tmp_path, task_dirs):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "sentiment").symlink_to(task_dirs["sentiment"], target_is_directory=True)
    proc = serve_process("--repository", str(root), "--grpc-port", "0")
    address = proc.text().split("gRPC on ")[1].split(")")[0].split(";")[0].strip()
    client = grpcclient.InferenceServerClient(address)
    try:
        assert [m.name for m in client.get_model_repository_index().models] == ["sentiment", "sentiment_text"]
        assert client.infer("sentiment", _tensor_inputs(task_dirs["sentiment"], "hi")[0]) is not None
    finally:
        client.close()
    proc.terminate()
    assert proc.wait(60) == 0
    assert "gRPC accepted=1 answered=1" in proc.text()


def test_reload_and_unload_from_both_sides_under_grpc_and_http_load(tmp_path, task_dirs):
    """gRPC and HTTP clients on two models while one is reloaded and unloaded, the
    commands alternating between gRPC and HTTP (the two sides run on different event
    loops and share the repository): the other model never fails, the changing one
    answers the old or the new export's logits or UNAVAILABLE/503 naming it, nothing is
    mixed up, and every retired model is closed."""
    from reloads import TEXT, changing_repository, swap_in

    dirs = changing_repository(tmp_path, task_dirs["reranker"])
    old_src, new_src, root = dirs["old"], dirs["new"], dirs["root"]
    text = TEXT
    e = Tokenizer.from_file(str(old_src / "tokenizer.json")).encode(text)
    expected = {k: run_alone(d, e.ids, e.type_ids) for k, d in (("old", old_src), ("new", new_src))}
    assert not np.allclose(expected["old"], expected["new"], atol=1e-3)
    rr_expected = run_alone(task_dirs["reranker"], e.ids, e.type_ids)
    feed = {"input_ids": e.ids, "attention_mask": [1] * len(e.ids), "token_type_ids": e.type_ids}

    repo = ModelRepository(root=root, config=CONFIG)
    assert repo.load_all() == []
    stop = threading.Event()
    seen: dict[str, list[Any]] = {"cls": [], "rr": []}
    problems: list[str] = []

    def grpc_client(model: str) -> None:
        c = grpcclient.InferenceServerClient(srv.grpc.address)
        inputs = []
        for name, values in feed.items():
            t = grpcclient.InferInput(name, [1, len(values)], "INT64")
            t.set_data_from_numpy(np.array([values], np.int64))
            inputs.append(t)
        try:
            while not stop.is_set():
                try:
                    seen[model].append(c.infer(model, inputs).as_numpy("logits")[0])
                except InferenceServerException as exc:
                    seen[model].append(exc.status())
                    if model != "cls" or exc.status() != "StatusCode.UNAVAILABLE" or "'cls'" not in exc.message():
                        problems.append(f"grpc {model}: {exc.status()} {exc.message()}")
        finally:
            c.close()

    def http_client(model: str) -> None:
        body = {"inputs": [{"name": n, "datatype": "INT64", "shape": [1, len(v)], "data": v} for n, v in feed.items()]}
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while not stop.is_set():
                r = c.post(f"/v2/models/{model}/infer", json=body)
                if r.status_code != 200:
                    seen[model].append(r.status_code)
                    if model != "cls" or r.status_code != 503 or "'cls'" not in r.text:
                        problems.append(f"http {model}: {r.status_code} {r.text}")
                    continue
                out = next(o for o in r.json()["outputs"] if o["name"] == "logits")
                seen[model].append(np.array(out["data"], np.float32).reshape(out["shape"])[0])

    with BackgroundServer(repo, CONFIG) as srv:
        assert srv.grpc is not None
        threads = [
            threading.Thread(target=fn, args=(m,)) for fn in (grpc_client, http_client) for m in ("cls", "cls", "rr")
        ]
        for t in threads:
            t.start()
        admin = grpcclient.InferenceServerClient(srv.grpc.address)
        try:
            swap_in(new_src, root / "cls")
            admin.load_model("cls")  # gRPC reload
            swap_in(old_src, root / "cls")
            assert httpx.post(srv.url + "/v2/repository/models/cls/load", timeout=60).status_code == 200
            admin.unload_model("cls")
            assert not admin.is_model_ready("cls")
            swap_in(new_src, root / "cls")
            assert httpx.post(srv.url + "/v2/repository/models/cls/load", timeout=60).status_code == 200
            assert admin.is_model_ready("cls")
            while sum(isinstance(x, np.ndarray) for x in seen["cls"][-8:]) < 8:
                threading.Event().wait(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            admin.close()
    assert not problems, problems[:5]
    answers = [x for x in seen["cls"] if isinstance(x, np.ndarray)]
    kinds = set()
    for a in answers:
        match = [k for k, v in expected.items() if np.allclose(a, v, atol=1e-5)]
        kinds.add(match[0] if match else "neither")
    assert kinds == {"old", "new"}, kinds
    assert np.allclose(answers[-1], expected["new"], atol=1e-5)
    assert seen["rr"] and all(isinstance(x, np.ndarray) for x in seen["rr"])
    np.testing.assert_allclose(np.array(seen["rr"]), np.broadcast_to(rr_expected, (len(seen["rr"]), 1)), atol=1e-5)
    for _ in range(1000):  # every retired model is closed (its thread may still be closing it)
        if not repo._retiring:
            break
        threading.Event().wait(0.01)
    assert not repo._retiring
