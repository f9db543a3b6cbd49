"""A real encoder-decoder export (a tiny BART, ``--task text2text-generation``) is refused by
``serve``, ``generate`` and ``run`` in one line naming what it is: no registered model kind
serves encoder-decoder generation yet, and its encoder graph is never served in its place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ortbatch.cli import main

pytestmark = [pytest.mark.export, pytest.mark.slow]


@pytest.mark.parametrize("command", ["serve", "generate", "run"])
def test_a_bart_export_is_refused_in_one_line(
    exported: Any, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = exported("bart").directory
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n')
    argv = {
        "serve": ["serve", str(export), "--port", "0"],
        "generate": ["generate", str(export), "hello"],
        "run": ["run", str(export), str(src), "-o", str(tmp_path / "out")],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "task 'text2text-generation-with-past', graph encoder_model.onnx" in err
    assert "encoder-decoder generation is not served yet" in err
    assert not (tmp_path / "out").exists()
