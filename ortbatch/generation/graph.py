"""Graph rewrites that make a decoder export cheaper to serve. Needs ``onnx``.

:func:`last_position_logits` makes the LM head run on the last position only. A decoder
export computes logits for every input position, but generation only reads the last one:
on a prefill of ``rows x prompt`` tokens that is ``prompt`` times the LM-head work, and a
``rows x prompt x vocab`` float array to allocate and copy back (6.4 GB for 32 prompts
of 1000 tokens with GPT-2's vocabulary). transformers' own ``generate`` avoids the same
waste with ``logits_to_keep=1``.
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["last_position_logits"]

log = logging.getLogger("ortbatch")

# Serialising a ModelProto is limited to 2 GiB; stay well under it.
_MAX_INLINE_BYTES = 1_800_000_000
_INT64_MAX = 2**63 - 1


def last_position_logits(model_path: str | Path, logits: str = "logits") -> bytes | None:
    """A serialized copy of the model whose ``logits`` output covers the last position only.

    The node producing ``logits`` must be ``MatMul(hidden [batch, seq, hidden], W)`` (as in
    optimum's GPT-2, Llama, Mistral, ... exports); a ``Slice`` taking the last position of
    ``hidden`` is inserted before it, and the output's sequence dim becomes 1. Returns
    ``None`` (and the caller keeps the original model) when ``onnx`` is missing, the model
    keeps its weights in external data files or is too large to serialize, or the graph
    does not have that shape.
    """
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError:
        return None
    import numpy as np

    path = Path(model_path)
    if path.stat().st_size > _MAX_INLINE_BYTES:
        return None
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer):
        return None
    producer = next((n for n in graph.node if logits in n.output), None)
    output = next((o for o in graph.output if o.name == logits), None)
    if producer is None or output is None or producer.op_type != "MatMul" or len(producer.input) != 2:
        log.info("logits are not produced by a MatMul: the LM head keeps running on every position")
        return None
    dims = output.type.tensor_type.shape.dim
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if len(dims) != 3 or opset < 10:  # Slice takes its bounds as inputs from opset 10
        return None

    prefix = "ortbatch_last_position"
    consts = {
        f"{prefix}_starts": np.array([-1], np.int64),
        f"{prefix}_ends": np.array([_INT64_MAX], np.int64),
        f"{prefix}_axes": np.array([1], np.int64),
    }
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    hidden_last = f"{prefix}_hidden"
    slice_node = helper.make_node("Slice", [producer.input[0], *consts], [hidden_last], name=f"/{prefix}/Slice")
    producer.input[0] = hidden_last
    index = list(graph.node).index(producer)
    graph.node.insert(index, slice_node)
    dims[1].Clear()
    dims[1].dim_value = 1
    return bytes(model.SerializeToString())
