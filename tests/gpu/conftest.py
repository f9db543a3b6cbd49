"""GPU tests: skipped unless onnxruntime has the CUDA execution provider."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import onnxruntime as ort

        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs onnxruntime-gpu with the CUDA execution provider")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
