"""The KServe v2 gRPC service against the real Triton client (``tritonclient.grpc``,
sync and asyncio): metadata, config, inference equal to a direct ONNX Runtime run,
Triton's status codes for bad requests, the same refusal messages as HTTP, and
fuzzed ModelInfer fields that never come back INTERNAL."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
import numpy as np
import onnxruntime as ort
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
grpcaio = pytest.importorskip("tritonclient.grpc.aio")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ortbatch.errors import (  # noqa: E402
    InferenceError,
    InvalidInputError,
    ModelLoadFailedError,
    ModelNotFoundError,
    ModelUnavailableError,
    QueueFullError,
    RequestTimeoutError,
    SessionClosedError,
    UnsupportedError,
)
from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel  # noqa: E402
from ortbatch.serve.grpc import GrpcServer, status_for  # noqa: E402
from ortbatch.serve.grpc.service import ResponseTooLargeError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def both(adder_path):
    """One adder model behind HTTP and gRPC at once (one BatchedSession)."""
    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")
    with BackgroundServer(model, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def adder_ort(adder_path):
    return ort.InferenceSession(str(adder_path), providers=["CPUExecutionProvider"])


def _inputs(x: np.ndarray, k: np.ndarray, module=grpcclient):
    a = module.InferInput("x", list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    b = module.InferInput("k", list(k.shape), "INT32")
    b.set_data_from_numpy(k)
    return [a, b]


def test_health_metadata_and_config_as_triton(both, encoder_dir):
    client = grpcclient.InferenceServerClient(both.grpc.address)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("adder") and client.is_model_ready("adder", "1")
        assert not client.is_model_ready("missing")
        assert client.get_server_metadata().name == "ortbatch"
        meta = client.get_model_metadata("adder")
        http_meta = httpx.get(both.url + "/v2/models/adder").json()
        assert meta.name == "adder" and list(meta.versions) == ["1"] and meta.platform == "onnxruntime_onnx"
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            (t["name"], t["datatype"], t["shape"]) for t in http_meta["inputs"]
        ]
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
            (t["name"], t["datatype"], t["shape"]) for t in http_meta["outputs"]
        ]
        config = client.get_model_config("adder").config
        http_config = httpx.get(both.url + "/v2/models/adder/config").json()
        assert config.name == "adder" and config.backend == "onnxruntime" and config.max_batch_size == 8
        assert config.HasField("dynamic_batching")
        dtype = service_pb2.model__config__pb2.DataType.Name
        assert [(i.name, dtype(i.data_type), list(i.dims)) for i in config.input] == [
            (i["name"], i["data_type"], i["dims"]) for i in http_config["input"]
        ]
        assert [(o.name, dtype(o.data_type), list(o.dims)) for o in config.output] == [
            (o["name"], o["data_type"], o["dims"]) for o in http_config["output"]
        ]
        with pytest.raises(InferenceServerException, match="unknown model 'missing'") as err:
            client.get_model_metadata("missing")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException, match="unknown version '7'") as err:
            client.get_model_config("adder", "7")
        assert err.value.status() == "StatusCode.NOT_FOUND"
    finally:
        client.close()


def test_2000_requests_from_32_clients_equal_direct_ort(both, adder_ort):
    """Acceptance 1: 2000 requests, 32 concurrent asyncio clients, random batch sizes;
    each answer equals ONNX Runtime run on that request alone."""
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(2000):
        n = int(rng.integers(1, 5))
        requests.append(
            (rng.standard_normal((n, 3)).astype(np.float32), rng.integers(-1000, 1000, (n, 1)).astype(np.int32))
        )

    async def main():
        clients = [grpcaio.InferenceServerClient(both.grpc.address) for _ in range(32)]
        answers: list = [None] * len(requests)

        async def worker(c: int) -> None:
            for i in range(c, len(requests), len(clients)):
                x, k = requests[i]
                r = await clients[c].infer("adder", _inputs(x, k, grpcaio), request_id=str(i))
                assert r.get_response().id == str(i)
                answers[i] = (r.as_numpy("y"), r.as_numpy("n"))

        try:
            await asyncio.gather(*(worker(c) for c in range(len(clients))))
        finally:
            for c in clients:
                await c.close()
        return answers

    answers = asyncio.run(main())
    for (x, k), (y, n) in zip(requests, answers, strict=True):
        ref_y, ref_n = adder_ort.run(["y", "n"], {"x": x, "k": k})
        np.testing.assert_array_equal(y, ref_y)
        np.testing.assert_array_equal(n, ref_n)
    assert both.model.session.stats().batches < 2000  # they were batched together


def test_requested_outputs_and_typed_contents(both, adder_ort):
    """Outputs in the order asked; inputs in typed ``contents`` instead of raw bytes."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    k = np.array([[1], [-2]], np.int32)
    client = grpcclient.InferenceServerClient(both.grpc.address)
    try:
        r = client.infer("adder", _inputs(x, k), outputs=[grpcclient.InferRequestedOutput("n")])
        assert [o.name for o in r.get_response().outputs] == ["n"]
        np.testing.assert_array_equal(r.as_numpy("n"), adder_ort.run(["n"], {"x": x, "k": k})[0])
    finally:
        client.close()
    request = service_pb2.ModelInferRequest(model_name="adder")
    t = request.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    t.contents.fp32_contents.extend(x.reshape(-1).tolist())
    t = request.inputs.add(name="k", datatype="INT32", shape=[2, 1])
    t.contents.int_contents.extend(k.reshape(-1).tolist())
    response = _call(both, "ModelInfer", request, service_pb2.ModelInferResponse)
    y = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(2, 3)
    np.testing.assert_array_equal(y, adder_ort.run(["y"], {"x": x, "k": k})[0])


