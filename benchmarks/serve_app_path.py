"""CPU per request of the HTTP app path alone: the Starlette app ``ortbatch serve`` runs
(metrics middleware, routing, body reading, KServe v2 parsing and encoding), called as
ASGI from C concurrent asyncio tasks in this process, over a session that answers at
once. No sockets, no HTTP parser, no model: what is left is the app's own Python cost
per request, the part of a front end's cost that the server's code decides.

    python benchmarks/serve_app_path.py                 # JSON requests, 20000 per pass
    python benchmarks/serve_app_path.py --binary --passes 8

Prints the CPU time per request of each pass and their median (passes vary by tens of
percent on a shared machine: compare medians of runs made one after the other).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np


class _Echo:
    """A session face whose ``run_async`` answers with its input at once."""

    max_batch_size = 32
    manifest = None

    def get_inputs(self) -> list[Any]:
        return [SimpleNamespace(name="x", type="tensor(float)", shape=["batch", 16])]

    def get_outputs(self) -> list[Any]:
        return [SimpleNamespace(name="y", type="tensor(float)", shape=["batch", 16])]

    async def run_async(self, names: Any, feed: Any) -> list[np.ndarray]:
        return [feed["x"]]

    def stats(self) -> Any:
        return SimpleNamespace(queued=0, padding_fraction=0.0, requests=0, batches=0, errors={}, rows_histogram={})

    def close(self, drain: bool = True) -> None:
        pass


def _request(binary: bool) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    if not binary:
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": x.reshape(-1).tolist()}]}
        return json.dumps(doc).encode(), [(b"content-type", b"application/json")]
    head = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = [(b"content-type", b"application/octet-stream"), (b"inference-header-content-length", b"%d" % len(head))]
    return head + x.tobytes(), headers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000, help="requests per pass")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--binary", action="store_true", help="binary tensors (else JSON)")
    args = p.parse_args(argv)

    from ortbatch.serve.http.app import build_app
    from ortbatch.serve.served.model import ServedModel

    app = build_app(ServedModel(_Echo(), "m"))
    body, headers = _request(args.binary)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v2/models/m/infer",
        "raw_path": b"/v2/models/m/infer",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"bench"), (b"content-length", b"%d" % len(body)), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }

    async def one() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        done = asyncio.Event()
        status: list[int] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await done.wait()  # as a server does: a disconnect only once the client goes
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(dict(scope, state={}), receive, send)
        done.set()
        if status != [200]:
            raise SystemExit(f"serve_app_path: the app answered {status}")

    async def run(n: int) -> float:
        async def client(k: int) -> None:
            for _ in range(k):
                await one()

        t0 = time.process_time()
        await asyncio.gather(*(client(n // args.concurrency) for _ in range(args.concurrency)))
        return (time.process_time() - t0) / (n // args.concurrency * args.concurrency)

    asyncio.run(run(2000))  # warm-up
    per = []
    for i in range(args.passes):
        per.append(asyncio.run(run(args.requests)) * 1e6)
        print(f"pass {i + 1}: {per[-1]:.0f} µs CPU per request", file=sys.stderr, flush=True)
    kind = "binary" if args.binary else "JSON"
    print(f"KServe v2 {kind} infer, app path only: median {statistics.median(per):.0f} µs CPU per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
