"""``ortbatch tune``: a variant that fails the checks is never chosen and the table says
why; the chosen export carries its runtime settings, which BatchedSession picks up."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.export, pytest.mark.slow]
pytest.importorskip("onnx")

from ortbatch.errors import InvalidInputError  # noqa: E402
from tests.integration.test_quantize import outlier_bert  # noqa: E402, F401  (fixture)


def test_tune_never_chooses_the_harmful_variant_and_records_the_choice(outlier_bert, tmp_path):  # noqa: F811
    from ortbatch import BatchedSession
    from ortbatch.export.tune import RuntimeSetting, tune

    holdout = tmp_path / "heldout.txt"
    holdout.write_text("A sentence nobody tuned on.\nAnother unseen one, somewhat longer than that.\n")
    out = tmp_path / "tuned"
    setting = RuntimeSetting(workers=1, max_batch_size=8, max_batch_tokens=512)
    result = tune(
        outlier_bert,
        out,
        lengths="4-64",
        variants=["fp32", "int8"],
        settings=[setting],
        holdout=holdout,
        requests=16,
        concurrency=4,
        rounds=1,
        bench_s=0.3,
        budget_s=300,
        keep=True,
    )
    rows = {r.variant: r for r in result.rows}
    assert result.chosen is rows["fp32"]
    bad = rows["int8"]
    assert bad.status == "failed" and bad.throughput is None
    assert "reference_parity" in bad.failure and "min cosine similarity" in bad.failure and "(by 0." in bad.failure
    assert bad.worst_metric.startswith("cosine=0.")
    assert rows["fp32"].holdout.startswith("passed")
    assert rows["fp32"].throughput and rows["fp32"].speedup == pytest.approx(1.0)

    # the chosen export: plain ONNX + manifest, with what tune chose
    manifest = json.loads((out / "ortbatch.json").read_text())
    assert manifest["runtime"] == setting.to_dict()
    assert manifest["tune"]["variant"] == "fp32"
    assert "quantization" not in manifest["source"]
    record = json.loads((out / "tune.json").read_text())
    assert record["chosen"] == "fp32" and [r["variant"] for r in record["rows"]] == ["fp32", "int8"]
    assert "| int8 | failed: reference_parity" in (out / "tune.md").read_text()
    assert (out / "tune.png").stat().st_size > 0
    assert (tmp_path / "tuned.variants" / "int8" / "model.onnx").is_file()  # --keep
    assert not (tmp_path / ".tuned.tune").exists()
    with BatchedSession(str(out)) as bs:
        assert (bs.workers, bs.max_batch_size) == (1, 8)
        assert bs._policy.max_tokens == 512
    with BatchedSession(str(out), max_batch_size=4, workers=2) as bs:  # explicit arguments win
        assert (bs.workers, bs.max_batch_size) == (2, 4)


def test_tune_chooses_the_smoothed_variant_where_plain_int8_fails(outlier_bert, tmp_path):  # noqa: F811
    """The only variant that passes is chosen, and the export says how it was quantized."""
    from ortbatch.export.tune import RuntimeSetting, tune

    out = tmp_path / "tuned"
    result = tune(
        outlier_bert,
        out,
        lengths="4-64",
        variants=["int8", "int8-smooth"],
        settings=[RuntimeSetting(workers=1, max_batch_size=8)],
        requests=16,
        concurrency=4,
        rounds=1,
        bench_s=0.3,
        budget_s=300,
    )
    rows = {r.variant: r for r in result.rows}
    assert rows["int8"].status == "failed"
    assert result.chosen is rows["int8-smooth"] and rows["int8-smooth"].throughput
    assert rows["int8-smooth"].quantization == "int8-rr-smooth0.65-outliers6-padmask"
    manifest = json.loads((out / "ortbatch.json").read_text())
    assert manifest["tune"]["variant"] == "int8-smooth"
    assert manifest["source"]["quantization"]["smooth_alpha"] == 0.65
    assert manifest["source"]["quantization"]["smoothed_inputs"] > 0


def test_tune_refuses_a_heldout_set_it_would_see(tiny_model, tmp_path):
    from ortbatch.export.recipes import DEFAULT_SAMPLES
    from ortbatch.export.tune import tune

    holdout = tmp_path / "heldout.txt"
    holdout.write_text(DEFAULT_SAMPLES[1] + "\n")
    with pytest.raises(InvalidInputError, match="held-out"):
        tune(tiny_model("bert"), tmp_path / "out", holdout=holdout, variants=["fp32"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--variants", "fp32,int9"], "unknown variant 'int9'"),
        (["--lengths", "x-y"], "--lengths"),
    ],
)
def test_tune_cli_bad_input_is_one_line_not_a_traceback(tmp_path, capsys, args, message):
    from ortbatch.cli import main

    assert main(["tune", "some-model", "-o", str(tmp_path / "out"), *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_tune_says_decoders_are_benchmarked_elsewhere(tiny_model, tmp_path):
    from ortbatch.export.tune import tune

    with pytest.raises(InvalidInputError, match="tune benchmarks encoder exports"):
        tune(tiny_model("gpt2"), tmp_path / "out", variants=["fp32"], budget_s=300)
    assert not (tmp_path / ".out.tune").exists() and not (tmp_path / "out").exists()