def _call(srv, method, request, response_type=None, metadata=None):
    """One raw unary call (bytes in, parsed message out)."""
    with grpc.insecure_channel(srv.grpc.address) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        data = request if isinstance(request, bytes) else request.SerializeToString()
        answer = call(data, metadata=metadata, timeout=30)
        return response_type.FromString(answer) if response_type is not None else answer


def _infer_request(**changes):
    request = service_pb2.ModelInferRequest(model_name="adder")
    x = request.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    k = request.inputs.add(name="k", datatype="INT32", shape=[1, 1])
    request.raw_input_contents.extend([np.zeros(3, "<f4").tobytes(), np.ones(1, "<i4").tobytes()])
    for key, value in changes.items():
        if key == "x_datatype":
            x.datatype = value
        elif key == "k_shape":
            del k.shape[:]
            k.shape.extend(value)
        elif key == "raw":
            del request.raw_input_contents[:]
            request.raw_input_contents.extend(value)
        elif key == "output":
            request.outputs.add(name=value)
        elif key == "model":
            request.model_name = value
        elif key == "drop_k":
            del request.inputs[1]
            del request.raw_input_contents[1]
    return request


# Each bad request with the gRPC code it must get and (the same as over HTTP) its message.
BAD = [
    ({"model": "other"}, grpc.StatusCode.NOT_FOUND, "unknown model 'other'"),
    ({"x_datatype": "INT32"}, grpc.StatusCode.INVALID_ARGUMENT, "input 'x': expected datatype FP32, got INT32"),
    ({"x_datatype": "BF16"}, grpc.StatusCode.INVALID_ARGUMENT, "BF16 tensors are not supported"),
    ({"x_datatype": "FP33"}, grpc.StatusCode.INVALID_ARGUMENT, "unknown datatype 'FP33'"),
    ({"k_shape": [-1, 1]}, grpc.StatusCode.INVALID_ARGUMENT, "'shape' must be a list of non-negative integers"),
    ({"k_shape": [2, 1]}, grpc.StatusCode.INVALID_ARGUMENT, "binary_data_size is 4 bytes but shape [2, 1]"),
    ({"drop_k": True}, grpc.StatusCode.INVALID_ARGUMENT, "missing input(s) ['k']"),
    ({"output": "zz"}, grpc.StatusCode.INVALID_ARGUMENT, "unknown output 'zz'"),
    ({"raw": [b"\0" * 12]}, grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents has 1 entries"),
]


@pytest.mark.parametrize(("changes", "code", "text"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_requests_get_triton_codes_and_the_http_message(both, changes, code, text):
    request = _infer_request(**changes)
    with pytest.raises(grpc.RpcError) as err:
        _call(both, "ModelInfer", request)
    assert err.value.code() == code
    assert text in err.value.details()
    if "raw" not in changes:  # the same request over HTTP/binary is refused with the same words
        http = _http_equivalent(both, request)
        assert http.status_code in (400, 404)
        assert err.value.details() == http.json()["error"]
    assert grpcclient.InferenceServerClient(both.grpc.address).is_server_ready()


def _http_equivalent(srv, request) -> httpx.Response:
    import json

    inputs, blobs = [], []
    for t, blob in zip(request.inputs, request.raw_input_contents, strict=True):
        size = {"binary_data_size": len(blob)}
        inputs.append({"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "parameters": size})
        blobs.append(blob)
    doc: dict = {"inputs": inputs}
    if request.outputs:
        doc["outputs"] = [{"name": o.name} for o in request.outputs]
    header = json.dumps(doc).encode()
    return httpx.post(
        f"{srv.url}/v2/models/{request.model_name}/infer",
        content=header + b"".join(blobs),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )


# (InferParameter field, value): each a timeout HTTP refuses; gRPC must refuse it alike
BAD_TIMEOUTS = [("int64_param", -1), ("int64_param", 2**62), ("uint64_param", 2**64 - 1), ("double_param", 1.5)]


@pytest.mark.parametrize(("kind", "value"), BAD_TIMEOUTS, ids=[f"{k}={v}" for k, v in BAD_TIMEOUTS])
def test_a_bad_timeout_parameter_is_refused_as_over_http(both, kind, value):
    request = _infer_request()
    setattr(request.parameters["timeout"], kind, value)
    with pytest.raises(grpc.RpcError) as err:
        _call(both, "ModelInfer", request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    doc = {
        "parameters": {"timeout": value},
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [0, 0, 0]},
            {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [1]},
        ],
    }
    http = httpx.post(f"{both.url}/v2/models/adder/infer", json=doc, timeout=30)
    assert http.status_code == 400
    assert err.value.details() == http.json()["error"]
    assert "parameter 'timeout' must be an integer number of microseconds" in err.value.details()


LONG = "n" * 100_000


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"model": LONG}, grpc.StatusCode.NOT_FOUND),
        ({"output": LONG}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": "é" * 50_000}, grpc.StatusCode.NOT_FOUND),  # percent-encoded: 6 bytes each
    ],
    ids=["model", "output", "non-ascii-model"],
)
def test_a_long_name_echoed_in_an_error_keeps_its_status(both, changes, code):
    """The status message travels in the trailers: a 100 kB one reached tritonclient as
    RESOURCE_EXHAUSTED 'Stream removed (received metadata size exceeds hard limit)'."""
    with pytest.raises(grpc.RpcError) as err:
        _call(both, "ModelInfer", _infer_request(**changes))
    assert err.value.code() == code, err.value.details()
    assert len(err.value.details().encode()) <= 2000
    with pytest.raises(InferenceServerException) as info:
        grpcclient.InferenceServerClient(both.grpc.address).get_model_metadata(LONG)
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_an_unknown_long_input_name_is_named_in_short_over_http(both):
    doc = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [0, 0, 0]},
            {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [1]},
            {"name": LONG, "datatype": "FP32", "shape": [1], "data": [1]},
        ],
        "outputs": [{"name": "y"}],
    }
    r = httpx.post(f"{both.url}/v2/models/adder/infer", json=doc, timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith("unknown input(s) ['nnn")
    assert len(r.text) < 500
    doc["inputs"].pop()
    doc["outputs"] = [{"name": LONG}]
    r = httpx.post(f"{both.url}/v2/models/adder/infer", json=doc, timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith("unknown output 'nnn") and len(r.text) < 500


def test_a_message_that_does_not_parse_is_invalid_argument(both):
    with pytest.raises(grpc.RpcError) as err:
        _call(both, "ModelInfer", b"\xff\xff\xff\xff")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid inference.ModelInferRequest" in err.value.details()


def test_every_error_has_a_deliberate_status():
    code = grpc.StatusCode
    assert status_for(InvalidInputError("x"))[0] == code.INVALID_ARGUMENT
    assert status_for(ModelNotFoundError("x"))[0] == code.NOT_FOUND
    assert status_for(QueueFullError(1, 1))[0] == code.RESOURCE_EXHAUSTED
    assert status_for(RequestTimeoutError("x"))[0] == code.DEADLINE_EXCEEDED
    assert status_for(SessionClosedError("x"))[0] == code.UNAVAILABLE
    assert status_for(InferenceError("x"))[0] == code.INTERNAL
    # the repository's errors, mapped here as HTTP maps them (404, 503, 400)
    assert status_for(ModelUnavailableError("x"))[0] == code.UNAVAILABLE
    assert status_for(ModelLoadFailedError("x"))[0] == code.INVALID_ARGUMENT
    assert status_for(UnsupportedError("x"))[0] == code.UNIMPLEMENTED
    assert status_for(ResponseTooLargeError("x"))[0] == code.RESOURCE_EXHAUSTED


def test_overload_deadline_and_closed_over_grpc(adder_path):
    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    with GrpcServer(model, port=0) as srv:
        client = grpcclient.InferenceServerClient(srv.address)
        x, k = np.zeros((1, 3), np.float32), np.zeros((1, 1), np.int32)
        with pytest.raises(InferenceServerException) as err:  # Triton's timeout parameter, in us
            client.infer("adder", _inputs(x, k), timeout=1)
        assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        model.close()
        with pytest.raises(InferenceServerException) as err:
            client.infer("adder", _inputs(x, k))
        assert err.value.status() == "StatusCode.UNAVAILABLE"
        assert not client.is_server_ready()
        client.close()
    with GrpcServer(ServedModel.load(adder_path), port=0, max_message_bytes=64 * 1024) as srv:
        client = grpcclient.InferenceServerClient(srv.address)
        big = np.zeros((70_000, 3), np.float32)  # over the 64 KiB limit
        with pytest.raises(InferenceServerException) as err:
            client.infer("adder", _inputs(big, np.zeros((70_000, 1), np.int32)))
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        client.close()
        srv.servicer.model.close()


def test_an_answer_over_the_message_limit_is_refused_and_a_stream_goes_on(encoder_dir):
    """A few texts make a large last_hidden_state: grpcio refused to send it and ended the
    whole ModelStreamInfer stream (RESOURCE_EXHAUSTED), losing the stream's other requests."""
    import queue

    def texts(n: int) -> list:
        t = grpcclient.InferInput("text", [n, 1], "BYTES")
        t.set_data_from_numpy(np.array([[b"the quick brown fox jumps over the lazy dog"]] * n, dtype=object))
        return [t]

    model = ServedModel.load(encoder_dir, name="tiny", session_kwargs={"max_batch_size": 8})
    with GrpcServer(model, port=0, max_message_bytes=64 * 1024) as srv:
        client = grpcclient.InferenceServerClient(srv.address)
        with pytest.raises(InferenceServerException) as err:
            client.infer("tiny_text", texts(400))  # about 100 kB of last_hidden_state
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "gRPC message limit of 65536 bytes" in err.value.message()
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("tiny_text", texts(400), request_id="big")
        result, error = answers.get(timeout=30)
        assert result is None and "gRPC message limit" in str(error)
        client.async_stream_infer("tiny_text", texts(2), request_id="small")
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "small"
        assert result.as_numpy("pooled").shape == (2, 4)
        client.stop_stream()
        client.close()
    model.close()


@pytest.mark.timeout(120)
def test_an_idle_stream_ends_unavailable_when_the_server_stops_instead_of_holding_it(adder_path):
    """A client keeping its ModelStreamInfer stream open after its answers held the server's
    stop for the whole grace period (with grace None: forever). Now what the stream asked is
    answered, then it ends with UNAVAILABLE and the stop completes."""
    import queue

    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    srv = GrpcServer(model, port=0).start()
    client = grpcclient.InferenceServerClient(srv.address)
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        x, k = np.ones((1, 3), np.float32), np.full((1, 1), 2, np.int32)
        client.async_stream_infer("adder", _inputs(x, k), request_id="one")
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "one"
        srv.stop_soon(grace=None).result()  # None: wait for every RPC; the open stream ends
        result, error = answers.get(timeout=30)
        assert result is None and error.status() == "StatusCode.UNAVAILABLE"
        assert "shutting down" in error.message()
        assert srv.counts.accepted == srv.counts.answered == 1
    finally:
        client.stop_stream()
        client.close()
        srv.stop(grace=0)
        model.close()


def test_stream_infer_answers_each_request_and_survives_a_bad_one(both, adder_ort):
    results: list = []
    finished = threading.Event()  # the sync client calls back on its own thread

    def callback(result, error):
        results.append((result, error))
        if len(results) == 4:
            finished.set()

    client = grpcclient.InferenceServerClient(both.grpc.address)
    try:
        client.start_stream(callback)
        sent = {}
        for i in range(3):
            x = np.full((1, 3), i, np.float32)
            k = np.full((1, 1), i, np.int32)
            sent[str(i)] = (x, k)
            client.async_stream_infer("adder", _inputs(x, k), request_id=str(i))
        client.async_stream_infer("missing", _inputs(x, k), request_id="bad")
        assert finished.wait(30)
        client.stop_stream()
    finally:
        client.close()
    errors = [e for _, e in results if e is not None]
    assert len(errors) == 1 and "unknown model 'missing'" in str(errors[0])
    for result, error in results:
        if error is None:
            x, k = sent[result.get_response().id]
            np.testing.assert_array_equal(result.as_numpy("y"), adder_ort.run(["y"], {"x": x, "k": k})[0])


_DATATYPES = ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16", "", "fp32"]


@st.composite
def _fuzzed_request(draw):
    request = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from(["adder", "adder", "", "x"])))
    request.model_version = draw(st.sampled_from(["", "1", "2"]))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        t = request.inputs.add(
            name=draw(st.sampled_from(["x", "k", "", "text", "x"])),
            datatype=draw(st.sampled_from(_DATATYPES)),
            shape=draw(st.lists(st.integers(-3, 2**40), max_size=3)),
        )
        if draw(st.booleans()):
            t.parameters[draw(st.sampled_from(["shared_memory_region", "binary_data_size", "x"]))].int64_param = 1
        if raw:
            request.raw_input_contents.append(draw(st.binary(max_size=32)))
        else:
            field = draw(st.sampled_from(["fp32_contents", "int_contents", "bytes_contents", "bool_contents"]))
            values = {
                "fp32_contents": st.floats(width=32),
                "int_contents": st.integers(-(2**31), 2**31 - 1),
                "bytes_contents": st.binary(max_size=4),
                "bool_contents": st.booleans(),
            }[field]
            getattr(t.contents, field).extend(draw(st.lists(values, max_size=6)))
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(["y", "n", "", "q"])))
    if draw(st.booleans()):
        key = draw(st.sampled_from(["timeout", "classification", "priority"]))
        value = request.parameters[key]
        choice = draw(st.sampled_from(["int64_param", "string_param", "bool_param"]))
        setattr(value, choice, {"int64_param": 5_000_000, "string_param": "s", "bool_param": True}[choice])
    if raw and draw(st.booleans()):
        request.raw_input_contents.append(b"extra")
    return request


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_fuzzed_request())
def test_fuzzed_model_infer_never_internal(both, request):
    try:
        _call(both, "ModelInfer", request)
    except grpc.RpcError as err:
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), err.details()


