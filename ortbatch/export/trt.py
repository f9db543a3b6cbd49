"""TensorRT execution-provider options for an export (pure Python, no onnxruntime needed).

``ortbatch export --trt`` writes these into the manifest's ``providers`` list:

- an optimization profile (``trt_profile_min/opt/max_shapes``) for every input,
  derived from the export's limits: the batch axis spans ``1..max_batch_size``,
  ragged (sequence) axes span ``1..max_sequence_length`` (past-key-value axes start at
  0, the prefill step feeds an empty cache), fixed axes keep their size;
- ``trt_fp16_enable`` when fp16 was asked for;
- engine and timing cache directories under ``trt_cache/<key>`` where ``key`` hashes
  the model file(s), the onnxruntime version and the profile shapes, so an engine is
  never reused for a different model, runtime or shape range.

Cache paths are written *relative to the export directory* so the directory can be
moved; :func:`resolve_cache_paths` turns them into absolute paths before a session
is built (ONNX Runtime would resolve them against the current working directory).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The hashes live with the manifest (the runtime verifies them without the export extra).
from ..manifest import file_hash, model_hash

__all__ = [
    "TRT_PROVIDER",
    "TrtShapes",
    "file_hash",
    "model_hash",
    "resolve_cache_paths",
    "tensorrt_provider_options",
]

TRT_PROVIDER = "TensorrtExecutionProvider"
_PATH_KEYS = ("trt_engine_cache_path", "trt_timing_cache_path")


class TrtShapes:
    """min/opt/max sizes for the batch axis and for ragged (sequence) axes."""

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        opt_batch_size: int | None = None,
        opt_sequence_length: int | None = None,
    ) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"TensorRT profile limits must be positive, got max_batch_size={max_batch_size}, "
                f"max_sequence_length={max_sequence_length}"
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        # Serving batches fill up under load, so optimise for the full batch by default,
        # at a typical (not maximal) text length.
        self.opt_batch_size = opt_batch_size if opt_batch_size is not None else max_batch_size
        self.opt_sequence_length = (
            opt_sequence_length if opt_sequence_length is not None else min(128, max_sequence_length)
        )
        for what, opt, top in (
            ("opt_batch_size", self.opt_batch_size, max_batch_size),
            ("opt_sequence_length", self.opt_sequence_length, max_sequence_length),
        ):
            if not 1 <= opt <= top:
                raise ValueError(f"{what}={opt} must be between 1 and {top}")

    def dim(self, axis: str | int | None) -> tuple[int, int, int]:
        """(min, opt, max) for one axis: ``"batch"``, a ragged axis name, or a fixed size."""
        if isinstance(axis, int):
            return axis, axis, axis
        if axis == "batch":
            return 1, self.opt_batch_size, self.max_batch_size
        if axis is None:
            raise ValueError("an axis without a name or fixed size cannot be profiled")
        low = 0 if "past" in axis else 1
        return low, self.opt_sequence_length, self.max_sequence_length

    def to_dict(self) -> dict[str, int]:
        return {
            "max_batch_size": self.max_batch_size,
            "opt_batch_size": self.opt_batch_size,
            "max_sequence_length": self.max_sequence_length,
            "opt_sequence_length": self.opt_sequence_length,
        }


def _profile(inputs: Mapping[str, Sequence[str | int | None]], shapes: TrtShapes, which: int) -> str:
    parts = []
    for name, dims in inputs.items():
        sizes = []
        for i, axis in enumerate(dims):
            try:
                sizes.append(str(shapes.dim(axis)[which]))
            except ValueError:
                raise ValueError(f"input {name!r} axis {i} is dynamic but has no role; cannot profile it") from None
        parts.append(f"{name}:{'x'.join(sizes)}")
    return ",".join(parts)


def tensorrt_provider_options(
    inputs: Mapping[str, Sequence[str | int | None]],
    shapes: TrtShapes,
    *,
    fp16: bool,
    model_digest: str,
    ort_version: str,
    cache_root: str = "trt_cache",
) -> dict[str, Any]:
    """Options for ``("TensorrtExecutionProvider", options)``.

    ``inputs`` maps each graph input to its axes: ``"batch"``, a ragged-axis name
    (e.g. ``"sequence"``) or a fixed size (int). ``model_digest`` is
    :func:`model_hash` of the exported model.
    """
    min_s, opt_s, max_s = (_profile(inputs, shapes, i) for i in range(3))
    key_src = "\n".join([model_digest, ort_version, min_s, opt_s, max_s, f"fp16={bool(fp16)}"])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    base = f"{cache_root}/{key}"
    return {
        "trt_fp16_enable": bool(fp16),
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": f"{base}/engines",
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": f"{base}/timing",
        "trt_profile_min_shapes": min_s,
        "trt_profile_opt_shapes": opt_s,
        "trt_profile_max_shapes": max_s,
    }


def resolve_cache_paths(options: Mapping[str, Any], directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Return ``options`` with relative TensorRT cache paths made absolute under ``directory``
    (the directories are created: TensorRT does not create them itself)."""
    out = dict(options)
    for key in _PATH_KEYS:
        value = out.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            path = Path(directory) / value
            path.mkdir(parents=True, exist_ok=True)
            out[key] = os.fspath(path)
    return out
