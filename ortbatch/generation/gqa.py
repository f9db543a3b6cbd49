"""The in-place KV cache rewrite: exported attention into ONNX Runtime's GroupQueryAttention.

A decoder export appends each step's keys and values to the cache with
``present = Concat(past, new)``: every step allocates and copies the whole cache, of every
layer. :func:`rewrite_in_place` replaces, in every layer, that ``Concat`` and the attention
that reads it (``MatMul(q, K^T)``, the scale, the mask ``Add``, ``Softmax``,
``MatMul(p, V)``, with grouped-KV repeats) by one ``com.microsoft.GroupQueryAttention``
node whose ``past_key``/``past_value`` inputs and ``present_key``/``present_value``
outputs are meant to be bound to the same preallocated buffer: ONNX Runtime's CPU kernel
then writes only the new positions (``past_present_share_buffer``, as onnxruntime-genai
runs its own models) and reads, per row, only that row's own length.

What changes for the caller (the runner): the cache is right-padded (row ``b`` holds its
tokens in columns ``[0, len_b)``) and has a fixed capacity; the attention mask input goes
(causality and each row's length come from the new inputs :data:`SEQLENS_K`,
:data:`TOTAL_LENGTH` and :data:`QUERY_LENGTHS`, with ``GroupQueryAttention``'s meaning);
positions still come from ``position_ids``; and the LM head runs on the one position per
row named by :data:`LAST_INDEX` (a flat index into ``rows x sequence``), since right-padded
rows end at different columns.

The rewrite is all-or-nothing: every layer must match the pattern below exactly, or the
graph is left alone and :class:`NotRewritable` says why (the runner then keeps the
export's own concatenating cache):

- ``present.N.key = Concat(past.N.key, k_new, axis=-2)``, likewise the value;
- the key cache reaches the scores ``MatMul`` as its second input through one transpose of
  its last two axes, grouped-KV repeats (``Unsqueeze``/``Expand``/``Reshape``) and scalar
  ``Mul`` s; the value cache reaches the output ``MatMul`` through repeats only;
- between the two ``MatMul`` s: scalar ``Mul``/``Div`` s, one ``Add`` of a mask computed
  from the attention mask, ``Softmax`` on the last axis and, optionally, the
  ``Where(IsNaN(p), 0, p)`` guard of SDPA exports.

Scalar factors are moved onto the query (``GroupQueryAttention`` then runs with
``scale=1``), so the scores are the export's own product. Anything else between them (a
soft cap, an ALiBi bias the mask does not come from, a sliding window) does not match.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CAPACITY_DIM",
    "IN_PLACE_KV",
    "LAST_INDEX",
    "MIN_ONNXRUNTIME",
    "QUERY_LENGTHS",
    "SEQLENS_K",
    "TOTAL_LENGTH",
    "CacheSpec",
    "NotRewritable",
    "cache_spec",
    "onnxruntime_too_old",
    "rewrite_in_place",
]

IN_PLACE_KV = "in-place-kv-cache"
SEQLENS_K = "ortbatch_seqlens_k"
TOTAL_LENGTH = "ortbatch_total_sequence_length"
QUERY_LENGTHS = "ortbatch_query_seqlens"
LAST_INDEX = "ortbatch_last_token_index"
CAPACITY_DIM = "cache_capacity"

_REPEATS = ("Unsqueeze", "Expand", "Reshape")
_PREFIX = "ortbatch_gqa"


#: The first onnxruntime whose ``GroupQueryAttention`` takes ``query_seqlens`` (its 17th
#: input, which the rewrite uses); 1.31's schema stops at 16 and refuses the graph.
MIN_ONNXRUNTIME = (1, 32)


def onnxruntime_too_old(version: str) -> str:
    """Why ``version`` of onnxruntime cannot run the rewritten graph (``""``: it can)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) >= MIN_ONNXRUNTIME:
        return ""
    need = ".".join(map(str, MIN_ONNXRUNTIME))
    return (
        f"the in-place cache needs onnxruntime >= {need} (GroupQueryAttention's query_seqlens input); this is {version}"
    )


class NotRewritable(Exception):
    """The graph does not have the attention pattern the in-place rewrite needs."""


@dataclass(frozen=True)
class CacheSpec:
    """The cache tensors of a decoder and what the rewrite needs to know of them."""

    past_keys: Sequence[str]
    past_values: Sequence[str]
    present_keys: Sequence[str]
    present_values: Sequence[str]
    num_kv_heads: int
    head_dim: int
    attention_mask: str = "attention_mask"
    logits: str = "logits"
    #: from config.json; used when shape inference cannot tell the query's head count
    num_heads: int | None = None


