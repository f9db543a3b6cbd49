"""Shared console helpers for the export/validate/demo commands (stdlib only)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from .._quiet import quiet_third_parties

__all__ = ["quiet_third_parties", "stepper"]


def stepper(stream: TextIO | None = None) -> Callable[[str], None]:
    """A progress callback printing ``[  3.2s] message`` lines to stderr."""
    out = stream or sys.stderr
    t0 = time.perf_counter()

    def step(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=out, flush=True)

    return step
