"""``ortbatch tune``'s printed table fits a terminal and its plot names no temp path (issue 26:
the table was ~250 columns wide; the plot's title carried ``texts:exports/.X.tune/...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ortbatch.export.tune import RuntimeSetting, TuneResult, VariantResult, plot

FLOOR = " (sentence_embedding, reference_parity; floor 0.99)"


def _result(tmp_path: Path) -> TuneResult:
    """The rows of a real MiniLM run (18:00 UTC, docs/benchmarks-log.md's kind), every status."""
    setting = RuntimeSetting(workers=2, max_batch_size=16, max_batch_tokens=2048)
    fp32 = VariantResult("fp32", "passed", "cosine=1.0000 (token_embeddings, shape_generalisation; floor 0.9999)")
    fp32.throughput, fp32.p50_ms, fp32.p99_ms, fp32.setting, fp32.speedup = 33.8, 1310.8, 3131.2, setting, 1.0
    int8 = VariantResult(
        "int8",
        "failed",
        "cosine=0.9624" + FLOOR,
        failure="reference_parity: 10 samples, right-padded: output 'sentence_embedding' min cosine "
        "similarity 0.962442 < 0.99 (by 0.0276)",
    )
    outliers = VariantResult("int8-outliers", "passed", "cosine=0.9927" + FLOOR, quantization="int8-rr-outliers4")
    outliers.attempts = ["int8-rr-outliers6-padmask: cosine=0.9877" + FLOOR]
    outliers.throughput, outliers.p50_ms, outliers.p99_ms, outliers.setting = 15.4, 2151.8, 5039.0, setting
    outliers.speedup, outliers.holdout = 0.46, "passed, cosine=0.9912" + FLOOR
    skipped = VariantResult("int8-float-edges", "skipped", failure="budget (600s) spent")
    workload = {"requests": 512, "lengths": "texts:exports/.minilm-tuned.tune/bench-texts.txt", "texts": "built-in"}
    workload["length"] = {"min": 8, "max": 121}
    return TuneResult(tmp_path, fp32, [fp32, int8, outliers, skipped], workload, 600.0)


def test_the_printed_table_fits_100_columns_and_keeps_the_details_below(tmp_path: Path) -> None:
    text = _result(tmp_path).table()
    assert max(len(line) for line in text.splitlines()) <= 100, text
    assert "fp32 *" in text and "* chosen" in text
    # what the cells leave out is in the notes: the failing check, the rejected try, held-out
    words = " ".join(text.split())  # the notes are wrapped
    assert "int8: failed: reference_parity: 10 samples" in words
    assert "min cosine similarity 0.962442 < 0.99 (by 0.0276)" in words
    assert "rejected first: int8-rr-outliers6-padmask" in words
    assert "held-out: passed, cosine=0.9912" in words


def test_the_markdown_table_keeps_every_detail_in_its_cell(tmp_path: Path) -> None:
    md = _result(tmp_path).table(markdown=True)
    assert "| fp32 (chosen) | passed | cosine=1.0000 (token_embeddings, shape_generalisation; floor 0.9999) |" in md
    assert "failed: reference_parity: 10 samples" in md


def test_the_plot_title_names_the_workload_not_a_temp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figure = pytest.importorskip("matplotlib.figure")
    titles: list[str] = []
    real = figure.Figure.savefig

    def savefig(fig: Any, *args: Any, **kwargs: Any) -> None:
        titles.extend(ax.get_title() for ax in fig.axes)
        real(fig, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", savefig)
    plot(_result(tmp_path), tmp_path / "tune.png")
    (title,) = titles
    assert ".tune" not in title and "texts:" not in title, title
    assert "512 requests, 8-121 tokens (built-in texts)" in title
    assert "grey" not in title  # failed variants have no bar to be grey
