"""The export's generation_config.json as transformers' ``generate`` reads it: its
``repetition_penalty`` is every request's default (a request's own value, 1.0 included, wins),
and a setting whose logits processor ortbatch lacks is refused at load, naming it, instead
of generating other tokens than ``generate`` does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ortbatch import BatchedGenerator
from ortbatch.errors import ModelContractError
from ortbatch.generation import SamplingParams
from ortbatch.generation.defaults import model_defaults

from .conftest import EOS, TinyModel, random_prompts

pytestmark = [pytest.mark.export]

PROMPTS = random_prompts([6, 11, 3], seed=7)
NEW = 16


def _with_generation_config(model: TinyModel, root: Path, **settings: object) -> TinyModel:
    """A copy of ``model`` (checkpoint and export) whose generation_config.json adds ``settings``."""
    copy = TinyModel(model.kind, root / "src", root / "onnx")
    shutil.copytree(model.source, copy.source)
    shutil.copytree(model.export, copy.export)
    for d in (copy.source, copy.export):
        path = d / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return copy


def _hf(model: TinyModel, prompt: list[int], **overrides: object) -> list[int]:
    """``generate`` with the checkpoint's own generation config (``overrides`` on top of it)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, **overrides
        )
    return out[0, len(prompt) :].tolist()


def test_generation_config_repetition_penalty_is_the_default(tiny_llama: TinyModel, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    model = _with_generation_config(tiny_llama, tmp_path, repetition_penalty=1.5)
    assert model.hf.generation_config.repetition_penalty == 1.5
    with BatchedGenerator(model.export, max_batch_size=4) as gen:
        assert gen.model_defaults.repetition_penalty == 1.5
        default = [f.result(60) for f in [gen.submit(p, NEW) for p in PROMPTS]]
        own = [gen.generate(p, NEW, repetition_penalty=1.0) for p in PROMPTS]
        other = gen.generate(PROMPTS[0], params=SamplingParams(max_new_tokens=NEW, repetition_penalty=1.2))
    for prompt, got, plain in zip(PROMPTS, default, own, strict=True):
        assert list(got.token_ids) == _hf(model, prompt)
        assert list(plain.token_ids) == _hf(model, prompt, repetition_penalty=1.0)
    assert list(other.token_ids) == _hf(model, PROMPTS[0], repetition_penalty=1.2)
    # the penalty changes these tokens, so the test tells applied from ignored
    assert [list(c.token_ids) for c in default] != [list(c.token_ids) for c in own]


def test_the_server_applies_it_to_a_request_without_the_field(tiny_llama: TinyModel, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    from ortbatch.serve import BackgroundServer, ServedGenerator

    model = _with_generation_config(tiny_llama, tmp_path, repetition_penalty=1.5)
    body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
    with BatchedGenerator(model.export, max_batch_size=2) as gen, BackgroundServer(ServedGenerator(gen, "m")) as srv:
        default = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        own = httpx.post(srv.url + "/v1/completions", json={**body, "repetition_penalty": 1.0}, timeout=60).json()
    assert default["choices"][0]["token_ids"] == _hf(model, PROMPTS[1])
    assert own["choices"][0]["token_ids"] == _hf(model, PROMPTS[1], repetition_penalty=1.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [("no_repeat_ngram_size", 2), ("bad_words_ids", [[5]]), ("suppress_tokens", [7]), ("num_beams", 4)],
)
def test_a_generation_config_setting_without_a_processor_is_refused_at_load(
    tiny_gpt2: TinyModel, tmp_path: Path, name: str, value: object
) -> None:
    export = tmp_path / "onnx"
    shutil.copytree(tiny_gpt2.export, export)
    path = export / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), name: value}))
    with pytest.raises(ModelContractError, match=f"{name}=.* is not supported"):
        BatchedGenerator(export)


def test_neutral_generation_config_values_are_taken() -> None:
    neutral = {"no_repeat_ngram_size": 0, "num_beams": 1, "suppress_tokens": None, "bad_words_ids": None}
    assert model_defaults({**neutral, "eos_token_id": [EOS, 5], "temperature": 0.7}).repetition_penalty == 1.0
    with pytest.raises(ModelContractError, match="repetition_penalty must be"):
        model_defaults({"repetition_penalty": 0})
