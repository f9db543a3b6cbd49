"""Acceptance 1: a real Triton client (``tritonclient[http]``) against the server.

Binary tensors (the client's default) and JSON tensors, sync and asyncio clients;
every output must equal the direct ONNX Runtime run of the same request."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

httpclient = pytest.importorskip("tritonclient.http")
aioclient = pytest.importorskip("tritonclient.http.aio")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _host(server) -> str:
    return server.url.removeprefix("http://")


@pytest.fixture(scope="module")
def encoder_ort(encoder_dir):
    return ort.InferenceSession(str(encoder_dir / "model.onnx"), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def adder_ort(adder_path):
    return ort.InferenceSession(str(adder_path), providers=["CPUExecutionProvider"])


def test_health_and_metadata(encoder_server):
    client = httpclient.InferenceServerClient(_host(encoder_server))
    try:
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("tiny")
        assert not client.is_model_ready("missing")
        server = client.get_server_metadata()
        assert "binary_tensor_data" in server["extensions"]
        meta = client.get_model_metadata("tiny")
        assert meta["name"] == "tiny"
        shapes = {t["name"]: t["shape"] for t in meta["inputs"]}
        assert shapes["input_ids"] == [-1, -1] and shapes["attention_mask"] == [-1, -1]
        assert client.get_model_metadata("tiny", model_version="1")["versions"] == ["1"]
        config = client.get_model_config("tiny")
        assert config["max_batch_size"] == 8
        assert {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]} in config["input"]
        with pytest.raises(InferenceServerException, match="unknown model") as err:
            client.get_model_metadata("missing")
        assert err.value.status() == "404"
    finally:
        client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_equals_direct_ort(adder_server, adder_ort, binary):
    client = httpclient.InferenceServerClient(_host(adder_server))
    rng = np.random.default_rng(3)
    try:
        for rows in (1, 3, 8):
            x = rng.standard_normal((rows, 3)).astype(np.float32)
            k = rng.integers(-100, 100, (rows, 1)).astype(np.int32)
            inputs = [
                httpclient.InferInput("x", list(x.shape), "FP32"),
                httpclient.InferInput("k", list(k.shape), "INT32"),
            ]
            inputs[0].set_data_from_numpy(x, binary_data=binary)
            inputs[1].set_data_from_numpy(k, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("y", "n")]
            result = client.infer("adder", inputs, outputs=outputs, request_id=f"r{rows}")
            y_ref, n_ref = adder_ort.run(None, {"x": x, "k": k})
            assert result.get_response()["id"] == f"r{rows}"
            np.testing.assert_array_equal(result.as_numpy("y"), y_ref)
            np.testing.assert_array_equal(result.as_numpy("n"), n_ref)
            assert result.as_numpy("n").dtype == np.int32
        # no outputs listed: the client asks for all of them as binary
        result = client.infer("adder", inputs)
        assert result.get_output("y")["parameters"]["binary_data_size"] == y_ref.nbytes
        np.testing.assert_array_equal(result.as_numpy("y"), y_ref)
    finally:
        client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_text_bytes_input(encoder_server, encoder_dir, encoder_ort, binary):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    texts = np.array([["hello world"], ["the lazy dog jumps"]], dtype=object)
    client = httpclient.InferenceServerClient(_host(encoder_server))
    try:
        inp = httpclient.InferInput("text", [2, 1], "BYTES")
        inp.set_data_from_numpy(texts, binary_data=binary)
        result = client.infer("tiny", [inp], outputs=[httpclient.InferRequestedOutput("pooled", binary_data=binary)])
        pooled = result.as_numpy("pooled")
        for i, t in enumerate(texts[:, 0]):
            e = tok.encode(t)
            ref = encoder_ort.run(
                ["pooled"], {"input_ids": np.array([e.ids]), "attention_mask": np.array([e.attention_mask])}
            )
            np.testing.assert_allclose(pooled[i], ref[0][0], rtol=1e-6)
    finally:
        client.close()


def test_bad_request_surfaces_as_400(adder_server):
    client = httpclient.InferenceServerClient(_host(adder_server))
    try:
        x = np.zeros((1, 4), np.float32)
        inp = httpclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        k = httpclient.InferInput("k", [1, 1], "INT32")
        k.set_data_from_numpy(np.zeros((1, 1), np.int32))
        with pytest.raises(InferenceServerException) as err:
            client.infer("adder", [inp, k])
        assert err.value.status() == "400" and "'x'" in err.value.message()
        assert client.is_server_ready()
    finally:
        client.close()


def test_concurrent_aio_clients_get_their_own_rows(encoder_server, encoder_ort):
    """Many concurrent requests batch together; each response is its own request's."""
    rng = np.random.default_rng(5)
    reqs = []
    for _ in range(48):
        n = int(rng.integers(1, 12))
        ids = rng.integers(4, 20, (1, n)).astype(np.int64)
        reqs.append((ids, np.ones_like(ids)))

    async def main():
        client = aioclient.InferenceServerClient(_host(encoder_server))
        try:

            async def one(ids, mask):
                a = aioclient.InferInput("input_ids", list(ids.shape), "INT64")
                a.set_data_from_numpy(ids)
                b = aioclient.InferInput("attention_mask", list(mask.shape), "INT64")
                b.set_data_from_numpy(mask)
                res = await client.infer("tiny", [a, b])
                return res.as_numpy("last_hidden_state"), res.as_numpy("pooled")

            return await asyncio.gather(*(one(*r) for r in reqs))
        finally:
            await client.close()

    results = asyncio.run(main())
    for (ids, mask), (hidden, pooled) in zip(reqs, results, strict=True):
        h_ref, p_ref = encoder_ort.run(None, {"input_ids": ids, "attention_mask": mask})
        np.testing.assert_array_equal(hidden, h_ref)
        np.testing.assert_allclose(pooled, p_ref, rtol=1e-6, atol=1e-6)
