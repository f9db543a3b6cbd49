"""scripts/gpu-check.sh stays inside what one device call allows (its dry run in CI runs
it for real; this checks the parts a dry run cannot: the GPU steps' time limits)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def _limits(mode: str) -> dict[str, int]:
    text = SCRIPT.read_text()
    common = dict(re.findall(r"\b(T_[A-Z]+)=(\d+)", text.split('if [ "$MODE" = quick ]')[0].split("# step limits")[1]))
    quick, full = text.split('if [ "$MODE" = quick ]; then', 1)[1].split("else", 1)
    full = full.split("fi", 1)[0]
    part = dict(re.findall(r"\b(T_[A-Z]+)=(\d+)", quick if mode == "quick" else full))
    return {k: int(v) for k, v in {**common, **part}.items()}


@pytest.mark.parametrize(("mode", "budget"), [("full", 420), ("quick", 360)])
def test_the_gpu_steps_limits_fit_the_budget(mode, budget):
    t = _limits(mode)
    # what runs on a GPU machine without TensorRT: install, probe, tests, model, two CUDA
    # benches, generation, time to ready (T_COLLECT runs only in --dry or without CUDA)
    total = sum(t[k] for k in ("T_INSTALL", "T_PROBE", "T_PYTEST", "T_MODEL", "T_GEN", "T_READY")) + 2 * t["T_BENCH"]
    assert total <= budget, (mode, total, t)


def test_every_step_runs_under_a_limit_and_the_script_parses():
    text = SCRIPT.read_text()
    calls = [line for line in text.splitlines() if line.strip().startswith("run_step ")]
    assert calls and all(re.match(r'\s*run_step "?\$?[A-Z_0-9]+"? ', c) for c in calls), calls
    assert "timeout --kill-after" in text
    assert "--import-mode=importlib" in text  # never dropped when addopts is overridden
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