@dataclass
class _Layer:
    """One layer's match: what feeds the new node, and the nodes it replaces."""

    index: int
    past_k: str
    past_v: str
    present_k: str
    present_v: str
    k_new: str
    v_new: str
    q: str
    out: str
    num_heads: int
    factors: list[tuple[str, str]] = field(default_factory=list)  # ("Mul" | "Div", scalar)
    replaced: list[Any] = field(default_factory=list)


class _Graph:
    """Who produces and who reads each value, and the static shapes of values."""

    def __init__(self, graph: Any, shapes: dict[str, list[int | None]]) -> None:
        self.graph = graph
        self.shapes = shapes
        self.producer = {out: n for n in graph.node for out in n.output}
        self.readers: dict[str, list[Any]] = {}
        for n in graph.node:
            for name in n.input:
                self.readers.setdefault(name, []).append(n)

    def data_readers(self, name: str) -> list[Any]:
        """Readers of ``name`` other than ``Shape`` (those read no data and die with the rewrite or stay harmless)."""
        return [n for n in self.readers.get(name, []) if n.op_type != "Shape"]

    def only_reader(self, name: str) -> Any:
        readers = self.data_readers(name)
        if len(readers) != 1:
            raise NotRewritable(f"{name} is read by {len(readers)} nodes; the pattern needs exactly one")
        return readers[0]

    def scalar(self, name: str) -> bool:
        shape = self.shapes.get(name)
        return shape is not None and all(d == 1 for d in shape)

    def other_input(self, node: Any, name: str) -> str:
        others = [i for i in node.input if i != name]
        if len(node.input) != 2 or len(others) != 1:
            raise NotRewritable(f"{node.op_type} {node.name} does not take {name} and one other input")
        return str(others[0])


def cache_spec(layout: Any, config: Mapping[str, Any]) -> CacheSpec:
    """The :class:`CacheSpec` of a :class:`~.layout.GenerationLayout` and its ``config.json``;
    :class:`NotRewritable` for what the in-place cache cannot serve whatever the graph: no
    ``position_ids`` input (positions would be counted from a mask it no longer has), or a
    sliding attention window (``GroupQueryAttention`` would need it as an attribute, and the
    exported mask is the only record of it)."""
    if not layout.position_ids:
        raise NotRewritable("the graph has no position_ids input")
    window = config.get("sliding_window")
    if isinstance(window, int) and window < layout.max_context_length and config.get("use_sliding_window", True):
        raise NotRewritable(f"sliding-window attention ({window} positions)")
    heads = next(
        (config[k] for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(config.get(k), int)), None
    )
    return CacheSpec(
        layout.past_keys,
        layout.past_values,
        layout.present_keys,
        layout.present_values,
        layout.num_kv_heads,
        layout.head_dim,
        attention_mask=layout.attention_mask,
        logits=layout.logits,
        num_heads=heads,
    )


def rewrite_in_place(model: Any, spec: CacheSpec, shapes: dict[str, list[int | None]], check_only: bool = False) -> int:
    """Rewrite every layer's attention of ``model`` (a ``ModelProto``, changed in place) into
    ``GroupQueryAttention`` over a shared cache buffer, and its LM head onto
    :data:`LAST_INDEX`; returns the number of layers. ``shapes``: static shapes of the
    graph's values (shape inference with data propagation). Raises :class:`NotRewritable`,
    leaving ``model`` unchanged, when any layer does not match. ``check_only``: match, but
    leave ``model`` as it is."""
    g = _Graph(model.graph, shapes)
    layers = [_match_layer(g, spec, i) for i in range(len(spec.past_keys))]
    head = _match_lm_head(g, spec.logits)
    nodes = _new_nodes(g, spec, layers)
    _check_dead(g, spec, nodes, layers)
    if not check_only:
        _commit(model, spec, nodes, layers, head)
    return len(layers)


# -- matching ------------------------------------------------------------------------------
def _match_layer(g: _Graph, spec: CacheSpec, i: int) -> _Layer:
    names = (spec.past_keys[i], spec.past_values[i], spec.present_keys[i], spec.present_values[i])
    past_k, past_v, present_k, present_v = names
    k_new = _appended(g, past_k, present_k)
    v_new = _appended(g, past_v, present_v)
    layer = _Layer(i, past_k, past_v, present_k, present_v, k_new, v_new, q="", out="", num_heads=0)
    qk, k_input = _key_path(g, layer)
    layer.q = str(qk.input[0])
    probs = _scores_path(g, layer, qk)
    av = g.only_reader(probs)
    if av.op_type != "MatMul" or av.input[0] != probs:
        raise NotRewritable(f"layer {i}: the attention probabilities feed {av.op_type}, not the value MatMul")
    _value_path(g, layer, av)
    layer.out = str(av.output[0])
    layer.replaced.append(av)
    layer.num_heads = _heads(g, spec, [str(qk.output[0]), layer.q, k_input], i)
    return layer


