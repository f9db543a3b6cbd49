"""What an export directory holds, ready to serve, built with a :class:`ServeConfig`'s
settings: the default loader of :class:`~.repository.ModelRepository` and of the runners.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ServeConfig
from .generator import ServedGenerator, is_generation_export
from .model import ServedModel

__all__ = ["load_served"]


def load_served(
    directory: str | Path,
    name: str | None,
    config: ServeConfig,
    session_options: Callable[[bool], Any] | None = None,
) -> ServedModel | ServedGenerator:
    """What ``directory`` holds, ready to serve: a ServedGenerator for a decoder-with-past
    export, else a ServedModel, built with ``config``'s settings. ``session_options(generation)``,
    when given, makes the ONNX Runtime session options (``ortbatch.ray`` sizes threads to a
    replica's CPUs)."""
    if is_generation_export(directory):
        gen_kw = config.generator_kwargs()
        if session_options is not None:
            gen_kw["session_options"] = session_options(True)
        return ServedGenerator.load(directory, name=name, generator_kwargs=gen_kw)
    kw = config.session_kwargs()
    if session_options is not None:
        kw["session_options"] = session_options(False)
    return ServedModel.load(
        directory,
        name=name,
        session_kwargs=kw,
        normalize_embeddings=config.normalize_embeddings,
        max_text_chars=config.max_text_chars,
        truncate=config.truncate,
    )
