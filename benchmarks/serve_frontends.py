"""``ortbatch serve --frontends N``: requests/s of N front-end processes against one, with a
compiled load generator, in one run.

    python benchmarks/serve_frontends.py --model identity --frontends 1,2 --concurrency 16,64,256
    python benchmarks/serve_frontends.py --model exports/minilm --lengths 8-16 --frontends 1,2 \\
        --modes inproc,http-binary,grpc --concurrency 16,64

Needs ``wrk`` (HTTP) and ``h2load`` (gRPC over HTTP/2): on Debian/Ubuntu
``apt-get install -y wrk nghttp2-client``; without them the script says so and stops
(the Python clients of benchmarks/serve_cost.py cost more CPU than the server they load
on a 2-core machine, so they would measure themselves).

Every server (``ortbatch serve MODEL --frontends N --grpc-port 0``) is started first and
the cells are interleaved (for each client count and mode, every N in turn), so drift in
the machine's load hits each alike; an idle server costs nothing. The loads:

* ``http-json`` / ``http-binary``: ``wrk -t1 -cC`` keep-alive connections cycling through
  pre-serialized KServe v2 requests (distinct random inputs; binary: the
  ``Inference-Header-Content-Length`` form, binary outputs);
* ``grpc``: ``h2load`` on C concurrent streams (C/2 connections of 2 streams, at most 64
  connections), split over up to 8 h2load processes that each send their own
  pre-serialized ModelInferRequest (raw_input_contents) from the same pool;
* ``inproc``: the same requests from C asyncio tasks on one BatchedSession in this process.

Correctness: while each load runs, a checker in this process sends a sample of distinct
requests (one at a time, over the same protocol) and compares every answer with a direct
ONNX Runtime run of its own request; and the server's ``ortbatch_session_failures`` must
not move. A cell with a wrong answer or an error says so in the table. Each cell also
reports the CPU seconds used per answered request by the server's processes (engine +
front ends) and by the load generator, read from /proc: what each request costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import serve_cost
from serve_cost import _inproc, _ok, build_identity, build_pool

MODES = ("http-json", "http-binary", "grpc")
#: distinct gRPC requests, one per h2load process (at most one process per connection)
GRPC_BODIES = 8
_DT = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (all their threads) so far."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


class Server(serve_cost.Server):
    """``ortbatch serve MODEL --frontends N --grpc-port 0`` in a subprocess; ``pids`` are
    the engine's and its front ends'."""

    def __init__(self, model: Path, name: str, frontends: int, args: argparse.Namespace, log: Path) -> None:
        extra = ("--frontends", str(frontends), "--max-queue", "8192", "--limit-concurrency", "4096")
        extra += tuple(args.server_args.split())
        super().__init__(model, name, args.max_batch_size, log, extra)
        self.frontends = frontends
        p = re.search(r"pids ([\d, ]+)\)", self.text)
        self.pids = [self.proc.pid] + ([int(x) for x in p.group(1).split(", ")] if p else [])

    def counters(self) -> tuple[float, float, float]:
        """The sessions' failures, batches and rows so far (from /metrics)."""
        import httpx

        text = httpx.get(f"http://{self.http}/metrics", timeout=30).text

        def total(metric: str) -> float:
            return sum(float(v) for v in re.findall(rf"^{metric}(?:\{{[^}}]*\}})? ([0-9.e+]+)", text, re.M))

        rows = total("ortbatch_batch_rows_sum")
        return total("ortbatch_session_failures_total"), total("ortbatch_batch_rows_count"), rows


# -- pre-serialized requests -------------------------------------------------------------
def json_body(feed: dict[str, np.ndarray], output: str) -> bytes:
    inputs = [
        {"name": n, "datatype": _DT[a.dtype], "shape": list(a.shape), "data": a.reshape(-1).tolist()}
        for n, a in feed.items()
    ]
    return json.dumps({"inputs": inputs, "outputs": [{"name": output}]}).encode()


