"""``ortbatch generate``: same completions as the Python API; typed errors become exit 1."""

from __future__ import annotations

import json

import pytest

from ortbatch import BatchedGenerator
from ortbatch.cli import main

from .conftest import TinyModel

pytestmark = [pytest.mark.export]


def test_generate_command_json(tiny_gpt2: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["Once upon a time", "The quick brown fox jumps"]
    assert main(["generate", str(tiny_gpt2.export), *prompts, "-n", "9", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with BatchedGenerator(tiny_gpt2.export) as gen:
        expected = [gen.generate(p, 9) for p in prompts]
    assert [line["token_ids"] for line in lines] == [list(e.token_ids) for e in expected]
    assert [line["text"] for line in lines] == [e.text for e in expected]


def test_generate_command_bad_prompt(tiny_gpt2: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_gpt2.export), "", "-n", "3"]) == 1
    assert "prompt is empty" in capsys.readouterr().err
