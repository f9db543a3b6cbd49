"""The generation benchmark's modes agree token for token (on the fake decoder, no torch)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "benchmarks" / "generation.py"
    spec = importlib.util.spec_from_file_location("ortbatch_generation_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_modes_agree_and_report(bench, fake_dir: Path, tmp_path: Path, no_thread_leak: None) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    rc = bench.main(
        [
            "--model",
            str(fake_dir),
            "--requests",
            "10",
            "--prompt-lengths",
            "2-12",
            "--new-tokens",
            "3-20",
            "--max-batch-size",
            "4",
            "--modes",
            "sequential,static,continuous,continuous-logprobs,continuous-export-graph,genai",
            "--json",
            str(out_json),
            "--markdown",
            str(out_md),
        ]
    )
    assert rc == 0
    data = json.loads(out_json.read_text())
    modes = {r["mode"]: r for r in data["results"]}
    assert set(modes) == {"sequential", "static", "continuous", "continuous-logprobs", "continuous-export-graph"}
    assert all(r["same_as_sequential"] == 10 for r in modes.values())
    assert len({r["tokens"] for r in modes.values()}) == 1
    assert "genai" in data["skipped"]  # not a Llama preset: said why, not silently dropped
    assert "| continuous |" in out_md.read_text()
    assert "continuous-logprobs / continuous tokens/s:" in out_md.read_text()
    assert modes["continuous-logprobs"]["note"].startswith("logprobs=5 on every row")


def test_baselines_on_the_rewritten_graph(bench, tiny_gpt2, tmp_path: Path, no_thread_leak: None) -> None:
    """--baseline-graph rewritten: the plain loop runs BatchedGenerator's graph on the
    export's own cache; every mode, rewritten or not, in place or not, with or without the
    prefix cache, produces the same tokens, and each says which graph and cache it ran."""
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    args = ["--model", str(tiny_gpt2.export), "--requests", "6", "--prompt-lengths", "3-9", "--new-tokens", "2-9"]
    modes = "sequential,static,continuous,continuous-concat,continuous-no-prefix-cache,continuous-export-graph"
    rc = bench.main(
        [
            *args,
            *("--max-batch-size", "3", "--shared-prefix", "20", "--modes", modes, "--baseline-graph", "rewritten"),
            *("--json", str(out_json), "--markdown", str(out_md)),
        ]
    )
    assert rc == 0
    results = {r["mode"]: r for r in json.loads(out_json.read_text())["results"]}
    assert all(r["same_as_sequential"] == 6 for r in results.values())
    assert len({r["outputs_sha256"] for r in results.values()}) == 1
    rewritten = "graph rewrites: attention-scale-after-scores, last-position-logits"
    for mode in ("sequential", "static", "continuous-concat"):
        assert rewritten in results[mode]["note"], mode
    assert "graph rewrites: in-place-kv-cache, last-position-logits" in results["continuous"]["note"]
    assert results["continuous"]["kv_cache"] == "in-place" and results["continuous-concat"]["kv_cache"] == "concat"
    assert "prefix cache 5 hits, 80 tokens saved" in results["continuous"]["note"]  # 16 of the shared 20
    assert "prefix cache" not in results["continuous-no-prefix-cache"]["note"]
    assert "graph rewrites: none" in results["continuous-export-graph"]["note"]
    text = out_md.read_text()
    assert "continuous / continuous-concat: tokens/s" in text and "same tokens 6/6" in text
