"""Requests/s through Ray Serve's proxy with 1 and 2 replicas against ``ortbatch serve`` on
one node: same requests, same client, same run, every answer checked.

    flock /work/notes/bench.lock python benchmarks/ray_serve.py --concurrency 1,16,64

Two models, as in benchmarks/serve_cost.py (whose request pool, tritonclient load
generator and ``ortbatch serve`` runner this reuses): ``identity`` (``y = Identity(x)``,
almost no compute: what is measured is the serving path's own cost) and the MiniLM export
(``export/minilm.toml`` exported once into a temporary folder, or ``--minilm DIR``).

Ray runs in a child process (``--driver``): a ``ray.cluster_utils.Cluster`` of two nodes on
this machine, Serve's proxy on the head, and per model two applications, ``/<model>-1``
with one replica (on the head) and ``/<model>-2`` with two (one per node, placed by custom
node resources). Each replica has ``num_cpus=1`` (one ONNX Runtime thread per batch, two
batches in flight: what ``ortbatch serve`` picks on a 2-core machine). This process never
imports ray, so the load generator's forked client processes are safe.

Ray Serve replicas listen on all interfaces, so the script re-executes itself inside a
loopback-only network namespace (``unshare -n``, then ``ip link set lo up``); where that is
not permitted it stops and says so. Cells are interleaved per concurrency (direct, 1
replica, 2 replicas), so a change in the machine's load hits each alike. Prints a Markdown
table per model, the per-request cost of the proxy at concurrency 1 (difference of mean
latencies, 1/throughput of one closed-loop client) and each replica's own answered count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_cost import Server, add_load_args, build_identity, build_pool, run_cell

ROOT = Path(__file__).resolve().parents[1]
IN_NETNS = "ORTBATCH_BENCH_NETNS"
TARGETS = ("direct", "ray-1", "ray-2")


def _reexec_in_netns() -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit("ray_serve: needs unshare and ip for a loopback-only network namespace")
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"ray_serve: unshare -n is not permitted ({probe.stderr.strip()}); Ray must not listen")
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, *sys.argv]
    os.execvpe("unshare", cmd, {**os.environ, IN_NETNS: "1"})


def driver(models: dict[str, Path], max_batch_size: int) -> None:
    """The child process: the two-node cluster and the applications; prints ``READY <port>``
    and serves until its stdin closes."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from ortbatch.ray import build_app
    from ortbatch.serve.server import ServeConfig

    # one proxy on the head: spread requests by queue length, not to the head's replica first
    os.environ["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    # each node one "pair" slot per model: a 2-replica app puts one replica on each node
    pair = {f"pair-{m}": 1 for m in models}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {**pair, "head": 8}})
    try:
        cluster.add_node(num_cpus=4, resources=pair)
        ray.init(address=cluster.address, log_to_driver=False)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        config = ServeConfig(max_batch_size=max_batch_size, max_queue=4096, access_log=False)
        for model, path in models.items():
            for replicas, where in ((1, {"head": 1}), (2, {f"pair-{model}": 1})):
                name = f"{model}-{replicas}"
                (app,) = build_app(
                    [(name, path)],
                    config=config,
                    replicas=replicas,
                    ray_actor_options={"num_cpus": 1, "resources": where},
                )
                serve.run(app.application, name=name, route_prefix=f"/{name}", blocking=False)
        print(f"READY {port}", flush=True)
        sys.stdin.read()  # until the parent closes it
        serve.shutdown()
        ray.shutdown()
    finally:
        cluster.shutdown()


