"""The server over real HTTP (uvicorn on a free loopback port, httpx as the client):
routes, JSON/binary/text inference equal to a direct ORT run, error mapping,
/v1/embeddings, /metrics."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import re
from types import SimpleNamespace

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from scripted import ScriptedSession, ScriptedTokenSession

from ortbatch.errors import InvalidInputError, QueueFullError, SessionClosedError
from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def encoder_ort(encoder_dir):
    return ort.InferenceSession(str(encoder_dir / "model.onnx"), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def adder_ort(adder_path):
    return ort.InferenceSession(str(adder_path), providers=["CPUExecutionProvider"])


def tensor(name, arr, datatype):
    return {"name": name, "shape": list(arr.shape), "datatype": datatype, "data": arr.reshape(-1).tolist()}


# -- routes ------------------------------------------------------------------------------


def test_health_and_server_metadata(encoder_server):
    with httpx.Client(base_url=encoder_server.url) as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").json() == {"ready": True}
        meta = c.get("/v2").json()
        assert meta["name"] == "ortbatch" and "binary_tensor_data" in meta["extensions"]


def test_model_metadata_dynamic_dims_and_text_input(encoder_server):
    with httpx.Client(base_url=encoder_server.url) as c:
        for path in ("/v2/models/tiny", "/v2/models/tiny/versions/1"):
            meta = c.get(path).json()
            assert meta["name"] == "tiny" and meta["versions"] == ["1"]
            inputs = {t["name"]: t for t in meta["inputs"]}
            assert inputs["input_ids"] == {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}
            # exactly the tensors a request needs (a metadata-driven client sends them all);
            # text has its own entry
            assert sorted(inputs) == ["attention_mask", "input_ids"]
            assert meta["parameters"]["text_model"] == "tiny_text"
            outputs = {t["name"]: t for t in meta["outputs"]}
            assert outputs["last_hidden_state"]["shape"] == [-1, -1, 4]
            assert outputs["pooled"] == {"name": "pooled", "datatype": "FP32", "shape": [-1, 4]}
        text = c.get("/v2/models/tiny_text").json()
        assert text["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]
        assert text["outputs"] == meta["outputs"]
        assert c.get("/v2/models/tiny/ready").json() == {"name": "tiny", "ready": True}
        assert c.get("/v2/models/tiny/versions/1/ready").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/v2/models/nope", 404, "unknown model 'nope'"),
        ("GET", "/v2/models/nope/ready", 404, "unknown model"),
        ("POST", "/v2/models/nope/infer", 404, "unknown model"),
        ("GET", "/v2/models/tiny/versions/7", 404, "unknown version '7'"),
        ("POST", "/v2/models/tiny/versions/7/infer", 404, "unknown version"),
        ("GET", "/nowhere", 404, "no route"),
        ("GET", "/v2/models/tiny/infer", 405, "not allowed"),
        ("DELETE", "/v2", 405, "not allowed"),
    ],
)
def test_unknown_routes_models_and_methods_answer_json(encoder_server, method, path, status, message):
    r = httpx.request(method, encoder_server.url + path, content=b"{}")
    assert r.status_code == status
    assert message in r.json()["error"]


# -- inference ---------------------------------------------------------------------------


def test_json_infer_equals_direct_ort(adder_server, adder_ort):
    x = np.random.default_rng(1).standard_normal((3, 3)).astype(np.float32)
    k = np.array([[1], [-2], [5]], dtype=np.int32)
    body = {"id": "req-7", "inputs": [tensor("x", x, "FP32"), tensor("k", k, "INT32")]}
    r = httpx.post(adder_server.url + "/v2/models/adder/infer", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model_name"] == "adder" and doc["id"] == "req-7"
    want = dict(zip(["y", "n"], adder_ort.run(None, {"x": x, "k": k}), strict=True))
    for out in doc["outputs"]:
        got = np.array(out["data"], dtype=want[out["name"]].dtype).reshape(out["shape"])
        np.testing.assert_array_equal(got, want[out["name"]])
    assert [o["name"] for o in doc["outputs"]] == ["y", "n"]


def test_binary_infer_with_requested_outputs(adder_server, adder_ort):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    k = np.array([[3], [4]], dtype=np.int32)
    header = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}},
                {"name": "k", "shape": [2, 1], "datatype": "INT32", "parameters": {"binary_data_size": k.nbytes}},
            ],
            "outputs": [{"name": "n", "parameters": {"binary_data": True}}, {"name": "y"}],
        }
    ).encode()
    r = httpx.post(
        adder_server.url + "/v2/models/adder/infer",
        content=header + x.tobytes() + k.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    hl = int(r.headers["inference-header-content-length"])
    doc = json.loads(r.content[:hl])
    y_ref, n_ref = adder_ort.run(None, {"x": x, "k": k})
    assert [o["name"] for o in doc["outputs"]] == ["n", "y"]
    n_out, y_out = doc["outputs"]
    assert n_out["parameters"]["binary_data_size"] == n_ref.nbytes and "data" not in n_out
    np.testing.assert_array_equal(np.frombuffer(r.content[hl:], dtype="<i4").reshape(2, 1), n_ref)
    np.testing.assert_array_equal(np.array(y_out["data"], dtype=np.float32).reshape(2, 3), y_ref)


def test_gzip_request_body(adder_server):
    body = {
        "inputs": [tensor("x", np.ones((1, 3), np.float32), "FP32"), tensor("k", np.ones((1, 1), np.int32), "INT32")]
    }
    r = httpx.post(
        adder_server.url + "/v2/models/adder/infer",
        content=gzip.compress(json.dumps(body).encode()),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [3.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("fields", "layers", "status"),
    [
        ([("Content-Encoding", "identity"), ("Content-Encoding", "gzip")], 1, 200),  # one list: a gzip body
        ([("Content-Encoding", "gzip, identity")], 1, 200),
        ([("Content-Encoding", "gzip"), ("Content-Encoding", "gzip")], 2, 415),  # stacked: named, not misread
        ([("Content-Encoding", "gzip, deflate")], 1, 415),
    ],
)
def test_content_encoding_fields_are_one_list(adder_server, fields, layers, status):
    body = {
        "inputs": [tensor("x", np.ones((1, 3), np.float32), "FP32"), tensor("k", np.ones((1, 1), np.int32), "INT32")]
    }
    data = json.dumps(body).encode()
    for _ in range(layers):
        data = gzip.compress(data)
    headers = [*fields, ("Content-Type", "application/json")]
    r = httpx.post(adder_server.url + "/v2/models/adder/infer", content=data, headers=headers)
    assert r.status_code == status, r.text
    if status == 415:
        assert "unsupported Content-Encoding" in r.json()["error"]
    else:
        assert r.json()["outputs"][0]["data"] == [3.0, 3.0, 3.0]


def test_text_input_is_tokenized_and_each_text_matches_its_own_run(encoder_server, encoder_dir, encoder_ort):
    from tokenizers import Tokenizer

    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "unknownword"]
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": texts}]}
    r = httpx.post(encoder_server.url + "/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    outs = {o["name"]: o for o in r.json()["outputs"]}
    tok = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    lengths = [len(tok.encode(t).ids) for t in texts]
    assert outs["last_hidden_state"]["shape"] == [3, max(lengths), 4]
    hidden = np.array(outs["last_hidden_state"]["data"], dtype=np.float32).reshape(3, max(lengths), 4)
    pooled = np.array(outs["pooled"]["data"], dtype=np.float32).reshape(3, 4)
    for i, t in enumerate(texts):
        e = tok.encode(t)
        feed = {"input_ids": np.array([e.ids], np.int64), "attention_mask": np.array([e.attention_mask], np.int64)}
        h_ref, p_ref = encoder_ort.run(None, feed)
        np.testing.assert_allclose(hidden[i, : lengths[i]], h_ref[0], rtol=1e-6)
        assert not hidden[i, lengths[i] :].any()  # zero padding past this text's own length
        np.testing.assert_allclose(pooled[i], p_ref[0], rtol=1e-6)


def test_text_input_is_truncated_to_the_manifest_limit(encoder_server):
    long = " ".join(["fox"] * 100)
    body = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [long]}],
        "outputs": [{"name": "last_hidden_state"}],
    }
    r = httpx.post(encoder_server.url + "/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [1, 16, 4]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}, "missing input"),
        (
            {
                "inputs": [
                    {"name": "x", "datatype": "FP64", "shape": [1, 3], "data": [1, 2, 3]},
                    {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [1]},
                ]
            },
            "expected datatype FP32",
        ),
        (
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                    {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [1]},
                ]
            },
            "'x'",
        ),
        (
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]},
                    {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [1]},
                ]
            },
            "'x'",
        ),
        (
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]},
                    {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [1]},
                    {"name": "z", "datatype": "INT32", "shape": [1, 1], "data": [1]},
                ]
            },
            "unknown input",
        ),
        (
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]},
                    {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [1]},
                ],
                "outputs": [{"name": "nope"}],
            },
            "unknown output",
        ),
    ],
)
def test_bad_tensors_are_400_with_the_reason(adder_server, body, message):
    r = httpx.post(adder_server.url + "/v2/models/adder/infer", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


HEADER = "Inference-Header-Content-Length"


def _binary_adder_request() -> tuple[bytes, int]:
    head = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 3], "parameters": {"binary_data_size": 12}},
                {"name": "k", "datatype": "INT32", "shape": [1, 1], "parameters": {"binary_data_size": 4}},
            ]
        }
    ).encode()
    return head + np.array([1, 2, 3], "<f4").tobytes() + np.array([1], "<i4").tobytes(), len(head)


@pytest.mark.parametrize("value", ["+{n}", "{n}_0", "-1", "0x1f", "{n}.0", "9" * 40])
def test_an_inference_header_length_that_is_not_digits_is_400(adder_server, value):
    body, n = _binary_adder_request()
    # int() took "+N" and "N_0" ("N_0" as N0): only ASCII digits are a length
    value = value.format(n=n)
    r = httpx.post(adder_server.url + "/v2/models/adder/infer", content=body, headers={HEADER: value})
    assert r.status_code == 400 and r.json()["error"].startswith("invalid Inference-Header-Content-Length"), r.text


def test_an_inference_header_length_sent_twice_must_agree(adder_server):
    body, n = _binary_adder_request()
    url = adder_server.url + "/v2/models/adder/infer"
    r = httpx.post(url, content=body, headers=[(HEADER, str(n)), (HEADER, "5")])
    assert r.status_code == 400 and "more than once with different values" in r.json()["error"], r.text
    r = httpx.post(url, content=body, headers=[(HEADER, str(n)), (HEADER, str(n))])
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3.0, 5.0, 7.0]


def test_bad_bodies_are_400(encoder_server):
    url = encoder_server.url + "/v2/models/tiny/infer"
    r = httpx.post(url, content=b'{"inputs": [')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(url, content=b"{}", headers={"Inference-Header-Content-Length": "abc"})
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]
    r = httpx.post(
        url,
        json={
            "inputs": [
                {"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [5, 10**6]},
                {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]},
            ]
        },
    )
    assert r.status_code == 400 and "outside the model's range" in r.json()["error"]
    r = httpx.post(
        url,
        json={
            "inputs": [
                {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                {"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": [5]},
            ]
        },
    )
    assert r.status_code == 400 and "either the text input" in r.json()["error"]
    r = httpx.post(
        url,
        json={
            "inputs": [
                {"name": "input_ids", "datatype": "INT64", "shape": [1, 17], "data": [5] * 17},
                {"name": "attention_mask", "datatype": "INT64", "shape": [1, 17], "data": [1] * 17},
            ]
        },
    )
    assert r.status_code == 400, r.text  # over max_sequence_length: the session's InvalidInputError text


def test_body_limits_are_413(encoder_server):
    url = encoder_server.url + "/v2/models/tiny/infer"
    big = b"x" * ((1 << 20) + 1)
    r = httpx.post(url, content=big)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]

    def chunks():  # no Content-Length: the streamed size is what gets checked
        for _ in range(40):
            yield b" " * 32768

    r = httpx.post(url, content=chunks())
    assert r.status_code == 413
    bomb = gzip.compress(b" " * (4 << 20))
    r = httpx.post(url, content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "decompressed" in r.json()["error"]
    r = httpx.post(url, content=b"abc", headers={"Content-Encoding": "br"})
    assert r.status_code == 415
    assert httpx.get(encoder_server.url + "/v2/health/ready").status_code == 200


# -- error mapping with a scripted session ---------------------------------------------


async def _queue_full(feed):
    raise QueueFullError(1024, 1024)


async def _slow(feed):
    await asyncio.sleep(2)
    return [feed["x"]]


async def _closed(feed):
    raise SessionClosedError("the session is closed")


@pytest.mark.parametrize(
    ("behaviour", "params", "status", "message"),
    [
        (_queue_full, {}, 429, "queue full"),
        (_slow, {"timeout": 50_000}, 504, "timeout of 50 ms"),
        (_closed, {}, 503, "closed"),
    ],
)
def test_overload_deadline_and_closed_mapping(behaviour, params, status, message):
    model = ServedModel(ScriptedSession(behaviour), "s")
    with BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning")) as srv:
        body = {"inputs": [tensor("x", np.zeros((1, 3), np.float32), "FP32")], "parameters": params}
        r = httpx.post(srv.url + "/v2/models/s/infer", json=body, timeout=10)
        assert r.status_code == status, r.text
        assert message in r.json()["error"]
        if status == 429:
            assert r.headers["retry-after"] == "1"


# -- /v1/embeddings ------------------------------------------------------------------------


def _reference_embedding(encoder_ort, tok, text):
    e = tok.encode(text)
    feed = {"input_ids": np.array([e.ids], np.int64), "attention_mask": np.array([e.attention_mask], np.int64)}
    hidden = encoder_ort.run(["last_hidden_state"], feed)[0][0]
    mask = np.array(e.attention_mask, np.float32)[:, None]
    v = (hidden * mask).sum(0) / mask.sum()
    return v / np.linalg.norm(v), len(e.ids)


def test_embeddings_openai_compatible(encoder_server, encoder_dir, encoder_ort):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    texts = ["hello world", "many callers one run"]
    r = httpx.post(encoder_server.url + "/v1/embeddings", json={"model": "tiny", "input": texts})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "list" and doc["model"] == "tiny"
    total = 0
    for i, t in enumerate(texts):
        ref, n = _reference_embedding(encoder_ort, tok, t)
        total += n
        item = doc["data"][i]
        assert item["index"] == i and item["object"] == "embedding"
        np.testing.assert_allclose(item["embedding"], ref, rtol=1e-5, atol=1e-6)
    assert doc["usage"] == {"prompt_tokens": total, "total_tokens": total}
    r = httpx.post(encoder_server.url + "/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, _reference_embedding(encoder_ort, tok, "hello world")[0], rtol=1e-5, atol=1e-6)
    ids = tok.encode("hello world").ids
    r = httpx.post(encoder_server.url + "/v1/embeddings", json={"input": ids})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], vec, rtol=1e-5, atol=1e-6)
    # OpenAI's dimensions: the first ones, re-normalized (this export normalizes)
    r = httpx.post(encoder_server.url + "/v1/embeddings", json={"input": "hello world", "dimensions": 2})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], vec[:2] / np.linalg.norm(vec[:2]), rtol=1e-5)
    models = httpx.get(encoder_server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "gpt-4", "input": "x"}, 404),
        ({"input": []}, 400),
        ({"input": [1, "a"]}, 400),
        ({"input": "x", "encoding_format": "int8"}, 400),
        ({"input": "x", "dimensions": 99}, 400),
        ({"input": "x", "dimensions": 0}, 400),
        ({"input": "x", "prompt_name": "query"}, 400),
        ({"input": [[5, 6]], "prompt": "query: "}, 400),
        ({"input": "x", "top_k": 3}, 400),
        ({"input": [[5, 2**70]]}, 400),
        ({"input": [[5, 99999]]}, 400),
        ([1, 2], 400),
    ],
)
def test_embeddings_errors_in_openai_shape(encoder_server, body, status):
    r = httpx.post(encoder_server.url + "/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"]["message"], str)


def test_embeddings_need_an_embedding_export(adder_server):
    r = httpx.post(adder_server.url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404 and "does not serve embeddings" in r.json()["error"]["message"]


# -- /metrics ------------------------------------------------------------------------------


def test_metrics_by_route_template_and_batching(adder_server):
    with httpx.Client(base_url=adder_server.url) as c:
        body = {
            "inputs": [
                tensor("x", np.ones((2, 3), np.float32), "FP32"),
                tensor("k", np.ones((2, 1), np.int32), "INT32"),
            ]
        }
        assert c.post("/v2/models/adder/infer", json=body).status_code == 200
        c.get("/some/random/path/123")
        text = c.get("/metrics").text
    assert re.search(
        r'ortbatch_http_requests_total\{endpoint="/v2/models/\{name\}/infer",method="POST",status="200"\} [1-9]', text
    )
    assert (
        'ortbatch_http_request_duration_seconds_bucket{endpoint="/v2/models/{name}/infer",le="0.005",status="200"}'
        in text
    )
    assert 'endpoint="unmatched"' in text and "/some/random" not in text
    assert re.search(r'ortbatch_batch_rows_bucket\{le="2.0"\} [1-9]', text) or re.search(
        r'ortbatch_batch_rows_bucket\{le="2"\} [1-9]', text
    )
    assert "ortbatch_queue_depth 0.0" in text
    assert "ortbatch_padding_fraction" in text
    assert re.search(r"ortbatch_batches_alone_total [1-9]", text)  # the idle server ran it alone


def test_a_client_that_leaves_is_not_computed_for():
    """Disconnecting cancels the request's session call (dropping it from the queue)."""
    import threading

    cancelled = threading.Event()

    async def hang(feed):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [feed["x"]]

    model = ServedModel(ScriptedSession(hang), "s")
    with BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning")) as srv:
        body = {"inputs": [tensor("x", np.zeros((1, 3), np.float32), "FP32")]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v2/models/s/infer", json=body, timeout=0.5)
        assert cancelled.wait(10)
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'endpoint="/v2/models/{name}/infer",method="POST",status="499"} 1.0' in metrics


def test_one_text_refused_fails_the_request_and_drops_its_siblings(encoder_dir):
    """Texts of one request are separate session requests: when one is refused (queue
    full), the request answers 429 at once and the others are cancelled, not run."""
    import threading

    from tokenizers import Tokenizer

    calls = []
    cancelled = []
    lock = threading.Lock()

    async def second_is_refused(feed):
        with lock:
            calls.append(feed)
            n = len(calls)
        if n == 2:
            raise QueueFullError(8, 8)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return [np.zeros((1, 4), np.float32)]

    tok = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    model = ServedModel(ScriptedTokenSession(second_is_refused), "s", tokenizer=tok)
    with BackgroundServer(model, ServeConfig(port=0, access_log=False, log_level="warning")) as srv:
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [4], "data": ["a", "b", "c", "d"]}]}
        r = httpx.post(srv.url + "/v2/models/s/infer", json=body, timeout=10)
        assert r.status_code == 429 and "queue full" in r.json()["error"]
        assert len(calls) == 4 and sorted(cancelled) == [1, 3, 4]


