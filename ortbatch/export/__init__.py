"""Export Hugging Face models to ONNX and check them (needs the ``export`` extra).

Public face::

    export_model(model, output_dir, ...) -> ExportResult
    validate(directory, providers=None, ...) -> ValidationReport

plus :class:`Recipe` / :func:`load_recipe` (reproducible exports from TOML) and
:func:`tensorrt_provider_options`. The heavy modules (torch, transformers, optimum)
load on first use, so importing this package, its recipes or its TensorRT helpers is
cheap and works without the extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "export_model",
    "validate",
    "ValidationReport",
    "ExportResult",
    "CheckResult",
    "Case",
    "Comparison",
    "CHECKS",
    "Recipe",
    "load_recipe",
    "DEFAULT_TOLERANCES",
    "SUPPORTED_TASKS",
    "tensorrt_provider_options",
]

_LAZY = {
    "export_model": "ortbatch.export.exporter",
    "ExportResult": "ortbatch.export.exporter",
    "validate": "ortbatch.export.checks",
    "ValidationReport": "ortbatch.export.checks",
    "CheckResult": "ortbatch.export.checks",
    "Case": "ortbatch.export.checks",
    "Comparison": "ortbatch.export.checks",
    "CHECKS": "ortbatch.export.checks",
    "Recipe": "ortbatch.export.recipes",
    "load_recipe": "ortbatch.export.recipes",
    "DEFAULT_TOLERANCES": "ortbatch.export.recipes",
    "SUPPORTED_TASKS": "ortbatch.export.tasks",
    "tensorrt_provider_options": "ortbatch._ort.trt",
}

if TYPE_CHECKING:  # pragma: no cover
    from .._ort.trt import tensorrt_provider_options
    from .checks import CHECKS, Case, CheckResult, Comparison, ValidationReport, validate
    from .exporter import ExportResult, export_model
    from .recipes import DEFAULT_TOLERANCES, Recipe, load_recipe
    from .tasks import SUPPORTED_TASKS


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ortbatch.export' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
