"""benchmarks/peers.py: the target verdicts and the generated sections of docs/benchmarks.md,
from a fabricated report (no peers are run here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("bench_peers", PEERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(mode: str, c: int, rps: float, p50: float = 10.0, padding: float = 0.0, digest: str = "d") -> dict:
    return {
        "mode": mode,
        "concurrency": c,
        "requests_per_s": rps,
        "tokens_per_s": rps * 12,
        "latency_ms": {"p50": p50, "p95": p50 * 2, "p99": p50 * 3},
        "mean_rows_per_batch": 1.0,
        "padding_fraction": padding,
        "request_digest": digest,
        "truncated": False,
        "errors": 0,
        "completed": 100,
        "served": 100,
        "batches": 100,
        "rows_histogram": {"1": 100},
    }


def _own(lengths: str, direct: float, batched: float, oracle: float, padding: float, p50_1: tuple) -> dict:
    results = [
        _result("direct", 1, 50, p50_1[0]),
        _result("batched", 1, 50, p50_1[1]),
        _result("oracle", 1, 60),
        _result("direct", 64, direct),
        _result("batched", 64, batched, padding=padding),
        _result("oracle", 64, oracle),
    ]
    ratios = [
        {
            "concurrency": 1,
            "batched_over_direct": 1.0,
            "batched_over_oracle": 50 / 60,
            "p50_batched_over_direct": p50_1[1] / p50_1[0],
        },
        {"concurrency": 64, "batched_over_direct": batched / direct, "batched_over_oracle": batched / oracle},
    ]
    return {
        "results": results,
        "ratios": ratios,
        "workload": {"digest": "d", "requests": 100, "tokens": 1200},
        "machine": {
            "cpu": "test cpu",
            "cores": 2,
            "platform": "linux",
            "python": "3.11",
            "numpy": "2",
            "onnxruntime": "1.32",
        },
        "settings": {"direct": {"session": {"intra_op_num_threads": 0}}, "batched": {"workers": 2}},
        "checks": {"reference": "direct", "batched": {"max_abs_diff": {"out": 0.0}, "ok": True}},
        "overhead": {
            "us_per_request_at_saturation": 80.0,
            "concurrency": 64,
            "lengths": "8-16",
            "requests": 10,
            "workers": 2,
            "rows": [
                {"label": "batched", "us_per_request": 80.0, "cpu_us_per_request": 70.0, "mean_rows_per_batch": 9.0}
            ],
        },
        "config": {},
        "target": {},
    }


def _report() -> dict:
    short = _own("8-16", direct=400, batched=700, oracle=540, padding=0.05, p50_1=(4.0, 4.1))
    long = _own("8-128", direct=80, batched=90, oracle=89, padding=0.2, p50_1=(20.0, 22.0))
    long["overhead"] = None
    return {
        "started": "now",
        "export": "x",
        "commands": ["ortbatch bench x"],
        "loadavg": [[1, 1, 1]],
        "peer_concurrency": "64",
        "workloads": {
            "8-16": {
                "ortbatch": short,
                "skipped": {"ray": "not installed"},
                "peers": {
                    "bi-seq": {"workload": {"digest": "d"}, "results": [_result("bi-seq", 64, 420)]},
                    "bi-bucket": {
                        "workload": {"digest": "OTHER"},
                        "results": [_result("bi-bucket", 64, 600, digest="OTHER")],
                    },
                },
            },
            "8-128": {"ortbatch": long, "skipped": {}, "peers": {}},
        },
    }


def test_targets_are_judged_from_the_figures(peers) -> None:
    verdicts = {name: (value, ok) for name, value, _need, ok in peers.targets(_report())}
    assert verdicts["batched ÷ direct, 8-16, 64 clients"] == ("1.75x", True)
    assert verdicts["batched ÷ direct, 8-128, 64 clients"] == ("1.12x", False)
    assert verdicts["batched ÷ oracle, 8-128, 64 clients"][1] is True
    assert verdicts["batched ÷ batch-inference SeqBatcher, 8-16"] == ("1.67x", True)
    # its digest differs from ortbatch's: no verdict from a different request set
    assert verdicts["batched ÷ batch-inference BucketSeqBatcher, 8-16"] == ("different requests: not comparable", None)
    assert verdicts["batched ÷ batch-inference SeqBatcher, 8-128"] == ("not measured", None)
    assert verdicts["padding fraction, 8-128, 64 clients"] == ("20.0%", False)
    assert verdicts["one client: p50 batched ÷ direct, 8-16"] == ("1.025", True)
    assert verdicts["one client: p50 batched ÷ direct, 8-128"] == ("1.100", False)
    assert verdicts["runtime overhead per request (64 clients, identity model)"] == ("80 µs", True)


def test_docs_sections_are_replaced_and_prose_kept(peers, tmp_path: Path) -> None:
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text(
        "# Benchmarks\n\nhand-written prose\n\n<!-- generated:peers -->\nold table\n"
        "<!-- /generated:peers -->\n\n## Generation\n\nreserved\n"
    )
    peers.write_docs(_report(), docs)
    text = docs.read_text()
    assert "hand-written prose" in text and "## Generation\n\nreserved" in text
    assert "old table" not in text
    assert text.count("<!-- generated:peers -->") == 1
    assert "| 8-16 | Ray Serve @serve.batch (handle) | - | skipped: not installed |" in text
    # a peer whose requests differ from ortbatch's is flagged, not silently compared
    assert "batch-inference BucketSeqBatcher DIFFERENT REQUESTS" in text
    for name in ("machine", "commands", "cpu", "overhead", "targets"):
        assert f"<!-- generated:{name} -->" in text and f"<!-- /generated:{name} -->" in text
    assert (docs.parent / "benchmarks-peers.png").read_bytes()[:4] == b"\x89PNG"
    # rerunning replaces, never duplicates
    peers.write_docs(_report(), docs)
    assert docs.read_text().count("<!-- generated:targets -->") == 1


def test_the_tracked_docs_are_written_only_with_the_docs_flag(peers, tmp_path: Path) -> None:
    repo = PEERS.parents[1]
    default = peers.parse_args(["--export", "x"])
    assert peers.docs_path(default) == repo / "out" / "peers" / "benchmarks.md"
    assert peers.docs_path(peers.parse_args(["--export", "x", "--out", str(tmp_path)])) == tmp_path / "benchmarks.md"
    assert peers.docs_path(peers.parse_args(["--export", "x", "--docs"])) == repo / "docs" / "benchmarks.md"
