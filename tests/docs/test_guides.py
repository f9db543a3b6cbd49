"""Issue 46, acceptances 1 and 4: every shell block of Getting started and of each guide runs as
written, in the site's order, as the README's blocks do (tests/readme): in one temporary
directory shared by all pages (a guide uses what an earlier one exported), with ``export/``,
``scripts/``, ``benchmarks/`` and ``examples/`` of this checkout linked in and ``ortbatch``
meaning this checkout's CLI. ``checkpoints/sentiment``, ``checkpoints/reranker`` and
``checkpoints/ner``, which the guides name as "your checkpoint folder", are tiny random
transformers checkpoints with real tokenizers, made here.

An HTML comment on the line before a block says how it runs:

* ``<!-- docs-test: skip (why) -->``: not run (the network, a GPU, a cluster). Every skip
  gives its reason, and the number of skips is pinned below, so none is silent.
* ``<!-- docs-test: server (...) -->``: its ``ortbatch serve`` line is started in the
  background on a free port (``localhost:8000`` in the lines after it points there, over
  HTTPS when the server says so); once it says where it listens, the lines after it run
  against it, then it gets SIGTERM and must exit 0.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.readme.test_readme_blocks import _FENCE, _bash, workdir  # noqa: F401 - workdir is a fixture

REPO = Path(__file__).resolve().parents[2]
#: the pages whose blocks run, in the site's order (mkdocs.yml's nav)
PAGES = [
    "docs/getting-started.md",
    "docs/guides/embeddings.md",
    "docs/guides/classifiers.md",
    "docs/guides/llms.md",
    "docs/guides/bulk-jobs.md",
    "docs/guides/gpu.md",
    "docs/guides/scale-out.md",
    "docs/guides/operations.md",
]
#: install lines x2 (the network), gpt2 from the hub, GPU validate/serve/bench, Ray, containers
EXPECTED_SKIPS = 8

_MARK = re.compile(r"<!-- docs-test: (skip|server)\b(.*?)-->\s*\Z", re.S)

pytestmark = [pytest.mark.slow, pytest.mark.export, pytest.mark.timeout(2400)]


def blocks(page: str) -> list[tuple[int, str, str, str]]:
    """``(line, mode, reason, code)`` of each shell block of ``page``."""
    text = (REPO / page).read_text()
    out = []
    for m in _FENCE.finditer(text):
        if m.group(1) not in ("bash", "sh", "shell"):
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        mode, reason = (mark.group(1), mark.group(2).strip()) if mark else ("run", "")
        out.append((text.count("\n", 0, m.start()) + 1, mode, reason, m.group(2)))
    return out


def test_every_guide_marks_its_blocks_and_gives_each_skip_a_reason() -> None:
    found = [(page, b) for page in PAGES for b in blocks(page)]
    skips = [(page, line, reason) for page, (line, mode, reason, _) in found if mode == "skip"]
    assert len(skips) == EXPECTED_SKIPS, skips
    assert all(reason.startswith("(") and len(reason) > 10 for _, _, reason in skips), skips
    for page in PAGES[1:]:  # acceptance 4: each guide's first command runs
        assert blocks(page) and blocks(page)[0][1] != "skip", page


def _run_server(page: str, line: int, code: str, cwd: Path, env: dict[str, str]) -> None:
    lines = code.splitlines(keepends=True)
    at = next(i for i, x in enumerate(lines) if x.startswith("ortbatch serve "))
    where = f"{page} line {line}"
    if "".join(lines[:at]).strip():
        _bash("".join(lines[:at]), cwd, env, f"{where}, before its server")
    command = lines[at].split("#", 1)[0].split()
    log = cwd / f"serve-{Path(page).stem}-{line}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ortbatch.cli", *command[1:], "--port", "0"],
            cwd=cwd,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on (https?)://(\S+)", log.read_text(errors="replace"))):
            assert proc.poll() is None, f"{where}: the server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"{where}: no server after 300 s:\n{log.read_text()}"
            time.sleep(0.1)
        scheme, address = m.groups()
        port = address.rsplit(":", 1)[1]
        rest = "".join(lines[at + 1 :]).replace("localhost:8000", f"localhost:{port}")
        rest = rest.replace("127.0.0.1:8000", address)
        ready = f"curl -s {'-k ' if scheme == 'https' else ''}{scheme}://{address}/v2/health/ready\n"
        _bash(ready + rest, cwd, env, f"{where}, against its server")
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert exit_code == 0, f"{where}: the server exited {exit_code} on SIGTERM:\n{log.read_text()}"


@pytest.fixture
def checkpoints(workdir: tuple[Path, dict[str, str]]) -> tuple[Path, dict[str, str]]:  # noqa: F811
    from tests.integration.conftest import build_tiny

    cwd, env = workdir
    for name, kind in (("sentiment", "bert-cls"), ("reranker", "bert-rerank"), ("ner", "bert-tok")):
        build_tiny(kind, cwd / "checkpoints" / name)
    return cwd, env


def test_every_offline_shell_block_of_the_guides_runs(checkpoints: tuple[Path, dict[str, str]]) -> None:
    cwd, env = checkpoints
    ran = 0
    for page in PAGES:
        for line, mode, _, code in blocks(page):
            if mode == "skip":
                continue
            if mode == "server":
                _run_server(page, line, code, cwd, env)
            else:
                _bash(code, cwd, env, f"{page} line {line}")
            ran += 1
    assert ran == sum(len(blocks(p)) for p in PAGES) - EXPECTED_SKIPS
    for export in ("minilm", "sentiment", "reranker", "ner", "tiny-gpt2", "sentiment-fp16"):
        assert (cwd / "exports" / export / "ortbatch.json").is_file(), export
    assert (cwd / "embeddings" / "_manifest.json").is_file()
