"""Graph rewrites that make dynamic int8 accurate on transformer encoders.

Dynamic int8 (``MatMulInteger`` after ``DynamicQuantizeLinear``) takes one activation
scale per tensor. Two things set that scale on an encoder, and both crush the precision
of everything else in the tensor (measured on all-MiniLM-L6-v2: docs/export.md, and the
``ortbatch tune`` runs in docs/benchmarks-log.md, "ortbatch tune on MiniLM"):

- **Outlier channels.** A few hidden units of a trained transformer carry values 20-45x
  the median unit's (MiniLM's units 63, 99, 157, 223 after LayerNorm; some GELU outputs),
  the same units for every token. :func:`prepare_int8` finds them by calibration (an
  input channel whose largest ``|x|`` exceeds ``outlier_ratio`` times the median
  channel's) and computes them in float, the rest in int8, as LLM.int8() does:
  ``X @ W = (X * inlier_mask) @ W  +  X[..., outliers] @ W[outliers, :]``. The int8 part
  no longer sees the outliers, so its scale fits the other units; the float part is a
  MatMul with a handful of rows. Exact in fp32 (the two parts add up to the original).
- **Padding.** In a right-padded batch the pad positions' hidden states (which attention
  masks out, so no real token ever reads them) still enter the per-tensor range, so one
  row's answer moves with its batch mates' lengths. ``mask_padding`` multiplies the
  quantized MatMul inputs that a LayerNormalization produces (where each layer reads the
  residual stream: Q/K/V and FFN-in) by the attention mask first: pad rows become 0 and
  only real tokens set the scale. The other inputs' pad rows then derive from those zeros
  (FFN activations) or from real tokens' values (attention context), so they need no Mul
  of their own (measured on MiniLM: the same accuracy as masking every input, with 12
  Muls instead of 24). Exact for every real token; the pad positions' outputs (which
  every consumer ignores) change.

- **Smoothing** (``smooth_alpha``, SmoothQuant). For each MatMul input that a
  LayerNormalization produces (a layer's Q/K/V and FFN-in projections, where the outlier
  units sit), per input channel ``s_j = max|x_j|^alpha / max|W_j,:|^(1-alpha)`` from
  calibration: ``X @ W = (X / s) @ (s * W)``, so the activation's range moves into the
  weights, which have one int8 scale per output column. ``1 / s`` folds into the
  LayerNorm's gamma and beta when only those MatMuls read its output (pre-LN blocks);
  in post-LN blocks (BERT) the residual Add reads it too, so it is one elementwise Mul
  there, much cheaper than the split's Gather + MatMul + Add. Exact in fp32. The split
  then only takes the channels that remain outliers after smoothing (on MiniLM, 5 GELU
  outputs instead of 39 channels).

All are plain ONNX operators (Mul, Gather, MatMul, Add, Unsqueeze, Cast) or changed
initializers, so the export stays a plain ONNX model that any onnxruntime runs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._ort import CPU
from ..errors import ExportError

__all__ = ["Int8Prep", "prepare_int8"]

_PAD_MASK = "ortbatch_pad_mask"


@dataclass
class Int8Prep:
    """What :func:`prepare_int8` did: the float nodes to keep out of quantization and counts
    for the manifest."""

    float_nodes: list[str] = field(default_factory=list)
    outlier_channels: int = 0
    split_inputs: int = 0
    masked_inputs: int = 0
    smoothed_inputs: int = 0
    folded_inputs: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "outlier_channels": self.outlier_channels,
            "outlier_split_inputs": self.split_inputs,
            "padding_masked_inputs": self.masked_inputs,
            "smoothed_inputs": self.smoothed_inputs,
            "smoothing_folded_into_layernorm": self.folded_inputs,
        }


def _weight_matmuls(model: Any) -> dict[str, list[tuple[int, Any]]]:
    """(position, node) of the MatMuls whose B is a 2-D float initializer, grouped by their
    (shared) input A."""
    import onnx

    inits = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list[tuple[int, Any]]] = {}
    for pos, node in enumerate(model.graph.node):
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        w = inits[node.input[1]]
        if len(w.dims) == 2 and w.data_type == onnx.TensorProto.FLOAT:
            groups.setdefault(node.input[0], []).append((pos, node))
    return groups


def _input_amax(
    model: Any, names: Sequence[str], feeds: Sequence[Mapping[str, np.ndarray]], workdir: Path
) -> dict[str, tuple[np.ndarray, int]]:
    """Per-channel max |x| of each tensor in ``names`` over ``feeds`` (rows where the feed's
    attention mask is set), with the tensor's rank."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for name in names:
        if name not in have:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    path = workdir / "probe.onnx"
    big = probe.ByteSize() > 1_800_000_000
    onnx.save(probe, os.fspath(path), save_as_external_data=big, location="probe.onnx.data" if big else None)
    del probe
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # the plain graph: ORT's fusions would rename or fold the tensors we read
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(os.fspath(path), opts, providers=[CPU])
    amax: dict[str, tuple[np.ndarray, int]] = {}
    for feed in feeds:
        mask = feed.get("attention_mask")
        for name, value in zip(names, sess.run(list(names), dict(feed)), strict=True):
            v = np.abs(np.asarray(value, dtype=np.float32))
            if mask is not None and v.ndim == 3 and v.shape[:2] == mask.shape:
                v = v[mask.astype(bool)]
            v = v.reshape(-1, v.shape[-1])
            cur = v.max(axis=0) if len(v) else np.zeros(v.shape[-1], np.float32)
            prev = amax.get(name)
            amax[name] = (cur if prev is None else np.maximum(prev[0], cur), np.asarray(value).ndim)
    return amax


