"""Reading an exported ONNX graph: its inputs/outputs, and the manifest entries they imply.

Axis roles come from the graph's symbolic dimension names, which optimum-onnx sets
consistently: ``batch_size`` is the batch axis; ``sequence_length`` becomes the
ragged axis ``"sequence"``; ``past_sequence_length + sequence_length`` becomes
``"total_sequence"``; and so on. An output dimension is ragged only when an input
carries the same name (otherwise it is a size computed inside the graph and left
alone); fixed dimensions are ``null``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ExportError
from ..manifest import BATCH_AXIS, InputSpec, OutputSpec

__all__ = ["GraphIO", "TensorInfo", "axis_role", "manifest_io", "read_graph_io", "save_onnx"]

_BATCH_NAMES = frozenset({"batch_size", "batch", "N"})
_TWO_GB = 2**31 - 2**26  # protobuf's hard limit, with headroom for the graph itself


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # numpy name, e.g. "int64", "float32"
    dims: tuple[str | int | None, ...]  # symbolic name, fixed size, or None (unknown)


@dataclass(frozen=True)
class GraphIO:
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    opset: int | None


def read_graph_io(path: str | Path) -> GraphIO:
    """Inputs, outputs and default-domain opset of an ONNX file (weights are not loaded)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    init_names = {i.name for i in model.graph.initializer}

    def info(v: Any) -> TensorInfo:
        tt = v.type.tensor_type
        dtype = str(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        dims: list[str | int | None] = []
        for d in tt.shape.dim:
            if d.HasField("dim_param"):
                dims.append(d.dim_param)
            elif d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(None)
        return TensorInfo(v.name, dtype, tuple(dims))

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return GraphIO(
        tuple(info(v) for v in model.graph.input if v.name not in init_names),
        tuple(info(v) for v in model.graph.output),
        opset,
    )


def axis_role(dim: str) -> str:
    """Manifest axis name for a symbolic graph dimension."""
    if dim in _BATCH_NAMES:
        return BATCH_AXIS
    text = dim.replace(" ", "")
    if re.fullmatch(r"past_(\w+)_length\+\1_length", text):
        return "total_" + re.sub(r"^past_", "", text.split("+")[0]).removesuffix("_length")
    return re.sub(r"\W+", "_", text).removesuffix("_length").strip("_") or "dim"


def manifest_io(
    io: GraphIO, pads: dict[str, float | int]
) -> tuple[dict[str, InputSpec], dict[str, OutputSpec], dict[str, list[str | int | None]]]:
    """Manifest input/output specs, plus each input's axes with fixed sizes kept (for TensorRT).

    Raises :class:`ExportError` if an input or output has no dynamic batch axis 0:
    such a model cannot be batched, and the export is wrong, not the request."""
    inputs: dict[str, InputSpec] = {}
    shapes: dict[str, list[str | int | None]] = {}
    input_dims: set[str] = set()
    for t in io.inputs:
        _check_batch(t, "input")
        axes: list[str | None] = [BATCH_AXIS]
        shape: list[str | int | None] = [BATCH_AXIS]
        for d in t.dims[1:]:
            if isinstance(d, str):
                input_dims.add(d)
                axes.append(axis_role(d))
                shape.append(axis_role(d))
            else:
                axes.append(None)
                shape.append(d)
        default_pad: float | int = 0.0 if t.dtype.startswith(("float", "bfloat")) else 0
        inputs[t.name] = InputSpec(dtype=t.dtype, axes=tuple(axes), pad=pads.get(t.name, default_pad))
        shapes[t.name] = shape
    outputs: dict[str, OutputSpec] = {}
    for t in io.outputs:
        _check_batch(t, "output")
        out_axes: list[str | None] = [BATCH_AXIS]
        out_axes += [axis_role(d) if isinstance(d, str) and d in input_dims else None for d in t.dims[1:]]
        outputs[t.name] = OutputSpec(axes=tuple(out_axes), dtype=t.dtype)
    return inputs, outputs, shapes


def _check_batch(t: TensorInfo, kind: str) -> None:
    if not t.dims:
        raise ExportError(f"{kind} {t.name!r} is a scalar: it has no batch axis, so it cannot be batched")
    d0 = t.dims[0]
    if not isinstance(d0, str):
        raise ExportError(
            f"{kind} {t.name!r} has a fixed batch dimension ({d0}): the export lost its dynamic batch axis"
        )


def save_onnx(model: Any, path: str | Path) -> None:
    """Save an ONNX ModelProto, with weights in ``<name>_data`` when the file would pass 2 GB."""
    import onnx

    path = Path(path)
    data = path.with_name(path.name + "_data")
    if data.exists():
        data.unlink()
    if model.ByteSize() > _TWO_GB:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))
