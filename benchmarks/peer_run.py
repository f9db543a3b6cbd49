"""Run ONE peer system on ortbatch's benchmark workload and write its results as JSON.

Started by ``benchmarks/peers.py``, each system in its own process and, where its
dependencies conflict, its own virtual environment (PyTriton needs numpy<2). Every
system gets the same requests (``ortbatch.bench.workload``, same seed: the digest in the
JSON proves it), the same closed-loop client threads (``ortbatch.bench.loadgen``) and an
InferenceSession with ONNX Runtime's default options on the same model file — the session
users of these libraries build.

Systems: ``bi-seq`` / ``bi-bucket`` (microsoft/batch-inference 1.0 ModelHost with
SeqBatcher / BucketSeqBatcher), ``pytriton`` (Triton's dynamic batcher through
nvidia-pytriton, ragged batching on, HTTP on 127.0.0.1), ``ray`` (Ray Serve ``@serve.batch``
through a deployment handle; run it inside ``unshare -n`` — peers.py does).

Exit status 3 means "not installed here": peers.py reports the system as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the peer venvs do not install ortbatch; its bench core is pure numpy + ORT

import numpy as np  # noqa: E402

from ortbatch.bench.loadgen import drive  # noqa: E402
from ortbatch.bench.modes import pad_stack, split_outputs, summarize  # noqa: E402
from ortbatch.bench.runner import make_baseline_session, model_path_of, session_settings  # noqa: E402
from ortbatch.bench.workload import Target, Workload, load_target, make_workload, parse_lengths  # noqa: E402

NOT_INSTALLED = 3
BUCKETS = [16, 32, 64, 128, 256, 512]


class BatchCounter:
    """Server-side view: batches, rows per batch and padded vs real tokens."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hist: Counter[int] = Counter()
        self.real = 0
        self.padded = 0

    def add(self, rows: int, real: int, padded: int) -> None:
        with self.lock:
            self.hist[rows] += 1
            self.real += real
            self.padded += padded

    def reset(self) -> None:
        with self.lock:
            self.hist.clear()
            self.real = self.padded = 0

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"hist": dict(self.hist), "real": self.real, "padded": self.padded}


def _tokens(target: Target, feed: dict[str, np.ndarray]) -> tuple[int, int]:
    """(real, padded) tokens of a stacked batch, from its attention mask when it has one."""
    mask = next((feed[i.name] for i in target.inputs if "mask" in i.name.lower()), None)
    first = feed[target.inputs[0].name]
    padded = int(first.shape[0] * (first.shape[-1] if first.ndim > 1 else 1))
    real = int(np.count_nonzero(mask)) if mask is not None else padded
    return real, padded


# -- systems ---------------------------------------------------------------------------------
def system_batch_inference(
    kind: str, target: Target, sess: Any, args: argparse.Namespace, counter: BatchCounter
) -> tuple[Any, Any, dict[str, Any]]:
    try:
        from batch_inference import ModelHost
        from batch_inference.batcher import BucketSeqBatcher, SeqBatcher
    except ImportError as exc:
        raise NotInstalledError(f"batch-inference is not installed ({exc})") from exc
    names = [i.name for i in target.inputs]
    outputs = target.outputs
    pads = [i.pad for i in target.inputs]  # its default padding_tokens is broken: always pass them

    class Model:
        def predict_batch(self, *arrays: np.ndarray) -> list[np.ndarray]:
            feed = dict(zip(names, arrays, strict=True))
            counter.add(arrays[0].shape[0], *_tokens(target, feed))
            return sess.run(outputs, feed)

    if kind == "bi-seq":
        batcher = SeqBatcher(padding_tokens=pads)
        desc = "SeqBatcher"
    else:
        batcher = BucketSeqBatcher(padding_tokens=pads, buckets=BUCKETS)
        desc = f"BucketSeqBatcher(buckets={BUCKETS})"
    # ModelHost's own defaults for wait_ms (5) and wait_n (8); max_batch_size as for ortbatch
    host = ModelHost(model_obj=Model(), batcher=batcher, max_batch_size=args.max_batch_size)
    host.start()

    def call(feed: dict[str, np.ndarray]) -> Any:
        return host.predict(*[feed[n] for n in names])

    settings = {
        "batcher": desc,
        "max_batch_size": args.max_batch_size,
        "wait_ms": host.wait_ms,
        "wait_n": host.wait_n,
        "num_workers": host.num_workers,
    }
    return call, host.stop, settings


