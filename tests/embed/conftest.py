"""Fixtures shared by the embedding tests: the tiny transformers, exported once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """``kind -> (transformer checkpoint, its feature-extraction ONNX graph)`` for a tiny
    random BERT and GPT-2 (tests/embed/stmodels.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    from tests.embed.stmodels import build_base, export_transformer

    root = tmp_path_factory.mktemp("st-bases")
    out = {}
    for kind in ("bert", "gpt2"):
        base = build_base(kind, root / f"base-{kind}")
        out[kind] = (base, export_transformer(base, root / f"onnx-{kind}"))
    return out
