"""``ortbatch bench --plot``: the concurrency axis says 1, 2, 4, ... (issue 26: it said 2^0 ... 2^6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ortbatch.bench.report import plot


def test_concurrency_ticks_are_the_levels_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figure = pytest.importorskip("matplotlib.figure")
    saved: list[Any] = []
    real = figure.Figure.savefig

    def savefig(fig: Any, *args: Any, **kwargs: Any) -> None:
        fig.canvas.draw()  # tick labels are formatted when drawn
        saved.append([[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes])
        real(fig, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", savefig)
    levels = [1, 2, 4, 8, 16, 32, 64]
    series = {
        "direct": [(c, 10.0 * c, 5.0 + c) for c in levels],
        "batched": [(c, 20.0 * c, 4.0 + c) for c in levels],
    }
    plot(series, tmp_path / "bench.png", "test")
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert saved == [[[str(c) for c in levels]] * 2]  # both panels