def replica_answers(base: str, replicas: int) -> dict[str, float]:
    """Each replica's answered requests (status 200, ``/metrics`` itself not counted), from
    its own ``/metrics``: concurrent GETs, 8 at a time, since Ray routes each to the replica
    with the shorter queue (sequential ones may all find the same idle one) and the response
    header names the replica. ``base``: ``host:port[/prefix]``. Also tests/ray's."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from ortbatch.ray import REPLICA_HEADER

    def answered(text: str) -> float:
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            if f.name == "ortbatch_http_requests"
            for s in f.samples
            if s.name.endswith("_total") and s.labels.get("status") == "200" and s.labels.get("endpoint") != "/metrics"
        )

    seen: dict[str, float] = {}
    with httpx.Client(timeout=60) as http, ThreadPoolExecutor(8) as pool:
        for _ in range(30):
            for r in pool.map(lambda _: http.get(f"http://{base}/metrics"), range(8)):
                r.raise_for_status()
                seen[r.headers[REPLICA_HEADER]] = answered(r.text)
            if len(seen) == replicas:
                break
    return seen


def _export_minilm(tmp: Path) -> Path:
    from ortbatch.export import export_model

    return export_model(None, tmp / "minilm", recipe=ROOT / "export" / "minilm.toml", validate=False).directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--models", default="identity,minilm")
    p.add_argument("--minilm", type=Path, help="a MiniLM export (default: export one into a temporary folder)")
    add_load_args(p)
    p.add_argument("--driver", help=argparse.SUPPRESS)  # internal: JSON {model: path} of the Ray child
    args = p.parse_args(argv)
    if args.driver:
        driver({k: Path(v) for k, v in json.loads(args.driver).items()}, args.max_batch_size)
        return 0
    if os.environ.get(IN_NETNS) != "1":
        _reexec_in_netns()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lo, _, hi = args.lengths.partition("-")
    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="ray-serve-bench-"))
    models: dict[str, Path] = {}
    for m in args.models.split(","):
        if m == "identity":
            models[m] = build_identity(tmp / "identity.onnx")
        elif m == "minilm":
            models[m] = args.minilm or _export_minilm(tmp)
        else:
            raise SystemExit(f"ray_serve: unknown model {m!r} (identity, minilm)")
    pools = {m: build_pool(path, args.pool, (int(lo), int(hi or lo)), 0) for m, path in models.items()}

    print(f"# load average at the start: {os.getloadavg()}", file=sys.stderr, flush=True)
    started = time.monotonic()
    paths = {k: str(v) for k, v in models.items()}
    ray_child = subprocess.Popen(
        [sys.executable, __file__, "--max-batch-size", str(args.max_batch_size), "--driver", json.dumps(paths)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp / "ray.log", "wb"),  # noqa: SIM115 - the child's, closed with it
        text=True,
    )
    assert ray_child.stdout is not None and ray_child.stdin is not None
    m = None
    for line in ray_child.stdout:  # Ray may print a line of its own first
        m = re.match(r"READY (\d+)", line)
        if m:
            break
    if not m:
        ray_child.kill()
        raise SystemExit(f"ray_serve: Ray did not start:\n{(tmp / 'ray.log').read_text(errors='replace')[-4000:]}")
    proxy = f"127.0.0.1:{m.group(1)}"
    up = time.monotonic() - started
    print(f"# Ray: two nodes and {2 * len(models)} applications up in {up:.0f} s", file=sys.stderr, flush=True)
    results: dict[str, dict[str, dict[int, dict]]] = {}
    replicas_seen: dict[str, dict[str, float]] = {}
    try:
        for model, path in models.items():
            pool, output = pools[model]
            server = Server(path, model, args.max_batch_size, tmp / f"serve-{model}.log")
            try:
                ctxs = {
                    "direct": {"server": server, "name": model},
                    "ray-1": {"server": SimpleNamespace(http=f"{proxy}/{model}-1"), "name": f"{model}-1"},
                    "ray-2": {"server": SimpleNamespace(http=f"{proxy}/{model}-2"), "name": f"{model}-2"},
                }
                results[model] = {t: {} for t in TARGETS}
                for c in levels:
                    for t in TARGETS:  # interleaved: drift in the machine's load hits each alike
                        ctx = {**ctxs[t], "model": path, "output": output, "pool": pool}
                        results[model][t][c] = run_cell("http-binary", c, args, ctx)
                        print(f"# {model} {t} c={c}: {results[model][t][c]}", file=sys.stderr, flush=True)
            finally:
                server.stop()
            replicas_seen[model] = replica_answers(f"{proxy}/{model}-2", 2)
    finally:
        ray_child.stdin.close()
        try:
            ray_child.wait(120)
        except subprocess.TimeoutExpired:
            ray_child.kill()
    load = os.getloadavg()
    print(
        f"\n{args.duration:g} s per cell, tritonclient HTTP binary tensors from {args.procs} client processes; "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end, {os.cpu_count()} CPUs"
    )
    for model in models:
        r = results[model]
        print(f"\n{model}\n\n| clients | ortbatch serve req/s | Ray, 1 replica | Ray, 2 replicas |\n|---|---|---|---|")
        for c in levels:
            cells = []
            for t in TARGETS:
                cell = f"{r[t][c]['rps']:g}"
                if t != "direct" and r["direct"][c]["rps"]:
                    cell += f" ({r[t][c]['rps'] / r['direct'][c]['rps']:.2f}x)"
                if r[t][c]["bad"] or r[t][c]["errors"]:
                    cell += f" [{r[t][c]['bad']} wrong, {r[t][c]['errors']} errors]"
                cells.append(cell)
            print(f"| {c} | " + " | ".join(cells) + " |")
        if 1 in levels and all(r[t][1]["rps"] for t in TARGETS):
            ms = {t: 1e3 / r[t][1]["rps"] for t in TARGETS}
            print(
                f"\nconcurrency 1, mean latency: direct {ms['direct']:.2f} ms, through the proxy {ms['ray-1']:.2f} ms"
                f" (+{ms['ray-1'] - ms['direct']:.2f} ms per request)"
            )
        print(f"2-replica app, each replica's own answered requests: {replicas_seen[model]}")
    if args.json:
        doc = {"load_average": load, "results": results, "replicas": replicas_seen}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
