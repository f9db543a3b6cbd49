"""Tiny ONNX exports built offline with onnx.helper (no torch), for the server tests.

* ``build_encoder(dir)``: a feature-extraction export with a WordLevel tokenizer:
  ``input_ids``/``attention_mask`` (int64, [batch, sequence]) ->
  ``last_hidden_state`` = embedding[input_ids] * mask  ([batch, sequence, HIDDEN]) and
  ``pooled`` = sum over the sequence of last_hidden_state ([batch, HIDDEN]).
  Every row depends only on its own tokens, so batching with padding cannot change it.
* ``build_adder(path)``: a bare ``.onnx`` (no manifest): ``x`` FP32 [batch, 3] and
  ``k`` INT32 [batch, 1] -> ``y = x * 2 + k`` FP32 and ``n = k + 1`` INT32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN = 4
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a batched session pads and stacks concurrent requests",
    "hello world from the inference server",
    "many callers one run split back",
]


def build_tokenizer(path: Path) -> int:
    """Train a tiny BERT-style WordLevel tokenizer; returns its vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(path))
    return tok.get_vocab_size()


def build_encoder(directory: Path, *, max_batch_size: int = 16, max_sequence_length: int = 16) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ortbatch.manifest import InputSpec, Manifest, OutputSpec

    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(directory / "tokenizer.json")
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, HIDDEN)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),
        helper.make_node("Mul", ["emb", "mask3"], ["last_hidden_state"]),
        helper.make_node("ReduceSum", ["last_hidden_state", "axis1"], ["pooled"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_encoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [
            helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", HIDDEN]),
            helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", HIDDEN]),
        ],
        initializer=[
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(directory / "model.onnx"))
    seq = ("batch", "sequence")
    Manifest(
        model="model.onnx",
        inputs={"input_ids": InputSpec("int64", seq, 0), "attention_mask": InputSpec("int64", seq, 0)},
        outputs={
            "last_hidden_state": OutputSpec(("batch", "sequence", None)),
            "pooled": OutputSpec(("batch", None)),
        },
        limits={"max_batch_size": max_batch_size, "max_sequence_length": max_sequence_length},
        source={"model": "tiny-encoder", "task": "feature-extraction"},
    ).save(directory)
    return directory


def build_adder(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path.parent.mkdir(parents=True, exist_ok=True)
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["x2"]),
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x2", "kf"], ["y"]),
        helper.make_node("Add", ["k", "one"], ["n"]),
    ]
    graph = helper.make_graph(
        nodes,
        "adder",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT32, ["batch", 1]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("n", TensorProto.INT32, ["batch", 1]),
        ],
        initializer=[
            numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
            numpy_helper.from_array(np.array(1, dtype=np.int32), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
