"""A model kind added by registration alone (``echokind.py``): served over HTTP (alone and in a
repository), documented in ``/openapi.json``, answered over gRPC and computed by ``ortbatch run``,
with no edit in a transport, the front ends, bulk or the CLI. And the other side of the
registry: an export no kind serves (an encoder-decoder export) is refused by ``serve``,
``generate`` and ``run`` in one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from echokind import EchoKind, EchoServed, write_echo_export
from starlette.testclient import TestClient

from ortbatch.cli import main
from ortbatch.serve import BackgroundServer, ServeConfig
from ortbatch.serve.assembly import app_for, load_app, served_summary
from ortbatch.serve.served.kinds import UnservedExportError, kind_for_export, kind_of, register, unregister
from ortbatch.serve.served.repository import ModelRepository


@pytest.fixture(scope="module")
def echo_kind() -> Iterator[EchoKind]:
    kind = register(EchoKind())
    yield kind  # type: ignore[misc]
    unregister("echo")


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_echo_export(tmp_path_factory.mktemp("kinds") / "echo", prefix="echo: ")


def _seq2seq_export(directory: Path) -> Path:
    """What ``ortbatch export`` writes for a BART (--task text2text-generation): the encoder as
    the manifest's main graph, the decoders beside it (export/exporter.py ``_write_manifest``)."""
    directory.mkdir(parents=True)
    files = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")
    for f in files:
        (directory / f).write_bytes(b"")
    manifest = {
        "format": 1,
        "model": "encoder_model.onnx",
        "source": {"model": "tiny-bart", "task": "text2text-generation", "family": "seq2seq"},
        "inputs": {"input_ids": {"dtype": "int64", "axes": ["batch", "sequence"], "pad": 1}},
        "outputs": {"last_hidden_state": {"axes": ["batch", "sequence", None]}},
        "components": {f.removesuffix(".onnx").removesuffix("_model"): {"model": f} for f in files},
    }
    (directory / "ortbatch.json").write_text(json.dumps(manifest))
    return directory


@pytest.fixture(scope="module")
def seq2seq_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _seq2seq_export(tmp_path_factory.mktemp("kinds") / "bart")


def test_the_registry_recognises_each_kind(echo_kind: EchoKind, echo_dir: Path, encoder_dir: Path) -> None:
    assert kind_for_export(echo_dir) is echo_kind
    assert kind_for_export(encoder_dir).name == "encoder"  # the fallback, asked after echo


def test_echo_over_http_alone(echo_kind: EchoKind, echo_dir: Path) -> None:
    served, app = load_app(echo_dir, ServeConfig(name="parrot"))
    assert isinstance(served, EchoServed) and kind_of(served) is echo_kind
    assert served_summary(served) == "echo: /v1/echo"
    with TestClient(app) as client:
        r = client.post("/v1/echo", json={"model": "parrot", "input": "hi"})
        assert r.status_code == 200 and r.json() == {"model": "parrot", "echo": "echo: hi"}
        r = client.post("/v1/echo", json={"input": "hi", "temperature": 1})
        assert r.status_code == 400 and "temperature" in r.text
        # another kind's body route: refused with what this model is, not "no route"
        r = client.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400
        assert "model 'parrot' is an echo export; /v1/embeddings is served by an encoder export" in r.text
        assert client.get("/v1/models").json()["data"][0]["id"] == "parrot"
        doc = client.get("/openapi.json").json()
    op = doc["paths"]["/v1/echo"]["post"]
    assert op["summary"] == "Echo a text" and "x-ortbatch-undocumented" not in op
    assert op["requestBody"]["content"]["application/json"]["example"] == {"model": "parrot", "input": "Hello, world!"}
    assert doc["components"]["schemas"]["EchoRequest"]["required"] == ["input"]
    assert "`POST /v1/embeddings`: served by an encoder export" in doc["info"]["description"]
    assert not [p for p, item in doc["paths"].items() for o in item.values() if o.get("x-ortbatch-undocumented")]


def test_encoders_refuse_the_echo_route_and_document_why(echo_kind: EchoKind, encoder_dir: Path) -> None:
    _, app = load_app(encoder_dir, ServeConfig(name="embedder"))
    with TestClient(app) as client:
        r = client.post("/v1/echo", json={"input": "hi"})
        assert r.status_code == 400
        assert "model 'embedder' is an encoder export; /v1/echo is served by an echo export" in r.text
        doc = client.get("/openapi.json").json()
    assert "/v1/echo" not in doc["paths"]
    assert "`POST /v1/echo`: served by an echo export" in doc["info"]["description"]


