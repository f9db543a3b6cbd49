"""How exact a provider's arithmetic is, and the tolerances that follow from it.

fp32 is not fp32 everywhere: the CUDA execution provider runs fp32 matrix products in
TF32 by default (10-bit mantissa) unless ``use_tf32=0``; TensorRT builds fp32 engines
with TF32 too, and with ``trt_fp16_enable`` computes in fp16 while its inputs and
outputs stay fp32. A tolerance must come from the arithmetic actually used, not from
the outputs' dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .providers import CUDA, TRT

__all__ = ["arithmetic", "fp32_parity_options", "output_tolerance", "parity_tolerances"]

# Max |difference| allowed between two runs of the same model on the same provider at
# different batch shapes (different kernels, different summation order).
_OUTPUT_ATOL = {"fp32": 1e-3, "tf32": 1e-2, "fp16": 5e-2}


def _on(value: Any, default: bool) -> bool:
    if value is None:
        return default
    return str(value).strip().lower() not in ("0", "false", "no", "off", "")


def arithmetic(provider: str, options: Mapping[str, Any] | None = None, dtype: str = "fp32") -> str:
    """``"fp32"``, ``"tf32"`` or ``"fp16"``: what ``provider`` with ``options`` computes in
    for a model exported as ``dtype``."""
    opts = options or {}
    if dtype == "fp16":
        return "fp16"
    if provider == TRT:
        return "fp16" if _on(opts.get("trt_fp16_enable"), False) else "tf32"
    if provider == CUDA:
        return "tf32" if _on(opts.get("use_tf32"), True) else "fp32"
    return "fp32"


def output_tolerance(provider: str, options: Mapping[str, Any] | None = None, dtype: str = "fp32") -> float:
    """Absolute tolerance for comparing a float output of two runs on ``provider``."""
    return _OUTPUT_ATOL[arithmetic(provider, options, dtype)]


def parity_tolerances(kind: str, fp32: Mapping[str, float], fp16: Mapping[str, float]) -> dict[str, float]:
    """The validation tolerances for arithmetic ``kind``: the export's fp32 or fp16 ones,
    and for TF32 the fp32 ones loosened to what a 10-bit mantissa allows."""
    if kind == "fp16":
        return dict(fp16)
    out = dict(fp32)
    if kind == "tf32":
        out["atol"] = max(float(out.get("atol", 0.0)), 1e-2)
        out["rtol"] = max(float(out.get("rtol", 0.0)), 1e-2)
        if "cosine" in out:
            out["cosine"] = min(float(out["cosine"]), 0.999)
    return out


def fp32_parity_options(provider: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``options`` with TF32 turned off on CUDA unless the user set it, so an fp32 export is
    checked against fp32 tolerances (TensorRT has no such switch: it is checked as TF32).
    BatchedGenerator runs CUDA with these too: TF32 flips greedy near-ties."""
    out = dict(options or {})
    if provider == CUDA:
        out.setdefault("use_tf32", "0")
    return out
