"""Lazy imports of optional dependencies, with errors that name the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

_HINTS = {
    "onnxruntime": "cpu",  # or gpu
    "onnx": "export",
    "torch": "export",
    "transformers": "export",
    "optimum": "export",
    "tokenizers": "serve",
    "starlette": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "matplotlib": "bench",
    "ray": "ray",
    "av": "audio",
    "PIL": "vision",
}


def require(module: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` or raise ImportError saying which ortbatch extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        extra = extra or _HINTS.get(top, "")
        if top == "onnxruntime":
            hint = "pip install 'ortbatch[cpu]' (or 'ortbatch[gpu]' for CUDA/TensorRT)"
        else:
            hint = f"pip install 'ortbatch[{extra}]'" if extra else f"pip install {top}"
        raise ImportError(f"{module} is needed for this feature but is not installed: {hint}") from exc
