"""Keep torch/transformers/optimum chatter (tracer warnings, info logs) off the console.

One place for both faces: the CLI quiets them for the whole process
(:func:`quiet_third_parties`), :func:`ortbatch.export_model` only while it runs
(:func:`third_parties_quiet`), so a Python caller sees the same output as the CLI and
gets its own logging and warning settings back afterwards. Standard library only.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = ["quiet_third_parties", "third_parties_quiet"]

_NAMES = ("transformers", "optimum", "torch", "onnxruntime", "sentence_transformers")
# transformers and optimum configure their own handlers and levels: ask them.
_VERBOSITY_MODULES = ("transformers.utils.logging", "optimum.utils.logging")


def _ignore_warnings() -> None:
    for name in _NAMES:
        warnings.filterwarnings("ignore", module=rf"{name}(\..*)?")
    try:
        from torch.jit import TracerWarning

        warnings.filterwarnings("ignore", category=TracerWarning)
    except ImportError:
        pass


def _verbosity_modules() -> list[ModuleType]:
    found = []
    for module in _VERBOSITY_MODULES:
        try:
            found.append(importlib.import_module(module))
        except ImportError:
            continue
    return found


def quiet_third_parties(verbose: bool) -> None:
    """For the rest of the process: third-party warnings and logs below ERROR hidden
    (``verbose``: INFO logs of everything shown instead)."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return
    for name in _NAMES:
        logging.getLogger(name).setLevel(logging.ERROR)
    _ignore_warnings()
    for module in _verbosity_modules():
        with contextlib.suppress(AttributeError):
            module.set_verbosity_error()


@contextlib.contextmanager
def third_parties_quiet() -> Iterator[None]:
    """The same as :func:`quiet_third_parties` inside the block; the caller's logger
    levels, verbosities and warning filters are restored after it."""
    levels = {name: logging.getLogger(name).level for name in _NAMES}
    verbosities: list[tuple[Any, int]] = []
    for module in _verbosity_modules():
        with contextlib.suppress(AttributeError):
            verbosities.append((module, module.get_verbosity()))
    with warnings.catch_warnings():
        quiet_third_parties(False)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            for module, verbosity in verbosities:
                module.set_verbosity(verbosity)