def test_echo_in_a_repository_beside_an_encoder(echo_kind: EchoKind, echo_dir: Path, encoder_dir: Path) -> None:
    repo = ModelRepository([("parrot", echo_dir), ("embedder", encoder_dir)], config=ServeConfig(warmup=False))
    repo.load_all()
    assert [line.split(": ", 1)[1] for line in repo.status_lines()] == [
        "READY, echo; endpoints ['echo']",
        "READY, model; endpoints ['embeddings', 'tokenize']",
    ]
    with TestClient(app_for(repo, ServeConfig())) as client:
        r = client.post("/v1/echo", json={"model": "parrot", "input": "hi"})
        assert r.status_code == 200 and r.json()["echo"] == "echo: hi"
        r = client.post("/v1/echo", json={"input": "hi"})  # the only model serving it
        assert r.status_code == 200 and r.json()["model"] == "parrot"
        r = client.post("/v1/echo", json={"model": "embedder", "input": "hi"})
        assert r.status_code == 400 and "is an encoder export; /v1/echo is served by an echo export" in r.text
        r = client.post("/v1/embeddings", json={"model": "parrot", "input": "hi"})
        assert r.status_code == 400 and "model 'parrot' is an echo export" in r.text
        doc = client.get("/openapi.json").json()
        assert doc["paths"]["/v1/echo"]["post"]["requestBody"]["content"]["application/json"]["example"]["model"] == (
            "parrot"
        )
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
    repo.close()


def test_echo_over_grpc(echo_kind: EchoKind, echo_dir: Path) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    served, _ = load_app(echo_dir, ServeConfig(name="parrot"))
    config = ServeConfig(port=0, grpc_port=0, access_log=False, log_level="warning")
    with BackgroundServer(served, config) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc.address)
        try:
            assert client.is_model_ready("parrot")
            meta = client.get_model_metadata("parrot")
            assert meta.platform == "ortbatch_echo" and [t.name for t in meta.inputs] == ["text"]
            text = grpcclient.InferInput("text", [2], "BYTES")
            text.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
            result = client.infer("parrot", [text])
            assert list(result.as_numpy("echo")) == [b"echo: a", b"echo: b"]
        finally:
            client.close()


def test_ortbatch_run_computes_the_echo_task(
    echo_kind: EchoKind, echo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["one", "two", "three"]))
    out = tmp_path / "out"
    assert main(["run", str(echo_dir), str(src), "-o", str(out), "--format", "jsonl", "--quiet"]) == 0
    lines = [json.loads(x) for p in sorted(out.glob("part-*.jsonl")) for x in p.read_text().splitlines()]
    assert lines == [{"row": i, "echo": f"echo: {t}"} for i, t in enumerate(["one", "two", "three"])]


def _one_line_refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", ["serve", "generate", "run"])
def test_an_encoder_decoder_export_is_refused_in_one_line(
    command: str, seq2seq_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hi"}\n')
    argv = {
        "serve": ["serve", str(seq2seq_dir), "--port", "0"],
        "generate": ["generate", str(seq2seq_dir), "hello"],
        "run": ["run", str(seq2seq_dir), str(src), "-o", str(tmp_path / "out")],
    }[command]
    err = _one_line_refusal(capsys, argv)
    assert f"ortbatch {command}: error: {seq2seq_dir}" in err
    assert "an encoder-decoder (seq2seq) export: encoder-decoder generation is not served yet" in err
    assert "encoder (an encoder export), decoder (a text-generation export)" in err
    assert not (tmp_path / "out").exists()


def test_the_encoder_decoder_refusal_names_every_registered_kind(echo_kind: EchoKind, seq2seq_dir: Path) -> None:
    # every kind registered, in order: the shipped ones (ortbatch.serve imports them), then echo
    with pytest.raises(UnservedExportError, match=r"image \(an image export\), echo \(an echo export\)$"):
        kind_for_export(seq2seq_dir)


def test_generate_refuses_an_encoder_export_in_one_line(encoder_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_refusal(capsys, ["generate", str(encoder_dir), "hello"])
    assert "is an encoder export: `ortbatch generate` takes a text-generation export" in err


def test_a_registered_kind_takes_the_export_before_the_unserved_declaration(seq2seq_dir: Path) -> None:
    """When the encoder-decoder kind lands, registering it is all it takes."""

    class Seq2SeqKind(EchoKind):
        name = "seq2seq"
        description = "an encoder-decoder export"

        def recognises(self, export: Any) -> bool:
            return export.source.get("family") == "seq2seq"

    kind = register(Seq2SeqKind())
    try:
        assert kind_for_export(seq2seq_dir) is kind
    finally:
        unregister("seq2seq")
    with pytest.raises(UnservedExportError):
        kind_for_export(seq2seq_dir)
