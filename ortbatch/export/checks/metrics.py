"""Comparing one output with its expected value: elementwise tolerances and the task
metric (cosine, argmax agreement, greedy-token agreement)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .report import Comparison

__all__ = ["compare", "compare_tokens"]


def _metric_kind(output: str) -> str | None:
    name = output.lower()
    if "logits" in name:
        return "argmax"
    if name.startswith(("present", "past")):
        return None
    return "cosine"


def _select(x: np.ndarray, axis: int | None, mask: np.ndarray | None, side: str) -> np.ndarray:
    """Valid positions only: rows of ``x`` along ``axis`` where ``mask`` (batch, len) is set."""
    if axis is None or mask is None or axis == x.ndim - 1:
        # A ragged last axis (e.g. QA start_logits) is compared whole, padded columns
        # included: both sides compute them the same way, and rows stay intact for argmax.
        return x
    moved = np.moveaxis(x, axis, 1)
    return moved[mask.astype(bool)]


def compare(
    output: str,
    got: np.ndarray,
    ref: np.ndarray,
    tol: Mapping[str, float],
    *,
    seq_axis: int | None = None,
    mask: np.ndarray | None = None,
    metric: str | bool | None = True,
) -> Comparison:
    """Compare one output; ``mask`` (batch, length) restricts a ragged ``seq_axis`` to
    real tokens. ``metric=True`` picks the task metric from the output's name."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    kind = _metric_kind(output) if metric is True else (metric or None)
    comp = Comparison(output=output, shape=list(got.shape), passed=False, tolerance=dict(tol))
    if got.shape != ref.shape:
        comp.message = f"shape {list(got.shape)} != expected {list(ref.shape)}"
        return comp
    g = _select(got, seq_axis, mask, "right").astype(np.float64)
    r = _select(ref, seq_axis, mask, "right").astype(np.float64)
    finite_ref = np.isfinite(r)
    comp.nonfinite = int(np.count_nonzero(~np.isfinite(g) & finite_ref))
    if comp.nonfinite:
        comp.message = f"{comp.nonfinite} NaN/Inf values (of {g.size}) where the expected value is finite"
        return comp
    if not finite_ref.all():
        comp.message = f"the expected output has {int((~finite_ref).sum())} NaN/Inf values"
        return comp
    if g.size == 0:
        comp.passed = True
        comp.max_abs_err = comp.max_rel_err = 0.0
        return comp
    atol, rtol = float(tol["atol"]), float(tol["rtol"])
    diff = np.abs(g - r)
    comp.max_abs_err = float(diff.max())
    comp.max_rel_err = float((diff / (np.abs(r) + atol)).max())
    excess = diff - (atol + rtol * np.abs(r))
    close = bool((excess <= 0).all())
    messages = []
    if not close:
        i = int(np.argmax(excess))
        messages.append(
            f"max abs err {comp.max_abs_err:.3g} exceeds atol={atol:g} + rtol={rtol:g}*|ref| "
            f"({int((excess > 0).sum())} of {diff.size} values; worst {g.flat[i]:.6g} vs {r.flat[i]:.6g})"
        )
    ok_metric = True
    # a per-token hidden state (batch, sequence, hidden) may have its own, looser floor
    floor = float(tol.get("token_cosine", tol.get("cosine", 1.0)) if got.ndim >= 3 else tol.get("cosine", 1.0))
    if kind == "cosine":
        a = g.reshape(-1, g.shape[-1]) if g.ndim > 1 else g.reshape(1, -1)
        b = r.reshape(-1, r.shape[-1]) if r.ndim > 1 else r.reshape(1, -1)
        denom = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        cos = np.where(denom > 0, (a * b).sum(axis=1) / np.maximum(denom, 1e-30), 1.0)
        comp.metric, comp.metric_value = "cosine", float(cos.min())
        ok_metric = comp.metric_value >= floor
        if not ok_metric:
            messages.append(
                f"min cosine similarity {comp.metric_value:.6f} < {floor} (by {floor - comp.metric_value:.4f})"
            )
    elif kind == "argmax":
        a = g.reshape(-1, g.shape[-1])
        b = r.reshape(-1, r.shape[-1])
        if b.shape[-1] > 1:
            top2 = np.sort(b, axis=1)[:, -2:]
            margin = top2[:, 1] - top2[:, 0]
            decisive = margin > 2 * (atol + rtol * np.abs(top2[:, 1]))
        else:
            decisive = np.zeros(len(b), dtype=bool)
        agree = a.argmax(axis=1) == b.argmax(axis=1)
        comp.metric = "argmax"
        comp.metric_value = float(agree[decisive].mean()) if decisive.any() else 1.0
        ok_metric = comp.metric_value >= tol["argmax"]
        if not ok_metric:
            messages.append(f"argmax agreement {comp.metric_value:.4f} < {tol['argmax']}")
    comp.passed = close and ok_metric
    comp.message = "; ".join(messages)
    return comp


def compare_tokens(
    output: str, got: np.ndarray, ref: np.ndarray, tol: Mapping[str, float], ref_top2: np.ndarray | None = None
) -> Comparison:
    """Greedy-token agreement: per row, tokens that agree before the first divergence
    (after it, the continuations legitimately differ). With ``ref_top2`` (the reference's
    two best logits per step), a divergence where those are within tolerance of each other
    is a tie, not an error: that row counts as agreeing."""
    comp = Comparison(
        output=output,
        shape=list(got.shape),
        passed=False,
        metric="greedy",
        tolerance={k: tol[k] for k in ("greedy", "atol", "rtol") if k in tol},
    )
    if got.shape != ref.shape:
        comp.message = f"shape {list(got.shape)} != expected {list(ref.shape)}"
        return comp
    agree = 0
    ties = 0
    first_bad = None
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        diverge = np.nonzero(a != b)[0]
        n = int(diverge[0]) if len(diverge) else len(a)
        if n < len(a) and ref_top2 is not None:
            best, second = (float(x) for x in ref_top2[i, n])
            if best - second <= 2 * (tol.get("atol", 0.0) + tol.get("rtol", 0.0) * abs(best)):
                ties += 1
                n = len(a)
        agree += n
        if n < len(a) and first_bad is None:
            first_bad = (i, n, a.tolist(), b.tolist())
    comp.metric_value = agree / max(1, got.size)
    comp.passed = comp.metric_value >= tol["greedy"]
    notes = [f"{ties} row(s) diverged at a near-tie of the reference's top-2 logits"] if ties else []
    if first_bad and not comp.passed:
        i, n, a, b = first_bad
        notes.insert(
            0, f"greedy agreement {comp.metric_value:.3f} < {tol['greedy']}; row {i} diverges at token {n}: {a} vs {b}"
        )
    comp.message = "; ".join(notes)
    return comp
