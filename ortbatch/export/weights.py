"""The ``finite_weights`` check: no NaN or Inf anywhere in a model's stored weights.

The other checks run sample texts, so they only see the weights those texts reach: a
damaged embedding table with NaN in the rows of rare tokens passes them all and then
answers NaN for the first request that uses one of those tokens. This check reads every
initializer (and every ``Constant`` node's tensor) of every ONNX file of the export.

NaN fails anywhere. Inf fails in any tensor of more than one value: exporters write
single ``-inf`` (or ``inf``) constants on purpose, as the fill value of attention masks
and the bounds of clips, and a weight matrix never holds one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require

__all__ = ["nonfinite_weights"]

_MAX_LISTED = 5


def nonfinite_weights(path: Path) -> tuple[int, list[str]]:
    """(how many float tensors were read, one line per tensor holding NaN or Inf) for
    the ONNX file ``path`` and its external data. Raises what ``onnx.load`` raises for a
    file that cannot be read."""
    onnx = require("onnx", "export")
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=True)
    tensors: list[Any] = list(model.graph.initializer)
    for node in model.graph.node:
        if node.op_type == "Constant":
            tensors += [a.t for a in node.attribute if a.name == "value" and a.HasField("t")]
    read, bad = 0, []
    for tensor in tensors:
        array = numpy_helper.to_array(tensor)
        if array.dtype.kind not in "fc":
            continue
        read += 1
        finite = np.isfinite(array)
        if finite.all() or (array.size == 1 and not np.isnan(array).any()):
            continue
        nan, inf = int(np.isnan(array).sum()), int((~finite).sum() - np.isnan(array).sum())
        where = ""
        if array.ndim >= 2:  # an embedding table: which rows (token ids) are hit
            rows = np.flatnonzero(~finite.reshape(array.shape[0], -1).all(axis=1))
            listed = ", ".join(map(str, rows[:_MAX_LISTED])) + (", ..." if len(rows) > _MAX_LISTED else "")
            where = f" in {len(rows)} of {array.shape[0]} rows ({listed})"
        bad.append(
            f"initializer {tensor.name or '<constant>'!r} {list(array.shape)}: {nan} NaN and {inf} Inf "
            f"of {array.size} values{where}"
        )
    return read, bad
