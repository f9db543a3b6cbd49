"""Issue 46: startup that speaks. ``ortbatch serve`` says each stage as it happens (loading,
loaded with what the warm-up ran, listening), and on the CPU provider the warm-up is the one
smallest request, so the server is ready in about the time it takes to load the model."""

from __future__ import annotations

import re
from pathlib import Path

import httpx


def test_serve_says_loading_then_what_the_warm_up_ran_then_listening(serve_process, encoder_dir: Path) -> None:
    server = serve_process(str(encoder_dir))
    lines = [line for line in server.text().splitlines() if line.startswith("ortbatch serve:")]
    stages = [line.split(": ", 1)[1] for line in lines if "was never checked" not in line]
    assert stages[0] == f"loading {encoder_dir}", lines
    assert re.fullmatch(
        r"loaded in \d+\.\ds \(warm-up: 1 shape \(1x1 rows x tokens\) on \d session\(s\), CPUExecutionProvider, "
        r"\d+\.\d\ds\)",
        stages[1],
    ), lines
    assert "listening on " + server.url in stages[2], lines
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
