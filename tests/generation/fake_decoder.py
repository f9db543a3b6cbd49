"""A decoder-with-past built with onnx.helper (no torch), whose next token is a known
function of the row's whole unmasked history, so a wrong mask, position or cache row
shows up as a wrong token.

Inputs follow optimum's text-generation-with-past layout (one layer, one kv head,
head_dim 1): the cache stores the token ids themselves. For a row whose real tokens
so far are ``t_0 .. t_n`` (n = position of the last one)::

    next = (t_0 + ... + t_n + 7 * n) mod VOCAB
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 50
EOS = 3
PAD = 2  # non-zero on purpose: a pad that leaks through the mask changes the sum
CONTEXT = 64


def reference(prompt: list[int], max_new_tokens: int, eos: int | None = EOS) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = (sum(seq) + 7 * (len(seq) - 1)) % VOCAB
        out.append(token)
        seq.append(token)
        if token == eos:
            break
    return out


def build(directory: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    directory.mkdir(parents=True, exist_ok=True)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", i64, ["batch_size", "total_length"]),
        helper.make_tensor_value_info("position_ids", i64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("past_key_values.0.key", f, ["batch_size", 1, "past_length", 1]),
        helper.make_tensor_value_info("past_key_values.0.value", f, ["batch_size", 1, "past_length", 1]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", f, ["batch_size", "sequence_length", VOCAB]),
        helper.make_tensor_value_info("present.0.key", f, ["batch_size", 1, "total_length", 1]),
        helper.make_tensor_value_info("present.0.value", f, ["batch_size", 1, "total_length", 1]),
    ]
    consts = {
        "axes_1_3": np.array([1, 3], np.int64),
        "seven": np.array(7.0, np.float32),
        "vocab": np.array(float(VOCAB), np.float32),
        "depth": np.array(VOCAB, np.int64),
        "onehot_values": np.array([0.0, 1.0], np.float32),
        "one": np.array([1], np.int64),
        "big": np.array([1 << 30], np.int64),
    }
    nodes = [
        # present = concat(past, ids) along the sequence axis
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=f),
        helper.make_node("Unsqueeze", ["ids_f", "axes_1_3"], ["ids_4d"]),
        helper.make_node("Concat", ["past_key_values.0.key", "ids_4d"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "ids_4d"], ["present.0.value"], axis=2),
        # masked running sum over the whole (past + new) sequence
        helper.make_node("Squeeze", ["present.0.key", "axes_1_3"], ["all_ids"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=f),
        helper.make_node("Mul", ["all_ids", "mask_f"], ["masked"]),
        helper.make_node("CumSum", ["masked", "one"], ["running"]),
        # keep the last sequence_length columns: slice [total - seq, total)
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one"], ["seq_len"], axis=0),
        helper.make_node("Neg", ["seq_len"], ["neg_seq_len"]),
        helper.make_node("Slice", ["running", "neg_seq_len", "big", "one"], ["running_new"]),
        # + 7 * position, mod VOCAB, one-hot
        helper.make_node("Cast", ["position_ids"], ["pos_f"], to=f),
        helper.make_node("Mul", ["pos_f", "seven"], ["pos7"]),
        helper.make_node("Add", ["running_new", "pos7"], ["score"]),
        helper.make_node("Mod", ["score", "vocab"], ["next_f"], fmod=1),
        helper.make_node("Cast", ["next_f"], ["next"], to=i64),
        helper.make_node("OneHot", ["next", "depth", "onehot_values"], ["logits"], axis=-1),
    ]
    init = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "fake_decoder", inputs, outputs, initializer=init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(directory / "model.onnx"))
    config = {
        "model_type": "fake",
        "vocab_size": VOCAB,
        "n_positions": CONTEXT,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "bos_token_id": 1,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory
