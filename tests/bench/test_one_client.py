"""benchmarks/one_client.py: one request at a time through session.run, the device runner and
BatchedSession, on the session a lone request runs on (CPU here; scripts/gpu-check.sh runs it on CUDA)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def one_client():
    spec = importlib.util.spec_from_file_location("ortbatch_one_client", ROOT / "benchmarks" / "one_client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_paths_at_each_length(one_client, embed_path: Path, tmp_path: Path, no_thread_leak: None, capsys) -> None:
    out = tmp_path / "one.json"
    assert (
        one_client.main(
            [str(embed_path), "--lengths", "3,17", "--requests", "7", "--max-id", "100", "--json", str(out)]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["provider"] == "CPUExecutionProvider" and data["requests"] == 7
    assert set(data["lengths"]) == {"3", "17"}
    for row in data["lengths"].values():
        for mode in one_client.MODES:
            assert 0 < row[mode]["p50_ms"] <= row[mode]["p90_ms"]
        assert row["batched_minus_direct_p50_ms"] == pytest.approx(row["batched"]["p50_ms"] - row["direct"]["p50_ms"])
    assert "| 17 |" in capsys.readouterr().out
    assert set(data["provider_options"]) == {"batched", "separate"}
    assert data["modes"] == list(one_client.MODES)


def test_a_path_that_answers_differently_is_an_error(one_client, embed_path: Path, monkeypatch) -> None:
    from ortbatch._ort import binding

    real = binding.DeviceRunner.run

    def off_by_one(self, b, feed, names):
        return [o + 1 for o in real(self, b, feed, names)]

    monkeypatch.setattr(binding.DeviceRunner, "run", off_by_one)
    with pytest.raises(AssertionError, match="binding at length 4"):
        one_client.measure(str(embed_path), "cpu", [4], 2, max_id=100)


@pytest.mark.parametrize("args", [["--lengths", "a,b"], ["--lengths", "0"], ["--requests", "0"], ["--max-id", "1"]])
def test_bad_arguments_are_usage_errors(one_client, embed_path: Path, args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        one_client.main([str(embed_path), *args])
    assert exc.value.code == 2
