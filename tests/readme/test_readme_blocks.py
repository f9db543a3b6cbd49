"""Every shell block of README.md, run as written, in a temporary directory (issue 26, acceptance 3).

A ```bash block runs with ``bash -e -o pipefail`` in one temporary directory shared by all
blocks, in README order (a later block uses what an earlier one exported), with ``export/``,
``scripts/``, ``benchmarks/`` and ``examples/`` of this checkout linked in and ``ortbatch``
meaning this checkout's CLI on this interpreter. Each must exit 0.

An HTML comment on the line before a block says how it runs:

* ``<!-- readme-test: skip (why) -->``: not run (the network, a GPU, minutes of runtime).
  The number of skipped blocks is pinned below, so a block is never skipped silently.
* ``<!-- readme-test: server (...) -->``: its ``ortbatch serve`` line is started in the
  background on a free port (``--port 0``; ``localhost:8000`` in the lines after it points
  there); once ``/v2/health/ready`` answers, the lines after it run against the server,
  which then gets SIGTERM and must exit 0. curl fails on an HTTP error status here.

What it runs (issue 46 cut the README to the pitch and two commands; the guides' blocks run in
tests/docs): ``ortbatch demo`` (MiniLM's export, checks and a short benchmark), one server
with an embeddings request, and the tiny GPT-2's export and generate.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

pytestmark = [pytest.mark.slow, pytest.mark.export, pytest.mark.timeout(1800)]

#: blocks marked skip: the quick start (a venv from PyPI, the whole suite) and development; the
#: README is the pitch and the two commands, the guides (tests/docs) run the rest
EXPECTED_SKIPS = 2

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
_MARK = re.compile(r"<!-- readme-test: (skip|server)\b(.*?)-->\s*\Z", re.S)


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    mode: str  # "run", "skip" or "server"
    code: str


def shell_blocks(text: str) -> list[Block]:
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group(1) not in ("bash", "sh", "shell"):
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        blocks.append(Block(text.count("\n", 0, m.start()) + 1, mark.group(1) if mark else "run", m.group(2)))
    return blocks


def test_the_readme_marks_its_blocks() -> None:
    blocks = shell_blocks(README.read_text())
    assert sum(b.mode == "skip" for b in blocks) == EXPECTED_SKIPS, [(b.line, b.mode) for b in blocks]
    assert sum(b.mode != "skip" for b in blocks) >= 2  # the two commands, run as written
    for b in blocks:
        if b.mode == "server":
            assert len(re.findall(r"^ortbatch serve ", b.code, re.M)) == 1, b


@pytest.fixture
def workdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    for name in ("export", "scripts", "benchmarks", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    cli = bin_dir / "ortbatch"
    cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ortbatch.cli "$@"\n')
    cli.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return tmp_path, env


def _bash(code: str, cwd: Path, env: dict[str, str], what: str) -> None:
    # curl fails on an HTTP error status (the README's `curl -s` alone would exit 0 on a 500)
    prelude = 'set -e -o pipefail\ncurl() { command curl --fail-with-body --max-time 60 "$@"; }\n'
    out = subprocess.run(
        ["bash", "-c", prelude + code], cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert out.returncode == 0, (
        f"{what} exited {out.returncode}:\n{code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    )


def _serve_line(line: str) -> list[str]:
    command = line.split("#", 1)[0].split()
    assert command[:2] == ["ortbatch", "serve"], line
    return [sys.executable, "-m", "ortbatch.cli", *command[1:], "--port", "0"]


def _run_server_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    lines = block.code.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("ortbatch serve "))
    if "".join(lines[:at]).strip():
        _bash("".join(lines[:at]), cwd, env, f"README line {block.line}, before its server")
    log = cwd / f"serve-{block.line}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(_serve_line(lines[at]), cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        # bounded: the server says where it listens once its model is loaded, or it exits
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on http://(\S+)", log.read_text(errors="replace"))):
            assert proc.poll() is None, f"README line {block.line}: the server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"README line {block.line}: no server after 300 s:\n{log.read_text()}"
            time.sleep(0.1)
        address = m.group(1)
        rest = "".join(lines[at + 1 :])
        rest = rest.replace("localhost:8000", address).replace("127.0.0.1:8000", address)
        _bash(f"curl -s {address}/v2/health/ready\n" + rest, cwd, env, f"README line {block.line}, against its server")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == 0, f"README line {block.line}: the server exited {code} on SIGTERM:\n{log.read_text()}"


def test_every_offline_shell_block_of_the_readme_runs(workdir: tuple[Path, dict[str, str]]) -> None:
    cwd, env = workdir
    ran = 0
    for block in shell_blocks(README.read_text()):
        if block.mode == "skip":
            continue
        if block.mode == "server":
            _run_server_block(block, cwd, env)
        else:
            _bash(block.code, cwd, env, f"README line {block.line}")
        ran += 1
    assert ran == len(shell_blocks(README.read_text())) - EXPECTED_SKIPS
    assert (cwd / "exports" / "minilm" / "ortbatch.json").is_file()
    assert (cwd / "exports" / "tiny-gpt2" / "ortbatch.json").is_file()
