"""The checks catch real breakage: each deliberately broken export is rejected, by
the check that should reject it, with a reason that says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.export, pytest.mark.slow]

onnx = pytest.importorskip("onnx")
from onnx import helper, numpy_helper  # noqa: E402


def _failed(report) -> dict[str, list[str]]:
    return {c.name: c.reasons() for c in report.checks if c.status == "failed"}


def _edit_graph(path: Path, edit) -> None:
    """Break the model on purpose, and record its new sha256 in the manifest: the checks
    must catch the breakage itself, not merely see that the file changed."""
    from ortbatch.manifest import Manifest, model_hash

    model = onnx.load(str(path))
    edit(model.graph)
    _topological(model.graph)  # an edit appends nodes after the embedding head that reads them
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    manifest = Manifest.load(path.parent)
    manifest.extra["components"]["model"]["sha256"] = model_hash(path)
    manifest.save()


def _topological(graph) -> None:
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(x in known for x in n.input)]
        assert ready, "the edit left a cycle or a dangling input"
        for n in ready:
            ordered.append(n)
            known.update(n.output)
            pending.remove(n)
    del graph.node[:]
    graph.node.extend(ordered)


def _producer(graph, output: str):
    return next(n for n in graph.node if output in n.output)


@pytest.fixture
def bert_copy(exported, tmp_path: Path) -> Path:
    res = exported("bert")
    assert res.report.passed
    return Path(shutil.copytree(res.directory, tmp_path / "broken"))


def _bake_batch(graph) -> None:
    """What tracing does with `x.view(int(x.size(0)), -1, hidden)`: the traced batch (2)
    becomes a constant. Shapes with batch 2 still work; nothing else does."""
    node = _producer(graph, "last_hidden_state")
    node.output[list(node.output).index("last_hidden_state")] = "hidden_raw"
    graph.initializer.append(numpy_helper.from_array(np.array([2, -1, 32], dtype=np.int64), "baked_shape"))
    graph.node.append(helper.make_node("Reshape", ["hidden_raw", "baked_shape"], ["last_hidden_state"]))


def test_reshape_baked_to_the_traced_batch_size_fails_shape_generalisation(bert_copy: Path) -> None:
    from ortbatch import validate

    _edit_graph(bert_copy / "model.onnx", _bake_batch)
    report = validate(bert_copy)
    assert not report.passed
    failed = _failed(report)
    assert "shape_generalisation" in failed
    reasons = " | ".join(failed["shape_generalisation"])
    assert "batch=1 len=7" in reasons and "batch=3 len=13" in reasons
    assert "Reshape" in reasons or "shape" in reasons
    # the report on disk says the same, and the manifest records the failure
    saved = json.loads((bert_copy / "validation.json").read_text())
    assert saved["passed"] is False
    assert json.loads((bert_copy / "ortbatch.json").read_text())["validation"]["passed"] is False


def test_pooling_that_ignores_the_mask_fails_batching_invariance(bert_copy: Path) -> None:
    from ortbatch import validate

    def add_mean(graph) -> None:
        # Mean over *all* positions, padding included: right for one unpadded request,
        # wrong as soon as the request shares a padded batch.
        graph.node.append(helper.make_node("ReduceMean", ["last_hidden_state"], ["mean_pooled"], axes=[1], keepdims=0))
        graph.output.append(helper.make_tensor_value_info("mean_pooled", onnx.TensorProto.FLOAT, ["batch_size", 32]))

    model = onnx.load(str(bert_copy / "model.onnx"))
    add_mean(model.graph)
    model.opset_import[0].version = 17  # ReduceMean with an `axes` attribute
    onnx.save(model, str(bert_copy / "model.onnx"))
    from ortbatch.manifest import model_hash

    manifest = json.loads((bert_copy / "ortbatch.json").read_text())
    manifest["outputs"]["mean_pooled"] = {"axes": ["batch", None]}
    manifest["components"]["model"]["outputs"]["mean_pooled"] = {"axes": ["batch", None]}
    manifest["components"]["model"]["sha256"] = model_hash(bert_copy / "model.onnx")  # a deliberate edit
    (bert_copy / "ortbatch.json").write_text(json.dumps(manifest))

    report = validate(bert_copy)
    failed = _failed(report)
    assert set(failed) == {"batching_invariance"}, report.format_table(verbose=True)
    (reason,) = failed["batching_invariance"]
    assert "'mean_pooled'" in reason and "changes when padded into a batch" in reason
    # an output the PyTorch model does not have is reported, not silently passed as compared
    parity = next(c for c in report.checks if c.name == "reference_parity")
    note = next(x for x in parity.cases[0].comparisons if x.output == "mean_pooled")
    assert "not compared" in note.message


def test_fp16_overflow_to_inf_nan_fails_reference_parity(exported) -> None:
    res = exported("bert-fp16-overflow", dtype="fp16")
    report = res.report
    assert not report.passed
    failed = _failed(report)
    assert "reference_parity" in failed
    assert any("NaN/Inf" in r for r in failed["reference_parity"]), failed
    comp = report.checks[0].cases[0].comparisons[0]
    assert comp.nonfinite > 0
    assert res.manifest.validation["passed"] is False
    assert (res.directory / "model.onnx").is_file()  # the files stay for inspection
    # the same checkpoint in fp32 is fine: it is the fp16 conversion that broke it
    assert exported("bert-fp16-overflow").report.passed


def test_fp16_overflow_raises_validation_error_by_default(tiny_model, tmp_path: Path) -> None:
    from ortbatch import ValidationError, export_model

    with pytest.raises(ValidationError) as info:
        export_model(tiny_model("bert-fp16-overflow"), tmp_path / "fp16", dtype="fp16")
    assert info.value.report is not None and not info.value.report.passed
    assert "reference_parity" in str(info.value) and "NaN/Inf" in str(info.value)
    # the failed export is kept for inspection beside the target, which is left alone
    assert (tmp_path / "fp16.failed" / "validation.json").is_file()
    assert not (tmp_path / "fp16").exists()
    assert "left as it was" in str(info.value) and "fp16.failed" in str(info.value)


def test_perturbed_weights_fail_reference_parity_only(bert_copy: Path) -> None:
    from ortbatch import validate

    def perturb(graph) -> None:
        rng = np.random.default_rng(1)
        for init in graph.initializer:
            w = numpy_helper.to_array(init)
            if w.dtype == np.float32 and w.shape == (32, 32):  # one attention projection
                w = w + rng.normal(0, 0.05, w.shape).astype(np.float32)
                init.CopyFrom(numpy_helper.from_array(w, init.name))
                return
        raise AssertionError("no 32x32 weight found")

    _edit_graph(bert_copy / "model.onnx", perturb)
    report = validate(bert_copy)
    failed = _failed(report)
    # the reference catches it; the self-consistency checks cannot (and do not claim to)
    assert "reference_parity" in failed and "batching_invariance" not in failed
    assert "exceeds atol" in failed["reference_parity"][0]


def test_reference_unavailable_runs_onnx_only_checks_and_says_so(bert_copy: Path, capsys) -> None:
    from ortbatch import validate
    from ortbatch.cli import main

    manifest = json.loads((bert_copy / "ortbatch.json").read_text())
    manifest["source"]["model"] = str(bert_copy / "deleted-checkpoint")
    (bert_copy / "ortbatch.json").write_text(json.dumps(manifest))
    report = validate(bert_copy)
    assert report.passed and report.reference_skipped
    statuses = {c.name: c.status for c in report.checks}
    assert statuses == {
        "reference_parity": "skipped",
        "shape_generalisation": "passed",
        "batching_invariance": "passed",
        "finite_weights": "passed",
    }
    assert "deleted-checkpoint" in report.reference["reason"]
    assert main(["validate", str(bert_copy)]) == 0
    out = capsys.readouterr().out
    assert "reference parity SKIPPED" in out


def test_onnx_only_checks_still_catch_a_baked_batch(bert_copy: Path) -> None:
    from ortbatch import validate

    _edit_graph(bert_copy / "model.onnx", _bake_batch)
    report = validate(bert_copy, use_reference=False)
    assert report.reference_skipped
    assert "shape_generalisation" in _failed(report)


def test_cli_validate_exits_non_zero_and_keeps_files(bert_copy: Path, capsys) -> None:
    from ortbatch.cli import main

    def perturb(graph) -> None:
        init = next(i for i in graph.initializer if numpy_helper.to_array(i).shape == (32,))
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 3, init.name))

    _edit_graph(bert_copy / "model.onnx", perturb)
    assert main(["validate", str(bert_copy)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "reference_parity" in out
    assert (bert_copy / "model.onnx").is_file() and (bert_copy / "validation.json").is_file()


def test_requested_gpu_provider_missing_is_not_run_not_a_fallback(exported) -> None:
    # issue 26 item 6: a provider this machine lacks is "not run" (said so), never a pass
    # on CPU behind its name and never a failed export
    from ortbatch import validate

    d = exported("bert").directory
    report = validate(d, providers=["cuda"], save=False)
    assert report.passed and report.not_run() == ["CUDAExecutionProvider"]
    cuda = {c.name: c for c in report.checks if c.provider == "CUDAExecutionProvider"}
    assert list(cuda) == ["reference_parity", "shape_generalisation", "batching_invariance", "provider_parity"]
    assert all(c.status == "not_run" and "not in this onnxruntime build" in c.note for c in cuda.values())
    assert "CUDA NOT RUN" in report.summary()


def test_silent_cpu_fallback_is_detected(exported, monkeypatch) -> None:
    """ORT given ['CUDA', 'CPU'] on a machine without CUDA just warns and runs on CPU."""
    import onnxruntime as ort

    from ortbatch import validate
    from ortbatch._ort.providers import probe_providers

    real = ort.get_available_providers()
    # the probe is cached per process: what an earlier test probed with the real list must not
    # answer here, nor what this test probes with the pretended one answer a later test
    probe_providers.cache_clear()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    try:
        report = validate(exported("bert").directory, providers="cuda", save=False)
    finally:
        probe_providers.cache_clear()
    (fail,) = [c for c in report.checks if c.name == "provider_parity"]
    if "CUDAExecutionProvider" in real:  # pragma: no cover - a CUDA machine really has it
        pytest.skip("CUDA is available here: nothing falls back")
    assert fail.status == "not_run" and "not active" in fail.note and "runs on ['CPUExecutionProvider']" in fail.note
    assert report.not_run() == ["CUDAExecutionProvider"]


def test_a_provider_that_is_not_here_is_not_run_and_the_export_stays_passed(exported, tmp_path: Path, capsys) -> None:
    # issue 26 item 6: `ortbatch validate DIR --providers cuda,trt` on a machine without a
    # GPU rewrote a CPU-correct export as failed, and `serve` then refused it
    from ortbatch._ort.probe import loads
    from ortbatch.cli import main
    from ortbatch.manifest import Manifest

    if loads("CUDAExecutionProvider") or loads("TensorrtExecutionProvider"):  # pragma: no cover - a GPU machine
        pytest.skip("a GPU provider loads here: it would really run")
    d = Path(shutil.copytree(exported("bert").directory, tmp_path / "minilm"))
    assert main(["validate", str(d), "--providers", "cuda,trt", "--no-reference"]) == 0
    out = capsys.readouterr().out
    assert "NOT RUN" in out and "CUDA" in out and "Tensorrt" in out
    assert Manifest.load(d).validation["passed"] is True
    saved = json.loads((d / "validation.json").read_text())
    assert saved["passed"] is True and saved["not_run"] == ["CUDAExecutionProvider", "TensorrtExecutionProvider"]
    by = {(c["check"], c["provider"]): c["status"] for c in saved["checks"]}
    assert {s for (_, p), s in by.items() if p != "CPUExecutionProvider" and p != "any"} == {"not_run"}
    assert by[("batching_invariance", "CPUExecutionProvider")] == "passed"
