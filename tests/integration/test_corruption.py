"""A damaged model.onnx is never served as a 200 with NaN: bytes corrupted at random offsets
of a real export are refused by the sha256 check, by the load, or by the weights check, and
`ortbatch serve` refuses an export whose checks failed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def good(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ortbatch.export import export_model

    out = tmp_path_factory.mktemp("good") / "bert"
    assert export_model(tiny_model("bert"), out, samples=["Hello world!", "ok"]).passed
    return out


def _corrupt(src: Path, dst: Path, seed: int) -> Path:
    """A copy of the export with 0xFF written over 1 KiB at each of 4 random offsets."""
    shutil.copytree(src, dst)
    path = dst / "model.onnx"
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(seed)
    for at in rng.integers(0, len(data) - 1024, size=4):
        data[at : at + 1024] = b"\xff" * 1024
    path.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("seed", range(10))
def test_a_corrupted_export_is_refused_before_it_serves(
    good: Path, tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ortbatch import BatchedSession, ModelIntegrityError, OrtBatchError, validate
    from ortbatch.cli import main
    from ortbatch.serve import ServedModel

    d = _corrupt(good, tmp_path / "bert", seed)
    # 1. every loader compares the bytes with the sha256 recorded at export
    with pytest.raises(ModelIntegrityError):
        BatchedSession(d, providers="cpu")
    with pytest.raises(ModelIntegrityError):
        ServedModel.load(d)
    with pytest.raises(ModelIntegrityError):
        validate(d, use_reference=False)
    assert main(["serve", str(d), "--port", "0"]) == 1
    assert "sha256" in capsys.readouterr().err

    # 2. told to skip that, the checks read every weight, and serve refuses what failed them
    monkeypatch.setenv("ORTBATCH_SKIP_VERIFY", "1")
    try:
        report = validate(d, use_reference=False)
    except Exception as exc:
        assert isinstance(exc, OrtBatchError) or "onnxruntime" in type(exc).__module__, exc
        return
    if not report.passed:
        assert main(["serve", str(d), "--port", "0"]) == 1
        err = capsys.readouterr().err
        assert "FAILED its accuracy checks" in err and "--allow-unvalidated" in err
        return
    # 3. it passed every check, weights included: whatever it answers is finite
    assert not any(c.status == "failed" for c in report.checks)
    rng = np.random.default_rng(seed)
    with BatchedSession(d, providers="cpu") as bs:
        for _ in range(8):
            ids = rng.integers(0, 30522, size=(4, 64))
            outs = bs.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": 0 * ids})
            assert all(np.isfinite(o).all() for o in outs)


def test_the_weights_check_names_the_tensor_and_rows(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnx
    from onnx import numpy_helper

    from ortbatch import validate

    d = Path(shutil.copytree(good, tmp_path / "bert"))
    model = onnx.load(str(d / "model.onnx"))
    emb = next(t for t in model.graph.initializer if t.name.endswith("word_embeddings.weight"))
    table = numpy_helper.to_array(emb).copy()
    table[[1021, 29999]] = np.nan  # rows of rare tokens: no sample text reaches them
    emb.CopyFrom(numpy_helper.from_array(table, emb.name))
    onnx.save(model, str(d / "model.onnx"))
    monkeypatch.setenv("ORTBATCH_SKIP_VERIFY", "1")
    report = validate(d, use_reference=False, save=False)
    failed = {c.name: c.reasons() for c in report.checks if c.status == "failed"}
    assert set(failed) == {"finite_weights"}, report.format_table(verbose=True)  # the samples never see it
    (reason,) = failed["finite_weights"]
    assert emb.name in reason and "2 of 30522 rows (1021, 29999)" in reason and "NaN" in reason


def _edit_manifest(src: Path, dst: Path, edit) -> Path:
    import json

    shutil.copytree(src, dst)
    data = json.loads((dst / "ortbatch.json").read_text())
    edit(data)
    (dst / "ortbatch.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda m: m["inputs"]["input_ids"].update(dtype="int32"), "inputs.input_ids.dtype is 'int32'"),
        (lambda m: m["inputs"]["input_ids"].update(axes=["batch", None]), "inputs.input_ids.axes"),
        (lambda m: m["inputs"]["attention_mask"].update(pad=1), "inputs.attention_mask.pad is 1"),
        (lambda m: m["inputs"].pop("attention_mask"), "inputs.attention_mask is missing"),
        (lambda m: m["outputs"].pop("last_hidden_state"), "outputs.last_hidden_state is missing"),
        (lambda m: m["outputs"].update(extra={"axes": ["batch"]}), "outputs.extra is not an output"),
        (lambda m: m.update(model="../other/model.onnx"), "'model' is '../other/model.onnx'"),
    ],
    ids=["dtype", "axes", "pad", "input-removed", "output-removed", "output-added", "model-redirected"],
)
def test_an_edited_manifest_contract_is_refused_naming_the_field(
    good: Path, tmp_path: Path, edit, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """model.onnx is intact (its sha256 matches) but ortbatch.json no longer describes it:
    every loader refuses it, naming ortbatch.json and the field, instead of batching the
    model by a contract it does not have (an int64 graph fed int32, an output dropped)."""
    from ortbatch import BatchedSession, ModelIntegrityError, validate
    from ortbatch.cli import main
    from ortbatch.serve import ServedModel

    d = _edit_manifest(good, tmp_path / "bert", edit)
    for load in (
        lambda: BatchedSession(d, providers="cpu"),
        lambda: ServedModel.load(d),
        lambda: validate(d, use_reference=False),
    ):
        with pytest.raises(ModelIntegrityError) as info:
            load()
        assert str(d / "ortbatch.json") in str(info.value) and named in str(info.value)
    assert main(["validate", str(d), "--no-reference", "--no-save"]) != 0
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_an_export_whose_tokenizer_files_are_gone_is_a_clear_error(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """validate tokenizes its samples with the export's own tokenizer: without its files
    it says so, naming the directory, not a TypeError from deep inside transformers."""
    from ortbatch import ModelIntegrityError, validate
    from ortbatch.cli import main

    d = Path(shutil.copytree(good, tmp_path / "bert"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)
    with pytest.raises(ModelIntegrityError, match="the export's tokenizer does not load") as info:
        validate(d, use_reference=False, save=False)
    assert str(d) in str(info.value)
    assert main(["validate", str(d), "--no-reference", "--no-save"]) == 1
    err = capsys.readouterr().err.strip()
    assert "tokenizer does not load" in err and err.count("\n") == 0 and "Traceback" not in err
