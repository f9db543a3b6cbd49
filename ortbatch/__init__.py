"""ortbatch: serve Hugging Face transformers fast and safely on ONNX Runtime.

Three parts, one pipeline::

    export_model()  ->  validate()  ->  BatchedSession / BatchedGenerator

Nothing heavy is imported here: the runtime needs only numpy and onnxruntime, and
the exporter's torch/transformers/optimum are imported when first used.
"""

import importlib as _importlib
import typing as _typing

from ._version import __version__
from .errors import (
    ExportError,
    InferenceError,
    InvalidInputError,
    ManifestError,
    ModelContractError,
    ModelIntegrityError,
    ModelLoadError,
    OrtBatchError,
    ProviderError,
    QueueFullError,
    RequestTimeoutError,
    SessionClosedError,
    UnsupportedModelError,
    ValidationError,
)
from .manifest import Manifest

__all__ = [
    # runtime
    "BatchedSession",
    "BatchedGenerator",
    "Collator",
    "PaddingCollator",
    "Completion",
    "Stats",
    "Embedder",
    # export and checks
    "export_model",
    "validate",
    "ValidationReport",
    "Manifest",
    # bulk jobs (ortbatch run)
    "run",
    "RunConfig",
    "RunSummary",
    # errors
    "OrtBatchError",
    "InvalidInputError",
    "QueueFullError",
    "RequestTimeoutError",
    "SessionClosedError",
    "InferenceError",
    "ProviderError",
    "ModelContractError",
    "ModelLoadError",
    "ManifestError",
    "ModelIntegrityError",
    "ExportError",
    "UnsupportedModelError",
    "ValidationError",
    "__version__",
]

# name -> module that defines it; imported on first attribute access (PEP 562).
_LAZY = {
    "BatchedSession": "ortbatch.runtime.session",
    "Collator": "ortbatch.runtime.collate",
    "PaddingCollator": "ortbatch.runtime.collate",
    "Stats": "ortbatch.runtime.stats",
    "Embedder": "ortbatch.embed",
    "BatchedGenerator": "ortbatch.generation",
    "Completion": "ortbatch.generation",
    "export_model": "ortbatch.export",
    "validate": "ortbatch.export",
    "ValidationReport": "ortbatch.export",
    "run": "ortbatch.bulk",
    "RunConfig": "ortbatch.bulk",
    "RunSummary": "ortbatch.bulk",
}

if _typing.TYPE_CHECKING:  # pragma: no cover
    from .bulk import RunConfig, RunSummary, run
    from .embed import Embedder
    from .export import ValidationReport, export_model, validate
    from .generation import BatchedGenerator, Completion
    from .runtime.collate import Collator, PaddingCollator
    from .runtime.session import BatchedSession
    from .runtime.stats import Stats


def __getattr__(name: str) -> "_typing.Any":
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ortbatch' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
