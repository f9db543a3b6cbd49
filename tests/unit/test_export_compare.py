"""The comparison at the heart of the checks: tolerances, metrics, NaN/Inf, masks."""

from __future__ import annotations

import numpy as np
import pytest

from ortbatch.export.checks import Case, CheckResult, ValidationReport, compare, compare_tokens
from ortbatch.export.graph import axis_role
from ortbatch.export.recipes import DEFAULT_TOLERANCES

FP32 = DEFAULT_TOLERANCES["fp32"]
rng = np.random.default_rng(0)


def test_identical_outputs_pass_with_zero_error() -> None:
    x = rng.normal(size=(2, 5, 8)).astype(np.float32)
    c = compare("last_hidden_state", x, x.copy(), FP32)
    assert c.passed and c.max_abs_err == 0 and c.metric == "cosine" and c.metric_value == pytest.approx(1.0)


def test_error_beyond_tolerance_fails_and_says_by_how_much() -> None:
    x = rng.normal(size=(2, 5, 8)).astype(np.float32)
    y = x.copy()
    y[1, 2, 3] += 0.01
    c = compare("last_hidden_state", y, x, FP32)
    assert not c.passed and c.max_abs_err == pytest.approx(0.01, rel=1e-3)
    assert "exceeds atol=0.0001" in c.message and "1 of 80 values" in c.message


def test_nan_and_inf_are_counted_and_fail_even_within_tolerance() -> None:
    x = np.zeros((2, 4), dtype=np.float32)
    y = x.copy()
    y[0, 0], y[1, 1] = np.nan, np.inf
    c = compare("sentence_embedding", y, x, {**FP32, "atol": 1e9})
    assert not c.passed and c.nonfinite == 2 and "2 NaN/Inf" in c.message


def test_mask_limits_the_comparison_to_real_tokens() -> None:
    x = rng.normal(size=(2, 4, 3)).astype(np.float32)
    y = x.copy()
    y[0, 3] = 100.0  # a padded position
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert compare("last_hidden_state", y, x, FP32, seq_axis=1, mask=mask).passed
    assert not compare("last_hidden_state", y, x, FP32).passed


def test_argmax_agreement_ignores_ties_but_catches_flips() -> None:
    ref = np.array([[1.0, 1.00001, 0.0], [3.0, 0.0, 0.0]], dtype=np.float32)
    tie_flip = np.array([[1.00001, 1.0, 0.0], [3.0, 0.0, 0.0]], dtype=np.float32)
    c = compare("logits", tie_flip, ref, {**FP32, "atol": 1e-3})
    assert c.passed and c.metric == "argmax" and c.metric_value == 1.0
    real_flip = np.array([[1.0, 1.00001, 0.0], [0.0, 3.0, 0.0]], dtype=np.float32)
    c = compare("logits", real_flip, ref, {**FP32, "atol": 1.0, "rtol": 0.0})
    assert not c.passed and c.metric_value == 0.0 and "argmax agreement" in c.message


def test_cosine_catches_a_direction_change_within_loose_atol() -> None:
    ref = np.array([[1.0, 0.0]], dtype=np.float32)
    got = np.array([[0.9, 0.3]], dtype=np.float32)
    c = compare("sentence_embedding", got, ref, {**FP32, "atol": 1.0})
    assert not c.passed and "cosine" in c.message


def test_shape_mismatch_fails() -> None:
    c = compare("logits", np.zeros((2, 3)), np.zeros((3, 3)), FP32)
    assert not c.passed and "shape [2, 3] != expected [3, 3]" in c.message


def test_greedy_agreement_counts_tokens_before_divergence() -> None:
    ref = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    got = np.array([[1, 2, 9, 4], [5, 6, 7, 8]])  # row 0 diverges at token 2: later tokens do not count
    c = compare_tokens("greedy_tokens", got, ref, {"greedy": 0.9})
    assert c.metric_value == pytest.approx(6 / 8) and not c.passed and "row 0 diverges at token 2" in c.message
    assert compare_tokens("greedy_tokens", ref, ref, {"greedy": 1.0}).passed


def test_report_summary_table_and_dict() -> None:
    bad = compare("logits", np.zeros((1, 2)), np.ones((1, 2)), FP32)
    report = ValidationReport(
        "d",
        "text-classification",
        "fp32",
        ["CPUExecutionProvider"],
        {"available": False, "reason": "no weights"},
        [
            CheckResult("reference_parity", "CPUExecutionProvider", "skipped", note="x"),
            CheckResult("shape_generalisation", "CPUExecutionProvider", "failed", [Case("batch=3 len=13", [bad])]),
            CheckResult(
                "batching_invariance", "CPUExecutionProvider", "failed", [Case("8 samples", error="Fail: boom")]
            ),
        ],
    )
    assert not report.passed and report.reference_skipped
    s = report.summary()
    assert "0 of 2 checks passed" in s and "shape_generalisation on CPUExecutionProvider: batch=3 len=13" in s
    assert "reference parity SKIPPED: no weights" in s
    table = report.format_table()
    assert "FAIL: Fail: boom" in table and "reference parity SKIPPED" in table
    d = report.to_dict()
    assert d["passed"] is False and d["checks"][1]["cases"][0]["outputs"][0]["max_abs_err"] == 1.0
    with pytest.raises(Exception, match="0 of 2 checks passed") as info:
        report.raise_for_failures()
    assert info.value.report is report


@pytest.mark.parametrize(
    ("dim", "role"),
    [
        ("batch_size", "batch"),
        ("sequence_length", "sequence"),
        ("past_sequence_length", "past_sequence"),
        ("past_sequence_length + sequence_length", "total_sequence"),
        ("encoder_sequence_length", "encoder_sequence"),
        ("past_decoder_sequence_length + decoder_sequence_length", "total_decoder_sequence"),
    ],
)
def test_axis_roles_from_optimum_dim_names(dim: str, role: str) -> None:
    assert axis_role(dim) == role


def test_greedy_divergence_at_a_near_tie_is_not_an_error() -> None:
    ref = np.array([[1, 2, 3], [4, 5, 6]])
    got = np.array([[1, 9, 9], [4, 5, 6]])
    top2 = np.zeros((2, 3, 2))
    top2[..., 0] = 5.0
    top2[..., 1] = 1.0
    tol = {"greedy": 1.0, "atol": 1e-3, "rtol": 0.0}
    assert not compare_tokens("greedy_tokens", got, ref, tol, top2).passed  # a clear winner: real divergence
    top2[0, 1] = [5.0, 4.9995]  # row 0 diverges where the reference's top two are 5e-4 apart
    c = compare_tokens("greedy_tokens", got, ref, tol, top2)
    assert c.passed and c.metric_value == 1.0 and "near-tie" in c.message