def test_every_ortbatch_error_has_a_deliberate_status():
    """The one mapping boundary: each error class a request can meet gets its status;
    a new error class in ortbatch.errors fails here until it is placed."""
    import inspect

    from ortbatch import errors
    from ortbatch.serve.http.plumbing import ClientGone, HTTPError, error_response

    expected = {
        "InvalidInputError": 400,
        "RequestTooLargeError": 413,
        "NonFiniteOutputError": 500,
        "ModelNotFoundError": 404,
        "ModelUnavailableError": 503,
        "ModelLoadFailedError": 400,
        "UnsupportedError": 501,
        "ModelContractError": 500,  # raised building the session, never per request
        "ModelLoadError": 500,  # likewise
        "ManifestError": 500,
        "ModelIntegrityError": 500,  # raised loading the model, never per request
        "ServeError": 500,  # raised binding the socket, before any request
        "UnsupportedModelError": 500,
        "QueueFullError": 429,
        "RequestTimeoutError": 504,
        "SessionClosedError": 503,
        "InferenceError": 500,
        "ProviderError": 500,
        "ExportError": 500,
        "ValidationError": 500,
        "OrtBatchError": 500,
    }
    classes = {
        name: cls for name, cls in inspect.getmembers(errors, inspect.isclass) if issubclass(cls, errors.OrtBatchError)
    }
    assert set(classes) == set(expected)
    for name, cls in classes.items():
        exc = cls(3, 4) if cls is errors.QueueFullError else cls("boom")
        status, body, headers = error_response(exc)
        assert status == expected[name], name
        assert isinstance(body["error"], str) and body["error"]
        assert ("Retry-After" in headers) == (status == 429)
    assert error_response(HTTPError(413, "big"))[0] == 413
    assert error_response(ClientGone())[0] == 499
    status, body, _ = error_response(InvalidInputError("bad x"), openai=True)
    assert status == 400 and body["error"]["message"] == "bad x"
    # an unexpected exception is a 500 whose body names an incident in the log, never
    # the exception itself (its repr may carry paths, values, internals)
    status, body, _ = error_response(KeyError("secret-path"))
    assert status == 500 and "incident" in body["error"]
    assert "KeyError" not in body["error"] and "secret-path" not in body["error"]
    # OpenAI's error types follow the status: the openai client maps them to its classes
    assert error_response(QueueFullError(1, 1), openai=True)[1]["error"]["type"] == "rate_limit_exceeded"
    assert error_response(InvalidInputError("x", input_name="top_p"), openai=True)[1]["error"]["param"] == "top_p"
    assert error_response(errors.InferenceError("x"), openai=True)[1]["error"]["type"] == "server_error"


