"""Where a gRPC request's cost goes: the same h2load load against servers that do more
and more of ortbatch's gRPC path, on the identity-like model.

    python benchmarks/grpc_stages.py                        # every stage, 1 and 4 accept loops
    python benchmarks/grpc_stages.py --stages grpcio,codec --loops 1,2,4,8

Stages (each a server in its own process; the load is ``h2load`` sending one
pre-serialized ModelInferRequest on ``--connections`` x ``--streams`` streams):

* ``grpcio``: a grpcio asyncio server whose ModelInfer handler returns fixed bytes
  (no protobuf, no model): grpcio's own floor;
* ``grpcio-sync``: the same handler on grpcio's thread-pool server (``--loops`` threads x 16);
* ``parse``: + parsing the ModelInferRequest and serializing a response message;
* ``codec``: + ``decode_infer_request`` / ``encode_infer_response`` (checks, tensors), the
  output being the input (no model);
* ``hop``: + one hand-off to a worker thread and back per request (what any thread
  pool would cost);
* ``session``: + ``ServedModel.infer`` through the BatchedSession (the real model run);
* ``server``: ``ortbatch.serve.grpc.GrpcServer`` itself (metrics, the handler guard).

Each stage runs with every ``--loops`` count: that many grpcio servers on one port in one
process (``GrpcServer(accept_loops=N)``). Figures: answered requests/s, the server's CPU
per request and cores (from /proc), and, for the session stages, the BatchedSession's
rows per batch. Each answer's bytes are checked once per cell against a direct run.
Needs ``h2load`` (Debian/Ubuntu: ``apt-get install -y nghttp2-client``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_cost import build_identity
from serve_frontends import cpu_seconds, grpc_message, h2load_command

STAGES = ("grpcio", "grpcio-sync", "parse", "codec", "hop", "session", "server")
SERVICE = "inference.GRPCInferenceService"


# -- the servers (run as ``grpc_stages.py --serve STAGE PORT LOOPS MODEL``) ---------------------
def _serve(stage: str, port: int, loops: int, model_path: str) -> None:
    import concurrent.futures

    import grpc

    from ortbatch.serve.grpc.codec import decode_infer_request, encode_infer_response
    from ortbatch.serve.grpc.schema import message
    from ortbatch.serve.served.model import ServedModel

    def same(b: bytes) -> bytes:
        return b

    if stage in ("server", "grpcio-sync"):
        # SIGTERM waits for sigwait below (every thread started from here inherits the mask)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    request_type, response_type = message("ModelInferRequest"), message("ModelInferResponse")
    fixed = response_type(model_name="identity").SerializeToString()
    stop = asyncio.Event() if stage != "grpcio-sync" else None

    if stage == "server":
        from ortbatch.serve.grpc import GrpcServer
        from ortbatch.serve.metrics import ServerMetrics

        served = ServedModel.load(model_path, name="identity")
        srv = GrpcServer(served, port=port, accept_loops=loops, metrics=ServerMetrics()).start()
        print("ready", flush=True)
        signal.sigwait([signal.SIGTERM])
        print(f"rows_per_batch {served.session.stats().mean_rows_per_batch:.2f}", flush=True)
        srv.stop(grace=1.0)
        return

    if stage == "grpcio-sync":

        def sync_handler(data: bytes, context: object) -> bytes:
            return fixed

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {"ModelInfer": grpc.unary_unary_rpc_method_handler(sync_handler, same, same)},
        )
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16 * loops))
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        signal.sigwait([signal.SIGTERM])
        server.stop(1.0)
        return

    served = ServedModel.load(model_path, name="identity") if stage == "session" else None
    pool = concurrent.futures.ThreadPoolExecutor(1)

    async def handler_fn(data: bytes, context: object) -> bytes:
        if stage == "grpcio":
            return fixed
        msg = request_type.FromString(data)
        if stage == "parse":
            return fixed
        req = decode_infer_request(msg)
        if stage == "codec":
            outs = [("y", req.inputs["x"])]
        elif stage == "hop":
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            pool.submit(loop.call_soon_threadsafe, _settle, done)
            await done
            outs = [("y", req.inputs["x"])]
        else:
            assert served is not None
            outs = await served.infer(req)
        return encode_infer_response("identity", "1", outs, req.id).SerializeToString()

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(handler_fn, same, same)}
        )
        servers = []
        for _ in range(loops):
            server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
            server.add_generic_rpc_handlers((handler,))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            servers.append(server)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # type: ignore[union-attr]
        print("ready", flush=True)
        await stop.wait()  # type: ignore[union-attr]
        if served is not None:
            print(f"rows_per_batch {served.session.stats().mean_rows_per_batch:.2f}", flush=True)
        await asyncio.gather(*(s.stop(1.0) for s in servers))

    asyncio.run(main())


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # the call was cancelled meanwhile (h2load stopping)
        fut.set_result(None)


# -- the load ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _h2load(port: int, data: Path, connections: int, streams: int, seconds: float) -> int:
    cmd = h2load_command(f"127.0.0.1:{port}", data, connections, streams, seconds)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.search(r"status codes: (\d+) 2xx", out)
    return int(m.group(1)) if m else 0


def _check(port: int, x: np.ndarray, stage: str) -> bool:
    """One real request through tritonclient: the answer (or, for the stages without a
    model, a well-formed reply) must come back."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = client.infer("identity", [inp])
        if stage in ("grpcio", "grpcio-sync", "parse"):
            return res.get_response().model_name == "identity"
        return bool(np.array_equal(res.as_numpy("y"), x))
    finally:
        client.close()


