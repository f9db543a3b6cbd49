"""The model-kind registry (``ortbatch/serve/served/kinds.py``) with the kinds ortbatch ships:
which kind an export and a served object are, what is refused, and that each kind's
request-field table covers what its ``/openapi.json`` entries document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from echokind import EchoKind
from fakegen import FakeGenerator

from ortbatch.serve import ServedModel
from ortbatch.serve.http.openapi_schemas import OPERATIONS, SCHEMAS
from ortbatch.serve.kinds import DECODER, ENCODER
from ortbatch.serve.served.generator import ServedGenerator
from ortbatch.serve.served.kinds import UnservedExportError, kind_for_export, kind_of, registered


def test_the_shipped_kinds_are_registered_encoder_last_asked() -> None:
    assert [k.name for k in registered()][:2] == ["encoder", "decoder"]
    assert ENCODER.fallback and not DECODER.fallback


def test_kind_of_a_served_object(encoder_dir: Path) -> None:
    model = ServedModel.load(encoder_dir, name="m")
    gen = ServedGenerator(FakeGenerator(), "g")
    try:
        assert kind_of(model) is ENCODER and kind_of(gen) is DECODER
        with pytest.raises(TypeError, match="no registered model kind"):
            kind_of(object())
    finally:
        model.close(drain=False)
        gen.close(drain=False)


def test_a_bare_onnx_file_and_an_encoder_export_are_the_encoders(encoder_dir: Path, adder_path: Path) -> None:
    assert kind_for_export(encoder_dir) is ENCODER
    assert kind_for_export(adder_path) is ENCODER


def test_optimums_encoder_decoder_layout_is_refused(tmp_path: Path) -> None:
    """No ortbatch.json: an encoder graph beside decoder graphs (optimum's seq2seq export)."""
    for f in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"):
        (tmp_path / f).write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BartForConditionalGeneration"]}))
    with pytest.raises(UnservedExportError, match="encoder-decoder generation is not served yet") as err:
        kind_for_export(tmp_path)
    assert err.value.exit_code == 2
    assert "graphs decoder_model.onnx, decoder_with_past_model.onnx, encoder_model.onnx" in str(err.value)


@pytest.mark.parametrize("task", ["text2text-generation", "text2text-generation-with-past", "seq2seq-lm"])
def test_an_encoder_decoder_task_is_refused(tmp_path: Path, task: str) -> None:
    manifest = {"format": 1, "model": "encoder_model.onnx", "source": {"task": task}, "inputs": {}, "outputs": {}}
    (tmp_path / "ortbatch.json").write_text(json.dumps(manifest))
    with pytest.raises(UnservedExportError, match=f"task '{task}', graph encoder_model.onnx"):
        kind_for_export(tmp_path)


@pytest.mark.parametrize("kind", [ENCODER, DECODER, EchoKind()], ids=lambda k: k.name)
def test_the_documented_request_fields_are_fields_the_routes_read(kind) -> None:
    """Every property an ``/openapi.json`` request schema documents is in the kind's request-field
    table (what its routes accept): the document never offers a field the server refuses as
    unknown."""
    operations = {**OPERATIONS, **kind.operations()}
    schemas = {**SCHEMAS, **kind.schemas()}
    fields = kind.request_fields(None)
    assert set(fields) == set(kind.body_routes)
    for path, accepted in fields.items():
        spec = operations[("POST", path)]
        documented = set(schemas[spec.request].get("properties", {})) - {"model"}
        assert documented <= accepted, (path, sorted(documented - accepted))


@pytest.mark.parametrize(
    "source",
    [{"task": "automatic-speech-recognition-with-past"}, {"task": "automatic-speech-recognition"}],
)
def test_a_speech_export_is_refused_as_speech(tmp_path: Path, source: dict) -> None:
    """A Whisper export is an encoder-decoder one too; its refusal names speech recognition."""
    manifest = {"format": 1, "model": "encoder_model.onnx", "source": source, "inputs": {}, "outputs": {}}
    (tmp_path / "ortbatch.json").write_text(json.dumps(manifest))
    with pytest.raises(UnservedExportError, match="speech-recognition \\(Whisper\\) export: speech recognition"):
        kind_for_export(tmp_path)


def test_a_whisper_checkpoint_layout_without_manifest_is_refused_as_speech(tmp_path: Path) -> None:
    for f in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"):
        (tmp_path / f).write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(UnservedExportError, match="speech recognition is not served yet"):
        kind_for_export(tmp_path)
