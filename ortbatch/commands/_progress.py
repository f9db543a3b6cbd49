"""Shared console helpers for the export/validate/demo commands (stdlib only)."""

from __future__ import annotations

import importlib
import logging
import sys
import time
import warnings
from collections.abc import Callable
from typing import TextIO

__all__ = ["quiet_third_parties", "stepper"]


def stepper(stream: TextIO | None = None) -> Callable[[str], None]:
    """A progress callback printing ``[  3.2s] message`` lines to stderr."""
    out = stream or sys.stderr
    t0 = time.perf_counter()

    def step(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=out, flush=True)

    return step


def quiet_third_parties(verbose: bool) -> None:
    """Keep torch/transformers/optimum chatter (tracer warnings, info logs) off the
    console unless ``-v``: the command prints its own steps and summary."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return
    for name in ("transformers", "optimum", "torch", "onnxruntime", "sentence_transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module=rf"{name}(\..*)?")
    # transformers and optimum configure their own handlers and levels: ask them.
    for module in ("transformers.utils.logging", "optimum.utils.logging"):
        try:
            importlib.import_module(module).set_verbosity_error()
        except (ImportError, AttributeError):
            pass
    try:
        from torch.jit import TracerWarning

        warnings.filterwarnings("ignore", category=TracerWarning)
    except ImportError:
        pass
