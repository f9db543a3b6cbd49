"""A text-generation export over gRPC as a decoupled model (``ModelStreamInfer``, Triton's
vLLM-backend tensor names), against tritonclient's stream API: token by token or at once,
the same text and the same refusals as ``/v1/completions``, requests on one stream
batched together, a client that leaves frees its rows, each request counted once."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
from fakegen import FakeGenerator  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ortbatch.serve import BackgroundServer, ServeConfig  # noqa: E402
from ortbatch.serve.served.generator import ServedGenerator  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CONFIG = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")


@pytest.fixture(scope="module")
def gen_srv() -> Iterator[BackgroundServer]:
    with BackgroundServer(ServedGenerator(FakeGenerator(), "gen"), CONFIG) as srv:
        yield srv


def _inputs(prompt: str, stream: bool | None = None, sampling: Any = None) -> list[Any]:
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    inputs = [t]
    if stream is not None:
        s = grpcclient.InferInput("stream", [1], "BOOL")
        s.set_data_from_numpy(np.array([stream]))
        inputs.append(s)
    if sampling is not None:
        p = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        p.set_data_from_numpy(np.array([text.encode()], dtype=object))
        inputs.append(p)
    return inputs


class _Stream:
    """tritonclient's stream, its callbacks collected: ``(id, text, finish, final, error)``."""

    def __init__(self, srv: BackgroundServer) -> None:
        assert srv.grpc is not None
        self.client = grpcclient.InferenceServerClient(srv.grpc.address)
        self.items: queue.Queue[tuple[str, str | None, str | None, bool, str | None]] = queue.Queue()
        self.client.start_stream(self._callback)

    def _callback(self, result: Any, error: Any) -> None:
        if error is not None:
            self.items.put(("", None, None, True, str(error)))
            return
        r = result.get_response()
        names = [o.name for o in r.outputs]
        text = result.as_numpy("text_output")[0].decode() if "text_output" in names else None
        finish = result.as_numpy("finish_reason")[0].decode() if "finish_reason" in names else None
        final = r.parameters["triton_final_response"].bool_param
        self.items.put((r.id, text, finish, final, None))

    def send(self, request_id: str, inputs: list[Any], **kw: Any) -> None:
        self.client.async_stream_infer("gen", inputs, request_id=request_id, **kw)

    def collect(self, finals: int) -> list[tuple[str, str | None, str | None, bool, str | None]]:
        out = []
        while finals:
            item = self.items.get(timeout=30)
            out.append(item)
            finals -= item[3]
        return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_streams_token_by_token_and_at_once_equal_to_http(gen_srv):
    stream = _Stream(gen_srv)
    try:
        stream.send("a", _inputs("hello", True, {"max_tokens": 4}))
        stream.send("b", _inputs("hi", True, {"max_tokens": 5, "temperature": 0}))
        stream.send("c", _inputs("hey", False, {"max_tokens": 3}))
        stream.send("d", _inputs("hey"))  # no stream flag: one answer; max_tokens: /v1/completions' default
        items = stream.collect(4)
    finally:
        stream.close()
    by_id: dict[str, list[Any]] = {}
    for rid, text, finish, final, error in items:
        assert error is None, error
        by_id.setdefault(rid, []).append((text, finish, final))
    # token by token: one response per token, the last one final with the finish reason
    assert by_id["a"] == [
        ("a", None, False),
        ("b", None, False),
        ("a", None, False),
        ("b", None, False),
        ("", "length", True),
    ]
    assert [t for t, _, _ in by_id["b"]] == ["a", "b", "a", "b", "a", ""] and by_id["b"][-1][1:] == ("length", True)
    assert by_id["c"] == [("aba", "length", True)]
    http = httpx.post(gen_srv.url + "/v1/completions", json={"prompt": "hey"}).json()["choices"][0]
    assert by_id["d"] == [(http["text"], http["finish_reason"], True)]
    # four prompts on one stream were submitted together, each as sent
    submitted = gen_srv.model.generator.submitted
    assert [(n, s.get("temperature")) for _, n, s in submitted[-5:-1]] == [(4, 1.0), (5, 0.0), (3, 1.0), (16, 1.0)]


