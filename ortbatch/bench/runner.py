"""One benchmark run: every mode at every concurrency, on one fixed set of requests."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from ..errors import InvalidInputError
from ..manifest import Manifest
from .modes import ModeResult, batched_stats_delta, run_clients, run_oracle, session_settings, summarize
from .workload import LengthSpec, Target, Workload, load_target, make_workload

__all__ = [
    "MODES",
    "SCHEMA",
    "BenchConfig",
    "BenchRun",
    "baseline_for",
    "make_baseline_session",
    "machine_info",
    "model_path_of",
    "run_bench",
]

MODES = ("direct", "batched", "oracle")
SCHEMA = "ortbatch.bench/1"
N_PROBES = 8  # requests whose outputs every mode keeps, to prove the modes computed the same thing


@dataclass
class BenchConfig:
    """Everything that shapes a run; recorded verbatim in the JSON."""

    target: str
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    requests: int = 1000
    duration_s: float = 120.0  # cap per (mode, concurrency) run
    lengths: LengthSpec = field(default_factory=lambda: LengthSpec(8, 128))
    arrival: str = "closed"
    rate: float | None = None
    seed: int = 0
    modes: list[str] = field(default_factory=lambda: list(MODES))
    warmup: int | None = None  # None: 2 x concurrency + 32 per run
    max_batch_size: int = 32
    max_batch_tokens: int | None = None
    max_delay_ms: float = 0.0
    workers: int | None = None
    latency_session: bool | None = None  # None: BatchedSession's default
    providers: str | None = None
    baseline_options: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lengths"] = str(self.lengths)
        return d


@dataclass
class BenchRun:
    """The outcome: results per mode and concurrency plus everything needed to read them."""

    config: BenchConfig
    target: Target
    workload: Workload
    results: list[ModeResult]
    settings: dict[str, Any]
    checks: dict[str, Any]
    machine: dict[str, Any]
    started: str
    overhead: dict[str, Any] | None = None

    def result(self, mode: str, concurrency: int) -> ModeResult | None:
        for r in self.results:
            if r.mode == mode and r.concurrency == concurrency:
                return r
        return None

    def ratios(self) -> list[dict[str, Any]]:
        rows = []
        for c in self.config.concurrency:
            d, b, o = (self.result(m, c) for m in ("direct", "batched", "oracle"))
            row: dict[str, Any] = {"concurrency": c}
            if b and d and d.requests_per_s:
                row["batched_over_direct"] = round(b.requests_per_s / d.requests_per_s, 3)
                row["p50_batched_over_direct"] = round(b.latency_ms()["p50"] / d.latency_ms()["p50"], 3)
            if b and o and o.requests_per_s:
                row["batched_over_oracle"] = round(b.requests_per_s / o.requests_per_s, 3)
            if d and o and d.requests_per_s:
                row["oracle_over_direct"] = round(o.requests_per_s / d.requests_per_s, 3)
            rows.append(row)
        return rows

    def to_dict(self) -> dict[str, Any]:
        from .. import __version__

        return {
            "schema": SCHEMA,
            "ortbatch": __version__,
            "started": self.started,
            "machine": self.machine,
            "config": self.config.to_dict(),
            "target": self.target.describe(),
            "workload": self.workload.describe(),
            "settings": self.settings,
            "results": [r.to_dict() for r in self.results],
            "ratios": self.ratios(),
            "checks": self.checks,
            "overhead": self.overhead,
        }


def machine_info() -> dict[str, Any]:
    ort = require("onnxruntime")
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        load = []
    return {
        "cpu": cpu,
        "cores": cores,
        "loadavg_at_start": load,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "onnxruntime": ort.__version__,
        "available_providers": list(ort.get_available_providers()),
    }


def make_baseline_session(
    model_path: Path,
    providers: str | None,
    options: dict[str, str],
    manifest_providers: Any = (),
    base_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """The direct/oracle session: ONNX Runtime's defaults, plus only what ``options`` names.

    Providers resolve exactly as BatchedSession resolves them (same shortcuts, the
    manifest's options merged per key, e.g. TensorRT fp16 and its profile shapes, cache
    paths under the export directory ``base_dir``), so both run on the same EP. A silent
    fallback to CPU would make every figure meaningless: it is a ProviderError.
    """
    ort = require("onnxruntime")
    from .._ort import build_session, resolve_providers

    so = ort.SessionOptions()
    for key, value in options.items():
        if key in ("intra_op_num_threads", "inter_op_num_threads"):
            setattr(so, key, int(value))
        else:  # a session config entry, e.g. session.intra_op.allow_spinning=0
            so.add_session_config_entry(key, value)
    requested = resolve_providers(providers, manifest_providers, base_dir)
    return build_session(model_path, requested, session_options=so)


def baseline_for(source: Path, providers: str | None, options: dict[str, str]) -> Any:
    """:func:`make_baseline_session` for an export directory or a bare ``.onnx`` file."""
    if source.is_dir():
        manifest = Manifest.load(source)
        return make_baseline_session(manifest.model_path, providers, options, manifest.providers, source)
    return make_baseline_session(source, providers, options)


def run_bench(
    cfg: BenchConfig,
    *,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    overhead: Callable[[], dict[str, Any]] | None = None,
) -> BenchRun:
    """Run every mode of ``cfg.modes`` at every concurrency on one seeded request set."""
    _check_config(cfg)
    base_log = log or (lambda _msg: None)
    bar_box: list[Any] = [None]

    def say(msg: str) -> None:
        if bar_box[0] is not None:
            bar_box[0].write(msg)  # keeps the progress bar on its own line
        else:
            base_log(msg)

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = machine_info()
    source = Path(cfg.target)
    if not source.exists():
        raise InvalidInputError(f"no export directory or .onnx file at {source}")
    sess = baseline_for(source, cfg.providers, cfg.baseline_options)
    target = load_target(source, sess)
    rate = cfg.rate if cfg.arrival == "poisson" else None
    workload = make_workload(target, cfg.lengths, cfg.requests, seed=cfg.seed, rate=rate)
    warm_n = cfg.warmup if cfg.warmup is not None else 2 * max(cfg.concurrency) + 32
    warm = make_workload(target, cfg.lengths, max(warm_n, 1), seed=cfg.seed + 10_007) if warm_n else None
    ids = list(range(len(workload)))
    keep = frozenset(ids[:N_PROBES])
    say(
        f"target {source}: {len(workload)} requests, lengths {workload.lengths_spec}, "
        f"{workload.tokens} tokens, digest {workload.digest[:12]}"
    )
    settings = _baseline_settings(cfg, sess)
    bar = _progress(progress, len(cfg.modes) * len(cfg.concurrency) * len(workload))
    bar_box[0] = bar
    results: list[ModeResult] = []
    outputs: dict[str, dict[int, Any]] = {}
    try:
        for c in cfg.concurrency:
            for mode in cfg.modes:
                if bar is not None:
                    bar.set_description(f"{mode:>7} c={c}")
                tick = bar.update if bar is not None else None
                res = _run_mode(mode, sess, source, target, workload, warm, ids, c, cfg, keep, tick, settings)
                results.append(res)
                for i, out in res.kept.items():
                    outputs.setdefault(mode, {}).setdefault(i, out)
                say(
                    f"{mode:>7} c={c:<3} {res.requests_per_s:9.1f} req/s  p50 {res.latency_ms()['p50']:.2f} ms"
                    f"  rows/batch {res.mean_rows_per_batch:.2f}  padding {res.padding_fraction:.1%}"
                    + ("  TRUNCATED" if res.truncated else "")
                    + (f"  errors {res.errors}" if res.errors else "")
                )
    finally:
        if bar is not None:
            bar.close()
        bar_box[0] = None
    checks = _compare_outputs(outputs, target.outputs, sess)
    run = BenchRun(cfg, target, workload, results, settings, checks, machine, started)
    if overhead is not None:
        run.overhead = overhead()
    return run


def _check_config(cfg: BenchConfig) -> None:
    unknown = [m for m in cfg.modes if m not in MODES]
    if unknown:
        raise InvalidInputError(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise InvalidInputError(f"--concurrency needs positive integers, got {cfg.concurrency}")
    if cfg.arrival not in ("closed", "poisson"):
        raise InvalidInputError(f"--arrival must be closed or poisson, got {cfg.arrival!r}")
    if cfg.arrival == "poisson" and not cfg.rate:
        raise InvalidInputError("--arrival poisson needs --rate R (requests per second)")


def _baseline_settings(cfg: BenchConfig, sess: Any) -> dict[str, Any]:
    """The settings of the direct and oracle modes (batched adds its own when it runs)."""
    settings: dict[str, Any] = {}
    base = session_settings(sess)
    if "direct" in cfg.modes:
        settings["direct"] = {
            "session": base,
            "clients": "one thread per client, session.run per request",
            "options_set": dict(cfg.baseline_options),
        }
    if "oracle" in cfg.modes:
        settings["oracle"] = {
            "session": base,
            "streams": 1,
            "max_batch_size": cfg.max_batch_size,
            "max_batch_tokens": cfg.max_batch_tokens,
            "options_set": dict(cfg.baseline_options),
        }
    return settings


def _run_mode(
    mode: str,
    sess: Any,
    source: Path,
    target: Any,
    workload: Any,
    warm: Any,
    ids: list[int],
    c: int,
    cfg: BenchConfig,
    keep: frozenset[int],
    tick: Callable[[int], Any] | None,
    settings: dict[str, Any],
) -> ModeResult:
    """One mode at concurrency ``c``: warm-up, then the measured run."""
    if mode == "direct":
        return _run_direct(sess, target, workload, warm, ids, c, cfg, keep, tick)
    if mode == "batched":
        res, info = _run_batched(source, target, workload, warm, ids, c, cfg, keep, tick)
        settings.setdefault("batched", info)
        res.extra["stats"] = info.pop("last_stats", None)
        return res
    if warm is not None:
        run_oracle(
            sess,
            target,
            warm,
            list(range(len(warm))),
            cfg.max_batch_size,
            cfg.max_batch_tokens,
            concurrency=c,
            max_seconds=30.0,
        )
    return run_oracle(
        sess,
        target,
        workload,
        ids,
        cfg.max_batch_size,
        cfg.max_batch_tokens,
        concurrency=c,
        max_seconds=cfg.duration_s,
        keep=keep,
        on_progress=tick,
    )


def model_path_of(source: Path) -> Path:
    if source.is_dir():
        return Manifest.load(source).model_path
    return source


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (CI logs, captured output)
    return tqdm(total=total, unit="req", leave=False, dynamic_ncols=True, file=sys.stderr, disable=None)


def _run_direct(
    sess: Any,
    target: Target,
    workload: Workload,
    warm: Workload | None,
    ids: list[int],
    c: int,
    cfg: BenchConfig,
    keep: frozenset[int],
    tick: Any,
) -> ModeResult:
    names = target.outputs

    def call(feed: dict[str, np.ndarray]) -> Any:
        return sess.run(names, feed)

    if warm is not None:
        run_clients(
            "direct", call, warm, list(range(len(warm))), c, max_seconds=30.0, keep=frozenset(), on_progress=None
        )
    res = run_clients("direct", call, workload, ids, c, max_seconds=cfg.duration_s, keep=keep, on_progress=tick)
    hist = {1: res.completed + res.errors}
    return summarize(
        "direct", res, workload, batches=res.completed + res.errors, rows_histogram=hist, padding_fraction=0.0
    )


def _run_batched(
    source: Path,
    target: Target,
    workload: Workload,
    warm: Workload | None,
    ids: list[int],
    c: int,
    cfg: BenchConfig,
    keep: frozenset[int],
    tick: Any,
) -> tuple[ModeResult, dict[str, Any]]:
    from ..runtime.session import BatchedSession

    names = target.outputs
    # a fresh session per concurrency level, built from the path so the runtime picks its own
    # thread settings (as a user passing a path gets); warmed up on other requests first
    bs = BatchedSession(
        str(source),
        max_batch_size=cfg.max_batch_size,
        max_batch_tokens=cfg.max_batch_tokens,
        max_delay_ms=cfg.max_delay_ms,
        workers=cfg.workers,
        providers=cfg.providers,
        latency_session=cfg.latency_session,
        max_queue=max(1024, 4 * c),
    )
    try:

        def call(feed: dict[str, np.ndarray]) -> Any:
            return bs.run(names, feed)

        warm_tokens = 0
        if warm is not None:
            wres = run_clients(
                "batched", call, warm, list(range(len(warm))), c, max_seconds=30.0, keep=frozenset(), on_progress=None
            )
            warm_tokens = int(warm.lengths[wres.served].sum()) if wres.served else 0
        before = bs.stats()
        res = run_clients("batched", call, workload, ids, c, max_seconds=cfg.duration_s, keep=keep, on_progress=tick)
        after = bs.stats()
        sent = int(workload.lengths[res.served].sum()) if res.served else 0
        delta = batched_stats_delta(before, after, warm_tokens, warm_tokens + sent)
        info = {
            "session": session_settings(bs.session),
            "latency_session": session_settings(bs.latency_session) if bs.latency_session is not None else None,
            "workers": getattr(bs, "workers", cfg.workers),
            "max_batch_size": getattr(bs, "max_batch_size", cfg.max_batch_size),
            "max_batch_tokens": cfg.max_batch_tokens,
            "max_delay_ms": cfg.max_delay_ms,
            "built_from": "path (BatchedSession chooses its session options)",
        }
        result = summarize(
            "batched",
            res,
            workload,
            batches=delta["batches"],
            rows_histogram=delta["rows_histogram"],
            padding_fraction=delta["padding_fraction"],
        )
        stats = after.as_dict()
        info["last_stats"] = {
            k: stats[k] for k in ("queue_wait_ms", "run_ms", "cost_model", "errors", "workers") if k in stats
        }
        return result, info
    finally:
        bs.close()


def _compare_outputs(outputs: dict[str, dict[int, Any]], names: list[str], session: Any = None) -> dict[str, Any]:
    """Max |difference| of each mode's outputs from direct's on the probe requests, against
    a tolerance from the arithmetic the session's provider really uses (TF32 on CUDA,
    fp16 inside a TensorRT fp16 engine whose outputs are still fp32)."""
    ref = outputs.get("direct")
    checks: dict[str, Any] = {"probes": sorted(ref) if ref else [], "reference": "direct"}
    if not ref:
        return checks
    for mode, outs in outputs.items():
        if mode == "direct":
            continue
        worst: dict[str, float] = {}
        shape_mismatch: list[str] = []
        for i, got in outs.items():
            want = ref.get(i)
            if want is None:
                continue
            for name, a, b in zip(names, got, want, strict=True):
                a, b = np.asarray(a), np.asarray(b)
                if a.shape != b.shape:
                    shape_mismatch.append(f"request {i} {name}: {a.shape} vs {b.shape}")
                    continue
                if a.size:
                    diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                    worst[name] = max(worst.get(name, 0.0), diff)
        tol = {name: _tolerance(ref, name, names, session) for name in names}
        ok = not shape_mismatch and all(worst.get(n, 0.0) <= tol[n] for n in names)
        checks[mode] = {"max_abs_diff": worst, "tolerance": tol, "shape_mismatch": shape_mismatch[:5], "ok": ok}
    return checks


def _tolerance(ref: dict[int, Any], name: str, names: list[str], session: Any = None) -> float:
    from .._ort import CPU, output_tolerance

    k = names.index(name)
    sample = np.asarray(next(iter(ref.values()))[k])
    if sample.dtype.kind in "iub":
        return 0.0
    provider, options = CPU, {}
    if session is not None and hasattr(session, "get_providers"):
        provider = session.get_providers()[0]
        if hasattr(session, "get_provider_options"):
            options = dict(session.get_provider_options().get(provider, {}) or {})
    return output_tolerance(provider, options, "fp16" if sample.dtype == np.float16 else "fp32")