def system_pytriton(
    target: Target, sess: Any, args: argparse.Namespace, counter: BatchCounter
) -> tuple[Any, Any, dict[str, Any]]:
    try:
        import pytriton.model_config.generator as generator
        import tritonclient.http as httpclient
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig
    except ImportError as exc:
        raise NotInstalledError(f"nvidia-pytriton / tritonclient[http] not installed ({exc})") from exc

    # PyTriton's Tensor cannot say allow_ragged_batch; without it Triton only batches
    # equal-shape requests, so random-length text forms batches of ~1. Amend the config.
    original = generator.ModelConfigGenerator.get_config

    def get_config(self: Any) -> dict[str, Any]:
        cfg = original(self)
        for spec in cfg.get("input", []):
            spec["allowRaggedBatch"] = True
        return cfg

    generator.ModelConfigGenerator.get_config = get_config
    outputs = target.outputs
    lengths_of = [i for i in target.inputs if "ragged" in i.dims]

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        feeds = [dict(r.data) for r in requests]
        batch = pad_stack(target, feeds)
        counter.add(len(feeds), *_tokens(target, batch))
        outs = sess.run(outputs, batch)
        res = []
        for row, feed in enumerate(feeds):
            length = int(feed[lengths_of[0].name].shape[1])
            res.append(dict(zip(outputs, split_outputs(target, outs, outputs, row, length), strict=True)))
        return res

    ports = [_free_port() for _ in range(3)]
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=ports[0],
        grpc_address="127.0.0.1",
        grpc_port=ports[1],
        metrics_address="127.0.0.1",
        metrics_port=ports[2],
        log_verbose=0,
    )
    triton = Triton(config=config)
    triton.__enter__()
    sess_inputs = {n.name: n for n in sess.get_inputs()}
    sess_outputs = {n.name: n for n in sess.get_outputs()}

    def tensor(node: Any, dtype: Any) -> Any:
        shape = tuple(d if isinstance(d, int) else -1 for d in node.shape[1:])
        return Tensor(name=node.name, dtype=dtype, shape=shape)

    out_dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(float16)": np.float16}
    triton.bind(
        model_name="bench",
        infer_func=infer,
        inputs=[tensor(sess_inputs[i.name], i.dtype) for i in target.inputs],
        outputs=[tensor(sess_outputs[o], out_dtypes[sess_outputs[o].type]) for o in outputs],
        config=ModelConfig(max_batch_size=args.max_batch_size, batcher=DynamicBatcher()),
        strict=False,
    )
    triton.run()
    url = f"127.0.0.1:{ports[0]}"
    probe = httpclient.InferenceServerClient(url)
    deadline = time.monotonic() + 120
    # the server says ready before the model has loaded: poll the model itself
    while not _safe(lambda: probe.is_model_ready("bench")):
        if time.monotonic() > deadline:
            raise RuntimeError("PyTriton model 'bench' not ready after 120 s")
        time.sleep(0.2)
    local = threading.local()
    np_to_triton = {
        np.dtype(np.int64): "INT64",
        np.dtype(np.int32): "INT32",
        np.dtype(np.float32): "FP32",
        np.dtype(np.float16): "FP16",
        np.dtype(np.bool_): "BOOL",
    }

    def call(feed: dict[str, np.ndarray]) -> Any:
        client = getattr(local, "client", None)
        if client is None:  # the sync client must not be shared across threads
            client = local.client = httpclient.InferenceServerClient(url, network_timeout=300.0)
        ins = []
        for name, arr in feed.items():
            inp = httpclient.InferInput(name, list(arr.shape), np_to_triton[arr.dtype])
            inp.set_data_from_numpy(arr, binary_data=True)
            ins.append(inp)
        outs = [httpclient.InferRequestedOutput(o, binary_data=True) for o in outputs]
        result = client.infer("bench", ins, outputs=outs)
        return [result.as_numpy(o) for o in outputs]

    def stop() -> None:
        triton.__exit__(None, None, None)

    settings = {
        "server": "Triton (nvidia-pytriton 0.7.0) on 127.0.0.1, HTTP binary tensors, one sync client per client thread",
        "dynamic_batcher": "default (no queue delay)",
        "allow_ragged_batch": True,
        "max_batch_size": args.max_batch_size,
    }
    return call, stop, settings