def test_metadata_config_and_unary_infer_of_a_decoupled_model(gen_srv):
    client = grpcclient.InferenceServerClient(gen_srv.grpc.address)
    try:
        assert client.is_model_ready("gen") and not client.is_model_ready("other")
        meta = client.get_model_metadata("gen")
        assert [(t.name, t.datatype) for t in meta.inputs] == [
            ("text_input", "BYTES"),
            ("stream", "BOOL"),
            ("sampling_parameters", "BYTES"),
        ]
        assert [(t.name, t.datatype) for t in meta.outputs] == [
            ("text_output", "BYTES"),
            ("finish_reason", "BYTES"),
            ("index", "INT32"),
            ("logprobs", "BYTES"),
        ]
        config = client.get_model_config("gen").config
        assert config.model_transaction_policy.decoupled
        assert [(i.name, i.optional) for i in config.input] == [
            ("text_input", False),
            ("stream", True),
            ("sampling_parameters", True),
        ]
        with pytest.raises(InferenceServerException) as err:
            client.infer("gen", _inputs("hello"))
        assert err.value.status() == "StatusCode.UNIMPLEMENTED" and "ModelStreamInfer" in err.value.message()
    finally:
        client.close()


BAD = [
    ({"no_text": True}, "missing input 'text_input'"),
    ({"sampling": "{nope"}, "input 'sampling_parameters' is not valid JSON"),
    ({"sampling": "[1]"}, "input 'sampling_parameters' must be a JSON object"),
    ({"extra": True}, "takes the inputs ['text_input', 'stream', 'sampling_parameters']"),
    ({"two": True}, "input 'text_input' takes one element"),
    ({"sampling": {"temperature": 5}}, None),  # the /v1/completions message, checked below
    ({"sampling": {"max_tokens": 0}}, None),
    ({"sampling": {"use_beam_search": True}}, None),
    ({"sampling": {"guided_json": {}}}, None),  # this generator has no grammar engine: 501 there
    ({"sampling": {"frobnicate": 1}}, "Unrecognized request argument supplied: frobnicate"),
    ({"sampling": {"prompt": "x"}}, "'prompt' is not a sampling parameter here"),
    ({"prompt": ""}, None),
]


@pytest.mark.parametrize(("case", "text"), BAD, ids=[str(c) for c, _ in BAD])
def test_bad_requests_get_the_completions_message_and_the_stream_goes_on(gen_srv, case, text):
    prompt = case.get("prompt", "hello")
    sampling = case.get("sampling")
    inputs = _inputs(prompt, True, sampling)
    if case.get("no_text"):
        inputs = inputs[1:]  # the stream flag alone
    if case.get("extra"):
        x = grpcclient.InferInput("x", [1], "INT32")
        x.set_data_from_numpy(np.array([1], np.int32))
        inputs.append(x)
    if case.get("two"):
        inputs[0] = grpcclient.InferInput("text_input", [2], "BYTES")
        inputs[0].set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    if text is None:  # the same words as /v1/completions answers the same fields with
        body = {"prompt": prompt, **(sampling or {})}
        r = httpx.post(gen_srv.url + "/v1/completions", json=body)
        assert r.status_code in (400, 501), r.text
        text = r.json()["error"]["message"]
    stream = _Stream(gen_srv)
    try:
        stream.send("bad", inputs)
        (item,) = stream.collect(1)
        assert item[4] is not None and text in item[4], item
        stream.send("good", _inputs("hello", True, {"max_tokens": 2}))
        assert [t for _, t, _, _, _ in stream.collect(1)] == ["a", "b", ""]
    finally:
        stream.close()


def test_sampling_fields_as_request_parameters_are_honoured_as_triton_s_vllm_backend_reads_them(gen_srv):
    stream = _Stream(gen_srv)
    try:
        # tritonclient's timeout is a request parameter too: not a sampling field
        stream.send("p", _inputs("hello", False), parameters={"max_tokens": 3}, timeout=10**7)
        assert [t for _, t, _, _, _ in stream.collect(1)] == ["aba"]
        stream.send("bad", _inputs("hello", False), parameters={"frobnicate": 1})
        (item,) = stream.collect(1)
        assert item[4] is not None and "Unrecognized request argument supplied: frobnicate" in item[4]
        stream.send("both", _inputs("hello", False, {"max_tokens": 2}), parameters={"max_tokens": 3})
        (item,) = stream.collect(1)
        assert item[4] is not None and "not both" in item[4]
        stream.send("good", _inputs("hello", False, {"max_tokens": 2}))
        assert [t for _, t, _, _, _ in stream.collect(1)] == ["ab"]
    finally:
        stream.close()


