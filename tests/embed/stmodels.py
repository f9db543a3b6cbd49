"""Tiny sentence-transformers checkpoints, built offline with sentence-transformers itself.

A random 2-layer BERT (CLS/SEP added by its tokenizer) and a random 2-layer GPT-2 (no
special tokens), each with a WordLevel tokenizer trained here; each checkpoint is
``SentenceTransformer(modules=[Transformer, Pooling, Dense?, Normalize?]).save(dir)``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a batched session pads and stacks concurrent requests",
    "hello world from the inference server",
    "many callers one run split back",
    "query passage search document answer",
]
# mixed lengths, longest first and last, so right padding differs row to row
TEXTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog again and again and again",
    "many callers one run",
    "a batched session pads and stacks concurrent requests",
    "world",
    "split back the quick brown fox jumps over the lazy dog hello world from the inference server",
]
HIDDEN = 32


def _tokenizer(kind: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator([*CORPUS, "query: passage: "], trainers.WordLevelTrainer(special_tokens=specials))
    if kind == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
        )
    # as GPT-2's own tokenizer: no token_type_ids (GPT2Model would add wte[0] to every token)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", model_input_names=["input_ids", "attention_mask"]
    )


def _bert_config(vocab: int) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )


def build_base(kind: str, directory: Path) -> Path:
    """A random transformer checkpoint (config, weights, tokenizer) in ``directory``."""
    import torch
    from transformers import BertModel, GPT2Config, GPT2Model

    torch.manual_seed(0)
    tok = _tokenizer(kind)
    if kind == "bert":
        model: Any = BertModel(_bert_config(len(tok)))
    else:
        cfg = GPT2Config(vocab_size=len(tok), n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=128, pad_token_id=0)
        model = GPT2Model(cfg)
    model.eval()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def build_st(
    base: Path,
    directory: Path,
    *,
    pooling: str | tuple[str, ...] = "mean",
    include_prompt: bool = True,
    dense: tuple[tuple[int, str], ...] = (),
    normalize: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    safe_serialization: bool = True,
    truncate_dim: int | None = None,
) -> Path:
    """A sentence-transformers checkpoint over ``base``; ``dense`` is (out_features,
    activation class name in torch.nn) per Dense layer; ``truncate_dim`` is saved in
    config_sentence_transformers.json."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(1)
    modules: list[Any] = [Transformer(str(base), max_seq_length=64)]
    modules.append(Pooling(HIDDEN, pooling_mode=pooling, include_prompt=include_prompt))
    width = HIDDEN * (1 if isinstance(pooling, str) else len(pooling))
    for out, act in dense:
        modules.append(Dense(width, out, activation_function=getattr(torch.nn, act)()))
        width = out
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules,
        device="cpu",
        prompts=prompts or {},
        default_prompt_name=default_prompt_name,
        truncate_dim=truncate_dim,
    )
    if directory.exists():
        shutil.rmtree(directory)
    model.save(str(directory), safe_serialization=safe_serialization)
    return directory


def build_splade(directory: Path, *, pooling: str = "max", activation: str = "relu") -> Path:
    """A SPLADE ``SparseEncoder`` checkpoint over a random 2-layer BERT masked LM."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    tok = _tokenizer("bert")
    base = directory.with_name(directory.name + "-mlm")
    BertForMaskedLM(_bert_config(len(tok))).eval().save_pretrained(base)
    tok.save_pretrained(base)
    modules = [
        Transformer(str(base), transformer_task="fill-mask", max_seq_length=64),
        SpladePooling(pooling_strategy=pooling, activation_function=activation),
    ]
    if directory.exists():
        shutil.rmtree(directory)
    SparseEncoder(modules=modules, device="cpu").save(str(directory))
    return directory


def export_transformer(base: Path, out: Path) -> Path:
    """The plain transformer's ONNX graph (optimum-onnx, feature-extraction), once per base."""
    from optimum.exporters.onnx import main_export

    main_export(
        str(base), output=out, task="feature-extraction", library_name="transformers", do_validation=False, opset=18
    )
    return out / "model.onnx"


def make_export(onnx_src: Path, st_dir: Path, out: Path, *, calibrate: bool = True, max_batch_size: int = 4) -> Path:
    """An export directory as the exporter writes it, without its checks: model.onnx with
    the checkpoint's pipeline appended, the tokenizer, and ortbatch.json with the
    'embedding' section (calibrated on sentence-transformers' encode of CORPUS, default
    prompt applied as encode applies it)."""
    import dataclasses

    import onnx
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from ortbatch.embed import calibration_ranges
    from ortbatch.export import graph, st_pipeline
    from ortbatch.manifest import Manifest, model_hash

    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None
    out.mkdir(parents=True)
    model = onnx.load(str(onnx_src))
    st_pipeline.append_pipeline(model, parsed)
    onnx.save(model, str(out / "model.onnx"))
    AutoTokenizer.from_pretrained(str(st_dir)).save_pretrained(str(out))
    inputs, outputs, _ = graph.manifest_io(graph.read_graph_io(out / "model.onnx"), {"input_ids": 0})
    pipe = parsed.pipeline
    if calibrate:
        cal = SentenceTransformer(str(st_dir), device="cpu").encode(CORPUS)
        rows = tuple(tuple(float(v) for v in r) for r in cal)
        pipe = dataclasses.replace(pipe, calibration=rows, quantization_ranges=calibration_ranges(cal))
    Manifest(
        inputs=inputs,
        outputs=outputs,
        limits={"max_batch_size": max_batch_size, "max_sequence_length": 64},
        source={"model": str(st_dir), "task": "feature-extraction"},
        extra={
            "components": {"model": {"model": "model.onnx", "sha256": model_hash(out / "model.onnx")}},
            "embedding": pipe.to_dict(),
        },
    ).save(out)
    return out


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def padded_feed(tokenizer: Any, texts: list[str], input_names: set[str]) -> dict[str, np.ndarray]:
    enc = tokenizer(texts, padding=True, return_tensors="np")
    feed = {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}
    if "token_type_ids" in input_names:
        feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
    if "position_ids" in input_names:
        feed["position_ids"] = np.broadcast_to(np.arange(feed["input_ids"].shape[1]), feed["input_ids"].shape).copy()
    return feed


def block_sentence_transformers() -> None:
    """Make ``import sentence_transformers`` fail in this process, as if not installed.

    The finder answers with a spec whose loader raises ImportError (rather than raising
    from find_spec), so libraries that only probe with ``importlib.util.find_spec``, as
    optimum does at import, go on working; any real import of it fails."""
    import importlib.abc
    import importlib.machinery
    import sys

    class _Loader(importlib.abc.Loader):
        def create_module(self, spec: Any) -> None:
            raise ImportError(f"No module named {spec.name!r} (blocked by the test)")

        def exec_module(self, module: Any) -> None:  # pragma: no cover - create_module raises
            raise ImportError(module.__name__)

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            if name == "sentence_transformers" or name.startswith("sentence_transformers."):
                return importlib.machinery.ModuleSpec(name, _Loader())
            return None

    for name in [m for m in sys.modules if m.split(".")[0] == "sentence_transformers"]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Block())