def _appended(g: _Graph, past: str, present: str) -> str:
    """The new positions ``Concat(past, new)`` appends to make ``present``."""
    cat = g.producer.get(present)
    if cat is None or cat.op_type != "Concat" or len(cat.input) != 2 or cat.input[0] != past:
        raise NotRewritable(f"{present} is not Concat({past}, new)")
    axis = next((a.i for a in cat.attribute if a.name == "axis"), None)
    if axis not in (2, -2):
        raise NotRewritable(f"{present} concatenates on axis {axis}, not the sequence axis")
    if g.data_readers(past) != [cat]:
        raise NotRewritable(f"{past} is read by more than its Concat")
    return str(cat.input[1])


def _key_path(g: _Graph, layer: _Layer) -> tuple[Any, str]:
    """Follow the key cache to the scores ``MatMul``; returns it and its key input."""
    t, transposed = layer.present_k, False
    layer.replaced.append(g.producer[layer.present_k])
    while True:
        n = g.only_reader(t)
        if n.op_type in _REPEATS and n.input[0] == t:
            pass
        elif _swaps_last_two(n) and not transposed:
            transposed = True
        elif n.op_type == "Mul" and g.scalar(g.other_input(n, t)):
            layer.factors.append(("Mul", g.other_input(n, t)))
        elif n.op_type == "MatMul" and transposed and n.input[1] == t and n.input[0] != t:
            layer.replaced.append(n)
            return n, t
        else:
            raise NotRewritable(f"layer {layer.index}: the key cache reaches {n.op_type} {n.name}")
        layer.replaced.append(n)
        t = n.output[0]


def _scores_path(g: _Graph, layer: _Layer, qk: Any) -> str:
    """Follow the scores from ``qk`` to the attention probabilities; returns their name."""
    t, masked = str(qk.output[0]), False
    while True:
        n = g.only_reader(t)
        if n.op_type in ("Mul", "Div") and n.input[0] == t and g.scalar(n.input[1]):
            layer.factors.append((n.op_type, str(n.input[1])))
        elif n.op_type == "Mul" and n.input[1] == t and g.scalar(n.input[0]):
            layer.factors.append(("Mul", str(n.input[0])))
        elif n.op_type == "Add" and not masked:
            _check_mask(g, g.other_input(n, t), layer.index)
            masked = True
        elif n.op_type == "Softmax" and masked:
            axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
            if axis not in (-1, 3):
                raise NotRewritable(f"layer {layer.index}: Softmax on axis {axis}")
            layer.replaced.append(n)
            return _nan_guard(g, layer, str(n.output[0]))
        else:
            raise NotRewritable(f"layer {layer.index}: the scores reach {n.op_type} {n.name}")
        layer.replaced.append(n)
        t = n.output[0]


def _nan_guard(g: _Graph, layer: _Layer, probs: str) -> str:
    """Step over SDPA's ``Where(IsNaN(p), 0, p)`` (fully masked rows; ``GroupQueryAttention``
    has none: every row sees at least its own token)."""
    readers = g.readers.get(probs, [])
    if len(readers) != 2:
        return probs
    isnan = next((n for n in readers if n.op_type == "IsNaN"), None)
    where = next((n for n in readers if n.op_type == "Where"), None)
    if isnan is None or where is None or list(where.input) != [isnan.output[0], where.input[1], probs]:
        raise NotRewritable(f"layer {layer.index}: the attention probabilities are read by {len(readers)} nodes")
    if len(g.readers.get(isnan.output[0], [])) != 1:
        raise NotRewritable(f"layer {layer.index}: the NaN guard is read elsewhere")
    layer.replaced += [isnan, where]
    return str(where.output[0])


def _value_path(g: _Graph, layer: _Layer, av: Any) -> None:
    t = layer.present_v
    layer.replaced.append(g.producer[layer.present_v])
    while True:
        n = g.only_reader(t)
        if n is av and av.input[1] == t:
            return
        if n.op_type not in _REPEATS or n.input[0] != t:
            raise NotRewritable(f"layer {layer.index}: the value cache reaches {n.op_type} {n.name}")
        layer.replaced.append(n)
        t = n.output[0]


