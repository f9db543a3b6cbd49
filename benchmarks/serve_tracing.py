"""What tracing costs a server: ``/v1/embeddings`` throughput of the code before tracing
(a checkout of main: --base), this tree with tracing off, and this tree exporting every
span to an OTLP/HTTP receiver in this process (--otlp), alternated round by round so the
three share the machine's load.

    git worktree add /tmp/ortbatch-base main
    python benchmarks/serve_tracing.py --base /tmp/ortbatch-base --rounds 3 --duration 10

Each cell starts ``ortbatch serve`` from its tree (PYTHONPATH), warms it up, then
``wrk`` posts one small embedding request from --connections keep-alive connections for
--duration seconds. The model is the tests' tiny BERT-like encoder (``--export tiny``,
built here; a few microseconds of compute, so the per-request cost of the server is what
is measured) or any feature-extraction export directory. Prints per cell requests/s and
the server's CPU microseconds per request (its /proc counters over the counted seconds:
less sensitive than the rate to other load on a shared machine) and, per round, the CPU
per request of each against the base.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that reads each export and answers 200 (an empty
    ExportTraceServiceResponse), counting the bytes."""

    received = 0

    def do_POST(self) -> None:
        _Sink.received += len(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _server(tree: Path, export: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "ortbatch.cli", "serve", str(export), "--name", "m", "--port", "0"]
    cmd += ["--no-access-log", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tree)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text(errors='replace')}")


def _wrk(url: str, script: Path, connections: int, seconds: float) -> float:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "30s", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    ).stdout
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        raise RuntimeError(f"{bad.group(1)} requests failed:\n{out}")
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    if rate is None:
        raise RuntimeError(f"wrk said:\n{out}")
    return float(rate.group(1))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cell(tree: Path, export: Path, extra: list[str], args: argparse.Namespace, work: Path) -> tuple[float, float]:
    """Requests/s, and the server's CPU microseconds per request (less sensitive to other
    load on the machine than the rate)."""
    proc, url = _server(tree, export, extra, work / "server.log")
    try:
        script = work / "post.lua"
        _wrk(url + "/v1/embeddings", script, args.connections, args.warmup)
        cpu = _cpu_s(proc.pid)
        rate = _wrk(url + "/v1/embeddings", script, args.connections, args.duration)
        return rate, (_cpu_s(proc.pid) - cpu) / (rate * args.duration) * 1e6
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _export(spec: str, work: Path) -> Path:
    if spec != "tiny":
        return Path(spec)
    sys.path.insert(0, str(REPO / "tests" / "serve"))
    from tinymodels import build_encoder

    return build_encoder(work / "tiny")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="a checkout of the code before tracing (main)")
    p.add_argument("--export", default="tiny", help="'tiny' (built here) or a feature-extraction export")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=10.0, help="counted seconds per cell")
    p.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds per cell")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--text", default="The quick brown fox jumps over the lazy dog.")
    args = p.parse_args(argv)
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    otlp = f"http://127.0.0.1:{sink.server_address[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        export = _export(args.export, work)
        body = json.dumps({"input": args.text.replace("'", "")})
        (work / "post.lua").write_text(
            f"wrk.method = 'POST'\nwrk.body = '{body}'\nwrk.headers['Content-Type'] = 'application/json'\n"
        )
        cells = [("main", args.base.resolve(), []), ("off", REPO, []), ("on", REPO, ["--otlp-endpoint", otlp])]
        print(f"load at start: {os.getloadavg()[0]:.1f}; {args.connections} connections, {args.duration:g} s a cell")
        for r in range(1, args.rounds + 1):
            got = {name: _cell(tree, export, extra, args, work) for name, tree, extra in cells}
            line = ", ".join(f"{k} {rate:.0f}/s {cpu:.0f} us" for k, (rate, cpu) in got.items())
            main_cpu = got["main"][1]
            ratio = f"CPU per request off/main {got['off'][1] / main_cpu:.3f}, on/main {got['on'][1] / main_cpu:.3f}"
            print(f"round {r}: {line}; {ratio}; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"OTLP bytes received with tracing on: {_Sink.received}")
    sink.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