def binary_body(feed: dict[str, np.ndarray], output: str) -> tuple[bytes, int]:
    inputs = [
        {"name": n, "datatype": _DT[a.dtype], "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
        for n, a in feed.items()
    ]
    head = json.dumps({"inputs": inputs, "outputs": [{"name": output, "parameters": {"binary_data": True}}]}).encode()
    return head + b"".join(np.ascontiguousarray(a).tobytes() for a in feed.values()), len(head)


def grpc_message(name: str, feed: dict[str, np.ndarray], output: str) -> bytes:
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=name)
    for n, a in feed.items():
        t = req.inputs.add()
        t.name, t.datatype = n, _DT[a.dtype]
        t.shape.extend(a.shape)
        req.raw_input_contents.append(np.ascontiguousarray(a).tobytes())
    req.outputs.add().name = output
    data = req.SerializeToString()
    return b"\x00" + struct.pack(">I", len(data)) + data  # the gRPC length-prefixed message


def _lua_string(data: bytes) -> str:
    return '"' + "".join(f"\\{b}" for b in data) + '"'


def wrk_script(path: Path, url_path: str, bodies: list[tuple[bytes, dict[str, str]]]) -> Path:
    """A wrk script cycling through pre-formatted requests (formatted once, at init)."""
    lines = ["local reqs = {}", "local n = 0", "init = function(args)"]
    for body, headers in bodies:
        h = ", ".join(f'["{k}"] = "{v}"' for k, v in headers.items())
        lines.append(f'  reqs[#reqs + 1] = wrk.format("POST", "{url_path}", {{{h}}}, {_lua_string(body)})')
    lines += ["end", "request = function()", "  n = n + 1", "  return reqs[(n % #reqs) + 1]", "end"]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_wrk(url: str, script: Path, connections: int, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "30s", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    ).stdout
    reqs = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    n = int(reqs.group(1)) if reqs else 0
    bad = int(non2xx.group(1)) if non2xx else 0
    socket_errors = sum(int(x) for x in errs.groups()) if errs else 0
    return {"answered": n - bad, "errors": bad + socket_errors, "raw": out}


def h2load_command(target: str, body: Path, connections: int, streams: int, seconds: float) -> list[str]:
    """h2load posting ``body`` (a length-prefixed ModelInferRequest) as gRPC ModelInfer
    calls to ``target`` (host:port) for ``seconds``."""
    cmd = ["h2load", "-c", str(connections), "-m", str(streams), "-t1", "-D", f"{seconds:g}", "-d", str(body)]
    cmd += ["-H", "content-type: application/grpc", "-H", "te: trailers"]
    return [*cmd, f"http://{target}/inference.GRPCInferenceService/ModelInfer"]