def _check_mask(g: _Graph, mask: str, index: int) -> None:
    """The added term must be the attention mask's (causal and padding) bias: computed from
    the mask input and shapes, with no weight of its own (an ALiBi bias has slopes)."""
    seen, todo, from_mask = set(), [mask], False
    inits = {t.name: t for t in g.graph.initializer}
    graph_inputs = {i.name for i in g.graph.input}
    while todo:
        name = todo.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in inits:
            if math.prod(inits[name].dims) > 1 and inits[name].data_type in (1, 10, 11, 16):
                raise NotRewritable(f"layer {index}: the attention bias reads the weight {name}")
            continue
        if name in graph_inputs:
            from_mask = from_mask or name == "attention_mask"
            continue
        node = g.producer.get(name)
        if node is not None and node.op_type != "Shape":  # a shape carries no values
            todo.extend(node.input)
    if not from_mask:
        raise NotRewritable(f"layer {index}: the term added to the scores is not computed from the attention mask")


def _heads(g: _Graph, spec: CacheSpec, values: list[str], index: int) -> int:
    """The query's head count: axis 1 of the scores or the query, else the config's, else
    the keys' after their grouped-KV repeat (multi-query exports broadcast a single key head
    against the query's, so the keys alone can undercount)."""
    found = [shape[1] for shape in (g.shapes.get(v) for v in values[:2]) if shape and len(shape) == 4]
    found.append(spec.num_heads)
    keys = g.shapes.get(values[2])
    found.append(keys[1] if keys and len(keys) == 4 else None)
    heads = next((h for h in found if isinstance(h, int) and h > 0), None)
    if heads is None or heads % spec.num_kv_heads:
        raise NotRewritable(f"layer {index}: cannot tell the number of query heads ({heads})")
    return heads


def _match_lm_head(g: _Graph, logits: str) -> Any:
    """The ``MatMul`` computing the logits (through casts), to run on one position per row."""
    producer = g.producer.get(logits)
    while producer is not None and producer.op_type in ("Cast", "Identity") and producer.input[0] in g.producer:
        if len(g.readers.get(producer.input[0], [])) != 1:
            break
        producer = g.producer[producer.input[0]]
    if producer is None or producer.op_type != "MatMul":
        raise NotRewritable("the logits are not computed by a MatMul")
    return producer


def _swaps_last_two(node: Any) -> bool:
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return perm == [0, 1, 3, 2]


# -- the new graph ---------------------------------------------------------------------------
def _new_nodes(g: _Graph, spec: CacheSpec, layers: list[_Layer]) -> list[Any]:
    """The graph's node list with each layer's attention replaced (topologically sorted: the
    new nodes take the place of the value ``MatMul``, after everything they read)."""
    from onnx import helper

    replaced = {id(n) for layer in layers for n in layer.replaced}
    at = {id(layer.replaced[-1]): layer for layer in layers}
    nodes: list[Any] = []
    for n in g.graph.node:
        layer = at.get(id(n))
        if layer is not None:
            nodes += _attention_nodes(helper, spec, layer)
        elif id(n) not in replaced:
            nodes.append(n)
    return _live(nodes, [o.name for o in g.graph.output])


def _attention_nodes(helper: Any, spec: CacheSpec, layer: _Layer) -> list[Any]:
    p = f"/{_PREFIX}/layer{layer.index}"
    nodes = []
    q = layer.q
    for j, (op, scalar) in enumerate(layer.factors):
        nodes.append(helper.make_node(op, [q, scalar], [f"{p}/q_scaled{j}"], name=f"{p}/Scale{j}"))
        q = f"{p}/q_scaled{j}"
    packed = []
    for what, bnsh in (("q", q), ("k", layer.k_new), ("v", layer.v_new)):
        nodes.append(
            helper.make_node("Transpose", [bnsh], [f"{p}/{what}_bsnh"], name=f"{p}/{what}T", perm=[0, 2, 1, 3])
        )
        nodes.append(helper.make_node("Reshape", [f"{p}/{what}_bsnh", f"{_PREFIX}_bsd"], [f"{p}/{what}_bsd"]))
        packed.append(f"{p}/{what}_bsd")
    gqa_inputs = [*packed, layer.past_k, layer.past_v, SEQLENS_K, TOTAL_LENGTH, *[""] * 9, QUERY_LENGTHS]
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            gqa_inputs,
            [f"{p}/out_bsd", layer.present_k, layer.present_v],
            name=f"{p}/GroupQueryAttention",
            domain="com.microsoft",
            num_heads=layer.num_heads,
            kv_num_heads=spec.num_kv_heads,
            scale=1.0,
        )
    )
    nodes.append(helper.make_node("Reshape", [f"{p}/out_bsd", f"{_PREFIX}_bsnh"], [f"{p}/out_bsnh"]))
    nodes.append(helper.make_node("Transpose", [f"{p}/out_bsnh"], [layer.out], name=f"{p}/outT", perm=[0, 2, 1, 3]))
    return nodes


