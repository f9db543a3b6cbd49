"""Tiny ONNX models built with onnx.helper, for runtime tests (no torch needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def echo_model(path: Path) -> Path:
    """Rows encode their inputs exactly, so a misrouted or mixed-up row is detected.

    inputs:  input_ids [batch, sequence] int64, attention_mask [batch, sequence] int64,
             extra [batch, 3] float32
    outputs: hidden [batch, sequence, 2] float32 = (ids, mask)         (ragged)
             pooled [batch, 1] int64 = sum(ids * mask) over sequence (not ragged, exact)
             extra_out [batch, 3] float32 = extra * 2                  (fixed)
    """
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    extra = helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["batch", 3])
    hidden = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "sequence", 2])
    pooled = helper.make_tensor_value_info("pooled", TensorProto.INT64, ["batch", 1])
    extra_out = helper.make_tensor_value_info("extra_out", TensorProto.FLOAT, ["batch", 3])
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    axes_last = numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes_last")
    axes_seq = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes_seq")
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids_f", "axes_last"], ["ids_u"]),
        helper.make_node("Unsqueeze", ["mask_f", "axes_last"], ["mask_u"]),
        helper.make_node("Concat", ["ids_u", "mask_u"], ["hidden"], axis=-1),
        helper.make_node("Mul", ["input_ids", "attention_mask"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axes_seq"], ["pooled"], keepdims=1),
        helper.make_node("Mul", ["extra", "two"], ["extra_out"]),
    ]
    graph = helper.make_graph(
        nodes, "echo", [ids, mask, extra], [hidden, pooled, extra_out], initializer=[two, axes_last, axes_seq]
    )
    return _save(graph, path)


def echo_reference(ids: np.ndarray, mask: np.ndarray, extra: np.ndarray) -> list[np.ndarray]:
    """What echo_model computes, in numpy."""
    hidden = np.stack([ids.astype(np.float32), mask.astype(np.float32)], axis=-1)
    pooled = (ids * mask).sum(axis=1, keepdims=True).astype(np.int64)
    return [hidden, pooled, (extra * 2).astype(np.float32)]


def embed_model(path: Path, vocab: int = 100, dim: int = 4, seed: int = 0) -> Path:
    """A Gather embedding + masked mean: token ids >= vocab make ONNX Runtime fail
    (a real poisoned request). outputs: emb [batch, sequence, dim], mean [batch, dim]."""
    rng = np.random.default_rng(seed)
    table = numpy_helper.from_array(rng.standard_normal((vocab, dim)).astype(np.float32), "table")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    emb = helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", "sequence", dim])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["batch", dim])
    axes_last = numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes_last")
    axes_seq = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes_seq")
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "axes_last"], ["mask_u"]),
        helper.make_node("Mul", ["emb", "mask_u"], ["emb_m"]),
        helper.make_node("ReduceSum", ["emb_m", "axes_seq"], ["emb_sum"], keepdims=0),
        helper.make_node("ReduceSum", ["mask_u", "axes_seq"], ["count"], keepdims=0),
        helper.make_node("Div", ["emb_sum", "count"], ["mean"]),
    ]
    graph = helper.make_graph(nodes, "embed", [ids, mask], [emb, mean], initializer=[table, axes_last, axes_seq])
    return _save(graph, path)


def identity_model(path: Path, width: int = 1) -> Path:
    """x [batch, width] float32 -> y = x. For overhead measurements."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    return _save(graph, path)


def scalar_output_model(path: Path) -> Path:
    """An output without a batch axis: must be refused at construction."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("total", TensorProto.FLOAT, [])
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0)], "scalar", [x], [y])
    return _save(graph, path)


def fixed_batch_model(path: Path) -> Path:
    """A model exported with a fixed batch dimension of 1: must be refused."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "fixed", [x], [y])
    return _save(graph, path)


def image_mean_model(path: Path) -> Path:
    """pixels [batch, 3, H, W] float32 and mask [batch, 1, H, W] float32 ->
    mean [batch, 3]: the per-channel mean over the unmasked pixels."""
    pixels = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 3, "height", "width"])
    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 1, "height", "width"])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["batch", 3])
    axes = numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "axes_hw")
    nodes = [
        helper.make_node("Mul", ["pixels", "mask"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axes_hw"], ["total"], keepdims=0),
        helper.make_node("ReduceSum", ["mask", "axes_hw"], ["count"], keepdims=0),
        helper.make_node("Div", ["total", "count"], ["mean"]),
    ]
    graph = helper.make_graph(nodes, "image_mean", [pixels, mask], [mean], initializer=[axes])
    return _save(graph, path)


def embed_export(directory: Path, passed: bool | None = True) -> Path:
    """An export directory around :func:`embed_model`: model.onnx and an ortbatch.json with
    its sha256 and ``validation.passed`` as given, as the exporter writes them."""
    from ortbatch.manifest import InputSpec, Manifest, OutputSpec, model_hash

    directory.mkdir(parents=True, exist_ok=True)
    embed_model(directory / "model.onnx")
    Manifest(
        inputs={
            "input_ids": InputSpec("int64", ("batch", "sequence"), 0),
            "attention_mask": InputSpec("int64", ("batch", "sequence"), 0),
        },
        outputs={"emb": OutputSpec(("batch", "sequence", None)), "mean": OutputSpec(("batch", None))},
        limits={"max_batch_size": 8},
        validation={"passed": passed, "report": "validation.json"},
        extra={"components": {"model": {"model": "model.onnx", "sha256": model_hash(directory / "model.onnx")}}},
    ).save(directory)
    return directory
