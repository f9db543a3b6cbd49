"""Moved to :mod:`ortbatch._ort.trt` (the runtime must not import ``export``); these names
stay importable from here for code written against the old place."""

from __future__ import annotations

from .._ort.trt import TRT_PROVIDER, TrtShapes, resolve_cache_paths, tensorrt_provider_options
from ..manifest import file_hash, model_hash

__all__ = ["TRT_PROVIDER", "TrtShapes", "file_hash", "model_hash", "resolve_cache_paths", "tensorrt_provider_options"]
