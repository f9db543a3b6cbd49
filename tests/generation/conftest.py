"""Tiny random GPT-2 and Llama decoders, exported once per session with optimum.

The tokenizer is a byte-level BPE trained offline with the ``tokenizers`` library; the
models are random with ``initializer_range=0.2`` so greedy decoding wanders over the
vocabulary instead of repeating one token. ``eos_token_id`` is a real token (3) that
the models do produce now and then, so stopping on eos is exercised too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 320
EOS = 3
CONTEXT = 96
CORPUS = [
    "Once upon a time there was a little model that wanted to generate text.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Continuous batching lets new requests join at every decode step.",
    "Héllo wörld: ünïcode, emoji 🙂 and 漢字 keep byte-level BPE honest.",
] * 10


@dataclass(frozen=True)
class TinyModel:
    kind: str
    source: Path  # transformers checkpoint + tokenizer
    export: Path  # optimum main_export output (no ortbatch.json)

    @functools.cached_property
    def hf(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.source).eval()

    def reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers generate(do_sample=False) for this prompt alone."""
        return list(_reference(self, tuple(prompt), max_new_tokens))


@functools.cache
def _reference(model: TinyModel, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    import torch

    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=EOS,
            eos_token_id=EOS,
        )
    return tuple(out[0, len(prompt) :].tolist())


def _tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert fast.eos_token_id == EOS and len(fast) == VOCAB
    fast.save_pretrained(directory)
    return fast


def _build(kind: str, root: Path, context: int = CONTEXT) -> TinyModel:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    source, export = root / f"{kind}-src", root / f"{kind}-onnx"
    tok = _tokenizer(source)
    vocab = len(tok)
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_positions=context, n_embd=32, n_layer=2, n_head=4, **common))
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=context,
                **common,
            )
        )
    model.save_pretrained(source)
    main_export(str(source), output=str(export), task="text-generation-with-past", do_validation=False)
    return TinyModel(kind, source, export)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _build("gpt2", tmp_path_factory.mktemp("gen-gpt2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _build("llama", tmp_path_factory.mktemp("gen-llama"))


@pytest.fixture(scope="session")
def tiny_gpt2_long(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """tiny_gpt2's shape with 2048 positions: room for chat prompts that list tools."""
    return _build("gpt2", tmp_path_factory.mktemp("gen-gpt2-long"), context=2048)


@pytest.fixture(scope="session")
def tool_exports(tiny_gpt2_long: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny_gpt2_long's export with each tool template (tool_templates.py) as its chat template:
    ``{"hermes": DIR, "llama3": DIR}``."""
    import shutil

    from .tool_templates import HERMES, LLAMA3

    out = {}
    for name, source in (("hermes", HERMES), ("llama3", LLAMA3)):
        d = tmp_path_factory.mktemp(f"tools-{name}") / "export"
        shutil.copytree(tiny_gpt2_long.export, d)
        (d / "chat_template.jinja").write_text(source)
        out[name] = d
    return out


@pytest.fixture(params=["gpt2", "llama"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return request.getfixturevalue(f"tiny_{request.param}")


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, avoiding the special ids."""
    rs = np.random.RandomState(seed)
    return [rs.randint(4, VOCAB, size=n).tolist() for n in lengths]


@pytest.fixture(scope="session")
def fake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The onnx.helper decoder of fake_decoder.py (needs only onnx, no torch)."""
    pytest.importorskip("onnx")
    from .fake_decoder import build

    return build(tmp_path_factory.mktemp("gen-fake"))


def assert_openai_answer(response: Any, answer_object: str) -> None:
    """A fuzzed OpenAI-style request got a proper answer: 200 (JSON of ``answer_object``,
    or a complete event stream) or a < 500 error in OpenAI's shape."""
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert isinstance(response.json()["error"]["message"], str)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
    else:
        assert response.json()["object"] == answer_object