def run_h2load(target: str, data: list[Path], concurrency: int, seconds: float) -> dict[str, Any]:
    """``concurrency`` gRPC streams from several h2load processes at once, each sending
    its own pre-serialized request (h2load posts one body), so the server sees distinct
    requests (for a text model: distinct lengths) as wrk's HTTP loads do."""
    # many connections: SO_REUSEPORT spreads connections (not streams) over the front ends,
    # so two connections would land on one front end half the time
    clients = min(max(1, concurrency // 2), 64)
    streams = max(1, concurrency // clients)
    bodies = data[: min(len(data), clients)]
    procs = []
    for i, body in enumerate(bodies):
        share = clients // len(bodies) + (1 if i < clients % len(bodies) else 0)
        cmd = h2load_command(target, body, share, streams, seconds)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    ok = errors = 0
    raw = []
    for proc in procs:
        out = proc.communicate(timeout=seconds + 60)[0]
        raw.append(out)
        m = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
        f = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed, (\d+) errored", out)
        ok += int(m.group(1)) if m else 0
        errors += (int(f.group(2)) + int(f.group(3))) if f else 1
    return {"answered": ok, "errors": errors, "raw": "\n".join(raw)}


# -- the correctness sample ----------------------------------------------------------------
class Checker(threading.Thread):
    """Distinct requests one at a time over ``mode`` while a load runs, each answer
    compared with its own request's direct ONNX Runtime run."""

    def __init__(self, mode: str, server: Server, name: str, output: str, pool: list, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.mode, self.server, self.name, self.output, self.pool, self.stop = mode, server, name, output, pool, stop
        self.checked = self.wrong = self.errors = 0

    def run(self) -> None:
        if self.mode == "grpc":
            import tritonclient.grpc as client_mod

            client: Any = client_mod.InferenceServerClient(self.server.grpc)
        else:
            import tritonclient.http as client_mod  # type: ignore[no-redef]

            client = client_mod.InferenceServerClient(self.server.http, connection_timeout=60, network_timeout=60)
        i = 0
        while not self.stop.is_set():
            item = self.pool[i % len(self.pool)]
            i += 7
            inputs = []
            for n, a in item["feed"].items():
                t = client_mod.InferInput(n, list(a.shape), _DT[a.dtype])
                if self.mode == "grpc":
                    t.set_data_from_numpy(a)
                else:
                    t.set_data_from_numpy(a, binary_data=self.mode == "http-binary")
                inputs.append(t)
            try:
                res = client.infer(self.name, inputs)
            except Exception:
                self.errors += 1
                time.sleep(0.05)
                continue
            self.checked += 1
            if not _ok(res.as_numpy(self.output), item["expected"]):
                self.wrong += 1
            time.sleep(0.02)
        client.close()


def measure(mode: str, c: int, server: Server, ctx: dict, args: argparse.Namespace) -> dict[str, Any]:
    stop = threading.Event()
    checker = Checker(mode, server, ctx["name"], ctx["output"], ctx["pool"], stop)
    failures0, batches0, rows0 = server.counters()
    checker.start()
    path = f"/v2/models/{ctx['name']}/infer"
    if args.warmup > 0:
        if mode == "grpc":
            run_h2load(server.grpc, ctx["grpc_data"], c, args.warmup)
        else:
            run_wrk(f"http://{server.http}{path}", ctx[f"{mode}-script"], c, args.warmup)
    cpu0 = cpu_seconds(server.pids)
    engine0 = cpu_seconds(server.pids[:1])
    t0 = time.monotonic()
    if mode == "grpc":
        proc_cpu = _child_cpu()
        r = run_h2load(server.grpc, ctx["grpc_data"], c, args.duration)
    else:
        proc_cpu = _child_cpu()
        r = run_wrk(f"http://{server.http}{path}", ctx[f"{mode}-script"], c, args.duration)
    wall = time.monotonic() - t0
    load_cpu = _child_cpu() - proc_cpu
    server_cpu = cpu_seconds(server.pids) - cpu0
    engine_cpu = cpu_seconds(server.pids[:1]) - engine0
    stop.set()
    checker.join(60)
    r.pop("raw")
    r["rps"] = round(r["answered"] / args.duration, 1)
    r["checked"], r["wrong"] = checker.checked, checker.wrong
    failures1, batches1, rows1 = server.counters()
    r["errors"] += checker.errors + int(failures1 - failures0)
    r["rows_per_batch"] = round((rows1 - rows0) / max(batches1 - batches0, 1), 1)
    n = max(r["answered"], 1)
    r["server_cpu_us"] = round(server_cpu / n * 1e6)
    r["engine_cpu_us"] = round(engine_cpu / n * 1e6)  # with one process: all of it
    r["load_cpu_us"] = round(load_cpu / n * 1e6)
    r["server_cores"] = round(server_cpu / wall, 2)
    return r


def _child_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="identity", help="'identity' or an export directory")
    p.add_argument("--frontends", default="1,2", help="front-end counts to compare (default 1,2)")
    p.add_argument("--concurrency", default="16,64,256")
    p.add_argument("--modes", default=",".join(MODES), help=f"of inproc,{','.join(MODES)}")
    p.add_argument("--lengths", default="8-16", help="token lengths MIN-MAX (text models)")
    p.add_argument("--duration", type=float, default=5.0, help="counted seconds per cell")
    p.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds per cell")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--pool", type=int, default=64, help="distinct requests")
    p.add_argument("--json", type=Path)
    p.add_argument("--server-args", default="", help="more ortbatch serve flags for every server (e.g. '--http h11')")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for tool, modes_of in (("wrk", ("http-json", "http-binary")), ("h2load", ("grpc",))):
        if any(m in modes_of for m in modes) and shutil.which(tool) is None:
            pkg = "wrk" if tool == "wrk" else "nghttp2-client"
            print(
                f"serve_frontends: {tool} is not installed (Debian/Ubuntu: apt-get install -y {pkg})", file=sys.stderr
            )
            return 2
    lo, _, hi = args.lengths.partition("-")
    tmp = Path(tempfile.mkdtemp(prefix="serve-frontends-"))
    if args.model == "identity":
        model, name = build_identity(tmp / "identity.onnx"), "identity"
    else:
        model = Path(args.model)
        name = model.resolve().name
    pool, output = build_pool(model, args.pool, (int(lo), int(hi or lo)), 0)
    ctx: dict[str, Any] = {"model": model, "name": name, "output": output, "pool": pool}
    path = f"/v2/models/{name}/infer"
    ctx["http-json-script"] = wrk_script(
        tmp / "json.lua", path, [(json_body(i["feed"], output), {"Content-Type": "application/json"}) for i in pool]
    )
    binary = []
    for i in pool:
        body, head = binary_body(i["feed"], output)
        binary.append(
            (body, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head)})
        )
    ctx["http-binary-script"] = wrk_script(tmp / "binary.lua", path, binary)
    ctx["grpc_data"] = []
    for i, item in enumerate(pool[:GRPC_BODIES]):
        ctx["grpc_data"].append(tmp / f"grpc-{i}.bin")
        ctx["grpc_data"][-1].write_bytes(grpc_message(name, item["feed"], output))
    counts = [int(f) for f in args.frontends.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    servers: dict[int, Server] = {}
    results: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        for f in counts:
            servers[f] = Server(model, name, f, args, tmp / f"server-{f}.log")
        for c in levels:
            for m in modes:
                if m == "inproc":
                    start = time.time() + args.warmup
                    window = (start, start + args.duration)
                    kw = {"max_batch_size": args.max_batch_size}
                    r = asyncio.run(_inproc(model, output, pool, c, window, kw))
                    r["rps"] = round(r["ok"] / args.duration, 1)
                    results.setdefault("inproc", {})[c] = r
                    print(f"# {name} inproc c={c}: {r}", file=sys.stderr, flush=True)
                    continue
                for f in counts:
                    key = f"{m} fe={f}"
                    r = measure(m, c, servers[f], ctx, args)
                    results.setdefault(key, {})[c] = r
                    print(f"# {name} {key} c={c}: {r}", file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()
    load = os.getloadavg()[0]
    extra = f", server flags {args.server_args!r}" if args.server_args else ""
    print(f"\n{name}, {args.duration:g} s per cell, load average {load:.1f} at the end, {os.cpu_count()} CPUs{extra}\n")
    keys = list(results)
    print("| clients | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for c in levels:
        cells = []
        for k in keys:
            r = results[k][c]
            cell = f"{r['rps']:g}"
            base = k.replace(f"fe={counts[-1]}", f"fe={counts[0]}")
            if k != base and base in results and results[base][c]["rps"]:
                cell += f" ({r['rps'] / results[base][c]['rps']:.2f}x)"
            if "inproc" in results and k != "inproc" and results["inproc"][c]["rps"]:
                cell += f" ({r['rps'] / results['inproc'][c]['rps']:.2f}x in-proc)"
            if "server_cpu_us" in r:
                cell += f" [{r['server_cpu_us']} µs server CPU/req, {r['server_cores']} cores]"
            if r.get("wrong") or r.get("bad") or r.get("errors"):
                cell += f" [{r.get('wrong', r.get('bad'))} wrong, {r['errors']} errors]"
            cells.append(cell)
        print(f"| {c} | " + " | ".join(cells) + " |")
    checked = sum(r.get("checked", 0) for v in results.values() for r in v.values())
    wrong = sum(r.get("wrong", 0) for v in results.values() for r in v.values())
    print(f"\n{checked} sampled answers checked against direct ONNX Runtime runs, {wrong} wrong")
    if args.json:
        args.json.write_text(json.dumps({"model": name, "load_average": load, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
