"""Tiny random encoder-decoder checkpoints (t5, mt5, bart, mbart, marian, m2m_100/NLLB) with real
tokenizers trained here, each exported once per session, all offline.

Random weights stop at random places; each checkpoint's generation_config.json sets lengths (and,
per family, the processors its real checkpoints set) so that outputs run long enough to exercise
the cache, the beams and the processors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

KINDS = ("t5", "mt5", "bart", "mbart", "marian", "m2m_100")
CORPUS = [
    "Once upon a time there was a tiny model that learned to translate.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Continuous batching lets new requests join at every decode step.",
    "ONNX Runtime runs transformer models fast on CPUs and GPUs.",
    "What is the capital of France? Paris is the capital of France.",
    "Guten Morgen, wie geht es dir heute? Sehr gut, danke.",
    "Le chat dort sur le canape pendant que la pluie tombe.",
]
DIMS = {"d_model": 32, "layers": 2, "heads": 4, "ffn": 64}


def _needs_export_extra() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("optimum.exporters.onnx")


def _bpe(specials: list[str], vocab: int = 300) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials)
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def _eos_template(tok: Any, eos: str, eos_id: int) -> None:
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A $B {eos}", special_tokens=[(eos, eos_id)]
    )


def build_seq2seq(kind: str, d: Path) -> Path:
    """Save a tiny random ``kind`` checkpoint with its tokenizer and generation config into ``d``."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    d.mkdir(parents=True, exist_ok=True)
    dm, layers, heads, ffn = DIMS["d_model"], DIMS["layers"], DIMS["heads"], DIMS["ffn"]
    bart_like = dict(
        d_model=dm,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=128,
    )
    gen: dict[str, Any] = {}
    if kind in ("t5", "mt5"):
        tok = _bpe(["<pad>", "</s>", "<unk>"])
        _eos_template(tok, "</s>", 1)
        fast = tf.T5TokenizerFast(
            tokenizer_object=tok, extra_ids=0, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
        )
        cfg_cls = tf.T5Config if kind == "t5" else tf.MT5Config
        cfg = cfg_cls(
            vocab_size=len(fast),
            d_model=dm,
            d_kv=dm // heads,
            d_ff=ffn,
            num_layers=layers,
            num_decoder_layers=layers,
            num_heads=heads,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            relative_attention_num_buckets=8,
            feed_forward_proj="relu" if kind == "t5" else "gated-gelu",
            tie_word_embeddings=kind == "t5",
        )
        model = (tf.T5ForConditionalGeneration if kind == "t5" else tf.MT5ForConditionalGeneration)(cfg)
        gen = {"max_length": 24, "min_length": 6}
    elif kind == "bart":
        tok = _bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
        )
        fast = tf.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            mask_token="<mask>",
            model_input_names=["input_ids", "attention_mask"],
        )
        cfg = tf.BartConfig(
            vocab_size=len(fast),
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
            **bart_like,
        )
        model = tf.BartForConditionalGeneration(cfg)
        # BART-CNN's settings, scaled down
        gen = {
            "max_length": 28,
            "min_length": 8,
            "no_repeat_ngram_size": 3,
            "length_penalty": 2.0,
            "num_beams": 3,
            "early_stopping": True,
            "forced_bos_token_id": 0,
            "forced_eos_token_id": 2,
        }
    elif kind == "mbart":
        tok = _bpe(["<s>", "<pad>", "</s>", "<unk>"])
        fast = tf.MBartTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            src_lang="en_XX",
            tgt_lang="de_DE",
        )
        cfg = tf.MBartConfig(
            vocab_size=len(fast),
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
            scale_embedding=True,
            **bart_like,
        )
        model = tf.MBartForConditionalGeneration(cfg)
        gen = {
            "max_length": 24,
            "min_length": 5,
            "forced_eos_token_id": 2,
            "decoder_start_token_id": 2,
            "repetition_penalty": 1.3,
        }
    elif kind == "marian":
        tok = _bpe(["</s>", "<unk>", "<pad>"])
        _eos_template(tok, "</s>", 0)
        fast = tf.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            model_input_names=["input_ids", "attention_mask"],
        )
        cfg = tf.MarianConfig(
            vocab_size=len(fast),
            pad_token_id=2,
            eos_token_id=0,
            decoder_start_token_id=2,
            forced_eos_token_id=0,
            scale_embedding=True,
            share_encoder_decoder_embeddings=True,
            **bart_like,
        )
        model = tf.MarianMTModel(cfg)
        # opus-mt's settings: beams, bad_words_ids = [[pad]]
        gen = {
            "max_length": 24,
            "num_beams": 4,
            "bad_words_ids": [[2]],
            "forced_eos_token_id": 0,
            "decoder_start_token_id": 2,
            "pad_token_id": 2,
            "min_new_tokens": 4,
        }
    elif kind == "m2m_100":
        tok = _bpe(["<s>", "<pad>", "</s>", "<unk>"])
        fast = tf.NllbTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            src_lang="eng_Latn",
            tgt_lang="deu_Latn",
        )
        cfg = tf.M2M100Config(
            vocab_size=len(fast), pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **bart_like
        )
        model = tf.M2M100ForConditionalGeneration(cfg)
        gen = {
            "max_length": 24,
            "min_length": 4,
            "decoder_start_token_id": 2,
            "suppress_tokens": [3],
            "begin_suppress_tokens": [5],
        }
    elif kind == "pegasus":
        tok = _bpe(["<pad>", "</s>", "<unk>"])
        _eos_template(tok, "</s>", 1)
        fast = tf.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            model_input_names=["input_ids", "attention_mask"],
        )
        cfg = tf.PegasusConfig(
            vocab_size=len(fast),
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            forced_eos_token_id=1,
            scale_embedding=True,
            **bart_like,
        )
        model = tf.PegasusForConditionalGeneration(cfg)
        gen = {"max_length": 20, "num_beams": 2, "length_penalty": 0.8}
    else:  # pragma: no cover - a typo in a test
        raise ValueError(kind)
    model.eval()
    model.save_pretrained(d)
    generation = tf.GenerationConfig.from_model_config(model.config)
    for k, v in gen.items():
        setattr(generation, k, v)
    generation.save_pretrained(d)
    fast.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def seq2seq_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``seq2seq_checkpoint(kind)`` -> a tiny random checkpoint directory (built once)."""
    _needs_export_extra()
    root = tmp_path_factory.mktemp("seq2seq-src")
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_seq2seq(kind, root / kind)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def seq2seq_export(
    tmp_path_factory: pytest.TempPathFactory, seq2seq_checkpoint: Callable[[str], Path]
) -> Callable[[str], Any]:
    """``seq2seq_export(kind)`` -> the ExportResult of its checkpoint (exported and checked once)."""
    from ortbatch.export import export_model

    root = tmp_path_factory.mktemp("seq2seq-export")
    cache: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in cache:
            cache[kind] = export_model(seq2seq_checkpoint(kind), root / kind, raise_on_failure=False)
        return cache[kind]

    return get
