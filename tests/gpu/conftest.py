"""GPU tests: skipped unless the CUDA execution provider really loads here.

The decision comes from a probe session (``ortbatch._ort.probe``), not from
``get_available_providers()``, which lists CUDA and TensorRT in the onnxruntime-gpu wheel
on machines that have no CUDA at all.
"""

from __future__ import annotations

import pytest

from ortbatch._ort.probe import loads


def pytest_collection_modifyitems(config, items):
    if loads("CUDAExecutionProvider"):
        return
    skip = pytest.mark.skip(reason="needs a GPU where onnxruntime-gpu's CUDA execution provider loads")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a keyword (a folder may be named gpu)
            item.add_marker(skip)