def test_id_ranges_come_from_config_json(tmp_path):
    """An id the embedding tables cannot look up is the request's fault: 400, not an
    ONNX Runtime failure (type ids included, from the export's config.json)."""
    from ortbatch.serve.served.model import _config_id_limits
    from ortbatch.serve.served.protocol import parse_infer_request

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50, "type_vocab_size": 2}))
    limits = _config_id_limits(tmp_path / "config.json")
    assert limits == {"input_ids": 50, "token_type_ids": 2}
    assert _config_id_limits(tmp_path / "missing.json") == {}

    class BertLike(ScriptedTokenSession):
        def get_inputs(self):
            names = ("input_ids", "attention_mask", "token_type_ids")
            return [SimpleNamespace(name=n, type="tensor(int64)", shape=["batch", "sequence"]) for n in names]

    async def ok(feed):
        return [np.zeros((1, 4), np.float32)]

    model = ServedModel(BertLike(ok), "b", id_limits=limits)

    def request(ids, types):
        doc = {
            "inputs": [
                {"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": ids},
                {"name": "attention_mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]},
                {"name": "token_type_ids", "datatype": "INT64", "shape": [1, 2], "data": types},
            ]
        }
        return asyncio.run(model.infer(parse_infer_request(json.dumps(doc).encode())))

    assert request([1, 49], [0, 1])[0][0] == "pooled"
    with pytest.raises(InvalidInputError, match=r"'token_type_ids': id 2 is outside the model's range \[0, 2\)"):
        request([1, 2], [0, 2])
    with pytest.raises(InvalidInputError, match="'input_ids': id 50"):
        request([1, 50], [0, 0])
    with pytest.raises(InvalidInputError, match="'input_ids': id -1"):
        request([-1, 5], [0, 0])
