"""``tiny:<kind>``: small models with real tokenizers, trained on this machine in seconds.

They let anyone try the whole pipeline offline in about a minute, generation included::

    ortbatch export tiny:gpt2 -o exports/tiny-gpt2
    ortbatch generate exports/tiny-gpt2 "Once upon a time" -n 16
    ortbatch serve exports/tiny-gpt2          # /v1/completions and /v1/chat/completions

The model (2 layers, 64 wide, 0.3 M parameters) is trained for a few seconds on a
handful of sentences, so it knows only those: "Once upon a time" continues with the
sentence it learned, and a prompt it has not seen gives word salad. Everything around it
(tokenizer, KV cache, batching, stopping on ``</s>``, the chat template, the checks) is
real. The checkpoint is built once (seeded: every build is the same) into
``$ORTBATCH_CACHE`` (default ``~/.cache/ortbatch``) and reused; the export's manifest
points the checks' PyTorch reference at it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ExportError

__all__ = ["TINY_KINDS", "build_tiny", "cache_root"]

# bump when what is built changes, so an old cached build is never reused for a new one
_VERSION = 2
TINY_KINDS = ("gpt2",)
_CORPUS = (
    "Once upon a time there was a little model that wanted to generate text.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Continuous batching lets new requests join at every decode step.",
    "ONNX Runtime runs transformer models fast on CPUs and GPUs.",
    "What is the capital of France? Paris is the capital of France.",
    "Hello! How can I help you today? Tell me a story about a robot.",
    "In 1969, Apollo 11 landed on the Moon; 600 million people watched it live.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
)
_CHAT_EXAMPLES = (
    ("Tell me a story.", "Once upon a time there was a little model that wanted to generate text."),
    ("What is the capital of France?", "Paris is the capital of France."),
)
_TRAIN_STEPS = 120
# Role-tagged turns, then the assistant's tag when a reply is asked for.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def cache_root() -> Path:
    env = os.environ.get("ORTBATCH_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ortbatch"


def build_tiny(kind: str, root: Path | None = None) -> Path:
    """The folder of the ``tiny:<kind>`` checkpoint (config, weights, tokenizer), built
    on first use; :class:`~ortbatch.ExportError` for an unknown kind."""
    if kind not in TINY_KINDS:
        raise ExportError(f"unknown tiny model {kind!r}; expected one of {[f'tiny:{k}' for k in TINY_KINDS]}")
    target = (root or cache_root()) / f"tiny-{kind}-v{_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed, so a half-built folder is never picked up
    build = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build_gpt2(build)
        try:
            os.replace(build, target)
        except OSError:  # another process built it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return target


def _build_gpt2(directory: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "<unk>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([*_CORPUS, *(q + " " + a for q, a in _CHAT_EXAMPLES)] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=256,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(fast),
        n_positions=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    chats = [
        str(
            fast.apply_chat_template(
                [{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False
            )
        )
        for q, a in _CHAT_EXAMPLES
    ]
    _train(model, fast, [f"{fast.bos_token}{t}{fast.eos_token}" for t in _CORPUS] + chats)
    model.eval().save_pretrained(directory)


def _train(model: Any, tokenizer: Any, texts: list[str]) -> None:
    """Fit the texts (a few seconds on one core; one thread keeps it deterministic)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
        model.train()
        for _ in range(_TRAIN_STEPS):
            loss = model(**batch, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
