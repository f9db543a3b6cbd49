"""tune's accuracy-aware search: a quantized variant that fails its checks is rebuilt with
more of the model in float, in order, until one passes or the budget says stop. Pure
Python: the builds are faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortbatch.export import tune as tune_mod
from ortbatch.export.quantize import QuantizeConfig
from ortbatch.export.tune import Variant, VariantResult, candidates


def _q(ratio: float) -> QuantizeConfig:
    return QuantizeConfig("int8", outlier_ratio=ratio, mask_padding=True)


VAR = Variant("int8-outliers", quantize=_q(6.0), fallbacks=(_q(4.0), _q(3.0)))


def _fake_builds(monkeypatch, outcomes: dict[float, float], export_s: float = 10.0) -> list[float]:
    """Each build 'passes' when its cosine (by outlier ratio) reaches 0.99."""
    built: list[float] = []

    def build(model, d, var, rcp, floors):
        ratio = var.quantize.outlier_ratio
        built.append(ratio)
        cos = outcomes[ratio]
        row = VariantResult(var.name, "passed" if cos >= 0.99 else "failed", export_s=export_s)
        row.worst_metric = f"cosine={cos:.4f} (sentence_embedding, reference_parity; floor 0.99)"
        row.directory = Path(d)
        return row

    monkeypatch.setattr(tune_mod, "_build", build)
    return built


def test_search_stops_at_the_first_variant_that_passes(monkeypatch, tmp_path):
    built = _fake_builds(monkeypatch, {6.0: 0.989, 4.0: 0.993, 3.0: 0.995})
    row = tune_mod._search("m", tmp_path / "v", VAR, None, {}, lambda: 1e9, 0.0, lambda msg: None)
    assert built == [6.0, 4.0]  # 3.0 keeps more in float (slower): never built once 4.0 passed
    assert row.status == "passed" and row.variant == "int8-outliers"
    assert row.quantization == "int8-outliers4-padmask"
    assert row.attempts == ["int8-outliers6-padmask: cosine=0.9890 (sentence_embedding, reference_parity; floor 0.99)"]
    assert row.export_s == 20.0  # both builds count against the budget


def test_search_that_never_passes_reports_every_try(monkeypatch, tmp_path):
    built = _fake_builds(monkeypatch, {6.0: 0.95, 4.0: 0.96, 3.0: 0.97})
    row = tune_mod._search("m", tmp_path / "v", VAR, None, {}, lambda: 1e9, 0.0, lambda msg: None)
    assert built == [6.0, 4.0, 3.0]
    assert row.status == "failed" and row.quantization == "int8-outliers3-padmask"
    assert [a.split(":")[0] for a in row.attempts] == ["int8-outliers6-padmask", "int8-outliers4-padmask"]
    table = tune_mod.TuneResult(tmp_path, None, [row], {}, 0.0).table(markdown=True)
    assert "rejected first: int8-outliers6-padmask: cosine=0.9500" in table


def test_search_respects_the_budget(monkeypatch, tmp_path):
    built = _fake_builds(monkeypatch, {6.0: 0.95, 4.0: 0.999, 3.0: 0.999}, export_s=30.0)
    # 40 s left, 20 s reserved for benchmarking: a second 30 s build does not fit
    row = tune_mod._search("m", tmp_path / "v", VAR, None, {}, lambda: 40.0, 20.0, lambda msg: None)
    assert built == [6.0]
    assert row.status == "failed" and row.attempts == ["2 more not tried: budget"]


def test_a_variant_without_fallbacks_is_built_once(monkeypatch, tmp_path):
    built = _fake_builds(monkeypatch, {6.0: 0.95})
    row = tune_mod._search("m", tmp_path / "v", Variant("x", quantize=_q(6.0)), None, {}, lambda: 1e9, 0.0, print)
    assert built == [6.0] and row.status == "failed" and row.attempts == []


def test_the_outlier_search_is_a_default_candidate_ordered_by_float_share():
    var = next(v for v in candidates(providers=["CPUExecutionProvider"]) if v.name == "int8-outliers")
    ratios = [a.quantize.outlier_ratio for a in var.attempts()]
    assert ratios == sorted(ratios, reverse=True)  # fewest float channels (fastest) first
    assert all(a.quantize.mask_padding and a.quantize.reduce_range for a in var.attempts())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"mode": "int8", "outlier_ratio": 0.5}, "outlier_ratio must be a number above 1"),
        ({"mode": "int8", "outlier_ratio": "4"}, "outlier_ratio must be a number above 1"),
        ({"mode": "int8", "mask_padding": "yes"}, "mask_padding must be true or false"),
        ({"mode": "int8-static", "mask_padding": True}, "apply to mode 'int8'"),
    ],
)
def test_outlier_options_are_validated(value, message):
    from ortbatch.errors import ExportError

    with pytest.raises(ExportError, match=message):
        QuantizeConfig.parse(value)


def test_the_smoothed_search_is_a_default_candidate_ordered_by_float_share():
    var = next(v for v in candidates(providers=["CPUExecutionProvider"]) if v.name == "int8-smooth")
    ratios = [a.quantize.outlier_ratio for a in var.attempts()]
    assert ratios == sorted(ratios, reverse=True) and len(ratios) > 1
    assert all(a.quantize.smooth_alpha == 0.65 and a.quantize.mask_padding for a in var.attempts())
    assert var.quantize.label == "int8-rr-smooth0.65-outliers6-padmask"


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.5, "0.5", True])
def test_smooth_alpha_must_lie_between_0_and_1(alpha):
    from ortbatch.errors import ExportError

    with pytest.raises(ExportError, match="smooth_alpha must be a number between 0 and 1"):
        QuantizeConfig.parse({"mode": "int8", "smooth_alpha": alpha})
    with pytest.raises(ExportError, match="apply to mode 'int8'"):
        QuantizeConfig.parse({"mode": "int8-static", "smooth_alpha": 0.5})


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/nonexistent/model", "no such model folder"),
        ("pkg:no_such_model_pkg", "needs the package no-such-model-pkg"),
        ("some-org/not-in-any-cache", "HF_HUB_OFFLINE is set and it is not in the local cache"),
    ],
)
def test_a_model_no_variant_can_be_exported_from_fails_once_before_any_variant(
    monkeypatch, tmp_path: Path, model: str, message: str
) -> None:
    # before, each of the nine variants was tried and the same error listed nine times
    from ortbatch.errors import ExportError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tried: list[str] = []
    monkeypatch.setattr(tune_mod, "_build_variants", lambda *a, **k: tried.append("built") or [])
    with pytest.raises(ExportError, match=message) as exc:
        tune_mod.tune(model, tmp_path / "out")
    assert "no variant passed" not in str(exc.value) and tried == []
    assert not (tmp_path / "out").exists()
