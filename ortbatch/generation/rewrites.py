"""Graph rewrites that make a decoder export cheaper to serve. Needs ``onnx``.

:func:`rewrite_decoder` loads the model once and applies, where the graph allows:

- **last-position logits** (:data:`LAST_POSITION_LOGITS`). A decoder export computes
  logits for every input position, but generation only reads the last one: on a prefill
  of ``rows x prompt`` tokens that is ``prompt`` times the LM-head work, and a
  ``rows x prompt x vocab`` float array to allocate and copy back (6.4 GB for 32 prompts
  of 1000 tokens with GPT-2's vocabulary). transformers' own ``generate`` avoids the same
  waste with ``logits_to_keep=1``. A ``Slice`` of the last position is inserted before
  the LM head's ``MatMul``.
- **attention scale after the scores** (:data:`ATTENTION_SCALE`). Exports of
  ``scaled_dot_product_attention`` (optimum's GPT-2, Llama, ...) compute
  ``(q * sqrt(s)) @ (transpose(k) * sqrt(s))``: every step transposes and scales the
  *whole* key cache, ``rows x heads x past x head_dim`` floats per layer, before the
  ``MatMul``. Rewritten as ``((q * sqrt(s)) @ transpose(k)) * sqrt(s)`` (the same
  product: the factor is a scalar), the scale applies to the small score tensor and ONNX
  Runtime fuses the transpose into the ``MatMul`` (``FusedMatMul`` with ``transB``), so
  the cache is read once in place. Measured on GPT-2 small (CPU, 16 rows, 150 cached
  positions): 169 → 113 ms per decode step; at one row, 0.99-1.14x (50-400 cached positions).

- **in-place KV cache** (:data:`~.gqa.IN_PLACE_KV`, asked for with ``in_place=``): every
  layer's ``Concat`` of past and new keys/values and the attention reading it become one
  ``GroupQueryAttention`` over a cache buffer bound as both past and present (see
  :mod:`ortbatch.generation.gqa`). It changes the graph's inputs (the attention mask goes,
  the cache's lengths come in) and puts the LM head on one position per row, so it replaces
  the last-position rewrite; the attention-scale rewrite then has nothing left to move.
  When any layer does not match, :attr:`RewrittenGraph.not_in_place` says why and the other
  rewrites apply as usual.

The first two rewrites leave the inputs and the present outputs unchanged; logits agree with
the unmodified graph to float rounding. A model whose weights live in external data files is
rewritten too: only its graph is loaded, and the rewritten graph is written to a temporary
file beside the original (ONNX Runtime only reads external data from the model's own
directory), to be removed with :meth:`RewrittenGraph.close` once a session has loaded it.
A model with its weights inline is written to a temporary file too (beside the original, or
in the system's temporary directory), a piece at a time (:func:`write_model`): serialized to
``bytes`` it would cost three times its size while loading, and ``onnxruntime`` keeps a
session's model bytes for as long as the session lives (a second copy of the weights).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .gqa import IN_PLACE_KV, CacheSpec, NotRewritable, rewrite_in_place

__all__ = [
    "ATTENTION_SCALE",
    "IN_PLACE_KV",
    "LAST_POSITION_LOGITS",
    "RewrittenGraph",
    "check_in_place",
    "rewrite_decoder",
    "write_model",
]

log = logging.getLogger("ortbatch")

LAST_POSITION_LOGITS = "last-position-logits"
ATTENTION_SCALE = "attention-scale-after-scores"

# Serialising a ModelProto is limited to 2 GiB; stay well under it.
_MAX_INLINE_BYTES = 1_800_000_000
_INT64_MAX = 2**63 - 1
# Initializers above this many elements become plain inputs in the copy that shape
# inference reads (it only needs their shapes; copying the weights costs seconds).
_SMALL_INITIALIZER = 4096
# write_model writes initializers over this size one at a time, smaller ones in groups.
_PIECE_BYTES = 16 << 20


@dataclass(frozen=True)
class RewrittenGraph:
    """A rewritten model, ready for ``onnxruntime.InferenceSession``."""

    model: bytes | str
    """The path of the rewritten graph, a temporary file (see :meth:`close`), or where no
    file could be written, the serialized ``ModelProto``."""
    rewrites: dict[str, int] = field(default_factory=dict)
    """Each rewrite applied and how many places it changed (e.g. one per layer)."""
    not_in_place: str = ""
    """Why the in-place KV cache rewrite, when asked for, did not apply (empty when it did)."""
    folder: str = ""
    """A temporary folder made to hold :attr:`model` alone, removed with it (empty: none)."""

    def close(self) -> None:
        """Remove the temporary graph file (and its folder), if any; call once the session
        is created (ONNX Runtime does not read the graph file again)."""
        if isinstance(self.model, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.model)
        if self.folder:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)

    def __enter__(self) -> RewrittenGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite_decoder(
    model_path: str | Path,
    *,
    logits: str = "logits",
    last_position: bool = True,
    attention: bool = True,
    in_place: CacheSpec | None = None,
) -> RewrittenGraph | None:
    """Apply the rewrites asked for where the graph allows them (see the module docs);
    ``in_place`` names the cache tensors for the in-place KV cache rewrite.

    Returns ``None`` (the caller keeps the original model) when ``onnx`` is missing, an
    inline model is too large to serialize, a model with external data sits in a directory
    that cannot be written to, or no rewrite applies.
    """
    try:
        import onnx
    except ImportError:
        return None

    path = Path(model_path)
    # A graph file this large holds its weights inline (the graph alone is small): over
    # protobuf's limit once rewritten, so it runs as it is.
    if path.stat().st_size > _MAX_INLINE_BYTES:
        return None
    done: dict[str, int] = {}
    not_in_place = "" if in_place is not None else "not asked for"
    try:
        model = onnx.load(str(path), load_external_data=False)
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        if in_place is not None:
            try:
                done[IN_PLACE_KV] = rewrite_in_place(model, in_place, _inferred_shapes(model, data_prop=True))
                done[LAST_POSITION_LOGITS] = 1
            except NotRewritable as exc:
                not_in_place = str(exc)
                log.info("%s: the KV cache stays the export's own (%s)", path, exc)
        if last_position and IN_PLACE_KV not in done and _last_position_logits(model, logits):
            done[LAST_POSITION_LOGITS] = 1
        if attention and IN_PLACE_KV not in done:
            count = _attention_scale_after_scores(model)
            if count:
                done[ATTENTION_SCALE] = count
    except Exception as exc:  # a graph onnx cannot read or rewrite: ONNX Runtime judges it as it is
        log.warning("%s: graph rewrites skipped (%s: %s)", path, type(exc).__name__, exc)
        return None
    if not done:
        return None
    # External data locations are relative to the graph file: only beside the original will
    # do. A graph with its weights inline goes there too (usually a disk, where the system's
    # temporary directory may be memory), else to that temporary directory, else to bytes.
    places = [path.parent] if external else [path.parent, None]
    for place in places:
        try:
            tmp, folder = _write_temporary(model, path, place, external)
            return RewrittenGraph(tmp, done, not_in_place, folder)
        except OSError as exc:
            log.info("cannot write a rewritten graph to %s (%s)", place or tempfile.gettempdir(), exc)
    if external:
        log.info("%s: the rewritten graph could not be written beside its data: it runs as it is", path)
        return None
    return RewrittenGraph(model.SerializeToString(), done, not_in_place)


def _write_temporary(model: Any, path: Path, place: Path | None, external: bool) -> tuple[str, str]:
    """Write ``model`` to a new temporary file in ``place`` (``None``: the system's temporary
    directory), a piece at a time (:func:`write_model`); returns its path and the folder
    made for it (``""``: none).

    A graph with inline weights is written under the original's own file name, in a folder
    of its own: TensorRT's engine cache keys a graph by its file name, which must not change
    from one load to the next. One with external data must sit beside that data: a file of
    its own name there."""
    prefix = f".{path.stem}.ortbatch-"
    if external:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".onnx", dir=place)
        folder = ""
        os.close(fd)
    else:
        folder = tempfile.mkdtemp(prefix=prefix, dir=place)
        tmp = os.path.join(folder, path.name)
    try:
        with open(tmp, "wb") as f:
            write_model(model, f)
    except BaseException:
        RewrittenGraph(tmp, folder=folder).close()
        raise
    return tmp, folder


def write_model(model: Any, file: BinaryIO) -> None:
    """Write ``model`` (an ``onnx.ModelProto``) to ``file`` as ``SerializeToString`` would,
    one piece at a time, so that no buffer holds the whole model.

    Serializing a model in one call costs about three times its size on top of the model
    (protobuf grows its buffer by doubling, then copies it into a ``bytes``): 2.4 GB for
    GPT-2 small's 650 MB, the peak of loading a generator. Written in pieces (the model
    without its graph, the graph without its initializers, then the initializers in their
    order, each large one alone) it costs about the largest weight. Protobuf merges
    a message field met more than once and appends to repeated fields, so the file parses
    back to an equal model (``onnx.load(file) == model``).
    """
    graph_field = type(model).DESCRIPTOR.fields_by_name["graph"]
    initializer = type(model.graph).DESCRIPTOR.fields_by_name["initializer"].number
    if not model.HasField(graph_field.name):
        file.write(model.SerializeToString())
        return

    def graph_piece(parts: list[bytes]) -> None:
        """A graph message made of ``parts``, as a piece of the model."""
        file.write(_field_head(graph_field.number, sum(map(len, parts))))
        file.writelines(parts)

    file.write(_copy_without(model, graph_field.name).SerializeToString())
    graph_piece([_copy_without(model.graph, "initializer").SerializeToString()])
    small: list[bytes] = []  # consecutive small initializers, written as one piece
    small_bytes = 0

    def flush() -> None:
        nonlocal small_bytes
        if small:
            graph_piece(small)
            small.clear()
            small_bytes = 0

    for tensor in model.graph.initializer:
        # Not tensor.ByteSize(): protobuf's Python binding serializes the tensor to count it.
        if _data_bytes(tensor) <= _PIECE_BYTES:
            data = tensor.SerializeToString()
            small += [_field_head(initializer, len(data)), data]
            small_bytes += len(data)
            if small_bytes > _PIECE_BYTES:
                flush()
            continue
        flush()
        # A piece of its own; its weights are freed before the next tensor's are read.
        pieces = _tensor_pieces(tensor)
        graph_piece([_field_head(initializer, sum(map(len, pieces))), *pieces])
        del pieces
    flush()


def _data_bytes(tensor: Any) -> int:
    """How many bytes ``tensor``'s elements take (an estimate: 8 per element of a type numpy
    does not size), without reading them."""
    import numpy as np
    from onnx import helper

    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 8
    return math.prod(tensor.dims) * itemsize


def _tensor_pieces(tensor: Any) -> list[bytes]:
    """``tensor`` serialized as consecutive pieces: its fields but ``raw_data``, then
    ``raw_data`` itself, so that the weights are copied once (``tensor.SerializeToString()``
    holds them about four times over while it runs); a tensor without ``raw_data`` whole."""
    raw_field = type(tensor).DESCRIPTOR.fields_by_name["raw_data"]
    if not tensor.HasField(raw_field.name):
        return [tensor.SerializeToString()]
    raw = tensor.raw_data
    return [_copy_without(tensor, raw_field.name).SerializeToString(), _field_head(raw_field.number, len(raw)), raw]


def _copy_without(message: Any, skipped: str) -> Any:
    """A new message of ``message``'s type with every set field but ``skipped`` copied."""
    copy = type(message)()
    for descriptor in message.DESCRIPTOR.fields:  # not ListFields(): it would read ``skipped`` too
        if descriptor.name == skipped or not _is_set(message, descriptor):
            continue
        value = getattr(message, descriptor.name)
        if _is_repeated(descriptor):
            getattr(copy, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            getattr(copy, descriptor.name).CopyFrom(value)
        else:
            setattr(copy, descriptor.name, value)
    return copy


def _is_set(message: Any, descriptor: Any) -> bool:
    if _is_repeated(descriptor):
        return len(getattr(message, descriptor.name)) > 0
    return bool(message.HasField(descriptor.name))  # ONNX's messages are proto2: every field has presence


def _is_repeated(descriptor: Any) -> bool:
    if hasattr(type(descriptor), "is_repeated"):  # protobuf >= 6.31, where ``label`` is deprecated
        return bool(descriptor.is_repeated)
    return bool(descriptor.label == descriptor.LABEL_REPEATED)


def _field_head(number: int, size: int) -> bytes:
    """The wire-format head of length-delimited field ``number`` whose payload is ``size`` bytes."""
    return _varint(number << 3 | 2) + _varint(size)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def check_in_place(model_path: str | Path, spec: CacheSpec) -> str:
    """Why the in-place KV cache rewrite would not apply to the graph (``""``: it would),
    rewriting nothing. Needs ``onnx`` (without it: a reason saying so)."""
    try:
        import onnx
    except ImportError:
        return "the onnx package is not installed"
    try:
        model = onnx.load(str(model_path), load_external_data=False)
        rewrite_in_place(model, spec, _inferred_shapes(model, data_prop=True), check_only=True)
    except NotRewritable as exc:
        return str(exc)
    except Exception as exc:  # a graph onnx cannot read: ONNX Runtime judges it at load
        return f"{type(exc).__name__}: {exc}"
    return ""


def _last_position_logits(model: Any, logits: str) -> bool:
    """Insert a ``Slice`` of the last position before the ``MatMul`` producing ``logits``
    (directly, or through casts, as in fp16 exports with float32 outputs)."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    producers, readers = _wiring(graph.node, graph.output)
    producer = producers.get(logits)
    output = next((o for o in graph.output if o.name == logits), None)
    # An fp16 export that keeps float32 outputs ends in Cast(MatMul(...)): look through
    # element-wise casts that nothing else reads.
    while (
        producer is not None
        and producer.op_type in ("Cast", "Identity")
        and readers.get(producer.input[0], 0) == 1
        and producer.input[0] in producers
    ):
        producer = producers[producer.input[0]]
    if producer is None or output is None or producer.op_type != "MatMul" or len(producer.input) != 2:
        log.info("logits are not produced by a MatMul: the LM head keeps running on every position")
        return False
    dims = output.type.tensor_type.shape.dim
    if len(dims) != 3 or _opset(model) < 10:  # Slice takes its bounds as inputs from opset 10
        return False

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
    return True


def _attention_scale_after_scores(model: Any) -> int:
    """Rewrite ``MatMul(a, Mul(Transpose(k, swap last two), s))`` with a one-element ``s``
    into ``Mul(MatMul(a, Transpose(k)), s)``; returns how many were rewritten."""
    graph = model.graph
    nodes = list(graph.node)
    producer, consumers = _wiring(nodes, graph.output)

    def only_reader(name: str) -> bool:
        return consumers.get(name, 0) == 1

    candidates = []  # (matmul, mul, transpose output, scale)
    for matmul in nodes:
        if matmul.op_type != "MatMul" or matmul.domain not in ("", "ai.onnx"):
            continue
        mul = producer.get(matmul.input[1])
        if mul is None or mul.op_type != "Mul" or not only_reader(mul.output[0]):
            continue
        for k in (0, 1):
            transpose = producer.get(mul.input[k])
            if transpose is not None and _swaps_last_two(transpose) and only_reader(transpose.output[0]):
                candidates.append((matmul, mul, transpose.output[0], mul.input[1 - k]))
                break
    if not candidates:
        return 0
    shapes = _inferred_shapes(model)
    moved: dict[int, Any] = {}  # id(matmul) -> the Mul now placed right after it
    for matmul, mul, transposed, scale in candidates:
        shape = shapes.get(scale)
        if shape is None or any(d != 1 for d in shape):
            continue  # not provably one element: it might not commute with the MatMul
        scores = matmul.output[0]
        unscaled = f"{scores}_ortbatch_unscaled"
        matmul.input[1] = transposed
        matmul.output[0] = unscaled
        del mul.input[:]
        mul.input.extend([unscaled, scale])
        mul.output[0] = scores
        moved[id(matmul)] = mul
    if not moved:
        return 0
    # Keep the node list topologically sorted: each moved Mul now follows its MatMul.
    after = {id(m) for m in moved.values()}
    order = []
    for n in nodes:
        if id(n) in after:
            continue
        order.append(n)
        if id(n) in moved:
            order.append(moved[id(n)])
    copies = [type(n).FromString(n.SerializeToString()) for n in order]
    del graph.node[:]
    graph.node.extend(copies)
    return len(moved)


def _wiring(nodes: Any, outputs: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """The node producing each value, and how many readers each value has (a graph
    output counts as one: a value the caller sees must not change shape)."""
    producers = {out: n for n in nodes for out in n.output}
    readers: dict[str, int] = {}
    for n in nodes:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    for out in outputs:
        readers[out.name] = readers.get(out.name, 0) + 1
    return producers, readers


def _swaps_last_two(node: Any) -> bool:
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    if not perm or len(perm) < 2:
        return False
    rank = len(perm)
    return perm == [*range(rank - 2), rank - 1, rank - 2]


def _inferred_shapes(model: Any, data_prop: bool = False) -> dict[str, list[int | None]]:
    """Static shapes (``None`` for a symbolic dim) of the graph's values, by ONNX shape
    inference on a copy whose large weights are plain inputs (only their shapes matter);
    ``data_prop`` also follows shape computations (``Shape``, ``Gather``, ``Concat``, ...)."""
    import onnx
    from onnx import helper

    graph = model.graph
    small = [t for t in graph.initializer if math.prod(t.dims) <= _SMALL_INITIALIZER]
    declared = {i.name for i in graph.input}
    large = [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in graph.initializer
        if math.prod(t.dims) > _SMALL_INITIALIZER and t.name not in declared
    ]
    light_graph = helper.make_graph(
        list(graph.node), graph.name, [*graph.input, *large], list(graph.output), initializer=small
    )
    light = helper.make_model(light_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=data_prop)
    except Exception as exc:  # inference is best effort: without shapes nothing is rewritten
        log.info("shape inference failed (%s): the attention scale stays where it is", exc)
        return {}
    shapes: dict[str, list[int | None]] = {}
    for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    for t in small:
        shapes[t.name] = list(t.dims)
    for n in graph.node:
        if n.op_type == "Constant":
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None:
                shapes[n.output[0]] = list(value.dims)
    return shapes


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
