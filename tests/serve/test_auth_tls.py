"""Acceptance 4: the API key (OpenAI client, tritonclient over HTTP and gRPC, raw
requests) and TLS (HTTPS and TLS gRPC with a self-signed certificate made here)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys

import httpx
import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
openai = pytest.importorskip("openai")
from tritonclient.utils import InferenceServerException  # noqa: E402

from ortbatch.errors import OrtBatchError  # noqa: E402
from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel  # noqa: E402
from ortbatch.serve.auth import ApiKey, resolve_api_key  # noqa: E402

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def locked(encoder_dir):
    """The tiny encoder (tensors, text, /v1/embeddings) behind an API key, HTTP + gRPC."""
    model = ServedModel.load(encoder_dir, name="tiny", session_kwargs={"max_batch_size": 8})
    config = ServeConfig(port=0, grpc_port=0, api_key=KEY, access_log=False, log_level="warning")
    with BackgroundServer(model, config) as srv:
        yield srv


def _requests_run(srv) -> int:
    return srv.model.session.stats().requests


def test_openai_client_with_the_key_and_without(locked):
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0)
    out = good.embeddings.create(model="tiny", input=["hello world", "two"])
    assert len(out.data) == 2 and len(out.data[0].embedding) > 0
    before = _requests_run(locked)
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.embeddings.create(model="tiny", input="hello")
    assert err.value.status_code == 401 and "invalid API key" in str(err.value)
    assert _requests_run(locked) == before  # never reached the model


def test_http_routes_need_the_key_except_health(locked):
    for path in ("/v2/health/live", "/v2/health/ready"):
        assert httpx.get(locked.url + path).status_code == 200
    for path in ("/v2", "/v2/models/tiny", "/v2/models/tiny/config", "/v1/models", "/metrics", "/nowhere"):
        r = httpx.get(locked.url + path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
        assert "missing API key" in r.text
    r = httpx.get(locked.url + "/v2/models/tiny", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["name"] == "tiny"
    r = httpx.get(locked.url + "/v2/models/tiny", headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200  # the scheme is case-insensitive
    for value in (KEY, f"Bearer {KEY}x", f"Basic {KEY}", "Bearer x"):
        r = httpx.get(locked.url + "/v2/models/tiny", headers={"Authorization": value})
        assert r.status_code == 401 and "invalid API key" in r.json()["error"], value
    r = httpx.post(locked.url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]  # OpenAI's error shape


def test_tritonclient_http_and_grpc_with_headers(locked):
    ids = np.array([[1, 2, 3]], np.int64)
    headers = {"Authorization": f"Bearer {KEY}"}

    http = httpclient.InferenceServerClient(locked.url.removeprefix("http://"))
    try:
        inputs = [httpclient.InferInput(n, [1, 3], "INT64") for n in ("input_ids", "attention_mask")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(np.ones_like(ids))
        via_http = http.infer("tiny", inputs, headers=headers).as_numpy("last_hidden_state")
        with pytest.raises(InferenceServerException) as err:
            http.infer("tiny", inputs)
        assert err.value.status() == "401"
    finally:
        http.close()

    headers = {"authorization": f"Bearer {KEY}"}  # gRPC metadata keys are lower-case
    client = grpcclient.InferenceServerClient(locked.grpc.address)
    try:
        assert client.is_server_live() and client.is_server_ready()  # health needs no key
        inputs = [grpcclient.InferInput(n, [1, 3], "INT64") for n in ("input_ids", "attention_mask")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(np.ones_like(ids))
        via_grpc = client.infer("tiny", inputs, headers=headers).as_numpy("last_hidden_state")
        np.testing.assert_array_equal(via_grpc, via_http)
        assert client.get_model_metadata("tiny", headers=headers).name == "tiny"
        before = _requests_run(locked)
        for bad in (None, {"authorization": "Bearer nope"}):
            with pytest.raises(InferenceServerException) as err:
                client.infer("tiny", inputs, headers=bad)
            assert err.value.status() == "StatusCode.UNAUTHENTICATED"
            with pytest.raises(InferenceServerException) as err:
                client.get_model_metadata("tiny", headers=bad)
            assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        assert _requests_run(locked) == before
    finally:
        client.close()


def test_key_check_and_sources(tmp_path, monkeypatch):
    key = ApiKey("abc")
    assert key.allows("Bearer abc") and key.allows(b"Bearer abc") and key.allows("BEARER  abc ")
    assert not any(key.allows(v) for v in (None, "", "abc", "Bearer ab", "Bearer abcd", "Token abc"))
    with pytest.raises(OrtBatchError, match="without whitespace"):
        ApiKey("a b")
    monkeypatch.delenv("ORTBATCH_API_KEY", raising=False)
    assert resolve_api_key() is None
    monkeypatch.setenv("ORTBATCH_API_KEY", "from-env")
    assert resolve_api_key() == "from-env"
    assert resolve_api_key("flag") == "flag"
    f = tmp_path / "key.txt"
    f.write_text("from-file\n")
    assert resolve_api_key(key_file=f) == "from-file"
    f.write_text("\n")
    with pytest.raises(OrtBatchError, match="is empty"):
        resolve_api_key(key_file=f)
    with pytest.raises(OrtBatchError, match="cannot read"):
        resolve_api_key(key_file=tmp_path / "missing")
    with pytest.raises(OrtBatchError, match="not both"):
        resolve_api_key("a", f)


@pytest.mark.parametrize("key", ["k\u00e9y", "\u043a\u043b\u044e\u0447", "key\x00", "key\x7f"])
def test_a_key_no_client_could_send_is_refused_at_start(key):
    # the openai client (httpx) cannot even encode it: the server would start locked for good
    if not key.isascii():
        url = "http://127.0.0.1:9/v1"
        with pytest.raises(UnicodeEncodeError), openai.OpenAI(base_url=url, api_key=key, max_retries=0) as c:
            c.models.list()
    with pytest.raises(OrtBatchError, match="printable ASCII"):
        resolve_api_key(key)
    with pytest.raises(OrtBatchError, match="printable ASCII"):
        ApiKey(key)
    assert ApiKey("sk-A1_b2.c3~d4+e5/f6=").allows("Bearer sk-A1_b2.c3~d4+e5/f6=")  # RFC 6750's token chars


def _self_signed(tmp_path):
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return certfile, keyfile


def test_https_and_tls_grpc_round_trip(tmp_path, adder_path):
    certfile, keyfile = _self_signed(tmp_path)
    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    config = ServeConfig(
        port=0,
        grpc_port=0,
        api_key=KEY,
        ssl_certfile=str(certfile),
        ssl_keyfile=str(keyfile),
        access_log=False,
        log_level="warning",
    )
    x = np.arange(3, dtype=np.float32).reshape(1, 3)
    k = np.array([[4]], np.int32)
    with BackgroundServer(model, config) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        body = {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": x.reshape(-1).tolist()},
                {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [4]},
            ]
        }
        with httpx.Client(verify=ssl.create_default_context(cafile=str(certfile))) as http:
            r = http.post(srv.url + "/v2/models/adder/infer", json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
            y_https = np.array(r.json()["outputs"][0]["data"], np.float32).reshape(1, 3)
        with pytest.raises(httpx.ConnectError):  # the certificate is not in the default trust store
            httpx.get(srv.url + "/v2/health/live")
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to a TLS port gets nothing back
            httpx.get(srv.url.replace("https://", "http://") + "/v2/health/live")

        client = grpcclient.InferenceServerClient(
            f"localhost:{srv.grpc.port}", ssl=True, root_certificates=str(certfile)
        )
        try:
            inputs = [grpcclient.InferInput("x", [1, 3], "FP32"), grpcclient.InferInput("k", [1, 1], "INT32")]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(k)
            result = client.infer("adder", inputs, headers={"authorization": f"Bearer {KEY}"})
            np.testing.assert_array_equal(result.as_numpy("y"), y_https)
        finally:
            client.close()
        plain = grpcclient.InferenceServerClient(f"localhost:{srv.grpc.port}")
        try:
            with pytest.raises(InferenceServerException):
                plain.is_server_live(client_timeout=5)
        finally:
            plain.close()


def test_cli_flags_grpc_port_key_file_and_the_open_bind_warning(tmp_path, adder_path, serve_process):
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    srv = serve_process(str(adder_path), "--grpc-port", "0", "--api-key-file", str(keyfile))
    text = srv.text()
    address = text.split("gRPC on ")[1].split(")")[0].split(";")[0].strip()
    client = grpcclient.InferenceServerClient(address)
    try:
        assert client.get_model_metadata("adder", headers={"authorization": f"Bearer {KEY}"}).name == "adder"
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata("adder")
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        client.close()
    assert httpx.get(srv.url + "/v2/models/adder").status_code == 401
    srv.terminate()
    assert srv.wait(30) == 0
    assert "gRPC accepted=0 answered=0" in srv.text()

    # an address reachable from other machines without a key: warned before anything binds
    # (an export whose model file is gone fails to load, so nothing ever listens on it)
    from tests.models import embed_export

    empty = embed_export(tmp_path / "empty")
    (empty / "model.onnx").unlink()
    cmd = [sys.executable, "-m", "ortbatch.cli", "serve", str(empty), "--host", "0.0.0.0", "--port", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert "without an API key" in out.stderr and "Traceback" not in out.stderr
    assert out.returncode != 0
    out = subprocess.run([*cmd[:4], str(empty), "--ssl-certfile", str(keyfile)], capture_output=True, text=True)
    assert out.returncode == 2 and "needs both --ssl-certfile and --ssl-keyfile" in out.stderr
