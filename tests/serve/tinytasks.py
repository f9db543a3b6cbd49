"""Tiny classification exports built offline with onnx.helper (no torch), for the task
endpoints and the model repository:

* ``build_classifier(dir, num_labels)``: a ``text-classification`` export (``num_labels=1``
  is a cross-encoder) over ``input_ids``/``attention_mask``/``token_type_ids``:
  ``logits = mean over the unmasked tokens of (word[ids] + type[type_ids]) @ W``.
* ``build_tagger(dir)``: a ``token-classification`` export: per-token
  ``logits = (word[ids] + type[type_ids]) @ W`` with BIO labels in ``config.json``.

Their tokenizer is tinymodels' WordLevel one with BERT's pair template
(``[CLS] A [SEP] B [SEP]``, token types 0/1), so pairs are tokenized as BERT's are. Every
row depends only on its own tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tinymodels import build_tokenizer

from tests.models import _save

HIDDEN = 8
TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def _pair_tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, processors

    vocab = build_tokenizer(path)
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(path))
    return vocab


def _build(directory: Path, num_labels: int, task: str, labels: list[str], seed: int) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    from ortbatch.manifest import InputSpec, Manifest, OutputSpec

    directory.mkdir(parents=True, exist_ok=True)
    vocab = _pair_tokenizer(directory / "tokenizer.json")
    rng = np.random.default_rng(seed)
    word = rng.standard_normal((vocab, HIDDEN)).astype(np.float32)
    types = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    w = rng.standard_normal((HIDDEN, num_labels)).astype(np.float32)
    tokens = task == "token-classification"
    nodes = [
        helper.make_node("Gather", ["word", "input_ids"], ["we"], axis=0),
        helper.make_node("Gather", ["types", "token_type_ids"], ["te"], axis=0),
        helper.make_node("Add", ["we", "te"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["per_token" if not tokens else "logits"]),
    ]
    if not tokens:
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),
            helper.make_node("Mul", ["per_token", "mask3"], ["masked"]),
            helper.make_node("ReduceSum", ["masked", "axis1"], ["total"], keepdims=0),
            helper.make_node("ReduceSum", ["mask3", "axis1"], ["count"], keepdims=0),
            helper.make_node("Div", ["total", "count"], ["logits"]),
        ]
    seq = ["batch", "sequence"]
    out_shape = ["batch", "sequence", num_labels] if tokens else ["batch", num_labels]
    graph = helper.make_graph(
        nodes,
        "tiny_" + task,
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, seq)
            for n in ("input_ids", "attention_mask", "token_type_ids")
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, out_shape)],
        initializer=[
            numpy_helper.from_array(word, "word"),
            numpy_helper.from_array(types, "types"),
            numpy_helper.from_array(w, "w"),
            *(
                []
                if tokens
                else [
                    numpy_helper.from_array(np.array([2], dtype=np.int64), "axis2"),
                    numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
                ]
            ),
        ],
    )
    _save(graph, directory / "model.onnx")
    axes = ("batch", "sequence")
    Manifest(
        model="model.onnx",
        inputs={n: InputSpec("int64", axes, 0) for n in ("input_ids", "attention_mask", "token_type_ids")},
        outputs={"logits": OutputSpec(("batch", "sequence", None) if tokens else ("batch", None))},
        limits={"max_batch_size": 16, "max_sequence_length": 16},
        source={"model": "tiny-" + task, "task": task},
    ).save(directory)
    config = {"vocab_size": vocab, "type_vocab_size": 2, "id2label": dict(enumerate(labels))}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def build_classifier(directory: Path, num_labels: int = 3, *, seed: int = 1) -> Path:
    labels = ["negative", "neutral", "positive"][:num_labels] if num_labels <= 3 else []
    labels += [f"LABEL_{i}" for i in range(len(labels), num_labels)]
    return _build(directory, num_labels, "text-classification", labels, seed)


def build_tagger(directory: Path, *, seed: int = 2) -> Path:
    return _build(directory, len(TAGS), "token-classification", TAGS, seed)


def run_alone(directory: Path, ids: list[int], type_ids: list[int]) -> np.ndarray:
    """The export's logits for one tokenized input, run alone on a plain InferenceSession."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    feed = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "token_type_ids": np.array([type_ids], np.int64),
    }
    return sess.run(["logits"], feed)[0][0]
