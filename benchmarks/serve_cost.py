"""The serving path's own cost: requests/s of ``ortbatch serve`` over HTTP/JSON,
HTTP/binary and gRPC against in-process ``BatchedSession.run_async``, same requests,
same concurrency, same BatchedSession settings.

    python benchmarks/serve_cost.py --model identity --concurrency 1,16,64,256
    python benchmarks/serve_cost.py --model exports/minilm --lengths 8-16 --concurrency 1,16,64,256

``--model identity`` builds (with onnx.helper) a model whose run costs almost nothing
(``y = Identity(x)``, x FP32 [batch, 16]), so what is measured is the server's own
per-request cost; an export directory (MiniLM) shows what that cost is worth next to a
real model (token ids of --lengths, output ``sentence_embedding``).

The server is ``ortbatch serve MODEL --grpc-port 0`` in its own process; the clients
(tritonclient's asyncio HTTP and gRPC clients) run in --procs other processes, the
concurrency split between them, so that one Python client process is not what limits
the figure. In-process runs the same requests from the same number of asyncio tasks on
one BatchedSession in this process. Every answer is checked against a direct ONNX
Runtime run of its own request; a mismatch or error is counted, never averaged away.
Each cell runs --warmup seconds uncounted, then --duration seconds counted. Prints a
Markdown table (and with --json writes the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MODES = ("inproc", "http-json", "http-binary", "grpc")


def build_identity(path: Path, width: int = 16) -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def build_pool(model: Path, size: int, lengths: tuple[int, int], seed: int) -> tuple[list[dict[str, Any]], str]:
    """Distinct one-row requests and their expected output from a direct ORT run."""
    import onnxruntime as ort

    from ortbatch.manifest import Manifest

    onnx_path = Manifest.load(model).model_path if model.is_dir() else model
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]
    output = "sentence_embedding" if "sentence_embedding" in outputs else outputs[0]
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(size):
        feed: dict[str, np.ndarray] = {}
        for inp in sess.get_inputs():
            if inp.name == "x":
                feed["x"] = rng.standard_normal((1, inp.shape[1])).astype(np.float32)
            elif inp.name == "input_ids":
                n = int(rng.integers(lengths[0], lengths[1] + 1))
                feed["input_ids"] = rng.integers(1000, 30000, (1, n)).astype(np.int64)
            elif inp.name in ("attention_mask", "token_type_ids"):
                pass
            else:
                raise SystemExit(f"serve_cost: don't know how to fill input {inp.name!r}")
        if "input_ids" in feed:
            ids = feed["input_ids"]
            names = {i.name for i in sess.get_inputs()}
            if "attention_mask" in names:
                feed["attention_mask"] = np.ones_like(ids)
            if "token_type_ids" in names:
                feed["token_type_ids"] = np.zeros_like(ids)
        (want,) = sess.run([output], feed)
        pool.append({"feed": feed, "expected": want})
    return pool, output


def _ok(got: np.ndarray | None, want: np.ndarray) -> bool:
    return got is not None and got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-4, atol=1e-5))


_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


async def _client_loop(mode: str, target: str, name: str, output: str, pool: list, tasks: int, window: tuple) -> dict:
    """``tasks`` concurrent closed-loop clients; counts answers completed inside ``window``."""
    start, end = window
    counts = {"ok": 0, "bad": 0, "errors": 0}
    if mode == "grpc":
        import tritonclient.grpc.aio as client_mod
    else:
        import tritonclient.http.aio as client_mod  # type: ignore[no-redef]
    if mode == "grpc":
        client = client_mod.InferenceServerClient(target)
    else:
        client = client_mod.InferenceServerClient(target, conn_limit=tasks)
    binary = mode != "http-json"

    async def one(worker: int) -> None:
        i = worker
        while time.time() < end:
            item = pool[i % len(pool)]
            i += tasks
            inputs = []
            for n, arr in item["feed"].items():
                t = client_mod.InferInput(n, list(arr.shape), _DTYPES[arr.dtype])
                if mode == "grpc":
                    t.set_data_from_numpy(arr)
                else:
                    t.set_data_from_numpy(arr, binary_data=binary)
                inputs.append(t)
            if mode == "grpc":
                outputs = [client_mod.InferRequestedOutput(output)]
            else:
                outputs = [client_mod.InferRequestedOutput(output, binary_data=binary)]
            try:
                res = await client.infer(name, inputs, outputs=outputs)
            except Exception:
                counts["errors"] += 1
                await asyncio.sleep(0.01)
                continue
            now = time.time()
            if start <= now <= end:
                counts["ok" if _ok(res.as_numpy(output), item["expected"]) else "bad"] += 1

    try:
        await asyncio.gather(*(one(w) for w in range(tasks)))
    finally:
        await client.close()
    return counts


def _client_proc(args: tuple, queue: Any) -> None:
    queue.put(asyncio.run(_client_loop(*args)))


async def _inproc(model: Path, output: str, pool: list, tasks: int, window: tuple, session_kwargs: dict) -> dict:
    from ortbatch import BatchedSession

    start, end = window
    counts = {"ok": 0, "bad": 0, "errors": 0}
    with BatchedSession(model, **session_kwargs) as bs:

        async def one(worker: int) -> None:
            i = worker
            while time.time() < end:
                item = pool[i % len(pool)]
                i += tasks
                try:
                    (got,) = await bs.run_async([output], item["feed"])
                except Exception:
                    counts["errors"] += 1
                    continue
                if start <= time.time() <= end:
                    counts["ok" if _ok(got, item["expected"]) else "bad"] += 1

        await asyncio.gather(*(one(w) for w in range(tasks)))
        counts["rows_per_batch"] = round(bs.stats().mean_rows_per_batch, 1)  # type: ignore[assignment]
    return counts


class Server:
    """``ortbatch serve MODEL --port 0 --grpc-port 0`` in a subprocess."""

    def __init__(self, model: Path, name: str, max_batch_size: int, log: Path, extra: tuple[str, ...] = ()) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.log_path = log
        self.text = ""
        cmd = [sys.executable, "-m", "ortbatch.cli", "serve", str(model), "--name", name, "--port", "0"]
        cmd += ["--grpc-port", "0", "--no-access-log", "--log-level", "warning"]
        cmd += ["--max-batch-size", str(max_batch_size), "--max-queue", "4096"]
        cmd += extra  # later flags win (serve_frontends.py adds --frontends N)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            m = re.search(r"gRPC on (\S+?)\); listening on http://(\S+)", text)
            if m:
                self.grpc, self.http = m.group(1), m.group(2)
                self.text = text
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise SystemExit(f"serve_cost: the server did not start:\n{log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def run_cell(mode: str, concurrency: int, args: argparse.Namespace, ctx: dict) -> dict:
    start = time.time() + args.warmup + (0.5 if mode == "inproc" else 1.5)
    window = (start, start + args.duration)
    if mode == "inproc":
        kw = {"max_batch_size": args.max_batch_size}
        counts = asyncio.run(_inproc(ctx["model"], ctx["output"], ctx["pool"], concurrency, window, kw))
    else:
        target = ctx["server"].grpc if mode == "grpc" else ctx["server"].http
        procs = 1 if concurrency < args.procs else args.procs
        queue: Any = mp.get_context("fork").Queue()
        workers = []
        for p in range(procs):
            tasks = concurrency // procs + (1 if p < concurrency % procs else 0)
            a = (mode, target, ctx["name"], ctx["output"], ctx["pool"], tasks, window)
            w = mp.get_context("fork").Process(target=_client_proc, args=(a, queue))
            w.start()
            workers.append(w)
        results = [queue.get(timeout=args.warmup + args.duration + 120) for _ in workers]
        for w in workers:
            w.join(30)
        counts = {k: sum(r[k] for r in results) for k in ("ok", "bad", "errors")}
    counts["rps"] = round(counts["ok"] / args.duration, 1)
    return counts


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The options of the requests and the load (also benchmarks/ray_serve.py's)."""
    p.add_argument("--lengths", default="8-16", help="token lengths MIN-MAX (text models)")
    p.add_argument("--duration", type=float, default=5.0, help="counted seconds per cell")
    p.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds per cell")
    p.add_argument("--procs", type=int, default=2, help="client processes")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--pool", type=int, default=256)
    p.add_argument("--json", type=Path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="identity", help="'identity' or an export directory")
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--modes", default=",".join(MODES))
    add_load_args(p)
    args = p.parse_args(argv)
    lo, _, hi = args.lengths.partition("-")
    tmp = Path(tempfile.mkdtemp(prefix="serve-cost-"))
    if args.model == "identity":
        model = build_identity(tmp / "identity.onnx")
        name = "identity"
    else:
        model = Path(args.model)
        name = model.resolve().name
    pool, output = build_pool(model, args.pool, (int(lo), int(hi or lo)), 0)
    modes = [m for m in args.modes.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",")]
    ctx: dict[str, Any] = {"model": model, "name": name, "output": output, "pool": pool}
    if any(m != "inproc" for m in modes):
        ctx["server"] = Server(model, name, args.max_batch_size, tmp / "server.log")
    results: dict[str, dict[int, dict]] = {m: {} for m in modes}
    try:
        for c in levels:
            for m in modes:  # interleaved, so drift in the machine's load hits every mode alike
                results[m][c] = run_cell(m, c, args, ctx)
                print(f"# {name} {m} c={c}: {results[m][c]}", file=sys.stderr, flush=True)
    finally:
        if "server" in ctx:
            ctx["server"].stop()
    load = os.getloadavg()[0]
    print(f"\n{name}, {args.duration:g} s per cell, load average {load:.1f}, {os.cpu_count()} CPUs\n")
    base = "inproc" if "inproc" in modes else None
    header = "| clients | " + " | ".join(f"{m} req/s" for m in modes) + " |"
    print(header)
    print("|" + "---|" * (len(modes) + 1))
    for c in levels:
        cells = []
        for m in modes:
            r = results[m][c]
            cell = f"{r['rps']:g}"
            if base and m != base and results[base][c]["rps"]:
                cell += f" ({r['rps'] / results[base][c]['rps']:.2f}x)"
            if r["bad"] or r["errors"]:
                cell += f" [{r['bad']} wrong, {r['errors']} errors]"
            cells.append(cell)
        print(f"| {c} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"model": name, "load_average": load, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