def _smooth_scales(x_amax: np.ndarray, w_amax: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's per-input-channel factors ``s_j = max|x_j|^alpha / max|W_j,:|^(1-alpha)``
    (channels that never fire or have zero weights keep 1)."""
    x = np.asarray(x_amax, np.float64)
    w = np.asarray(w_amax, np.float64)
    ok = (x > 0) & (w > 0)
    s = np.ones_like(x)
    s[ok] = x[ok] ** alpha / w[ok] ** (1.0 - alpha)
    return s.astype(np.float32)


def _fold_into_layernorm(
    ln: Any,
    s: np.ndarray,
    consumers: Mapping[str, Sequence[Any]],
    inits: Mapping[str, Any],
    group: Sequence[Any],
) -> bool:
    """Divide LayerNormalization ``ln``'s gamma and beta by ``s`` in place, when that is exact:
    its output is read only by the MatMuls of ``group`` (a pre-LN block; in a post-LN block
    such as BERT's the residual Add reads it too) and nothing else uses gamma or beta."""
    from onnx import numpy_helper

    if any(r is None or all(r is not g for g in group) for r in consumers[ln.output[0]]):
        return False
    params = [n for n in ln.input[1:3] if n]
    if any(len(consumers.get(n, ())) != 1 for n in params):
        return False
    for name in params:
        value = numpy_helper.to_array(inits[name]).astype(np.float32)
        inits[name].CopyFrom(numpy_helper.from_array((value / s).astype(np.float32), name))
    return True


def prepare_int8(
    model: Any,
    *,
    feeds: Sequence[Mapping[str, np.ndarray]],
    outlier_ratio: float | None,
    mask_padding: bool,
    exclude: Sequence[str] = (),
    smooth_alpha: float | None = None,
) -> Int8Prep:
    """Rewrite ``model`` (an ``onnx.ModelProto``, in place) for dynamic int8.

    ``feeds`` (tokenized real texts) calibrate the channel ranges. MatMuls named in
    ``exclude`` stay float and untouched. ``smooth_alpha`` smooths the LayerNorm-fed inputs
    first; ``outlier_ratio`` then judges the smoothed ranges. Returns the float nodes the quantizer must skip.
    Raises :class:`ExportError` when the model cannot take a rewrite asked for.
    """
    graph = model.graph
    groups = _groups(model, feeds, mask_padding, exclude)
    with tempfile.TemporaryDirectory(prefix="ortbatch-int8prep-") as tmp:
        amax = _input_amax(model, list(groups), feeds, Path(tmp))
    rw = _Rewrite(graph)
    head = _pad_mask_nodes(model) if mask_padding else []
    layernorms = {node.output[0]: node for node in graph.node if node.op_type == "LayerNormalization"}
    # smoothing applies where a LayerNormalization with constant gamma/beta makes the input
    producers = {
        x: node for x, node in layernorms.items() if len(node.input) > 1 and all(i in rw.inits for i in node.input[1:3])
    }
    # pad rows are zeroed where the layers read the residual stream (LayerNorm outputs):
    # every other input's pad rows are then computed from those zeros or from real tokens
    # (attention mixes only real tokens' values), measured as accurate on MiniLM with half
    # the Muls. A model without LayerNormalization nodes gets all its inputs masked.
    normed_groups = [x for x in groups if x in layernorms]
    for i, (x, nodes) in enumerate(groups.items()):
        channels, rank = amax[x]
        key = f"ortbatch_int8_{i}"
        cur = x
        added: list[Any] = []
        if mask_padding and rank == 3 and (x in layernorms or not normed_groups):
            added.append(_node("Mul", [cur, _PAD_MASK], [f"{key}_unpadded"], name=f"{key}_PadMul"))
            cur = f"{key}_unpadded"
            rw.prep.masked_inputs += 1
        producer = producers.get(x)
        if smooth_alpha is not None and channels.size > 1 and producer is not None:
            channels, cur = rw.smooth(key, x, cur, nodes, channels, producer, smooth_alpha, added)
        idx = np.zeros(0, np.int64)
        if outlier_ratio is not None and channels.size > 1:
            median = float(np.median(channels))  # after smoothing, if any
            idx = np.flatnonzero(channels > outlier_ratio * max(median, 1e-12)).astype(np.int64)
        if idx.size:
            cur = rw.split_outliers(key, cur, channels, idx, added)
        if added:
            rw.rewire(key, cur, nodes, idx, added)
    rw.reorder(head)
    return rw.prep


def _node(*args: Any, **kwargs: Any) -> Any:
    from onnx import helper

    return helper.make_node(*args, **kwargs)


def _groups(
    model: Any, feeds: Sequence[Mapping[str, np.ndarray]], mask_padding: bool, exclude: Sequence[str]
) -> dict[str, list[tuple[int, Any]]]:
    """The weight MatMuls to rewrite, by the input they read, once the rewrite is possible."""
    if not feeds:
        raise ExportError("int8 outlier_ratio / mask_padding / smooth_alpha need calibration texts")
    inputs = {i.name for i in model.graph.input}
    if mask_padding and ("attention_mask" not in inputs or any("past" in n for n in inputs)):
        raise ExportError(
            "quantization.mask_padding needs an encoder with an attention_mask input (batch, sequence); "
            f"this model takes {sorted(inputs)}"
        )
    skip = set(exclude)
    groups = {x: [(p, n) for p, n in nodes if n.name not in skip] for x, nodes in _weight_matmuls(model).items()}
    groups = {x: nodes for x, nodes in groups.items() if nodes}
    if not groups:
        raise ExportError(
            "int8 outlier_ratio / mask_padding / smooth_alpha: the model has no MatMul with a weight matrix"
        )
    return groups


def _pad_mask_nodes(model: Any) -> list[Any]:
    """Nodes that turn ``attention_mask`` (batch, sequence) into a float (batch, sequence, 1)."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset >= 13:
        axes = numpy_helper.from_array(np.array([-1], np.int64), f"{_PAD_MASK}_axes")
        graph.initializer.append(axes)
        unsq = _node("Unsqueeze", ["attention_mask", axes.name], [f"{_PAD_MASK}_u"], name="PadMaskUnsq")
    else:
        unsq = _node("Unsqueeze", ["attention_mask"], [f"{_PAD_MASK}_u"], name="PadMaskUnsq", axes=[-1])
    cast = _node("Cast", [f"{_PAD_MASK}_u"], [_PAD_MASK], name="PadMaskCast", to=onnx.TensorProto.FLOAT)
    return [unsq, cast]


class _Rewrite:
    """The graph being rewritten: its initializers, the readers of each value, and the nodes
    to insert before and after each original node's position."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.inits = {i.name: i for i in graph.initializer}
        self.prep = Int8Prep()
        self.before: dict[int, list[Any]] = {}  # node position -> nodes to insert before it
        self.after: dict[int, list[Any]] = {}
        # every reader of each value, once per use (None: a graph output)
        self.consumers: dict[str, list[Any]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        for out in graph.output:
            self.consumers.setdefault(out.name, []).append(None)

    def smooth(
        self,
        key: str,
        x: str,
        cur: str,
        nodes: list[tuple[int, Any]],
        channels: np.ndarray,
        producer: Any,
        alpha: float,
        added: list[Any],
    ) -> tuple[np.ndarray, str]:
        """Scale the input's channels down and the weights' rows up by the same factors
        (folded into the LayerNorm when it is theirs alone). Returns the new ranges and input."""
        import onnx
        from onnx import numpy_helper

        graph, inits = self.graph, self.inits
        weights = [numpy_helper.to_array(inits[n.input[1]]) for _, n in nodes]
        s = _smooth_scales(channels, np.max([np.abs(w).max(axis=1) for w in weights], axis=0), alpha)
        if cur == x and _fold_into_layernorm(producer, s, self.consumers, inits, [n for _, n in nodes]):
            self.prep.folded_inputs += 1
        else:
            graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), f"{key}_smooth"))
            added.append(_node("Mul", [cur, f"{key}_smooth"], [f"{key}_smoothed"], name=f"{key}_SmoothMul"))
            cur = f"{key}_smoothed"
        for j, ((_, node), w) in enumerate(zip(nodes, weights, strict=True)):
            name = node.input[1]
            if len(self.consumers.get(name, ())) > 1:  # shared with another node: the scaled copy is this one's own
                name = f"{key}_{j}_smoothed_w"
                graph.initializer.append(onnx.TensorProto())
                inits[name] = graph.initializer[-1]
                node.input[1] = name
            inits[name].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), name))
        self.prep.smoothed_inputs += 1
        return channels / s, cur

    def split_outliers(self, key: str, cur: str, channels: np.ndarray, idx: np.ndarray, added: list[Any]) -> str:
        """Zero the outlier channels ``idx`` of the int8 input and gather them for a float MatMul."""
        from onnx import numpy_helper

        keep = np.ones(channels.size, np.float32)
        keep[idx] = 0.0
        self.graph.initializer.extend(
            [numpy_helper.from_array(keep, f"{key}_inliers_mask"), numpy_helper.from_array(idx, f"{key}_outliers")]
        )
        added += [
            _node("Mul", [cur, f"{key}_inliers_mask"], [f"{key}_inliers"], name=f"{key}_InlierMul"),
            _node("Gather", [cur, f"{key}_outliers"], [f"{key}_outlier_x"], name=f"{key}_Gather", axis=-1),
        ]
        self.prep.outlier_channels += int(idx.size)
        self.prep.split_inputs += 1
        return f"{key}_inliers"

    def rewire(self, key: str, cur: str, nodes: list[tuple[int, Any]], idx: np.ndarray, added: list[Any]) -> None:
        """Point the MatMuls at the rewritten input; with outliers, add each one's float part."""
        from onnx import numpy_helper

        self.before.setdefault(nodes[0][0], []).extend(added)
        for j, (pos, node) in enumerate(nodes):
            node.input[0] = cur
            if not idx.size:
                continue
            w = numpy_helper.to_array(self.inits[node.input[1]])
            rows = numpy_helper.from_array(np.ascontiguousarray(w[idx]), f"{key}_{j}_outlier_rows")
            self.graph.initializer.append(rows)
            y = node.output[0]
            node.output[0] = f"{key}_{j}_int8_part"
            fm = _node(
                "MatMul", [f"{key}_outlier_x", rows.name], [f"{key}_{j}_float_part"], name=f"{key}_{j}_FloatMatMul"
            )
            add = _node("Add", [node.output[0], fm.output[0]], [y], name=f"{key}_{j}_Add")
            self.after.setdefault(pos, []).extend([fm, add])
            self.prep.float_nodes.append(fm.name)

    def reorder(self, head: list[Any]) -> None:
        order = list(head)
        for pos, node in enumerate(self.graph.node):
            order += [*self.before.get(pos, []), node, *self.after.get(pos, [])]
        del self.graph.node[:]
        self.graph.node.extend(order)
