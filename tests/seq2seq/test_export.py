"""``ortbatch export`` of encoder-decoder checkpoints: the checks pass, and the manifest's
``generation`` section records what the engine needs, read back from the checkpoint's own files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ortbatch.generation.seq2seq_layout import load_seq2seq_layout

from .conftest import KINDS

pytestmark = [pytest.mark.export, pytest.mark.slow]


@pytest.mark.parametrize("kind", [*KINDS, "pegasus"])
def test_export_passes_its_checks_and_records_the_layout(
    kind: str, seq2seq_export: Callable[[str], Any], seq2seq_checkpoint: Callable[[str], Path]
) -> None:
    result = seq2seq_export(kind)
    assert result.report is not None and result.report.passed, result.report
    config = json.loads((seq2seq_checkpoint(kind) / "config.json").read_text())
    generation = json.loads((seq2seq_checkpoint(kind) / "generation_config.json").read_text())
    section = result.manifest.generation
    assert section["kind"] == "seq2seq"
    assert section["self_attention"] == "concat" and section["cross_attention"] == "kept"
    assert section["num_layers"] == config.get("decoder_layers", config.get("num_decoder_layers"))
    assert section["decoder_start_token_id"] == generation.get(
        "decoder_start_token_id", config["decoder_start_token_id"]
    )
    eos = generation.get("eos_token_id", config["eos_token_id"])
    assert section["eos_token_ids"] == ([eos] if isinstance(eos, int) else eos)
    assert section["vocab_size"] == config["vocab_size"]
    assert section["past_names"]["cross"][0] == ["past_key_values.0.encoder.key", "past_key_values.0.encoder.value"]
    layout, _ = load_seq2seq_layout(result.directory)
    assert layout.num_heads * layout.head_dim > 0
    if kind == "m2m_100":  # NLLB's tokenizer: language codes, the source's in front
        assert layout.languages is not None and layout.languages.source_position == "prefix"
        assert "deu_Latn" in layout.languages.codes
    elif kind == "mbart":  # mBART-cc25: the source language after </s>
        assert layout.languages is not None and layout.languages.source_position == "suffix"
    else:
        assert layout.languages is None
