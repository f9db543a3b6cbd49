"""Shared fixtures: tiny ONNX models built with onnx.helper (no torch)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def echo_path(model_dir: Path) -> Path:
    from tests.models import echo_model

    return echo_model(model_dir / "echo.onnx")


@pytest.fixture(scope="session")
def embed_path(model_dir: Path) -> Path:
    from tests.models import embed_model

    return embed_model(model_dir / "embed.onnx")


@pytest.fixture
def no_thread_leak():
    """Fail the test if an ortbatch worker thread started during it outlives it."""
    before = set(threading.enumerate())
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("ortbatch-") and t not in before]
    assert not alive, f"ortbatch threads still alive: {alive}"
