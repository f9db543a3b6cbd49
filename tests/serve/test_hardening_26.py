"""Issue 26, the serve-side items: each test failed on main before its fix."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from ortbatch.cli import main
from ortbatch.errors import ModelLoadFailedError, ModelNotFoundError, ValidationError
from ortbatch.manifest import Manifest, UnvalidatedExportWarning
from ortbatch.serve import ServeConfig
from ortbatch.serve.served.loading import load_served
from ortbatch.serve.served.repository import READY, UNAVAILABLE, ModelRepository, discover

pytestmark = pytest.mark.timeout(180)

CONFIG = ServeConfig(port=0, access_log=False, log_level="warning", max_batch_size=8)


def _failed_copy(source: Path, dest: Path) -> Path:
    """``dest``: a copy of ``source`` whose manifest records failed checks, as the exporter
    leaves an export in ``X.failed``."""
    shutil.copytree(source, dest)
    m = Manifest.load(dest)
    m.validation["passed"] = False
    m.save()
    return dest


# -- item 1: a failed export is refused however it is loaded ---------------------------------
@pytest.fixture(scope="module")
def failed_root(tmp_path_factory: pytest.TempPathFactory, encoder_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("failed-repo")
    (root / "minilm").symlink_to(encoder_dir, target_is_directory=True)
    _failed_copy(encoder_dir, root / "minilm-int8.failed")
    _failed_copy(encoder_dir, root / "checked-bad")  # failed checks, but not named .failed
    return root


def test_a_failed_export_beside_a_good_one_is_refused_by_the_cli(failed_root, capsys, monkeypatch):
    import ortbatch.serve.server

    # had it been let through, it would serve (and this test would not return): say so instead
    monkeypatch.setattr(ortbatch.serve.server, "serve", lambda *a, **k: 0)
    code = main(["serve", str(failed_root / "minilm"), str(failed_root / "minilm-int8.failed"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "minilm-int8.failed FAILED its accuracy checks" in err and "--allow-unvalidated" in err


def test_failed_folders_are_not_models_of_a_repository(failed_root, caplog):
    with caplog.at_level(logging.WARNING, logger="ortbatch.serve"):
        names = [n for n, _ in discover(failed_root)]
    assert names == ["checked-bad", "minilm"]
    assert any("minilm-int8.failed" in r.getMessage() for r in caplog.records)


def test_the_repository_refuses_a_failed_export_on_scan_and_on_load(failed_root):
    repo = ModelRepository(root=failed_root, config=CONFIG)
    try:
        failed = repo.load_all()
        states = {name: (state, reason) for name, _, state, reason in repo.states()}
        assert [n for n, _ in failed] == ["checked-bad"], failed
        assert states["minilm"][0] == READY
        assert states["checked-bad"][0] == UNAVAILABLE and "FAILED its accuracy checks" in states["checked-bad"][1]
        # the load API: a failed export is not loaded, a .failed folder is not a model
        with pytest.raises(ModelLoadFailedError) as info:  # HTTP 400
            repo.load_now("checked-bad")
        assert "FAILED its accuracy checks" in str(info.value)
        with pytest.raises(ModelNotFoundError):  # HTTP 404
            repo.load_now("minilm-int8.failed")
    finally:
        repo.close(drain=False)


def test_load_served_refuses_unless_allowed(failed_root):
    # front ends (frontends/engine.py) and Ray (ray.py) load through load_served too
    with pytest.raises(ValidationError, match="FAILED its accuracy checks"):
        load_served(failed_root / "checked-bad", "x", CONFIG)
    allowed = ServeConfig(port=0, max_batch_size=8, warmup=False, allow_unvalidated=True)
    with pytest.warns(UnvalidatedExportWarning):  # allowed, still said
        served = load_served(failed_root / "checked-bad", "x", allowed)
    served.close(drain=False)


# -- item 3: a model name the filesystem cannot hold is unknown, and no 5xx shows a repr -------
def test_a_name_over_255_bytes_is_not_found_over_http_and_grpc(tmp_path, encoder_dir):
    import httpx

    grpc = pytest.importorskip("grpc")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    from ortbatch.serve import BackgroundServer

    (tmp_path / "minilm").symlink_to(encoder_dir, target_is_directory=True)
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning", max_batch_size=8)
    repo = ModelRepository(root=tmp_path, config=config)
    assert repo.load_all() == []
    name = "m" * 300
    with BackgroundServer(repo, config) as srv:
        r = httpx.post(f"{srv.url}/v2/repository/models/{name}/load", timeout=30)
        assert r.status_code == 404, r.text
        assert name in r.json()["error"]
        assert srv.grpc is not None
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        with pytest.raises(InferenceServerException) as info:
            client.load_model(name)
        assert info.value.status() == str(grpc.StatusCode.NOT_FOUND), info.value
        assert name in info.value.message()
        client.close()


def test_grpc_fallback_status_names_an_incident_never_the_exception(caplog):
    pytest.importorskip("grpc")
    import grpc

    from ortbatch.serve.grpc import status_for

    with caplog.at_level(logging.ERROR, logger="ortbatch.serve"):
        code, details = status_for(OSError(36, "File name too long"))
    assert code == grpc.StatusCode.INTERNAL
    assert "OSError" not in details and "File name too long" not in details
    incident = details.rsplit("incident ", 1)[-1].rstrip(")")
    assert any(incident in r.getMessage() and r.exc_info for r in caplog.records), details


# -- item 9: a generation model's v2 ready/metadata; the other kind's endpoint, one answer ----
def _wrong_kind_errors(url: str, generator: bool) -> list[str]:
    import httpx

    if generator:
        r = httpx.post(url + "/v1/embeddings", json={"model": "gen", "input": "a"}, timeout=30)
    else:
        r = httpx.post(url + "/v1/completions", json={"model": "minilm", "prompt": "a"}, timeout=30)
    assert r.status_code == 400, r.text
    return [r.json()["error"]["message"]]


def test_generation_models_answer_v2_ready_and_the_wrong_kind_alike_alone_and_in_a_repository(tmp_path, encoder_dir):
    httpclient = pytest.importorskip("tritonclient.http")
    from fakegen import FakeGenerator

    from ortbatch.serve import BackgroundServer, ServedModel
    from ortbatch.serve.served.generator import ServedGenerator

    config = ServeConfig(port=0, access_log=False, log_level="warning", max_batch_size=8)
    alone: dict[bool, list[str]] = {}
    with BackgroundServer(ServedGenerator(FakeGenerator(), "gen"), config) as srv:
        client = httpclient.InferenceServerClient(srv.url.removeprefix("http://"))
        assert client.is_model_ready("gen")
        assert client.get_model_metadata("gen")["name"] == "gen"
        assert not client.is_model_ready("other")
        client.close()
        alone[True] = _wrong_kind_errors(srv.url, generator=True)
    model = ServedModel.load(encoder_dir, name="minilm", session_kwargs={"max_batch_size": 8})
    with BackgroundServer(model, config) as srv:
        alone[False] = _wrong_kind_errors(srv.url, generator=False)

    (tmp_path / "minilm").symlink_to(encoder_dir, target_is_directory=True)
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "ortbatch.json").write_text("{}")

    def loader(directory: Path, name: str) -> object:
        return ServedGenerator(FakeGenerator(), name) if name == "gen" else load_served(directory, name, config)

    repo = ModelRepository(root=tmp_path, config=config, loader=loader)
    assert repo.load_all() == []
    with BackgroundServer(repo, config) as srv:
        client = httpclient.InferenceServerClient(srv.url.removeprefix("http://"))
        index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
        assert index["gen"] == "READY"
        assert client.is_model_ready("gen")  # as the index says
        assert client.get_model_metadata("gen")["name"] == "gen"
        client.close()
        for generator in (True, False):
            assert _wrong_kind_errors(srv.url, generator) == alone[generator]
    assert "is not a text-generation export" in alone[False][0]
    assert "is a text-generation export" in alone[True][0]


# -- item 10: a port in use is said before the model loads ---------------------------------
@pytest.mark.parametrize("frontends", ["1", "2"])
def test_a_port_in_use_is_reported_before_loading(encoder_dir, capsys, monkeypatch, frontends):
    import socket

    import ortbatch.serve.assembly
    import ortbatch.serve.frontends.engine

    def load_served_not_yet(*args: object, **kwargs: object) -> object:
        raise AssertionError("the model was loaded before the port was checked")

    # serve() loads through assembly.load_app, the front ends' engine directly
    monkeypatch.setattr(ortbatch.serve.assembly, "load_served", load_served_not_yet)
    monkeypatch.setattr(ortbatch.serve.frontends.engine, "load_served", load_served_not_yet)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", str(encoder_dir), "--port", str(port), "--frontends", frontends, "--no-access-log"])
    err = capsys.readouterr().err
    assert code != 0 and f"cannot listen on 127.0.0.1:{port}" in err, err


# -- item 4: an unparsable frame while an earlier answer is being written ---------------------
def test_a_bad_frame_during_a_write_lets_the_write_finish_before_the_stream_is_refused(adder_path):
    import asyncio

    import numpy as np

    pytest.importorskip("grpc")
    from tritonclient.grpc import service_pb2

    from ortbatch.errors import InvalidInputError
    from ortbatch.serve import ServedModel
    from ortbatch.serve.grpc import InferenceServicer
    from ortbatch.serve.grpc.service import _parsed

    good = service_pb2.ModelInferRequest(model_name="adder", id="0")
    good.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    good.inputs.add(name="k", datatype="INT32", shape=[1, 1])
    good.raw_input_contents.extend([np.zeros(3, "<f4").tobytes(), np.ones(1, "<i4").tobytes()])

    class Context:
        """A stream whose write of the first answer is held until the test lets it go."""

        def __init__(self) -> None:
            self.writing, self.release = asyncio.Event(), asyncio.Event()
            self.written: list[object] = []
            self.cut = False

        async def write(self, response: object) -> None:
            self.writing.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:  # grpcio's call is left mid-write: what hung the stream
                self.cut = True
                raise
            self.written.append(response)

    async def scenario() -> tuple[Context, BaseException | None]:
        context = Context()
        bad_sent = asyncio.Event()

        async def frames():
            yield good.SerializeToString()
            await context.writing.wait()  # the first answer is being written now
            bad_sent.set()
            yield b"\xff\xff\xff\xff"

        handler = asyncio.ensure_future(servicer.ModelStreamInfer(_parsed("ModelInferRequest", frames()), context))
        await bad_sent.wait()
        context.release.set()
        try:
            await handler
        except BaseException as exc:
            return context, exc
        return context, None

    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    try:
        servicer = InferenceServicer(model)
        context, raised = asyncio.run(scenario())
    finally:
        model.close(drain=False)
    assert isinstance(raised, InvalidInputError), raised  # the stream is refused (the handler aborts it)
    assert not context.cut, "the write in progress was cancelled midway"
    assert len(context.written) == 1


# -- item 5: a front end that comes back gets its share of the keep-alive clients -------------
def test_the_dealer_tells_the_others_to_rebalance_when_a_front_end_joins():
    import socket
    import threading

    from ortbatch.serve.frontends.dealer import REBALANCE, ConnectionDealer, channel_pair

    (a_ours, a_theirs), (b_ours, b_theirs) = channel_pair(), channel_pair()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    serving = [a_ours]
    looked = threading.Event()

    def channels() -> list[socket.socket]:
        now = list(serving)
        looked.set()
        return now

    dealer = ConnectionDealer(listener, channels).start()
    try:
        assert looked.wait(10)  # it has seen front end a alone
        serving.append(b_ours)  # b (re)joins
        a_theirs.settimeout(10)  # a hang guard only
        assert a_theirs.recv(16) == REBALANCE
        b_theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            b_theirs.recv(16)  # the one that joined keeps what it gets
    finally:
        dealer.stop()
        for s in (listener, a_ours, a_theirs, b_ours, b_theirs):
            s.close()


def test_a_front_end_told_to_rebalance_closes_its_keep_alive_connections_after_their_next_response():
    import socket
    import threading
    import time

    import uvicorn

    from ortbatch.serve.frontends.dealer import REBALANCE, adopting_server, channel_pair

    async def app(scope, receive, send):
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    ours, theirs = channel_pair()
    # keep-alive outlasts the hang guard below, so only the rebalance can close the connection
    config = uvicorn.Config(
        app, lifespan="off", log_level="warning", access_log=False, http="h11", timeout_keep_alive=120
    )
    server = adopting_server(config, theirs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": []}, daemon=True)
    thread.start()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname(), timeout=30)  # a hang guard only
    try:
        conn, _ = listener.accept()
        socket.send_fds(ours, [b"c"], [conn.fileno()])
        conn.close()
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"ok"):
            answer += client.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")  # served; the connection stays open (keep-alive)
        assert b"connection: close" not in answer.lower()
        ours.send(REBALANCE)
        deadline = time.monotonic() + 30  # a hang guard only: the loop below waits on the mark
        while not server._closing:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # not closed while idle (a request on its way would meet a closed connection) ...
        client.setblocking(False)
        with pytest.raises(BlockingIOError):
            client.recv(16)
        client.setblocking(True)
        # ... but its next response says so, and then it closes: the client reconnects via the dealer
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := client.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
        assert b"connection: close" in answer.lower()
    finally:
        server.should_exit = True
        thread.join(30)
        for s in (client, listener, ours, theirs):
            s.close()


# -- item 2: connections that send nothing deny no one ---------------------------------------
@pytest.mark.parametrize("cap", [None, 100], ids=["no-cap", "cap-100"])
def test_idle_connections_do_not_deny_health_or_requests(encoder_dir, cap):
    import resource
    import socket
    import time

    import httpx

    from ortbatch.serve import BackgroundServer, ServedModel

    idle_count = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * idle_count + 512  # the client's ends and the server's, in this one process
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"needs {want} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    key = "k" * 32
    # idle connections stay until the test closes them (long first-byte and header timeouts)
    config = ServeConfig(
        port=0,
        access_log=False,
        log_level="warning",
        api_key=key,
        limit_concurrency=1000,
        header_timeout_s=300,
        first_byte_timeout_s=300,
        max_idle_per_address=cap,
    )
    model = ServedModel.load(encoder_dir, name="minilm", session_kwargs={"max_batch_size": 8})
    idle: list[socket.socket] = []
    try:
        with BackgroundServer(model, config) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            for _ in range(idle_count):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            # connections are accepted in order: the requests below come after all the idle ones
            with httpx.Client(timeout=30) as client:  # the timeout is a hang guard only
                started = time.perf_counter()
                live = client.get(srv.url + "/v2/health/live")
                health_s = time.perf_counter() - started
                started = time.perf_counter()
                r = client.post(
                    srv.url + "/v1/embeddings",
                    json={"model": "minilm", "input": "hello"},
                    headers={"Authorization": f"Bearer {key}"},
                )
                embed_s = time.perf_counter() - started
            print(
                f"\nwith {idle_count} idle connections (cap {cap}): health {health_s:.3f} s, embedding {embed_s:.3f} s"
            )
            assert live.status_code == 200, live.text
            assert r.status_code == 200, r.text
            if cap is not None:  # the oldest beyond the cap were closed by the server
                idle[0].settimeout(30)
                assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()


def test_a_connection_that_sends_nothing_is_closed_at_the_first_byte_timeout(encoder_dir):
    import socket

    from ortbatch.serve import BackgroundServer, ServedModel

    # the header timeout is far beyond the hang guard: only the first-byte timeout can close it
    config = ServeConfig(port=0, access_log=False, log_level="warning", header_timeout_s=300, first_byte_timeout_s=0.5)
    model = ServedModel.load(encoder_dir, name="minilm", session_kwargs={"max_batch_size": 8})
    with BackgroundServer(model, config) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as idle:  # a hang guard only
            assert idle.recv(1) == b""