def _live(nodes: list[Any], outputs: list[str]) -> list[Any]:
    """``nodes`` without those no graph output depends on."""
    needed = set(outputs)
    keep = []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in n.input if i)
    return keep[::-1]


def _check_dead(g: _Graph, spec: CacheSpec, nodes: list[Any], layers: list[_Layer]) -> None:
    """After the rewrite the cache and the mask must be read by the attention nodes only."""
    reads: dict[str, list[str]] = {}
    for n in nodes:
        for i in n.input:
            reads.setdefault(i, []).append(n.op_type)
    for layer in layers:
        for name in (layer.past_k, layer.past_v):
            if reads.get(name) != ["GroupQueryAttention"]:
                raise NotRewritable(f"{name} is still read by {reads.get(name)} after the rewrite")
        for name in (layer.present_k, layer.present_v):
            if name in reads:
                raise NotRewritable(f"{name} is still read by {reads[name]} after the rewrite")
    if spec.attention_mask in reads:
        raise NotRewritable(f"{spec.attention_mask} is still read by {reads[spec.attention_mask]} beyond attention")


def _commit(model: Any, spec: CacheSpec, nodes: list[Any], layers: list[_Layer], head: Any) -> None:
    """Write the new node list, inputs and constants into ``model``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    consts = {f"{_PREFIX}_bsd": [0, 0, -1], f"{_PREFIX}_bsnh": [0, 0, -1, spec.head_dim], f"{_PREFIX}_one": [1]}
    graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items())
    _insert_lm_head(helper, model, head, nodes)
    copies = [type(n).FromString(n.SerializeToString()) for n in nodes]
    del graph.node[:]
    graph.node.extend(copies)
    kept_inputs = [i for i in graph.input if i.name != spec.attention_mask]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    graph.input.extend(
        [
            helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, ["batch_size"]),
            helper.make_tensor_value_info(TOTAL_LENGTH, TensorProto.INT32, []),
            helper.make_tensor_value_info(QUERY_LENGTHS, TensorProto.INT32, ["batch_size"]),
            helper.make_tensor_value_info(LAST_INDEX, TensorProto.INT64, ["batch_size"]),
        ]
    )
    cache = {n for layer in layers for n in (layer.past_k, layer.past_v, layer.present_k, layer.present_v)}
    for value in [*graph.input, *graph.output]:
        if value.name in cache:
            value.type.tensor_type.shape.dim[2].Clear()
            value.type.tensor_type.shape.dim[2].dim_param = CAPACITY_DIM
        elif value.name == spec.logits:
            value.type.tensor_type.shape.dim[1].Clear()
            value.type.tensor_type.shape.dim[1].dim_value = 1
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.value_info[:]


def _insert_lm_head(helper: Any, model: Any, head: Any, nodes: list[Any]) -> None:
    """Make the LM head read one position per row: ``hidden`` ``[rows, seq, d]`` is
    flattened and the rows' :data:`LAST_INDEX` positions gathered (``[rows, 1, d]``); the
    new nodes go into ``nodes`` right before the head."""
    p = f"/{_PREFIX}/last_token"
    hidden = head.input[0]
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    unsqueeze = (
        helper.make_node("Unsqueeze", [f"{p}/rows", f"{_PREFIX}_one"], [f"{p}/hidden"], name=f"{p}/Unsqueeze")
        if opset >= 13
        else helper.make_node("Unsqueeze", [f"{p}/rows"], [f"{p}/hidden"], name=f"{p}/Unsqueeze", axes=[1])
    )
    new = [
        helper.make_node("Flatten", [hidden], [f"{p}/flat"], name=f"{p}/Flatten", axis=2),
        helper.make_node("Gather", [f"{p}/flat", LAST_INDEX], [f"{p}/rows"], name=f"{p}/Gather", axis=0),
        unsqueeze,
    ]
    index = next(k for k, n in enumerate(nodes) if n is head)
    head.input[0] = f"{p}/hidden"
    nodes[index:index] = new
