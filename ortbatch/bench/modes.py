"""The three ways one benchmark run serves the same requests.

* ``direct``  — C client threads call ``session.run`` on one shared InferenceSession, one
  request each: what users do today. The session has ONNX Runtime's default options unless
  ``--baseline-option`` says otherwise; the options used are recorded.
* ``batched`` — the same clients call :meth:`BatchedSession.run`.
* ``oracle``  — the same requests, pre-formed *offline* (before the clock starts) into
  length-sorted batches of ``max_batch_size`` (and ``max_batch_tokens`` when given), run
  back to back in one stream on the direct session; every request "arrives" at t=0.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .loadgen import DriveResult, drive
from .workload import RAGGED, Target, Workload, feed_digest

__all__ = [
    "ModeResult",
    "OracleBatches",
    "batched_stats_delta",
    "form_oracle_batches",
    "pad_stack",
    "run_oracle",
    "session_settings",
    "split_outputs",
    "summarize",
]

PERCENTILES = (50, 95, 99)


@dataclass
class ModeResult:
    """One (mode, concurrency) cell of the result table."""

    mode: str
    concurrency: int
    completed: int
    errors: int
    elapsed_s: float
    cpu_s: float
    tokens: int
    latencies_s: np.ndarray
    served: list[int]
    request_digest: str
    mean_rows_per_batch: float
    padding_fraction: float
    batches: int
    rows_histogram: dict[int, int] = field(default_factory=dict)
    truncated: bool = False
    hung: int = 0
    error_samples: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    kept: dict[int, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def latency_ms(self) -> dict[str, float]:
        lat = self.latencies_s
        if lat.size == 0:
            return {f"p{p}": float("nan") for p in PERCENTILES} | {"mean": float("nan"), "max": float("nan")}
        values = np.percentile(lat, PERCENTILES) * 1e3
        out = {f"p{p}": round(float(v), 3) for p, v in zip(PERCENTILES, values, strict=True)}
        out["mean"] = round(float(lat.mean() * 1e3), 3)
        out["max"] = round(float(lat.max() * 1e3), 3)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "completed": self.completed,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "truncated": self.truncated,
            "hung": self.hung,
            "elapsed_s": round(self.elapsed_s, 4),
            "cpu_s": round(self.cpu_s, 4),
            "requests_per_s": round(self.requests_per_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "latency_ms": self.latency_ms(),
            "batches": self.batches,
            "mean_rows_per_batch": round(self.mean_rows_per_batch, 3),
            "padding_fraction": round(self.padding_fraction, 4),
            "rows_histogram": {str(k): v for k, v in sorted(self.rows_histogram.items())},
            "served": len(self.served),
            "request_digest": self.request_digest,
            **self.extra,
        }


def summarize(
    mode: str,
    res: DriveResult,
    workload: Workload,
    *,
    batches: int,
    rows_histogram: dict[int, int],
    padding_fraction: float,
    extra: dict[str, Any] | None = None,
) -> ModeResult:
    """Fold what the clients saw (and what the server counted) into one :class:`ModeResult`."""
    objects = dict(zip(res.served, res.sent_objects, strict=True))
    ok = [i for i in res.served]
    tokens = int(workload.lengths[ok].sum()) if ok else 0
    rows = sum(k * v for k, v in rows_histogram.items())
    return ModeResult(
        mode=mode,
        concurrency=res.concurrency,
        completed=res.completed,
        errors=res.errors,
        elapsed_s=res.elapsed_s,
        cpu_s=res.cpu_s,
        tokens=tokens,
        latencies_s=res.latencies_s,
        served=res.served,
        request_digest=_digest(objects, workload),
        mean_rows_per_batch=rows / batches if batches else 0.0,
        padding_fraction=padding_fraction,
        batches=batches,
        rows_histogram=rows_histogram,
        truncated=res.truncated,
        hung=res.hung,
        error_samples=res.error_samples,
        extra=extra or {},
        kept=res.kept,
    )


def _digest(objects: dict[int, dict[str, np.ndarray]], workload: Workload) -> str:
    """Digest of what a mode actually sent; equals ``workload.digest`` when it served every request."""
    ids = sorted(objects)
    arrivals = workload.arrivals[ids] if workload.arrivals is not None else None
    return feed_digest(objects, ids, arrivals)


def session_settings(session: Any) -> dict[str, Any]:
    """The thread and provider settings an InferenceSession actually runs with."""
    out: dict[str, Any] = {"providers": list(session.get_providers())}
    try:
        opts = session.get_session_options()
    except AttributeError:
        return out
    out["intra_op_num_threads"] = opts.intra_op_num_threads  # 0 = ORT default: one per physical core
    out["inter_op_num_threads"] = opts.inter_op_num_threads
    out["execution_mode"] = str(opts.execution_mode).rsplit(".", 1)[-1]
    out["graph_optimization_level"] = str(opts.graph_optimization_level).rsplit(".", 1)[-1]
    try:
        spinning = opts.get_session_config_entry("session.intra_op.allow_spinning")
    except Exception:  # ORT raises when the entry was never set
        spinning = ""
    out["intra_op_allow_spinning"] = spinning or "default (1)"
    return out


# -- batched: what the session's own counters say about one measured window ------------------
def batched_stats_delta(before: Any, after: Any, tokens_before: int, tokens_after: int) -> dict[str, Any]:
    """Batches, rows histogram and padding fraction of the window between two ``stats()``.

    ``Stats`` is cumulative (warm-up included). Padding needs padded-token totals; when the
    snapshot does not carry them they are recovered from the real tokens this benchmark sent
    (``padded = real / (1 - padding_fraction)``), which is exact for single-axis models.
    """
    hist = Counter({int(k): v for k, v in after.rows_histogram.items()})
    hist.subtract({int(k): v for k, v in before.rows_histogram.items()})
    hist = Counter({k: v for k, v in hist.items() if v > 0})
    batches = after.batches - before.batches
    real_a, pad_a = _real_padded(after, tokens_after)
    real_b, pad_b = _real_padded(before, tokens_before)
    padded = pad_a - pad_b
    padding = 1.0 - (real_a - real_b) / padded if padded > 0 else 0.0
    return {"batches": batches, "rows_histogram": dict(hist), "padding_fraction": max(0.0, padding)}


def _real_padded(stats: Any, tokens_sent: int) -> tuple[float, float]:
    real = getattr(stats, "real_tokens", None)
    padded = getattr(stats, "padded_tokens", None)
    if real is not None and padded is not None:
        return float(real), float(padded)
    frac = float(stats.padding_fraction)
    return float(tokens_sent), (tokens_sent / (1.0 - frac) if frac < 1.0 else float("inf"))


# -- oracle ----------------------------------------------------------------------------------
@dataclass
class OracleBatches:
    """Batches formed before the clock starts: feeds, member request ids and their lengths."""

    feeds: list[dict[str, np.ndarray]]
    members: list[list[int]]
    real_tokens: int
    padded_tokens: int


def form_oracle_batches(
    target: Target, workload: Workload, ids: Sequence[int], max_rows: int, max_tokens: int | None = None
) -> OracleBatches:
    """Length-sorted batches of ``max_rows`` (and at most ``max_tokens`` padded tokens)."""
    order = sorted(ids, key=lambda i: (int(workload.lengths[i]), i))
    groups: list[list[int]] = []
    for i in order:
        length = int(workload.lengths[i])
        if groups:
            g = groups[-1]
            # sorted ascending, so the new request is the longest of its batch
            if len(g) < max_rows and (max_tokens is None or (len(g) + 1) * length <= max_tokens):
                g.append(i)
                continue
        groups.append([i])
    feeds = [pad_stack(target, [workload.feeds[i] for i in g]) for g in groups]
    real = sum(int(workload.lengths[i]) for i in order)
    padded = sum(len(g) * max(int(workload.lengths[i]) for i in g) for g in groups)
    return OracleBatches(feeds, groups, real, padded)


def pad_stack(target: Target, feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    left = target.padding_side == "left"
    for info in target.inputs:
        arrays = [f[info.name] for f in feeds]
        shape = list(arrays[0].shape)
        shape[0] = sum(a.shape[0] for a in arrays)
        for k, d in enumerate(info.dims):
            if d == RAGGED:
                shape[k] = max(a.shape[k] for a in arrays)
        batch = np.full(shape, info.pad, dtype=info.dtype)
        row = 0
        for a in arrays:
            index: list[slice] = [slice(row, row + a.shape[0])]
            for k in range(1, a.ndim):
                n = a.shape[k]
                index.append(slice(shape[k] - n, shape[k]) if left and info.dims[k] == RAGGED else slice(0, n))
            batch[tuple(index)] = a
            row += a.shape[0]
        out[info.name] = batch
    return out


def _unpad(target: Target, batch: dict[str, np.ndarray], row: int, length: int) -> dict[str, np.ndarray]:
    """The feed of one member, cut back out of a padded batch (proves what the oracle ran)."""
    out = {}
    for info in target.inputs:
        a = batch[info.name][row : row + 1]
        index: list[slice] = [slice(None)]
        for k in range(1, a.ndim):
            if info.dims[k] == RAGGED:
                index.append(slice(a.shape[k] - length, None) if target.padding_side == "left" else slice(0, length))
            else:
                index.append(slice(None))
        out[info.name] = np.ascontiguousarray(a[tuple(index)])
    return out


def split_outputs(
    target: Target, outputs: Sequence[np.ndarray], names: Sequence[str], row: int, length: int
) -> list[np.ndarray]:
    res = []
    for name, arr in zip(names, outputs, strict=True):
        view = arr[row : row + 1]
        axes = target.ragged_outputs.get(name, ())
        if axes:
            index: list[slice] = [slice(None)] * view.ndim
            for k in axes:
                index[k] = slice(view.shape[k] - length, None) if target.padding_side == "left" else slice(0, length)
            view = view[tuple(index)]
        res.append(view)
    return res


def run_oracle(
    session: Any,
    target: Target,
    workload: Workload,
    ids: Sequence[int],
    max_rows: int,
    max_tokens: int | None,
    *,
    concurrency: int,
    max_seconds: float,
    keep: frozenset[int] = frozenset(),
    on_progress: Callable[[int], None] | None = None,
) -> ModeResult:
    """Run the offline batches in one stream; latency of a request = when its batch ended."""
    pre = form_oracle_batches(target, workload, ids, max_rows, max_tokens)
    names = target.outputs
    served: list[int] = []
    ends: list[float] = []
    kept: dict[int, Any] = {}
    hist: Counter[int] = Counter()
    errors = 0
    samples: list[str] = []
    ran = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for feed, members in zip(pre.feeds, pre.members, strict=True):
        if time.perf_counter() - t0 >= max_seconds:
            break
        try:
            outputs = session.run(names, feed)
        except Exception as exc:
            errors += len(members)
            if len(samples) < 5:
                samples.append(f"{type(exc).__name__}: {exc}")
            outputs = None
        # splitting back per request is part of serving; it is timed
        if outputs is not None:
            for row, i in enumerate(members):
                part = split_outputs(target, outputs, names, row, int(workload.lengths[i]))
                if i in keep:
                    kept[i] = part
        end = time.perf_counter()
        ran += 1
        hist[len(members)] += 1
        served.extend(members)
        ends.extend([end] * len(members))
        if on_progress is not None:
            on_progress(len(members))
    cpu = time.process_time() - cpu0
    elapsed = (ends[-1] - t0) if ends else 0.0
    # after the clock: cut each member back out of the batch it ran in, for the digest
    objects: dict[int, dict[str, np.ndarray]] = {}
    for feed, members in zip(pre.feeds[:ran], pre.members[:ran], strict=True):
        for row, i in enumerate(members):
            objects[i] = _unpad(target, feed, row, int(workload.lengths[i]))
    ran_members = [i for m in pre.members[:ran] for i in m]
    real = int(workload.lengths[ran_members].sum()) if ran_members else 0
    padded = sum(len(m) * max(int(workload.lengths[i]) for i in m) for m in pre.members[:ran])
    return ModeResult(
        mode="oracle",
        concurrency=concurrency,
        completed=len(served) - errors,
        errors=errors,
        elapsed_s=elapsed,
        cpu_s=cpu,
        tokens=real,
        latencies_s=np.array(ends) - t0,
        served=served,
        request_digest=_digest(objects, workload),
        mean_rows_per_batch=len(served) / ran if ran else 0.0,
        padding_fraction=1.0 - real / padded if padded else 0.0,
        batches=ran,
        rows_histogram=dict(hist),
        truncated=ran < len(pre.feeds),
        error_samples=samples,
        extra={"streams": 1},
        kept=kept,
    )


def run_clients(
    mode: str,
    call: Callable[[dict[str, np.ndarray]], Any],
    workload: Workload,
    ids: Sequence[int],
    concurrency: int,
    *,
    max_seconds: float,
    keep: frozenset[int],
    on_progress: Callable[[int], None] | None,
) -> DriveResult:
    arrivals = None
    if workload.arrivals is not None:
        arrivals = workload.arrivals[np.asarray(ids)] if len(ids) != len(workload) else workload.arrivals
    return drive(
        call,
        workload.feeds,
        ids,
        concurrency,
        arrivals=arrivals,
        max_seconds=max_seconds,
        keep=keep,
        on_progress=on_progress,
    )
