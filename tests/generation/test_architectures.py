"""Greedy parity across decoder architectures that optimum exports with positions the
generator can drive (the GPT-2 and Llama fixtures are tested throughout; Gemma and BLOOM in
test_positions.py): batched, with rows joining and leaving, token-identical to transformers
for each prompt alone, with the graph rewrites on wherever they apply: on the in-place KV cache
where the architecture's attention can be rewritten, and on the export's own cache too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ortbatch import BatchedGenerator
from ortbatch.generation.rewrites import ATTENTION_SCALE, IN_PLACE_KV

from .conftest import EOS, TinyModel, _tokenizer, random_prompts

pytestmark = pytest.mark.slow

LENGTHS = [3, 9, 5, 14, 7, 2]
NEW = [12, 5, 20, 9, 16, 11]
SMALL = dict(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
GQA = dict(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **SMALL)

# config class name, model class name, config arguments, the load-time rewrite of its attention
ARCHS: dict[str, tuple[str, str, dict[str, Any], str | None]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", GQA, IN_PLACE_KV),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(GQA, sliding_window=None), IN_PLACE_KV),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", GQA, IN_PLACE_KV),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, **SMALL),
        IN_PLACE_KV,
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(hidden_size=32, intermediate_size=64, **SMALL),
        IN_PLACE_KV,
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False),
        IN_PLACE_KV,
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=128),
        None,
    ),
}


@pytest.mark.parametrize("kv_cache", ["auto", "concat"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batched_greedy_matches_transformers(arch: str, kv_cache: str, tmp_path: Path, no_thread_leak: None) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    import torch
    import transformers as tf
    from optimum.exporters.onnx import main_export

    config_name, model_name, kwargs, attention = ARCHS[arch]
    source, export = tmp_path / "src", tmp_path / "onnx"
    vocab = len(_tokenizer(source))
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    getattr(tf, model_name)(getattr(tf, config_name)(**common, **kwargs)).save_pretrained(source)
    main_export(str(source), output=str(export), task="text-generation-with-past", do_validation=False)

    model = TinyModel(arch, source, export)
    prompts = random_prompts(LENGTHS)
    with BatchedGenerator(export, max_batch_size=3, kv_cache=kv_cache) as gen:
        if kv_cache == "concat" and attention is not None:
            attention = ATTENTION_SCALE  # the export's own cache, its scale moved off the keys
        assert attention in (*gen.graph_rewrites, None)
        assert gen.kv_cache == ("in-place" if attention == IN_PLACE_KV else "concat") == gen.stats().kv_cache
        results = [f.result(60) for f in [gen.submit(p, n) for p, n in zip(prompts, NEW, strict=True)]]
    for prompt, n, out in zip(prompts, NEW, results, strict=True):
        assert list(out.token_ids) == model.reference(prompt, n), len(prompt)
