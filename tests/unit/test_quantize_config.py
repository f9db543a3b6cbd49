"""Quantization options, int8 tolerances and the manifest's tuned runtime settings:
pure Python, no onnxruntime or torch needed."""

from __future__ import annotations

import pytest

from ortbatch.errors import ExportError, ManifestError
from ortbatch.export.quantize import QuantizeConfig
from ortbatch.export.recipes import INT8_TOLERANCES, Recipe, load_recipe, tolerances_for
from ortbatch.manifest import Manifest


def test_parse_modes_and_tables():
    assert QuantizeConfig.parse(None) is None
    assert QuantizeConfig.parse("none") is None
    assert QuantizeConfig.parse("int8") == QuantizeConfig("int8")
    cfg = QuantizeConfig.parse({"mode": "int8-static", "per_channel": False, "nodes_to_exclude": ["a"]})
    assert cfg == QuantizeConfig("int8-static", per_channel=False, nodes_to_exclude=("a",))
    assert cfg.label == "int8-static-per-tensor-float-1"
    assert QuantizeConfig.parse(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("int4", "quantization mode must be one of"),
        ({"mode": "int8", "per_chanel": True}, "unknown quantization option"),
        ({"mode": "int8", "op_types": "MatMul"}, "op_types must be a list"),
        ({"mode": "int8", "op_types": ["Softmax"]}, "op_types must be a non-empty subset"),
        ({"mode": "int8", "keep_float": "middle"}, "keep_float must be one of"),
        ({"mode": "int8", "reduce_range": "yes"}, "reduce_range must be true or false"),
        ({"mode": "int8-static", "calibration": "kl"}, "calibration must be one of"),
    ],
)
def test_bad_options_name_what_is_wrong(value, message):
    with pytest.raises(ExportError, match=message):
        QuantizeConfig.parse(value)


def test_recipe_quantization_table(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text(
        'model = "m"\n[quantization]\nmode = "int8"\nkeep_float = "edges"\n[tolerances.int8]\ncosine = 0.995\n'
    )
    r = load_recipe(p)
    assert r.quantize == QuantizeConfig("int8", keep_float="edges")
    assert tolerances_for("int8", None, r.tolerances, "feature-extraction")["cosine"] == 0.995
    p.write_text('model = "m"\n[quantization]\nmode = "int8"\nfoo = 1\n')
    with pytest.raises(ExportError, match=r"unknown key\(s\) \['foo'\] in \[quantization\]"):
        load_recipe(p)
    with pytest.raises(ExportError, match="fp32 CPU exports"):
        Recipe(model="m", dtype="fp16", quantize=QuantizeConfig())


def test_int8_tolerances_are_per_task_and_validated():
    for task, tol in INT8_TOLERANCES.items():
        assert tolerances_for("int8", None, None, task) == tol
    assert tolerances_for("int8", None, None, "text-classification")["argmax"] == 0.9
    with pytest.raises(ExportError, match="unknown tolerance 'cosin'"):
        tolerances_for("int8", None, {"int8": {"cosin": 0.9}}, "feature-extraction")


def test_manifest_runtime_settings():
    m = Manifest.from_dict({"format": 1, "runtime": {"workers": 1, "max_batch_size": 16, "max_batch_tokens": None}})
    assert m.runtime == {"workers": 1, "max_batch_size": 16}
    assert Manifest.from_dict({"format": 1}).runtime == {}
    assert Manifest.from_dict(m.to_dict()).runtime == m.runtime
    with pytest.raises(ManifestError, match=r"runtime\.workers must be a positive integer"):
        _ = Manifest.from_dict({"format": 1, "runtime": {"workers": 0}}).runtime
    with pytest.raises(ManifestError, match="'runtime' must be an object"):
        _ = Manifest.from_dict({"format": 1, "runtime": [1]}).runtime
