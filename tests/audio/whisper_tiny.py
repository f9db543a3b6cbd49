"""A tiny random Whisper checkpoint with a real Whisper tokenizer, built here from a config.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on a few sentences, followed
by Whisper's special tokens in the order the real checkpoints have them (end of text, start
of transcript, the languages, translate, transcribe, start of LM, start of previous text,
no speech, no timestamps, then the 1501 timestamps ``<|0.00|>`` .. ``<|30.00|>``), and a
generation config with what ``WhisperForConditionalGeneration.generate`` reads
(``lang_to_id``, ``task_to_id``, ``no_timestamps_token_id``, suppress lists, alignment heads).
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Batching many requests together makes speech recognition cheaper.",
    "Hello world, this is a test of the audio pipeline.",
    "Whisper transcribes and translates speech in many languages.",
)
BASE_VOCAB = 320


def build_whisper(directory: Path, *, n_mels: int = 80, seed: int = 0, layers: int = 2) -> Path:
    """Save a tiny random ``WhisperForConditionalGeneration`` (with tokenizer, feature
    extractor and generation config) to ``directory``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizer,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    raw = directory / "bpe"
    raw.mkdir(exist_ok=True)
    bpe.model.save(str(raw))
    tok = WhisperTokenizer(str(raw / "vocab.json"), str(raw / "merges.txt"))
    languages = [f"<|{code}|>" for code in LANGUAGES]
    specials = [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *languages,
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
    ]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    base = len(bpe.get_vocab())
    assert ids["<|endoftext|>"] == base and ids["<|notimestamps|>"] == base + len(specials) - 1, ids
    tok.save_pretrained(directory)

    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    space = tok.convert_tokens_to_ids("Ġ")
    # a few tokens the checkpoint never emits (real ones list ~90 symbols here)
    suppress = sorted(tok.convert_tokens_to_ids(t) for t in ("#", "(", ")", "*", "+", "/", ":", ";", "<", "=", ">"))
    config = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=n_mels,
        d_model=64,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=448,
        init_std=0.2,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        suppress_tokens=suppress,
        begin_suppress_tokens=[space, eot],
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    gen = GenerationConfig(
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=448,
        begin_suppress_tokens=[space, eot],
        suppress_tokens=suppress,
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        lang_to_id={t: ids[t] for t in languages},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        is_multilingual=True,
        max_initial_timestamp_index=50,
        alignment_heads=[[layers - 1, 0], [layers - 1, 2]],
        return_timestamps=False,
    )
    gen.save_pretrained(directory)
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(directory)
    (directory / "TINY.json").write_text(json.dumps({"seed": seed, "n_mels": n_mels}), encoding="utf-8")
    return directory
