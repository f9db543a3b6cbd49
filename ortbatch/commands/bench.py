"""``ortbatch bench TARGET``: throughput and latency of BatchedSession vs direct session.run vs an oracle."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._flags import add_runtime_arguments, positive_float

HELP = "benchmark BatchedSession against direct session.run and an offline oracle, on the same requests"


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET", help="an export directory (with ortbatch.json) or a .onnx file")
    _add_load(p.add_argument_group("load"))
    _add_runtime(p.add_argument_group("runtime (passed to BatchedSession)"))
    _add_output(p.add_argument_group("output"))


def _add_load(load: Any) -> None:
    load.add_argument(
        "--concurrency",
        type=_ints,
        default=[1, 4, 16, 64],
        metavar="C1,C2,...",
        help="client threads, one run per value (default 1,4,16,64)",
    )
    load.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="requests per run, the same N for every mode (default 1000; with --duration "
        "alone, sized from a short calibration so a direct run lasts about S seconds)",
    )
    load.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        metavar="S",
        help="time cap per (mode, concurrency) run in seconds (default 120)",
    )
    load.add_argument(
        "--lengths",
        default="8-128",
        metavar="SPEC",
        help="token lengths: A-B uniform, N fixed, or texts[:FILE] (real texts through the "
        "export's tokenizer; built-in corpus by default). Default 8-128",
    )
    load.add_argument(
        "--arrival",
        choices=("closed", "poisson"),
        default="closed",
        help="closed loop (each client sends when its last answer came) or Poisson arrivals",
    )
    load.add_argument("--rate", type=positive_float, default=None, metavar="R", help="Poisson arrival rate, requests/s")
    load.add_argument("--seed", type=int, default=0, help="seed of the request lengths and arrivals (default 0)")
    load.add_argument(
        "--warmup",
        type=int,
        default=None,
        metavar="N",
        help="unmeasured warm-up requests before each run (default 2 x max concurrency + 32)",
    )
    load.add_argument(
        "--modes",
        default="direct,batched,oracle",
        metavar="M1,M2",
        help="which of direct,batched,oracle to run (default all three)",
    )


def _add_runtime(rt: Any) -> None:
    add_runtime_arguments(
        rt,
        max_batch_size=32,
        max_batch_size_help="rows per batch (default 32)",
        max_batch_tokens_help="cap on rows x longest length per batch (default none)",
        latency_help="no second, every-core session for batches that run alone (BatchedSession(latency_session=False))",
    )
    rt.add_argument(
        "--baseline-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set on the direct/oracle session (default: none, ONNX Runtime's defaults as users "
        "have them): intra_op_num_threads=1, session.intra_op.allow_spinning=0, ...",
    )


def _add_output(out: Any) -> None:
    out.add_argument("--json", metavar="FILE", help="write every figure and setting as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="throughput and p99 latency against concurrency")
    out.add_argument("--markdown", metavar="FILE", help="write the tables as markdown")
    out.add_argument(
        "--no-overhead", action="store_true", help="skip the per-request runtime overhead measurement (identity model)"
    )
    out.add_argument(
        "--overhead-requests",
        type=int,
        default=4000,
        metavar="N",
        help="requests per row of the overhead measurement (default 4000)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchConfig, parse_lengths, run_bench
    from ..bench.report import markdown_tables, plot, series_from, text_tables, write_json
    from ..manifest import MANIFEST_NAME, Manifest
    from ._target import export_target

    target = export_target(args.target, onnx_file=True)
    if (target / MANIFEST_NAME).is_file():  # the baseline sessions load the file directly
        Manifest.load(target).verify()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cfg = BenchConfig(
        target=args.target,
        concurrency=args.concurrency,
        requests=args.requests or 1000,
        duration_s=args.duration or 120.0,
        lengths=parse_lengths(args.lengths),
        arrival=args.arrival,
        rate=args.rate,
        seed=args.seed,
        modes=modes,
        warmup=args.warmup,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
        max_delay_ms=args.max_delay_ms,
        workers=args.workers,
        latency_session=False if args.no_latency_session else None,
        providers=args.providers,
        baseline_options=dict(args.baseline_option),
    )
    if args.requests is None and args.duration is not None:
        cfg.requests = _calibrate(cfg)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    overhead = None
    if not args.no_overhead and "batched" in modes:

        def overhead() -> dict[str, Any]:
            from ..bench.overhead import measure_overhead

            log("measuring per-request runtime overhead on an identity model ...")
            return measure_overhead(
                concurrency=max(cfg.concurrency),
                max_batch_size=cfg.max_batch_size,
                requests=args.overhead_requests,
                workers=cfg.workers,
                max_seconds=min(cfg.duration_s, 30.0),
            )

    result = run_bench(cfg, progress=not args.no_progress, log=log, overhead=overhead)
    data = result.to_dict()
    print(text_tables(data))
    if args.json:
        write_json(data, args.json)
        log(f"wrote {args.json}")
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).write_text(markdown_tables(data) + "\n", encoding="utf-8")
        log(f"wrote {args.markdown}")
    if args.plot:
        title = f"{data['target']['path']} · lengths {data['workload']['lengths']} · {data['machine']['cores']} cores"
        plot(series_from(data), args.plot, title)
        log(f"wrote {args.plot}")
    failed = [m for m, c in data["checks"].items() if isinstance(c, dict) and c.get("ok") is False]
    errors = sum(r["errors"] + r["hung"] for r in data["results"])
    if failed:
        log(f"ortbatch bench: outputs of {failed} differ from direct's beyond tolerance: see checks in the JSON")
    if errors:
        log(f"ortbatch bench: {errors} request(s) failed or hung")
    return 1 if failed or errors else 0


def _calibrate(cfg: Any) -> int:
    """Requests for ~duration seconds of direct at the highest concurrency (a 2-second probe)."""
    from pathlib import Path

    from ..bench.loadgen import drive
    from ..bench.runner import baseline_for
    from ..bench.workload import load_target, make_workload

    sess = baseline_for(Path(cfg.target), cfg.providers, cfg.baseline_options)
    target = load_target(cfg.target, sess)
    probe = make_workload(target, cfg.lengths, 512, seed=cfg.seed + 20_011)
    names = target.outputs
    res = drive(
        lambda f: sess.run(names, f), probe.feeds, list(range(len(probe))), max(cfg.concurrency), max_seconds=2.0
    )
    rate = res.completed / res.elapsed_s if res.elapsed_s > 0 else 100.0
    return max(64, min(200_000, int(rate * cfg.duration_s)))
