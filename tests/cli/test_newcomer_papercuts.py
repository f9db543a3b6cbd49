"""Issue 46's papercuts: what a newcomer's first mistakes print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ortbatch.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_a_mistyped_flag_is_said_first_and_the_usage_does_not_bury_it(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--prot", "1"])
    err = capsys.readouterr().err.splitlines()
    assert info.value.code == 2
    assert err[0] == "ortbatch serve: error: unrecognized arguments: --prot", err
    assert err[1].strip() == "--prot: did you mean --port?", err
    # serve's full usage is ~30 lines: a pointer to --help stands in for it
    assert len(err) <= 4 and "ortbatch serve --help" in err[-1], err


def test_a_short_usage_is_still_printed_whole(capsys):
    with pytest.raises(SystemExit):
        main(["--bogus"])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ortbatch: error: unrecognized arguments: --bogus")
    assert err[1].startswith("usage: ortbatch [")


def test_python_dash_m_ortbatch_runs_the_command_line():
    done = subprocess.run(
        [sys.executable, "-m", "ortbatch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ortbatch") and "serve" in done.stdout


def test_serving_a_checkpoint_folder_suggests_exporting_it_elsewhere(tmp_path, capsys):
    ckpt = tmp_path / "my-bert"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["serve", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "is a model checkpoint (config.json), not an export" in err, err
    assert f"`ortbatch export {ckpt} -o exports/my-bert`" in err, err
    assert f"-o {ckpt}`" not in err, err  # exporting into the checkpoint itself is not the fix
