"""int8 exports: every exported task goes through ``--quantize int8`` and the checks, with
the task's int8 tolerances stated in the report; a tampered or badly quantized export fails."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.export, pytest.mark.slow]

onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402

from ortbatch.errors import ExportError  # noqa: E402
from ortbatch.export.recipes import INT8_TOLERANCES  # noqa: E402

TASKS = {
    "bert": "feature-extraction",
    "bert-cls": "text-classification",
    "bert-tok": "token-classification",
    "gpt2": "text-generation-with-past",
}


def _op_types(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize("kind", sorted(TASKS))
def test_int8_export_of_each_task_passes_the_int8_checks(exported, kind):
    res = exported(kind, quantize="int8")
    task = TASKS[kind]
    assert res.report.passed, res.report.summary()
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= _op_types(res.directory / "model.onnx")
    manifest = json.loads((res.directory / "ortbatch.json").read_text())
    assert manifest["source"]["task"] == task
    assert manifest["source"]["quantization"]["mode"] == "int8"
    assert manifest["source"]["quantization"]["per_channel"] is True
    assert manifest["validation"]["tolerances"] == INT8_TOLERANCES[task]
    assert res.report.variant == "int8"
    assert res.report.tolerances == INT8_TOLERANCES[task]
    assert f"int8 tolerances ({task})" in res.report.format_table()
    # still a plain ONNX model: same inputs and outputs as the fp32 export
    fp32 = onnx.load(str(exported(kind).directory / "model.onnx"), load_external_data=False)
    q = onnx.load(str(res.directory / "model.onnx"), load_external_data=False)
    assert [i.name for i in q.graph.input] == [i.name for i in fp32.graph.input]
    assert [o.name for o in q.graph.output] == [o.name for o in fp32.graph.output]


def test_int8_static_is_calibrated_and_checked(exported):
    res = exported("bert", quantize="int8-static")
    assert res.report.passed, res.report.summary()
    assert "QuantizeLinear" in _op_types(res.directory / "model.onnx")
    assert res.report.variant == "int8-static"


def test_validate_reports_the_int8_tolerances_and_passes(exported, capsys):
    from ortbatch.cli import main

    res = exported("bert", quantize="int8")
    assert main(["validate", str(res.directory), "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "int8 tolerances (feature-extraction): " in out
    assert "cosine=0.99," in out and "token_cosine=0.95" in out
    assert "PASSED" in out


def test_validate_fails_on_a_tampered_int8_export(exported, tmp_path, capsys):
    from ortbatch.cli import main

    d = Path(shutil.copytree(exported("bert", quantize="int8").directory, tmp_path / "tampered"))
    model = onnx.load(str(d / "model.onnx"))
    # the weights' per-channel scales, each multiplied by 1000: the file still loads and runs
    scales = [t for t in model.graph.initializer if t.name.endswith("_scale") and len(t.dims) == 1 and t.dims[0] > 1]
    assert scales
    for t in scales:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(1000.0), t.name))
    onnx.save(model, str(d / "model.onnx"))
    from ortbatch.manifest import Manifest, model_hash

    manifest = Manifest.load(d)  # a deliberate edit: the checks must catch it, not only the sha256
    manifest.extra["components"]["model"]["sha256"] = model_hash(d / "model.onnx")
    manifest.save()
    assert main(["validate", str(d), "--no-save"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    assert "min cosine similarity" in out and "< 0.95" in out


def _outlier_bert(src: Path, d: Path) -> Path:
    """A tiny BERT whose FFN has one unit 1e4 times larger than the rest (its next
    projection scaled back), so fp32 is exact but one activation scale per tensor crushes
    every other unit: a model that all-nodes int8 breaks."""
    import torch
    import transformers

    shutil.copytree(src, d)
    model = transformers.BertModel.from_pretrained(d)
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.intermediate.dense.weight[0] *= 1e4
            layer.intermediate.dense.bias[0] *= 1e4
            layer.output.dense.weight[:, 0] /= 1e4
            layer.output.dense.weight[:, 1:] *= 50.0
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def outlier_bert(tiny_model, tmp_path_factory) -> Path:
    return _outlier_bert(tiny_model("bert"), tmp_path_factory.mktemp("outlier") / "bert-outlier")


def test_harmful_int8_is_rejected_saying_which_metric_and_by_how_much(outlier_bert, tmp_path):
    from ortbatch.export import export_model

    fp32 = export_model(outlier_bert, tmp_path / "fp32", raise_on_failure=False)
    assert fp32.report.passed, fp32.report.summary()
    res = export_model(outlier_bert, tmp_path / "int8", quantize="int8", raise_on_failure=False)
    assert not res.report.passed
    parity = next(c for c in res.report.checks if c.name == "reference_parity")
    assert parity.status == "failed"
    comp = next(c for case in parity.cases for c in case.comparisons if c.output == "last_hidden_state")
    assert comp.metric == "cosine" and comp.metric_value < 0.9
    assert f"min cosine similarity {comp.metric_value:.6f} < 0.95 (by {0.95 - comp.metric_value:.4f})" in comp.message


def test_quantization_errors_are_typed_and_name_the_problem(tiny_model, tmp_path):
    from ortbatch.export import export_model
    from ortbatch.export.quantize import QuantizeConfig

    cfg = QuantizeConfig("int8", nodes_to_exclude=("/no/such/MatMul",))
    with pytest.raises(ExportError, match="/no/such/MatMul"):
        export_model(tiny_model("bert"), tmp_path / "a", quantize=cfg, validate=False)
    with pytest.raises(ExportError, match="fp32 CPU exports"):
        export_model(tiny_model("bert"), tmp_path / "b", quantize="int8", dtype="fp16", validate=False)


def test_outlier_split_and_padding_mask_rescue_the_model_all_nodes_int8_breaks(outlier_bert, tmp_path):
    """The same model plain int8 breaks (above): its outlier unit computed in float and
    padding kept out of the scale, int8 passes the int8 checks; the export records what
    the rewrite did and stays plain ONNX."""
    from ortbatch.export import export_model
    from ortbatch.export.quantize import QuantizeConfig

    cfg = QuantizeConfig("int8", outlier_ratio=6.0, mask_padding=True)
    res = export_model(outlier_bert, tmp_path / "int8", quantize=cfg, raise_on_failure=False)
    assert res.report.passed, res.report.summary()
    q = json.loads((res.directory / "ortbatch.json").read_text())["source"]["quantization"]
    assert q["outlier_ratio"] == 6.0 and q["mask_padding"] is True
    # the planted unit (channel 0 of every FFN output projection's input) is split off
    assert q["outlier_channels"] >= 2 and q["outlier_split_inputs"] >= 2
    assert q["padding_masked_inputs"] > 0
    assert {"MatMulInteger", "DynamicQuantizeLinear", "Gather"} <= _op_types(res.directory / "model.onnx")


def test_the_outlier_rewrite_is_exact_in_float(tiny_model, tmp_path):
    """Before quantization the rewrite changes no real token's value: split parts add up
    to the original MatMul and pad masking touches pad rows only."""
    import onnxruntime as ort
    from transformers import AutoTokenizer

    from ortbatch.export import export_model
    from ortbatch.export.outliers import prepare_int8

    d = export_model(tiny_model("bert"), tmp_path / "fp32").directory
    model = onnx.load(str(d / "model.onnx"))
    tok = AutoTokenizer.from_pretrained(d)
    feeds = [{k: v.astype(np.int64) for k, v in tok([t], return_tensors="np").items()} for t in ("a b c", "hello")]
    graph_inputs = {i.name for i in model.graph.input}
    feeds = [{k: v for k, v in f.items() if k in graph_inputs} for f in feeds]
    from ortbatch.export.outliers import _weight_matmuls

    groups = _weight_matmuls(model)
    normed = {n.output[0] for n in model.graph.node if n.op_type == "LayerNormalization"}
    prep = prepare_int8(model, feeds=feeds, outlier_ratio=1.5, mask_padding=True)
    assert prep.outlier_channels > 0 and prep.float_nodes
    # pad rows are zeroed where the layers read the residual stream (the LayerNorm outputs)
    # only: the attention context and FFN activations derive from those rows or real tokens
    assert prep.masked_inputs == len(normed & set(groups)) and 0 < prep.masked_inputs < len(groups)
    onnx.checker.check_model(model)
    rewritten = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    original = ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
    enc = tok(["a much longer sentence than the other", "hi"], return_tensors="np", padding=True)
    feed = {k: v.astype(np.int64) for k, v in enc.items() if k in graph_inputs}
    want, got = original.run(None, feed)[0], rewritten.run(None, feed)[0]
    real = feed["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-5)
    with pytest.raises(ExportError, match="mask_padding needs an encoder"):
        gpt = onnx.load(str(export_model(tiny_model("gpt2"), tmp_path / "gpt").directory / "model.onnx"))
        prepare_int8(gpt, feeds=feeds, outlier_ratio=None, mask_padding=True)


def _ln_graph(residual: bool) -> tuple[object, dict[str, np.ndarray]]:
    """x -> LayerNorm (channel 0's gamma 30x the rest: an outlier unit) -> two MatMuls; with
    ``residual`` the LayerNorm output also feeds the sum (a post-LN block's residual)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    hid = 16
    gamma = np.ones(hid, np.float32)
    gamma[0] = 30.0
    inits = [
        numpy_helper.from_array(gamma, "gamma"),
        numpy_helper.from_array(rng.normal(0, 0.1, hid).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.normal(0, 0.2, (hid, hid)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.2, (hid, hid)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="LN", axis=-1),
        helper.make_node("MatMul", ["h", "w1"], ["a"], name="MM1"),
        helper.make_node("MatMul", ["h", "w2"], ["b"], name="MM2"),
        helper.make_node("Add", ["a", "b"], ["ab" if residual else "y"], name="Sum"),
    ]
    if residual:
        nodes.append(helper.make_node("Add", ["ab", "h"], ["y"], name="Residual"))
    graph = helper.make_graph(
        nodes,
        "ln",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", hid])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", hid])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": rng.normal(0, 1, (2, 5, hid)).astype(np.float32)}


@pytest.mark.parametrize("residual", [False, True], ids=["pre-LN: folded into gamma", "post-LN: one Mul"])
def test_smoothing_is_exact_in_float_and_removes_the_outlier(residual):
    """SmoothQuant scaling changes no output in fp32; where only the MatMuls read the
    LayerNorm it costs no node at all (gamma and beta absorb 1/s), else one Mul; and the
    outlier unit is no longer one to the split: its range moved into the weights."""
    import copy

    import onnxruntime as ort

    from ortbatch.export.outliers import prepare_int8

    model, feed = _ln_graph(residual)
    plain = copy.deepcopy(model)
    before = prepare_int8(copy.deepcopy(model), feeds=[feed], outlier_ratio=4.0, mask_padding=False)
    assert before.outlier_channels == 1  # channel 0, unsmoothed
    prep = prepare_int8(model, feeds=[feed], outlier_ratio=4.0, mask_padding=False, smooth_alpha=0.65)
    onnx.checker.check_model(model)
    assert prep.smoothed_inputs == 1 and prep.outlier_channels == 0 and not prep.float_nodes
    ops = [n.op_type for n in model.graph.node]
    if residual:
        assert prep.folded_inputs == 0 and ops.count("Mul") == 1
    else:
        assert prep.folded_inputs == 1 and "Mul" not in ops and len(ops) == len(plain.graph.node)
    want = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_smoothed_int8_passes_on_the_model_plain_int8_breaks_and_is_recorded(outlier_bert, tmp_path):
    from ortbatch.export import export_model
    from ortbatch.export.quantize import QuantizeConfig

    cfg = QuantizeConfig("int8", reduce_range=True, smooth_alpha=0.65, outlier_ratio=6.0, mask_padding=True)
    res = export_model(outlier_bert, tmp_path / "int8", quantize=cfg, raise_on_failure=False)
    assert res.report.passed, res.report.summary()
    q = json.loads((res.directory / "ortbatch.json").read_text())["source"]["quantization"]
    assert q["smooth_alpha"] == 0.65 and q["outlier_ratio"] == 6.0 and q["reduce_range"] is True
    # BERT is post-LN: every LayerNorm output also feeds a residual Add, so no fold
    assert q["smoothed_inputs"] > 0 and q["smoothing_folded_into_layernorm"] == 0
    assert q["outlier_split_inputs"] >= 2  # the planted unit is a GELU output: split, not smoothed
    assert "Mul" in _op_types(res.directory / "model.onnx")
