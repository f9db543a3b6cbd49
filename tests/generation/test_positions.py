"""Architectures whose exports give positions differently: Gemma (optimum exports it with no
position_ids input, so its graph counts positions from the cache length) and BLOOM (ALiBi:
positions from the attention mask, and no context length in its config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ortbatch import BatchedGenerator
from ortbatch.errors import ModelContractError

from .conftest import EOS, TinyModel, _tokenizer, random_prompts

pytestmark = pytest.mark.slow

LENGTHS = [3, 9, 5, 14, 7, 2]
NEW = [12, 5, 20, 9, 16, 11]


def _source(kind: str, root: Path) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    import torch
    import transformers as tf

    source = root / f"{kind}-src"
    vocab = len(_tokenizer(source))
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    if kind == "gemma":
        config = tf.GemmaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=128,
            **common,
        )
        model = tf.GemmaForCausalLM(config)
    else:
        model = tf.BloomForCausalLM(tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **common))
    model.save_pretrained(source)
    return source


def _optimum_export(source: Path) -> Path:
    from optimum.exporters.onnx import main_export

    out = source.with_name(source.name.replace("-src", "-onnx"))
    main_export(str(source), output=str(out), task="text-generation-with-past", do_validation=False)
    return out


@pytest.fixture(scope="module")
def gemma_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _source("gemma", tmp_path_factory.mktemp("gemma"))


def _batched(gen: BatchedGenerator, prompts: list[list[int]]) -> list[list[int]]:
    return [list(f.result(60).token_ids) for f in [gen.submit(p, n) for p, n in zip(prompts, NEW, strict=True)]]


def test_export_counting_positions_from_the_cache_is_refused(gemma_source: Path, no_thread_leak: None) -> None:
    """optimum's Gemma export has no position_ids input: rows that move in the cache would
    get shifted positions and generate other tokens, so the generator refuses it, saying how
    to export it instead."""
    export = _optimum_export(gemma_source)
    with pytest.raises(ModelContractError, match=r"no position_ids input.*ortbatch export"):
        BatchedGenerator(export)


def test_ortbatch_export_adds_position_ids(gemma_source: Path, tmp_path: Path, no_thread_leak: None) -> None:
    """`ortbatch export` gives the Gemma export a position_ids input, and batched generation
    with rows joining and leaving is then token-identical to transformers, prompt by prompt."""
    from ortbatch.export import export_model

    result = export_model(gemma_source, tmp_path / "gemma", task="text-generation-with-past", validate=False)
    model = TinyModel("gemma", gemma_source, result.directory)
    prompts = random_prompts(LENGTHS)
    with BatchedGenerator(result.directory, max_batch_size=3) as gen:
        assert gen.layout.position_ids == "position_ids"
        results = _batched(gen, prompts)
        assert gen.stats().slot_reuses + gen.stats().cache_copies > 0  # rows did move
    for prompt, n, out in zip(prompts, NEW, results, strict=True):
        assert out == model.reference(prompt, n), len(prompt)


def test_alibi_model_needs_a_context_length_and_batches_exactly(
    tmp_path_factory: pytest.TempPathFactory, no_thread_leak: None
) -> None:
    """BLOOM has no position_ids input either, but ALiBi counts positions from the mask, so
    the positions probe passes. Its config has no context length: it must be given."""
    source = _source("bloom", tmp_path_factory.mktemp("bloom"))
    export = _optimum_export(source)
    with pytest.raises(ModelContractError, match="max_context_length"):
        BatchedGenerator(export)
    model = TinyModel("bloom", source, export)
    prompts = random_prompts(LENGTHS)
    with BatchedGenerator(export, max_batch_size=3, max_context_length=128) as gen:
        assert gen.layout.position_ids is None and gen.layout.max_context_length == 128
        results = _batched(gen, prompts)
    for prompt, n, out in zip(prompts, NEW, results, strict=True):
        assert out == model.reference(prompt, n), len(prompt)
