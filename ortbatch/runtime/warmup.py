"""Warm-up: run what pays before a session says it is ready, and no more.

On a GPU the first run at a new shape is slow: TensorRT builds its engine (minutes for a
large model, unless its engine cache already holds one), cuDNN and cuBLAS pick their
algorithms, the memory arena grows. A session on such a provider runs a small grid first,
so no client waits for that: rows ``1, 8, max_batch_size`` x lengths ``1, 16, 128, max``
(the TensorRT profile's opt and max shapes are among them when the export has one).

On CPU none of that happens: measured on all-MiniLM-L6-v2 (2 cores, docs/operations.md),
the grid took 32 s of a 34 s startup, and a 1x12-token request right after a
1-request warm-up took what it took on a server warmed with the whole grid (14 vs 27 ms,
noise of a shared machine). So a session that runs only on the CPU provider runs one
smallest request (one row of one token): it proves the export runs, in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._ort import CPU
from .signature import ModelSignature

__all__ = ["describe_grid", "warmup_feeds", "warmup_grid"]

_DEFAULT_MAX_LENGTH = 128  # a graph without limits: warm the lengths most texts have


def _opt_lengths(providers: Sequence[Any]) -> set[int]:
    """Sequence lengths named by a TensorRT profile (its opt shapes), if any."""
    out: set[int] = set()
    for p in providers:
        if isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], dict):
            text = str(p[1].get("trt_profile_opt_shapes") or "")
            for part in filter(None, text.split(",")):
                dims = part.rpartition(":")[2].split("x")
                if len(dims) >= 2 and dims[1].isdigit():
                    out.add(int(dims[1]))
    return out


def _cpu_only(active: Sequence[str] | None) -> bool:
    return active is not None and all(p == CPU for p in active)


def warmup_grid(
    sig: ModelSignature, max_rows: int, providers: Sequence[Any] = (), active: Sequence[str] | None = None
) -> list[tuple[int, int]]:
    """(rows, length) pairs to run, smallest first. ``providers``: the export's (for the
    TensorRT profile's lengths); ``active``: the providers the session really runs on;
    only the CPU provider: the one smallest request (nothing there pays for more)."""
    if _cpu_only(active):
        return [(1, 1)]
    top = min(sig.max_lengths.values()) if sig.max_lengths else _DEFAULT_MAX_LENGTH
    lengths = sorted({n for n in {1, 16, 128, top, *_opt_lengths(providers)} if 1 <= n <= top})
    rows = sorted({r for r in (1, 8, max_rows) if 1 <= r <= max_rows})
    if not any(s.ragged_axes for s in sig.inputs.values()):
        lengths = [1]  # nothing ragged: the length does not change any shape
    return [(r, n) for r in rows for n in lengths]


def describe_grid(grid: Sequence[tuple[int, int]]) -> str:
    """``grid`` in a few words for a log line: ``1 shape (1x1)`` or ``12 shapes (rows 1, 8,
    64 x lengths 1, 16, 128, 256)``."""
    rows = sorted({r for r, _ in grid})
    lengths = sorted({n for _, n in grid})
    if len(grid) == 1:
        return f"1 shape ({rows[0]}x{lengths[0]} rows x tokens)"
    join = ", ".join
    return f"{len(grid)} shapes (rows {join(map(str, rows))} x lengths {join(map(str, lengths))})"


def warmup_feeds(
    sig: ModelSignature, max_rows: int, providers: Sequence[Any] = (), active: Sequence[str] | None = None
) -> list[dict[str, np.ndarray]]:
    """Stacked feeds for :func:`warmup_grid` (ones everywhere: valid token ids, a full
    attention mask). Empty for models with string inputs (nothing to warm on a GPU)."""
    if any(s.dtype == object for s in sig.inputs.values()):
        return []
    feeds = []
    for rows, length in warmup_grid(sig, max_rows, providers, active):
        feed = {}
        for name, s in sig.inputs.items():
            shape = [rows]
            for i, dim in enumerate(s.shape[1:], 1):
                if s.axes[i] is not None:
                    shape.append(length)
                else:
                    shape.append(dim if isinstance(dim, int) and dim >= 0 else 1)
            feed[name] = np.ones(shape, dtype=s.dtype)
        feeds.append(feed)
    return feeds