def test_a_client_that_leaves_mid_generation_frees_its_row():
    generator = FakeGenerator(hold=True)  # each request emits one token, then waits to be cancelled
    with BackgroundServer(ServedGenerator(generator, "gen"), CONFIG) as srv:
        stream = _Stream(srv)
        stream.send("a", _inputs("hello", True, {"max_tokens": 50}))
        first = stream.items.get(timeout=30)
        assert first[1] == "a" and not first[3]
        stream.client.stop_stream(cancel_requests=True)
        assert generator.cancelled.acquire(timeout=30)  # the generator saw the cancellation
        stream.client.close()
        assert srv.grpc is not None
        for _ in range(500):  # the server settles the request it was answering
            if srv.grpc.counts.answered == srv.grpc.counts.accepted:
                break
            threading.Event().wait(0.01)
        assert srv.grpc.counts.answered == srv.grpc.counts.accepted == 1
        # counted once, as the request it was: the closed stream itself is no second count
        samples = [
            line
            for line in httpx.get(srv.url + "/metrics").text.splitlines()
            if line.startswith("ortbatch_grpc_requests_total{")
        ]
        assert samples == ['ortbatch_grpc_requests_total{code="CANCELLED",method="ModelStreamInfer"} 1.0'], samples


def test_each_generation_request_counts_once_in_metrics(gen_srv):
    def ok() -> float:
        for line in httpx.get(gen_srv.url + "/metrics").text.splitlines():
            if line.startswith('ortbatch_grpc_requests_total{code="OK",method="ModelStreamInfer"}'):
                return float(line.split()[-1])
        return 0.0

    before = ok()
    stream = _Stream(gen_srv)
    try:
        stream.send("a", _inputs("hello", True, {"max_tokens": 6}))
        stream.send("b", _inputs("hello", False, {"max_tokens": 6}))
        stream.collect(2)
    finally:
        stream.close()
    assert ok() - before == 2  # two requests, eight responses


def test_fuzzed_stream_requests_are_never_internal(gen_srv):
    """150 random requests on one raw stream: every one ends in a final response or an
    error message, and none of those errors is INTERNAL (by the metrics' codes)."""
    import random

    from tritonclient.grpc import service_pb2

    from ortbatch.serve.grpc.schema import message

    rng = random.Random(0)
    values = {
        "BYTES": lambda: rng.choice([b"hi", b"", b"\xff\xfe", b"{}", b'{"max_tokens": 3}', b'{"temperature": "x"}']),
        "BOOL": lambda: rng.choice([b"\x00", b"\x01", b"\x02"]),
        "INT32": lambda: b"\x01\x00\x00\x00",
    }
    requests = []
    for i in range(150):
        r = service_pb2.ModelInferRequest(model_name=rng.choice(["gen", "gen", "gen", "nope", ""]), id=str(i))
        for _ in range(rng.randint(0, 3)):
            name = rng.choice(["text_input", "stream", "sampling_parameters", "x", ""])
            datatype = rng.choice(["BYTES", "BOOL", "INT32"])
            count = rng.choice([1, 1, 1, 2, 0])
            r.inputs.add(name=name, datatype=datatype, shape=[count])
            data = b"".join(values[datatype]() for _ in range(count))
            if datatype == "BYTES":
                data = b"".join(len(v).to_bytes(4, "little") + v for v in (values["BYTES"]() for _ in range(count)))
            r.raw_input_contents.append(data)
        if rng.random() < 0.2:
            r.outputs.add(name=rng.choice(["text_output", "finish_reason", "zz"]))
        requests.append(r)

    def ok_and_internal() -> tuple[float, float]:
        ok = internal = 0.0
        for line in httpx.get(gen_srv.url + "/metrics").text.splitlines():
            if line.startswith("ortbatch_grpc_requests_total{") and 'method="ModelStreamInfer"' in line:
                if 'code="INTERNAL"' in line:
                    internal += float(line.split()[-1])
                ok += float(line.split()[-1])
        return ok, internal

    before, internal_before = ok_and_internal()
    ended: set[str] = set()
    stream_response = message("ModelStreamInferResponse")
    with grpc.insecure_channel(gen_srv.grpc.address) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        for data in call((r.SerializeToString() for r in requests), timeout=60):
            response = stream_response.FromString(data)
            r = response.infer_response
            if response.error_message or r.parameters["triton_final_response"].bool_param:
                assert "internal server error" not in response.error_message
                ended.add(r.id)
    after, internal_after = ok_and_internal()
    assert ended == {str(i) for i in range(150)}
    assert after - before == 150 and internal_after == internal_before
