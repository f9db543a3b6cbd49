"""What an export directory holds, ready to serve, built with a :class:`ServeConfig`'s
settings: the default loader of :class:`~.repository.ModelRepository` and of the runners.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import ValidationError
from ...manifest import MANIFEST_NAME, Manifest
from .. import tracing
from ..config import ServeConfig
from .kinds import kind_for_export

__all__ = ["load_served", "refuse_unvalidated"]


def refuse_unvalidated(directory: str | Path, allow_unvalidated: bool) -> None:
    """Raise :class:`~ortbatch.errors.ValidationError` when ``directory``'s manifest records
    failed accuracy checks (``validation.passed`` false, as in an ``X.failed`` export), unless
    ``allow_unvalidated``. Every way a model gets loaded goes through :func:`load_served`, which
    calls this, so the rule cannot be skipped by serving the export beside another."""
    target = Path(directory)
    if allow_unvalidated or not (target / MANIFEST_NAME).is_file():
        return
    if Manifest.load(target).validation.get("passed") is False:
        raise ValidationError(
            f"{target} FAILED its accuracy checks (validation.passed is false; see "
            f"{target / 'validation.json'}), so it may answer wrong numbers. Re-export it, "
            "or pass --allow-unvalidated to serve it anyway"
        )


def load_served(
    directory: str | Path,
    name: str | None,
    config: ServeConfig,
    session_options: Callable[[bool], Any] | None = None,
) -> Any:
    """What ``directory`` holds, ready to serve, as its kind loads it
    (:func:`~.kinds.kind_for_export`: a ServedGenerator for a decoder-with-past export, a
    ServedModel for an encoder), built with ``config``'s settings. ``session_options(generation)``,
    when given, makes the ONNX Runtime session options (``ortbatch.ray`` sizes threads to a
    replica's CPUs). An export no kind serves is refused
    (:class:`~.kinds.UnservedExportError`), and one whose accuracy checks failed
    (:func:`refuse_unvalidated`) unless ``config.allow_unvalidated``."""
    kind = kind_for_export(directory)
    refuse_unvalidated(directory, config.allow_unvalidated)
    served = kind.load(Path(directory), name, config, session_options)
    tracing.observe(served, tracing.active())  # when tracing is on (ortbatch.serve.tracing)
    return served