def system_ray(target: Target, model_path: Path, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise NotInstalledError(f"ray[serve] is not installed ({exc})") from exc
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}
    )
    max_batch = args.max_batch_size

    @serve.deployment(max_ongoing_requests=128)  # the default (5) never lets a batch fill
    class Model:
        def __init__(self, source: str) -> None:
            sys.path.insert(0, str(REPO))
            import onnxruntime as ort

            from ortbatch.bench.workload import load_target as _load

            self.sess = ort.InferenceSession(str(model_path_of(Path(source))), providers=["CPUExecutionProvider"])
            self.target = _load(source, self.sess)
            self.counter = BatchCounter()

        @serve.batch(max_batch_size=max_batch)
        async def __call__(self, feeds: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
            # a blocking run here blocks the replica's loop, which is what lets batches fill
            t = self.target
            batch = pad_stack(t, feeds)
            self.counter.add(len(feeds), *_tokens(t, batch))
            outs = self.sess.run(t.outputs, batch)
            lengths = [int(f[t.inputs[0].name].shape[-1]) for f in feeds]
            return [split_outputs(t, outs, t.outputs, row, n) for row, n in enumerate(lengths)]

        def stats(self) -> dict[str, Any]:
            return self.counter.snapshot()

        def reset(self) -> None:
            self.counter.reset()

    handle = serve.run(Model.bind(str(args.export)), name="bench", route_prefix=None)

    def call(feed: dict[str, np.ndarray]) -> Any:
        return handle.remote(feed).result(timeout_s=300)

    def stop() -> None:
        serve.shutdown()
        ray.shutdown()

    call.handle = handle  # type: ignore[attr-defined]
    settings = {
        "server": "Ray Serve 2.60 deployment handle, one replica, ray.init(num_cpus=2)",
        "serve_batch": {"max_batch_size": max_batch, "batch_wait_timeout_s": "default (0.01)"},
        "max_ongoing_requests": 128,
    }
    return call, stop, settings


class NotInstalledError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _safe(fn: Any) -> bool:
    try:
        return bool(fn())
    except Exception:
        return False


# -- main --------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", required=True, choices=["bi-seq", "bi-bucket", "pytriton", "ray"])
    p.add_argument("--export", required=True, type=Path)
    p.add_argument("--lengths", default="8-128")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--json", required=True, type=Path)
    args = p.parse_args()

    levels = [int(x) for x in args.concurrency.split(",")]
    model_path = model_path_of(args.export)
    sess = make_baseline_session(model_path, "cpu", {})
    target = load_target(args.export, sess)
    spec = parse_lengths(args.lengths)
    workload: Workload = make_workload(target, spec, args.requests, seed=args.seed)
    warm_n = args.warmup if args.warmup is not None else 2 * max(levels) + 32
    warm = make_workload(target, spec, warm_n, seed=args.seed + 10_007)  # as ortbatch bench warms up
    counter = BatchCounter()
    try:
        if args.system in ("bi-seq", "bi-bucket"):
            call, stop, settings = system_batch_inference(args.system, target, sess, args, counter)
        elif args.system == "pytriton":
            call, stop, settings = system_pytriton(target, sess, args, counter)
        else:
            call, stop, settings = system_ray(target, model_path, args)
    except NotInstalledError as exc:
        print(f"peer_run: {args.system} skipped: {exc}", file=sys.stderr)
        return NOT_INSTALLED
    settings["session"] = session_settings(sess) if args.system != "ray" else "default InferenceSession in the replica"
    results = []
    try:
        for c in levels:
            drive(call, warm.feeds, list(range(len(warm))), c, max_seconds=60.0)
            if args.system == "ray":
                call.handle.reset.remote().result()
            counter.reset()
            res = drive(call, workload.feeds, list(range(len(workload))), c, max_seconds=args.duration)
            snap = call.handle.stats.remote().result() if args.system == "ray" else counter.snapshot()
            padding = 1.0 - snap["real"] / snap["padded"] if snap["padded"] else 0.0
            r = summarize(
                args.system,
                res,
                workload,
                batches=sum(snap["hist"].values()),
                rows_histogram={int(k): v for k, v in snap["hist"].items()},
                padding_fraction=padding,
            )
            results.append(r.to_dict())
            print(
                f"{args.system:>9} c={c:<3} {r.requests_per_s:8.1f} req/s  p50 {r.latency_ms()['p50']:.1f} ms  "
                f"rows/batch {r.mean_rows_per_batch:.2f}  padding {r.padding_fraction:.1%}  errors {r.errors}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "system": args.system,
                "settings": settings,
                "workload": workload.describe(),
                "results": results,
                "python": sys.version.split()[0],
                "numpy": np.__version__,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