def run_cell(stage: str, loops: int, model: Path, data: Path, x: np.ndarray, args: argparse.Namespace) -> dict:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path]))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", stage, str(port), str(loops), str(model)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"stage {stage}: the server did not start")
        ok = _check(port, x, stage)
        _h2load(port, data, args.connections, args.streams, args.warmup)
        cpu0, t0 = cpu_seconds([proc.pid]), time.monotonic()
        answered = _h2load(port, data, args.connections, args.streams, args.duration)
        cpu, wall = cpu_seconds([proc.pid]) - cpu0, time.monotonic() - t0
        ok = ok and _check(port, x, stage)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    rows = re.search(r"rows_per_batch ([\d.]+)", rest or "")
    return {
        "stage": stage,
        "loops": loops,
        "rps": answered / args.duration,
        "cpu_us": cpu / answered * 1e6 if answered else float("nan"),
        "cores": cpu / wall,
        "rows_per_batch": float(rows.group(1)) if rows else None,
        "checked": ok,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--loops", default="1,4", help="grpcio servers per process to try (default 1,4)")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--streams", type=int, default=2, help="concurrent streams per connection")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        stage, port, loops, model = args.serve
        _serve(stage, int(port), int(loops), model)
        return 0
    if shutil.which("h2load") is None:
        print("grpc_stages: h2load is not installed (apt-get install -y nghttp2-client)", file=sys.stderr)
        return 2
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"grpc_stages: unknown stage(s) {unknown}; choose from {list(STAGES)}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="grpc-stages-"))
    model = build_identity(tmp / "identity.onnx")
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    data = tmp / "request.bin"
    data.write_bytes(grpc_message("identity", {"x": x}, "y"))
    print(f"# load average {os.getloadavg()[0]:.1f} at the start, {os.cpu_count()} CPUs", flush=True)
    print("| stage | accept loops | requests/s | server CPU per request | cores | rows per batch | answer checked |")
    print("|---|---|---|---|---|---|---|")
    for stage in stages:
        for loops in [int(n) for n in args.loops.split(",")]:
            r = run_cell(stage, loops, model, data, x, args)
            rows = f"{r['rows_per_batch']:.1f}" if r["rows_per_batch"] is not None else ""
            print(
                f"| {stage} | {loops} | {r['rps']:.0f} | {r['cpu_us']:.0f} µs | {r['cores']:.2f} | {rows} | "
                f"{'ok' if r['checked'] else 'WRONG'} |",
                flush=True,
            )
    print(f"# load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
