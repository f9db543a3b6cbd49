"""Manifest.verify: the sha256 recorded at export is checked wherever an export is loaded,
and an export whose checks failed is loaded only with a loud warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from ortbatch import BatchedSession, ModelIntegrityError
from ortbatch.manifest import Manifest, UnvalidatedExportWarning
from tests.models import embed_export

pytest.importorskip("onnx")


def _export(tmp_path: Path, embed_path: Path, passed: bool | None = True) -> Path:
    return embed_export(tmp_path / "export", passed)


def _flip_byte(path: Path) -> None:
    """Change one byte inside the embedding table's raw data: still a loadable model."""
    import onnx

    table = next(t for t in onnx.load(str(path)).graph.initializer if t.name == "table")
    data = bytearray(path.read_bytes())
    at = data.find(table.raw_data)
    assert at > 0
    data[at + len(table.raw_data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_intact_export_loads(tmp_path: Path, embed_path: Path) -> None:
    d = _export(tmp_path, embed_path)
    assert Manifest.load(d).verify().directory == d
    with BatchedSession(d, providers="cpu") as bs:
        assert bs.manifest is not None


def test_a_changed_model_is_refused_with_the_path_and_what_to_do(tmp_path: Path, embed_path: Path) -> None:
    d = _export(tmp_path, embed_path)
    _flip_byte(d / "model.onnx")
    with pytest.raises(ModelIntegrityError, match="sha256") as info:
        BatchedSession(d, providers="cpu")
    assert info.value.path == d / "model.onnx"
    assert "ORTBATCH_SKIP_VERIFY=1" in str(info.value)
    with pytest.raises(ModelIntegrityError):
        BatchedSession(d / "model.onnx", providers="cpu")  # the file, with its manifest beside it


def test_skip_by_argument_or_environment(tmp_path: Path, embed_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _export(tmp_path, embed_path)
    _flip_byte(d / "model.onnx")
    Manifest.load(d).verify(skip=True)
    monkeypatch.setenv("ORTBATCH_SKIP_VERIFY", "1")
    with BatchedSession(d, providers="cpu"):
        pass
    monkeypatch.setenv("ORTBATCH_SKIP_VERIFY", "0")
    with pytest.raises(ModelIntegrityError):
        Manifest.load(d).verify()


def test_a_missing_model_file_is_an_integrity_error(tmp_path: Path, embed_path: Path) -> None:
    d = _export(tmp_path, embed_path)
    (d / "model.onnx").unlink()
    with pytest.raises(ModelIntegrityError, match="missing"):
        Manifest.load(d).verify()


def test_the_hash_is_cached_by_file_identity_and_rechecked_after_a_write(
    tmp_path: Path, embed_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ortbatch import manifest as mod

    d = _export(tmp_path, embed_path)
    calls: list[Path] = []
    real = mod.model_hash
    monkeypatch.setattr(mod, "model_hash", lambda p: calls.append(Path(p)) or real(p))
    Manifest.load(d).verify()
    Manifest.load(d).verify()
    moved = tmp_path / "moved"
    d.rename(moved)  # a rename keeps the identity: no second read
    Manifest.load(moved).verify()
    assert len(calls) == 1
    _flip_byte(moved / "model.onnx")  # a write changes the mtime: read again, and refused
    with pytest.raises(ModelIntegrityError):
        Manifest.load(moved).verify()
    assert len(calls) == 2


def test_a_manifest_without_hashes_is_loaded(tmp_path: Path, embed_path: Path) -> None:
    d = _export(tmp_path, embed_path)
    m = Manifest.load(d)
    m.extra = {}
    m.save()
    _flip_byte(d / "model.onnx")
    Manifest.load(d).verify()  # nothing recorded (hand-written, older): nothing to compare


def test_an_export_whose_checks_failed_warns_loudly(tmp_path: Path, embed_path: Path) -> None:
    d = _export(tmp_path, embed_path, passed=False)
    with pytest.warns(UnvalidatedExportWarning, match="FAILED its accuracy checks"):
        BatchedSession(d, providers="cpu").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Manifest.load(d).verify(warn=False)
        Manifest.load(_export(tmp_path / "ok", embed_path, passed=None)).verify()


def test_a_request_over_the_row_limit_says_which_limit_and_what_to_do(tmp_path: Path, embed_path: Path) -> None:
    import numpy as np

    from ortbatch import InvalidInputError

    d = _export(tmp_path, embed_path)
    m = Manifest.load(d)
    m.limits = {"max_batch_size": 64}  # what the exporter writes; BatchedSession's default is 32
    m.save()
    ids = np.ones((100, 3), dtype=np.int64)
    with BatchedSession(d, providers="cpu") as bs, pytest.raises(InvalidInputError) as info:
        bs.run(None, {"input_ids": ids, "attention_mask": ids})
    msg = str(info.value)
    assert "has 100 rows" in msg and "max_batch_size=32" in msg and "limits.max_batch_size" in msg
    assert "requests of at most 32 rows" in msg
