"""A real encoder-decoder export (a tiny BART, ``--task text2text-generation``) is refused by
``serve`` and ``run`` in one line naming what it is: no registered model kind serves
encoder-decoder generation yet, and its encoder graph is never served in its place.
``generate`` runs it on the encoder-decoder engine (``Seq2SeqGenerator``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ortbatch.cli import main

pytestmark = [pytest.mark.export, pytest.mark.slow]


@pytest.mark.parametrize("command", ["serve", "run"])
def test_a_bart_export_is_refused_in_one_line(
    exported: Any, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = exported("bart").directory
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n')
    argv = {
        "serve": ["serve", str(export), "--port", "0"],
        "run": ["run", str(export), str(src), "-o", str(tmp_path / "out")],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "task 'text2text-generation-with-past', graph encoder_model.onnx" in err
    assert "encoder-decoder generation is not served yet" in err
    assert not (tmp_path / "out").exists()


def test_generate_runs_a_bart_export_on_the_encoder_decoder_engine(
    exported: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    export = exported("bart").directory
    assert main(["generate", str(export), "hello world", "a longer source text", "--json", "-n", "5"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["source"] for line in lines] == ["hello world", "a longer source text"]
    for line in lines:
        assert 1 <= line["completion_tokens"] <= 5 and len(line["token_ids"]) == line["completion_tokens"]
        assert line["finish_reason"] in ("stop", "length")
