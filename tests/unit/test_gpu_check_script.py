"""scripts/gpu-check.sh stays inside what one device call allows (its dry run in CI runs
it for real; this checks the parts a dry run cannot: the GPU steps' time limits)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def _run_step(deadline_in: int, limit: int, command: str = "true", steps: str = "") -> str:
    """The script's own run_step, cut out of it, run with a deadline ``deadline_in`` seconds away."""
    text = SCRIPT.read_text()
    body = text[text.index("run_step() {") :]
    body = body[: body.index("\n}\n") + 3]
    script = f"""
set -uo pipefail
WORK=$(mktemp -d); FAILED=(); BUDGET=77; STEPS="{steps}"
DEADLINE=$(($(date +%s) + {deadline_in}))
{body}
run_step {limit} "9. a step" {command}
echo "rc=$? failed=${{#FAILED[@]}}"; cat "$WORK/steps.tsv"; rm -rf "$WORK"
"""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_budget_caps_each_step_and_skips_what_cannot_start() -> None:
    # far from the deadline a step keeps its own limit
    assert "9. a step (limit 100s)" in _run_step(10_000, 100)
    # near it, the limit shrinks to what is left less 20 s for the summary
    out = _run_step(520, 600)
    limit = int(re.search(r"9\. a step \(limit (\d+)s\)", out)[1])  # type: ignore[index]
    assert 400 < limit <= 500, out
    # past it, the step does not start, is recorded NOT RUN, and counts as a failure
    out = _run_step(0, 100, "touch /nonexistent/never")
    assert "NOT RUN (the 77s budget is spent)" in out and "rc=1 failed=1" in out
    assert "9. a step\tnot run\t0\t100" in out
    # a step STEPS leaves out is neither run nor counted, whatever time is left
    out = _run_step(0, 100, "touch /nonexistent/never", steps="5,8")
    assert "not selected (STEPS=5,8)" in out and "rc=0 failed=0" in out and "NOT RUN" not in out
    assert "9. a step (limit 100s)" in _run_step(10_000, 100, steps="9")


def test_the_default_budget_fits_one_device_call() -> None:
    # a device call runs at most 600 s: the budget, then the summary and the tarball
    budget = int(re.search(r'BUDGET="\$\{BUDGET:-(\d+)\}"', SCRIPT.read_text())[1])  # type: ignore[index]
    assert budget <= 560


def test_every_step_runs_under_a_limit_and_the_script_parses():
    text = SCRIPT.read_text()
    calls = [line for line in text.splitlines() if line.strip().startswith("run_step ")]
    assert calls and all(re.match(r'\s*run_step "?\$?[A-Z_0-9]+"? ', c) for c in calls), calls
    assert "timeout --kill-after" in text
    assert "--import-mode=importlib" in text  # never dropped when addopts is overridden
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
