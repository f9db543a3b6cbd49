"""Tiny image checkpoints, built once per session and exported once each (tests/vision/models.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

KINDS = (
    "clip",
    "clip-legacy",
    "siglip",
    "st-clip",
    "dinov2-backbone",
    "vit",
    "deit",
    "beit",
    "convnext",
    "swin",
    "dinov2",
)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    from tests.vision import models

    root = tmp_path_factory.mktemp("vision-checkpoints")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            target = root / kind
            if kind == "clip":
                built[kind] = models.build_clip(target)
            elif kind == "clip-legacy":
                built[kind] = models.build_clip(target, legacy_eos=True)
            elif kind == "siglip":
                built[kind] = models.build_siglip(target)
            elif kind == "st-clip":
                pytest.importorskip("sentence_transformers")
                built[kind] = models.build_st_clip(target)
            elif kind == "dinov2-backbone":
                built[kind] = models.build_dinov2_backbone(target)
            else:
                built[kind] = models.build_classifier(kind, target)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory, checkpoint: Callable[[str], Path]) -> Callable[..., Any]:
    """``exported(kind, **export_model kwargs)`` -> ExportResult, each combination once."""
    from ortbatch.export import export_model

    root = tmp_path_factory.mktemp("vision-exports")
    done: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}

    def get(kind: str, **kwargs: Any) -> Any:
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in done:
            name = kind + "".join(f"-{v}" for _, v in key[1])
            done[key] = export_model(str(checkpoint(kind)), root / name, **kwargs)
        return done[key]

    return get
