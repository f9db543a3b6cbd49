"""What the runtime knows about a model's inputs and outputs.

Built from the manifest when there is one, else inferred from the graph:

* axis 0 of every input and output is the batch axis (it must be dynamic);
* a dynamic axis is *ragged*: requests may differ along it, so it is padded.
  Axes that share a symbolic name share one padded length (``input_ids`` and
  ``attention_mask`` both ``sequence``); an unnamed dynamic axis is ragged on its own;
* an output axis carrying the same name as a ragged input axis is trimmed back
  per request; other output axes are returned as computed;
* pads default to 0; explicit ``pad_values`` / ``padding_side`` override.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelContractError
from ..manifest import BATCH_AXIS, Manifest

__all__ = ["InputSig", "ModelSignature", "OutputSig", "ort_type_to_dtype"]

Dim = int | str | None

_ORT_TYPES: dict[str, Any] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint64)": np.uint64,
    "tensor(uint32)": np.uint32,
    "tensor(uint16)": np.uint16,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
    "tensor(string)": np.object_,
}


def ort_type_to_dtype(ort_type: str) -> np.dtype:
    """``'tensor(int64)'`` -> ``np.dtype('int64')``; ModelContractError if unsupported."""
    try:
        return np.dtype(_ORT_TYPES[ort_type])
    except KeyError:
        raise ModelContractError(f"unsupported tensor type {ort_type!r}") from None


@dataclass(frozen=True)
class InputSig:
    """One input: dtype, graph shape, the role of each axis, its pad value."""

    name: str
    dtype: np.dtype
    shape: tuple[Dim, ...]
    axes: tuple[str | None, ...]
    pad: Any = 0

    @property
    def ragged_axes(self) -> tuple[tuple[int, str], ...]:
        return tuple((i, a) for i, a in enumerate(self.axes) if i > 0 and a is not None)

    def describe(self) -> str:
        dims = [
            "batch" if i == 0 else (self.axes[i] or (str(d) if d is not None else "?"))
            for i, d in enumerate(self.shape)
        ]
        return f"(dtype {self.dtype}, shape [{', '.join(map(str, dims))}])"


@dataclass(frozen=True)
class OutputSig:
    """One output: the ragged axes to trim per request, as (axis, name)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[Dim, ...] | None
    ragged: tuple[tuple[int, str], ...] = ()


@dataclass
class ModelSignature:
    """Inputs, outputs, padding side and limits: all a collator needs."""

    inputs: dict[str, InputSig]
    outputs: dict[str, OutputSig]
    padding_side: str = "right"
    max_lengths: dict[str, int] = field(default_factory=dict)
    max_rows: int = 1 << 30

    def output_ragged(self, name: str) -> tuple[tuple[int, str], ...]:
        out = self.outputs.get(name)
        return out.ragged if out is not None else ()

    @classmethod
    def from_node_args(
        cls,
        inputs: Sequence[Any],
        outputs: Sequence[Any],
        *,
        manifest: Manifest | None = None,
        pad_values: Mapping[str, Any] | None = None,
        padding_side: str | None = None,
    ) -> ModelSignature:
        """Build from onnxruntime ``NodeArg``-like objects (``name``, ``type``, ``shape``)."""
        minputs = manifest.inputs if manifest is not None else {}
        moutputs = manifest.outputs if manifest is not None else {}
        rename: dict[str, str] = {}  # graph dim name -> ragged key
        sigs: dict[str, InputSig] = {}
        for arg in inputs:
            shape = _shape(arg)
            if shape is None:
                raise ModelContractError(f"input {arg.name!r} has no known rank; cannot batch it")
            _check_batch_dim("input", arg.name, shape)
            spec = minputs.get(arg.name)
            if spec is not None and len(spec.axes) != len(shape):
                raise ModelContractError(
                    f"manifest gives input {arg.name!r} {len(spec.axes)} axes but the graph has rank {len(shape)}"
                )
            axes: list[str | None] = [BATCH_AXIS]
            for i in range(1, len(shape)):
                dim = shape[i]
                if isinstance(dim, int):
                    axes.append(None)  # fixed: checked at submit
                    continue
                key = spec.axes[i] if spec is not None else None
                if key is None:
                    key = dim if isinstance(dim, str) else f"{arg.name}.{i}"
                if isinstance(dim, str):
                    rename.setdefault(dim, key)
                axes.append(key)
            pad = spec.pad if spec is not None else 0
            sigs[arg.name] = InputSig(arg.name, ort_type_to_dtype(arg.type), shape, tuple(axes), pad)
        if pad_values:
            unknown = sorted(set(pad_values) - set(sigs))
            if unknown:
                raise ModelContractError(f"pad_values names unknown input(s) {unknown}; inputs: {sorted(sigs)}")
            for name, pad in pad_values.items():
                s = sigs[name]
                sigs[name] = InputSig(s.name, s.dtype, s.shape, s.axes, pad)
        ragged_keys = {k for s in sigs.values() for _, k in s.ragged_axes}
        outs: dict[str, OutputSig] = {}
        for arg in outputs:
            shape = _shape(arg)
            if shape is not None:
                _check_batch_dim("output", arg.name, shape)
            ospec = moutputs.get(arg.name)
            ragged: list[tuple[int, str]] = []
            if ospec is not None:
                ragged = [(i, a) for i, a in enumerate(ospec.axes) if i > 0 and a in ragged_keys]
            elif shape is not None:
                for i in range(1, len(shape)):
                    dim = shape[i]
                    if isinstance(dim, str) and rename.get(dim, dim) in ragged_keys:
                        ragged.append((i, rename.get(dim, dim)))
            dtype = ort_type_to_dtype(arg.type) if arg.type in _ORT_TYPES else None
            outs[arg.name] = OutputSig(arg.name, dtype, shape, tuple(ragged))
        side = padding_side or (manifest.padding_side if manifest is not None else "right")
        if side not in ("left", "right"):
            raise ModelContractError(f"padding_side must be 'left' or 'right', got {side!r}")
        max_lengths: dict[str, int] = {}
        if manifest is not None and manifest.max_sequence_length:
            for s in sigs.values():
                if s.name in minputs:
                    for _, key in s.ragged_axes:
                        max_lengths[key] = manifest.max_sequence_length
        return cls(sigs, outs, side, max_lengths)


def _shape(arg: Any) -> tuple[Dim, ...] | None:
    shape = getattr(arg, "shape", None)
    if shape is None:
        return None
    return tuple(d if isinstance(d, (int, str)) or d is None else None for d in shape)


def _check_batch_dim(kind: str, name: str, shape: tuple[Dim, ...]) -> None:
    if not shape:
        raise ModelContractError(
            f"{kind} {name!r} is a scalar: it has no batch axis, so requests cannot be batched "
            "(re-export it with a leading batch dimension, or use a custom collator)"
        )
    if isinstance(shape[0], int):
        raise ModelContractError(
            f"{kind} {name!r} has a fixed batch dimension of {shape[0]} (shape {list(shape)}): "
            "batching needs a dynamic axis 0 (re-export with dynamic axes)"
        )
