"""Duck-typed sessions for server tests: what ``run_async`` does is the test's script."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


def start_script_server(source: str, directory: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    """Run the Python ``source`` (a script that ends in ``ortbatch.serve.server.serve``) in a
    subprocess; returns it, its URL once it prints ``listening on URL``, and its log."""
    script = directory / "server_script.py"
    script.write_text(source)
    log = directory / "server_script.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(script), *args], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 60
    while not (m := re.search(r"listening on (http://\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(log.read_text())
        time.sleep(0.05)
    return proc, m.group(1), log


class ScriptedSession:
    """Duck-typed session whose run_async does what the test says."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.closed = False
        self.max_batch_size = 4
        self.manifest = None

    def get_inputs(self):
        return [SimpleNamespace(name="x", type="tensor(float)", shape=["batch", 3])]

    def get_outputs(self):
        return [SimpleNamespace(name="y", type="tensor(float)", shape=["batch", 3])]

    async def run_async(self, names, feed):
        return await self.behaviour(feed)

    def stats(self):
        return SimpleNamespace(
            queued=0, padding_fraction=0.0, requests=0, batches=0, errors={}, rows_histogram={}, rows=0
        )

    def close(self, drain=True):
        self.closed = True


class ScriptedTokenSession(ScriptedSession):
    def get_inputs(self):
        return [
            SimpleNamespace(name=n, type="tensor(int64)", shape=["batch", "sequence"])
            for n in ("input_ids", "attention_mask")
        ]

    def get_outputs(self):
        return [SimpleNamespace(name="pooled", type="tensor(float)", shape=["batch", 4])]
