"""Fixtures for the server tests: tiny exports built offline, servers on free
loopback ports (each stopped by the fixture that started it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("tokenizers")
pytest.importorskip("onnx")

sys.path.insert(0, str(Path(__file__).parent))

from tinymodels import build_adder, build_encoder

from ortbatch.serve import BackgroundServer, ServeConfig, ServedModel

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder(tmp_path_factory.mktemp("exports") / "tiny-encoder")


@pytest.fixture(scope="session")
def task_dirs(tmp_path_factory: pytest.TempPathFactory, encoder_dir: Path) -> dict[str, Path]:
    """Tiny exports of every task the task endpoints serve (tinytasks.py), by model name."""
    from tinytasks import build_classifier, build_tagger

    root = tmp_path_factory.mktemp("tasks")
    return {
        "embedder": encoder_dir,
        "reranker": build_classifier(root / "reranker", num_labels=1),
        "sentiment": build_classifier(root / "sentiment", num_labels=3),
        "ner": build_tagger(root / "ner"),
    }


@pytest.fixture(scope="session")
def adder_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adder(tmp_path_factory.mktemp("bare") / "adder.onnx")


def _config(**kw: object) -> ServeConfig:
    base: dict[str, object] = {"port": 0, "access_log": False, "log_level": "warning"}
    base.update(kw)
    return ServeConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def encoder_server(encoder_dir: Path) -> Iterator[BackgroundServer]:
    model = ServedModel.load(encoder_dir, name="tiny", session_kwargs={"max_batch_size": 8})
    with BackgroundServer(model, _config(max_body_bytes=1 << 20)) as srv:
        yield srv


@pytest.fixture(scope="module")
def adder_server(adder_path: Path) -> Iterator[BackgroundServer]:
    model = ServedModel.load(adder_path, session_kwargs={"max_batch_size": 8})
    with BackgroundServer(model, _config()) as srv:
        yield srv


class ServeProcess:
    """``python -m ortbatch.cli serve ...`` in a subprocess; stderr goes to a file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ortbatch.cli", "serve", *args, "--port", "0", "--log-level", "warning"],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
        self.url = self._wait_url(timeout=60.0)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"listening on (https?://\S+)", self.text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.text()}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._fh.close()


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[type]:
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        p = ServeProcess(list(args), tmp_path / f"serve-{len(started)}.log")
        started.append(p)
        return p

    yield start  # type: ignore[misc]
    for p in started:
        p.stop()