def test_fuzzed_bytes_never_internal(both):
    rng = random.Random(0)
    good = _infer_request().SerializeToString()
    for _ in range(100):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            _call(both, "ModelInfer", bytes(data))
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), err.details()
    assert grpcclient.InferenceServerClient(both.grpc.address).is_server_ready()


def test_text_input_over_grpc_equals_http(encoder_dir):
    """BYTES text is tokenized on the server, as over HTTP, with the same answer."""
    model = ServedModel.load(encoder_dir, name="tiny", session_kwargs={"max_batch_size": 8})
    texts = ["hello world", "a b c d"]
    with BackgroundServer(model, ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        try:
            text = grpcclient.InferInput("text", [2], "BYTES")
            text.set_data_from_numpy(np.array(texts, dtype=object))
            result = client.infer("tiny", [text], outputs=[grpcclient.InferRequestedOutput("last_hidden_state")])
        finally:
            client.close()
        body = {
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}],
            "outputs": [{"name": "last_hidden_state"}],
        }
        out = httpx.post(srv.url + "/v2/models/tiny/infer", json=body).json()["outputs"][0]
    want = np.array(out["data"], np.float32).reshape(out["shape"])
    np.testing.assert_array_equal(result.as_numpy("last_hidden_state"), want)


def _grpc_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every ``ortbatch_grpc_*`` sample of ``/metrics``, by (sample name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name.startswith("ortbatch_grpc_"):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_grpc_requests_are_counted_in_metrics_by_method_and_code(both):
    """Each answered RPC is one count (and one latency observation) under its method and
    status code, next to the HTTP families; each request of a stream counts as one."""
    before = _grpc_samples(both.url)
    x, k = np.zeros((1, 3), np.float32), np.zeros((1, 1), np.int32)
    client = grpcclient.InferenceServerClient(both.grpc.address)
    try:
        for _ in range(3):
            client.infer("adder", _inputs(x, k))
        assert client.is_server_live()
        with pytest.raises(InferenceServerException):
            client.get_model_metadata("missing")
    finally:
        client.close()
    with pytest.raises(grpc.RpcError):
        _call(both, "ModelInfer", _infer_request(x_datatype="INT32"))
    results: list = []
    finished = threading.Event()
    stream = grpcclient.InferenceServerClient(both.grpc.address)
    try:
        stream.start_stream(lambda result, error: (results.append(error), len(results) == 3 and finished.set()))
        stream.async_stream_infer("adder", _inputs(x, k))
        stream.async_stream_infer("adder", _inputs(x, k))
        stream.async_stream_infer("missing", _inputs(x, k))
        assert finished.wait(30)
        stream.stop_stream()
    finally:
        stream.close()
    after = _grpc_samples(both.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    total = "ortbatch_grpc_requests_total"
    assert delta(total, method="ModelInfer", code="OK") == 3
    assert delta(total, method="ModelInfer", code="INVALID_ARGUMENT") == 1
    assert delta(total, method="ServerLive", code="OK") == 1
    assert delta(total, method="ModelMetadata", code="NOT_FOUND") == 1
    assert delta(total, method="ModelStreamInfer", code="OK") == 2
    assert delta(total, method="ModelStreamInfer", code="NOT_FOUND") == 1
    hist = "ortbatch_grpc_request_duration_seconds"
    assert delta(hist + "_count", method="ModelInfer", code="OK") == 3
    assert delta(hist + "_bucket", method="ModelInfer", code="OK", le="+Inf") == 3
    assert delta(hist + "_sum", method="ModelInfer", code="OK") > 0
    assert after[("ortbatch_grpc_requests_in_flight", ())] == 0
    # the labels are the service's method names and status code names only
    methods = {dict(labels)["method"] for name, labels in after if name == total}
    assert methods <= {
        "ModelInfer",
        "ServerLive",
        "ModelMetadata",
        "ModelStreamInfer",
        "ModelReady",
        "ServerReady",
        "ModelConfig",
        "ServerMetadata",
    }, methods


def test_a_server_without_grpc_exports_no_grpc_metrics(adder_server):
    assert "ortbatch_grpc" not in httpx.get(adder_server.url + "/metrics").text


def test_the_schema_matches_tritonclients_stubs_field_for_field():
    """Every field this server declares has the number, type and label of Triton's own
    ``grpc_service.proto`` / ``model_config.proto`` (as tritonclient's generated stubs
    carry them), so a mistyped field number cannot slip through."""
    from ortbatch.serve.grpc.schema import _ENUMS, _MESSAGES, message

    config_types = service_pb2.model__config__pb2.DESCRIPTOR.message_types_by_name
    for full in _MESSAGES:
        top, *nested = full.split(".")
        ref = config_types[top] if top in config_types else service_pb2.DESCRIPTOR.message_types_by_name[top]
        for part in nested:
            ref = ref.nested_types_by_name[part]
        for field in message(full).DESCRIPTOR.fields:
            theirs = ref.fields_by_name[field.name]
            assert (field.number, field.type, field.label) == (theirs.number, theirs.type, theirs.label), (
                full,
                field.name,
            )
            if field.message_type is not None and not field.message_type.GetOptions().map_entry:
                assert field.message_type.full_name == theirs.message_type.full_name, (full, field.name)
    data_type = service_pb2.model__config__pb2.DataType
    assert {v: data_type.Value(v) for v in _ENUMS["DataType"]} == {v: i for i, v in enumerate(_ENUMS["DataType"])}


def test_the_repository_rpcs_of_a_one_model_server_say_what_they_need(both):
    client = grpcclient.InferenceServerClient(both.grpc.address)
    try:
        for call in (client.get_model_repository_index, lambda: client.load_model("adder")):
            with pytest.raises(InferenceServerException) as err:
                call()
            assert err.value.status() == "StatusCode.UNIMPLEMENTED"
            assert "serves one model" in err.value.message() and "--repository" in err.value.message()
        assert client.is_model_ready("adder")  # nothing was unloaded
    finally:
        client.close()


def test_a_request_past_its_client_deadline_is_counted_as_deadline_exceeded():
    from scripted import ScriptedSession

    entered: list[int] = []  # requests that reached the session (the server's handler ran)

    async def slow(feed):
        entered.append(1)
        await asyncio.sleep(5)
        return [feed["x"]]

    model = ServedModel(ScriptedSession(slow), "s")
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning", graceful_timeout_s=1)
    with BackgroundServer(model, config) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        x = grpcclient.InferInput("x", [1, 3], "FP32")
        x.set_data_from_numpy(np.zeros((1, 3), np.float32))
        try:
            # on a loaded machine a deadline can pass before the call reaches the handler (then the
            # server counts nothing): call again until one has reached it
            for _ in range(10):
                with pytest.raises(InferenceServerException) as err:
                    client.infer("s", [x], client_timeout=0.5)
                assert "Deadline" in str(err.value)
                if entered:
                    break
            assert entered, "no call reached the server's handler before its deadline"
        finally:
            client.close()
        for _ in range(1000):  # the server sees the deadline pass when grpcio cancels the handler
            line = f'ortbatch_grpc_requests_total{{code="DEADLINE_EXCEEDED",method="ModelInfer"}} {float(len(entered))}'
            text = httpx.get(srv.url + "/metrics").text
            if line in text:
                break
            threading.Event().wait(0.01)
        assert line in text
        assert "ortbatch_grpc_requests_in_flight 0.0" in text
