"""``ortbatch run`` holds one window in memory, whatever the input's size: the peak RSS of a
real run over four times the rows (the same rows, repeated) is that of the run over one
time, within a margin far below what the extra rows take as text (docs/bulk.md states the
bound measured on a 1 GB input). Peak RSS is the kernel's count (``ru_maxrss`` of the
finished process), not a timing."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from subprocess import DEVNULL, Popen

import pytest

from .conftest import REPO, WORDS, write_jsonl

pytestmark = pytest.mark.slow

ROWS = 600
ROW_CHARS = 8000  # as text, the 3 x ROWS extra rows of the big input take 14 MB
MARGIN_MIB = 6


def _peak_rss_mib(*args: str) -> float:
    proc = Popen(
        [sys.executable, "-m", "ortbatch.cli", "run", *args, "--quiet"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=DEVNULL,
        stderr=DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)  # (Popen.wait would not give the usage)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    return usage.ru_maxrss / 1024  # Linux reports KiB


def test_peak_memory_does_not_grow_with_the_input(encoder: Path, tmp_path: Path) -> None:
    texts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(ROW_CHARS // 3))[:ROW_CHARS] for i in range(ROWS)]
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": t} for t in texts])
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": t} for t in texts * 4])
    assert big.stat().st_size > 4 * ROWS * ROW_CHARS * 0.99
    common = ("--window", "50", "--truncate", "--format", "jsonl")
    rss_small = _peak_rss_mib(str(encoder), str(small), "-o", str(tmp_path / "out-small"), *common)
    rss_big = _peak_rss_mib(str(encoder), str(big), "-o", str(tmp_path / "out-big"), *common)
    assert rss_big - rss_small < MARGIN_MIB, (rss_small, rss_big)
    assert len(list((tmp_path / "out-big").glob("part-*"))) == 4 * ROWS // 50
