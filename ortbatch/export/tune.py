"""``ortbatch tune``: the fastest variant of a model that still passes the checks, with proof.

1. Build the candidate variants that fit this machine (:func:`candidates`): fp32, ORT
   fusions O1/O2, int8 dynamic (per-channel; on the fused graph; first and last layers
   kept in float; outlier units kept in float with padding masked, searched from the
   fewest float units to more until the checks pass; the same after SmoothQuant-style
   smoothing of the LayerNorm-fed inputs), int8 static; on a GPU also fp16
   (O4) and TensorRT fp16.
2. Run the full built-in checks on each, with the user's floors (``min_cosine``, ...)
   merged over the variant's own tolerances. A variant that fails is never benchmarked
   and never chosen; the table says which metric failed and by how much.
3. Benchmark each passing variant with :class:`~ortbatch.BatchedSession` on the user's
   length distribution (real texts through the tokenizer) under a few runtime settings
   (workers, and so threads per worker, and max batch size), in interleaved rounds so a
   busy machine slows every cell alike; the median round counts.
4. Keep the fastest passing variant as the export in ``output`` (a plain ONNX model
   plus manifest), with the chosen settings in the manifest's ``runtime`` section, which
   BatchedSession and ``ortbatch serve`` read. The others are deleted, or kept next to it
   with ``keep=True``. ``tune.json``, ``tune.md`` and ``tune.png`` record the table.

Everything runs within ``budget_s`` (variants that no longer fit are reported as skipped).
An optional held-out text file is checked *after* the choice, on every passing variant,
and never influences it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._ort import CUDA, TRT
from ..errors import ExportError, InvalidInputError
from ..manifest import Manifest
from .quantize import QuantizeConfig

__all__ = ["RuntimeSetting", "TuneResult", "Variant", "VariantResult", "candidates", "resolve_variants", "tune"]

log = logging.getLogger("ortbatch.export")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Variant:
    """One way to build the export."""

    name: str
    optimize: str | None = None
    quantize: QuantizeConfig | None = None
    dtype: str = "fp32"
    device: str = "cpu"
    trt: bool = False
    #: accuracy-aware search: quantizations to try in turn, each keeping more in float
    #: (so slower, more accurate), when the one before fails the checks; the first that
    #: passes is the variant. Only the check samples drive it, never the held-out set.
    fallbacks: tuple[QuantizeConfig, ...] = ()

    def attempts(self) -> list[Variant]:
        """This variant, then one per fallback quantization."""
        return [self, *(replace(self, quantize=q, fallbacks=()) for q in self.fallbacks)]

    def export_kwargs(self) -> dict[str, Any]:
        return {
            "optimize": self.optimize,
            "quantize": self.quantize,
            "dtype": self.dtype,
            "device": self.device,
            "trt": self.trt,
        }


@dataclass(frozen=True)
class RuntimeSetting:
    """BatchedSession settings tried for each variant (threads per worker = cores // workers)."""

    workers: int
    max_batch_size: int
    max_batch_tokens: int | None = None

    @property
    def label(self) -> str:
        tokens = f" tok{self.max_batch_tokens}" if self.max_batch_tokens else ""
        return f"w{self.workers} b{self.max_batch_size}{tokens}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "max_batch_size": self.max_batch_size,
            "max_batch_tokens": self.max_batch_tokens,
        }


DEFAULT_SETTINGS: tuple[RuntimeSetting, ...] = (
    RuntimeSetting(workers=2, max_batch_size=32),
    RuntimeSetting(workers=1, max_batch_size=32),
    RuntimeSetting(workers=2, max_batch_size=16, max_batch_tokens=2048),
)


def candidates(providers: Sequence[str] | None = None) -> list[Variant]:
    """The variants worth trying with these onnxruntime providers (default: those that really
    load here, by a probe session; the onnxruntime-gpu build lists CUDA and TensorRT anywhere)."""
    if providers is None:
        from .._ort.probe import probe

        providers = [name for name, ok in probe()["loads"].items() if ok]
    out = [
        Variant("fp32"),
        Variant("O1", optimize="O1"),
        Variant("O2", optimize="O2"),
        Variant("int8", quantize=QuantizeConfig("int8")),
        # outlier units in float and padding out of the scale (ortbatch.export.outliers);
        # 7-bit weights: the u8s8 kernels of CPUs without VNNI saturate int16 sums otherwise
        Variant(
            "int8-outliers",
            quantize=_outliers(6.0),
            fallbacks=(_outliers(4.0), _outliers(3.0), _outliers(2.0)),
        ),
        # LayerNorm-fed inputs smoothed (one Mul each, no float MatMul); the split only for
        # what stays an outlier (on MiniLM the GELU outputs of 4 layers)
        Variant(
            "int8-smooth",
            quantize=_outliers(6.0, smooth_alpha=SMOOTH_ALPHA),
            fallbacks=(_outliers(4.0, smooth_alpha=SMOOTH_ALPHA), _outliers(3.0, smooth_alpha=SMOOTH_ALPHA)),
        ),
        Variant("O2+int8", optimize="O2", quantize=QuantizeConfig("int8")),
        Variant("int8-float-edges", quantize=QuantizeConfig("int8", keep_float="edges")),
        Variant("int8-static", quantize=QuantizeConfig("int8-static", op_types=("MatMul",))),
    ]
    if CUDA in providers:
        out.append(Variant("fp16-O4-cuda", optimize="O4", dtype="fp16", device="cuda"))
    if TRT in providers:
        out.append(Variant("trt-fp16", dtype="fp16", device="cuda", trt=True))
    return out


#: int8-smooth's alpha: with 7-bit weights the most accurate of those measured on MiniLM
#: (docs/export.md, "Smoothing")
SMOOTH_ALPHA = 0.65


def _outliers(ratio: float, smooth_alpha: float | None = None) -> QuantizeConfig:
    return QuantizeConfig("int8", reduce_range=True, smooth_alpha=smooth_alpha, outlier_ratio=ratio, mask_padding=True)


@dataclass
class VariantResult:
    """One row of the tune table."""

    variant: str
    status: str  # "passed", "failed" (the checks), "error" (the build), "skipped" (budget)
    worst_metric: str = "-"
    failure: str = ""
    export_s: float = 0.0
    throughput: float | None = None  # requests/s at the best setting (median round)
    p50_ms: float | None = None
    p99_ms: float | None = None
    setting: RuntimeSetting | None = None
    by_setting: dict[str, dict[str, float]] = field(default_factory=dict)
    speedup: float | None = None  # vs fp32 at fp32's best setting, same run
    holdout: str = "-"
    directory: Path | None = None
    onnx_mib: float | None = None
    quantization: str | None = None  # the label of the quantization that was built
    attempts: list[str] = field(default_factory=list)  # the search's rejected tries, in order

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "status": self.status,
            "worst_metric": self.worst_metric,
            "failure": self.failure,
            "export_s": round(self.export_s, 1),
            "requests_per_s": None if self.throughput is None else round(self.throughput, 2),
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "setting": self.setting.to_dict() if self.setting else None,
            "by_setting": self.by_setting,
            "speedup_vs_fp32": None if self.speedup is None else round(self.speedup, 3),
            "holdout": self.holdout,
            "onnx_mib": None if self.onnx_mib is None else round(self.onnx_mib, 1),
            "quantization": self.quantization,
            "attempts": self.attempts,
        }


@dataclass
class TuneResult:
    """What :func:`tune` chose, and the table that proves it."""

    directory: Path
    chosen: VariantResult | None
    rows: list[VariantResult]
    workload: dict[str, Any]
    seconds: float

    def table(self, markdown: bool = False) -> str:
        """The table of every variant. ``markdown``: every detail in its cell (tune.md). Plain
        text (the terminal): each cell short enough that the table fits about 100 columns
        (``*`` marks the chosen variant), and what a cell leaves out (the failing check, the
        rejected tries, where a failing variant fell short, the held-out result) in notes below it."""
        header = ["variant", "checks", "worst metric", "req/s", "p50 ms", "p99 ms", "setting", "vs fp32", "held-out"]
        rows = []
        notes = []
        for r in self.rows:
            checks = r.status if not r.failure else f"{r.status}: {r.failure}"
            if r.attempts:
                checks += f" (as {r.quantization}; rejected first: " + "; ".join(r.attempts) + ")"
            chosen = self.chosen is not None and r.variant == self.chosen.variant
            numbers = [
                _num(r.throughput, 1),
                _num(r.p50_ms, 1),
                _num(r.p99_ms, 1),
                r.setting.label if r.setting else "-",
                "-" if r.speedup is None else f"{r.speedup:.2f}x",
            ]
            if markdown:
                rows.append([r.variant + (" (chosen)" if chosen else ""), checks, r.worst_metric, *numbers, r.holdout])
                continue
            worst = r.worst_metric.split(" (", 1)[0]
            holdout = r.holdout.split(",", 1)[0].split(":", 1)[0]
            rows.append([r.variant + (" *" if chosen else ""), r.status, worst, *numbers, holdout])
            detail = [checks] if checks != r.status else []
            if worst != r.worst_metric and r.status != "passed":  # where a failing variant fell short
                detail.append(f"worst {r.worst_metric}")
            if holdout != r.holdout:
                detail.append(f"held-out: {r.holdout}")
            if detail:
                notes.append(textwrap.fill(f"{r.variant}: " + "; ".join(detail), width=100, subsequent_indent="    "))
        if markdown:
            cells = [[c.replace("|", "\\|") for c in row] for row in rows]
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
        out.append("  ".join("-" * w for w in widths))
        out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        if self.chosen is not None:
            out.append("* chosen")
        return "\n".join(out + notes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": os.fspath(self.directory),
            "chosen": None if self.chosen is None else self.chosen.variant,
            "setting": None if self.chosen is None or self.chosen.setting is None else self.chosen.setting.to_dict(),
            "workload": self.workload,
            "seconds": round(self.seconds, 1),
            "rows": [r.to_dict() for r in self.rows],
        }


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def tune(
    model: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    lengths: str = "8-128",
    texts: str | os.PathLike[str] | None = None,
    min_cosine: float | None = None,
    min_argmax: float | None = None,
    min_greedy: float | None = None,
    budget_s: float = 600.0,
    keep: bool = False,
    variants: Sequence[Variant] | Sequence[str] | None = None,
    settings: Sequence[RuntimeSetting] = DEFAULT_SETTINGS,
    holdout: str | os.PathLike[str] | None = None,
    recipe: Any = None,
    requests: int = 512,
    concurrency: int = 64,
    rounds: int = 3,
    bench_s: float | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    bar: Any = None,
) -> TuneResult:
    """Find and keep the fastest variant of ``model`` that passes the checks.

    Args:
        model: hub id, local model directory, ``pkg:<module>``, or an ortbatch export
            directory (its source model is re-exported).
        output: where the chosen export goes (must not exist, or be an earlier export).
        lengths: ``A-B`` token lengths of the benchmark's requests; real texts (``texts``
            or the built-in corpus) within that range, longer ones truncated to ``B``.
        texts: a file with one text per line for the benchmark requests.
        min_cosine, min_argmax, min_greedy: floors every variant must reach (merged over
            its own tolerances; a floor never loosens them).
        budget_s: wall-clock bound for the whole run.
        keep: keep the other variants in ``<output>.variants/`` instead of deleting them.
        variants: subset of :func:`candidates` (by name) or explicit :class:`Variant` s.
        settings: BatchedSession settings to try per variant.
        holdout: a text file checked after the choice (reported, never used to choose).
        recipe: a recipe (file or :class:`Recipe`) for everything else of the export.
        rounds, bench_s: interleaved rounds, and seconds per (variant, setting) cell in
            each (default: what the budget leaves, 1-10 s).
        bar: a tqdm-like object (``update(n)``, ``set_description(s)``) for progress.

    Raises:
        InvalidInputError: bad arguments (lengths, floors, texts overlapping the held-out set).
        ExportError: no variant could be built or the output directory is in the way.
    """
    t0 = time.perf_counter()
    floors = {"cosine": min_cosine, "argmax": min_argmax, "greedy": min_greedy}
    spec = _check_arguments(
        lengths, floors, budget_s, {"requests": requests, "concurrency": concurrency, "rounds": rounds}, settings
    )
    out = Path(output)
    rcp, model_ref, chosen_variants, bench_texts, holdout_texts = _inputs(out, model, recipe, variants, texts, holdout)
    floors_set = {k: v for k, v in floors.items() if v}
    work = _work_dir(out)
    clock = _Clock(t0 + budget_s, budget_s, bar, progress or (lambda msg: log.info("%s", msg)))
    try:
        # -- 1+2: build and check every variant -------------------------------------
        rows = _build_variants(model, model_ref, chosen_variants, work, rcp, floors_set, clock)
        passed = [r for r in rows if r.status == "passed"]
        if not passed:
            raise ExportError("tune: no variant passed the checks:\n" + _plain(rows))
        # -- 3: benchmark the passing ones (fp32 too, as the baseline) -------------------
        bench = _BenchPlan(spec, bench_texts, requests, seed, concurrency, rounds, bench_s)
        workload = _benchmark(rows, settings, bench, work, clock)
        chosen = max(passed, key=lambda r: r.throughput or 0.0)
        # -- held-out: checked after the choice, reported only ---------------------------
        if holdout_texts is not None:
            _check_holdout(passed, chosen, holdout_texts, floors_set, clock)
        # -- 4: keep the winner -------------------------------------------------------
        result = TuneResult(out, chosen, rows, workload.describe() | {"texts": os.fspath(texts or "built-in")}, 0.0)
        _install(chosen, out, result, work, keep)
        result.seconds = time.perf_counter() - t0
        _write_records(result, out)
        return result
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


# -- the phases of tune ----------------------------------------------------------------------


def _check_arguments(
    lengths: str,
    floors: dict[str, float | None],
    budget_s: float,
    counts: dict[str, int],
    settings: Sequence[RuntimeSetting],
) -> Any:
    """The benchmark's LengthSpec, once every argument is known to be usable."""
    from ..bench.workload import parse_lengths

    spec = parse_lengths(lengths)
    if spec.texts is not None:
        raise InvalidInputError("tune: --lengths takes A-B or N; give real texts with --texts FILE")
    for name, value in floors.items():
        if value is not None and not 0.0 < value <= 1.0:
            raise InvalidInputError(f"tune: min_{name} must be in (0, 1], got {value}")
    if budget_s <= 0:
        raise InvalidInputError(f"tune: budget_s must be positive, got {budget_s}")
    for name, count in counts.items():
        if count < 1:
            raise InvalidInputError(f"tune: {name} must be at least 1, got {count}")
    if not settings:
        raise InvalidInputError("tune: no runtime settings to try")
    return spec


def _inputs(
    out: Path,
    model: str | os.PathLike[str],
    recipe: Any,
    variants: Sequence[Variant] | Sequence[str] | None,
    texts: str | os.PathLike[str] | None,
    holdout: str | os.PathLike[str] | None,
) -> tuple[Any, str, list[Variant], list[str] | None, list[str] | None]:
    """The output checked, then the recipe, model, variants and texts, read."""
    from .recipes import Recipe, load_recipe

    _check_output(out)
    rcp = load_recipe(recipe) if isinstance(recipe, (str, os.PathLike)) else (recipe or Recipe())
    model_ref = _model_ref(model)
    _check_model(model_ref)
    chosen_variants = resolve_variants(variants)
    bench_texts = _read_texts(texts) if texts is not None else None
    holdout_texts = _read_texts(holdout) if holdout is not None else None
    _check_unseen(holdout_texts, rcp.samples, bench_texts)
    return rcp, model_ref, chosen_variants, bench_texts, holdout_texts


def _work_dir(out: Path) -> Path:
    """A fresh scratch directory beside ``out`` (removed when tune ends)."""
    work = out.parent / f".{out.name}.tune"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def _check_unseen(holdout_texts: list[str] | None, samples: Sequence[str], bench_texts: list[str] | None) -> None:
    if holdout_texts is None:
        return
    overlap = set(holdout_texts) & (set(samples) | set(bench_texts or ()))
    if overlap:
        raise InvalidInputError(
            f"tune: {len(overlap)} held-out text(s) are also tuning texts or check samples, "
            f"e.g. {next(iter(overlap))!r}: a held-out set must be unseen"
        )


@dataclass
class _Clock:
    """The budget's deadline, and where progress goes."""

    deadline: float
    budget_s: float
    bar: Any
    say: Progress

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)


@dataclass
class _BenchPlan:
    """What the benchmark of the passing variants runs."""

    spec: Any
    texts: list[str] | None
    requests: int
    seed: int
    concurrency: int
    rounds: int
    bench_s: float | None


def _build_variants(
    model: Any,
    model_ref: str,
    variants: Sequence[Variant],
    work: Path,
    rcp: Any,
    floors: dict[str, float],
    clock: _Clock,
) -> list[VariantResult]:
    rows: list[VariantResult] = []
    for i, var in enumerate(variants):
        clock.describe(f"export+check {var.name}")
        left = clock.left()
        # each build must leave time to benchmark what passed (a fifth of the budget)
        if rows and left < 0.2 * clock.budget_s + max(r.export_s for r in rows):
            rows.append(VariantResult(var.name, "skipped", failure=f"budget ({clock.budget_s:g}s) spent"))
            _tick(clock.bar)
            continue
        clock.say(f"[{i + 1}/{len(variants)}] {var.name}: export and checks")
        row = _search(model_ref, work / _slug(var.name), var, rcp, floors, clock.left, 0.2 * clock.budget_s, clock.say)
        rows.append(row)
        _tick(clock.bar)
        if row.directory is not None:
            family = Manifest.load(row.directory).source.get("family", "encoder")
            if family != "encoder":
                # BatchedGenerator's continuous batching is another benchmark (ortbatch generate/bench)
                raise InvalidInputError(
                    f"tune benchmarks encoder exports with BatchedSession; {model} is a {family} model. "
                    "Export it with --quantize int8 (checked by greedy-token agreement) and compare with "
                    "benchmarks/generation.py instead"
                )
    return rows


def _benchmark(
    rows: list[VariantResult], settings: Sequence[RuntimeSetting], plan: _BenchPlan, work: Path, clock: _Clock
) -> Any:
    """Benchmark every passing variant (and the fp32 baseline) under every setting, in
    interleaved rounds; each row gets its median round's figures. Returns the workload."""
    from ..bench.workload import LengthSpec, load_target, make_workload

    baseline = next((r for r in rows if r.variant == "fp32"), None)
    bench_rows = [r for r in rows if r.status == "passed" or (r is baseline and r.directory is not None)]
    ref_dir = bench_rows[0].directory
    assert ref_dir is not None
    spec = plan.spec
    text_file = _length_filtered_texts(ref_dir, spec.low, spec.high, plan.texts, work / "bench-texts.txt")
    import onnxruntime

    target = load_target(ref_dir, onnxruntime.InferenceSession(os.fspath(ref_dir / "model.onnx")))
    workload = make_workload(target, LengthSpec(texts=os.fspath(text_file)), plan.requests, seed=plan.seed)
    cells = [(r, s) for r in bench_rows for s in settings]
    # each cell also builds its sessions and warms up (about as long again as it measures)
    left = clock.left() - 5.0
    per_cell = plan.bench_s or max(1.0, min(10.0, left / max(1, 2 * len(cells) * plan.rounds) - 1.0))
    clock.say(
        f"benchmarking {len(bench_rows)} variant(s) x {len(settings)} setting(s), "
        f"{plan.rounds} rounds of {per_cell:.1f}s"
    )
    samples = _rounds(cells, workload, plan, per_cell, clock)
    _median_figures(bench_rows, settings, samples, baseline)
    return workload


def _rounds(
    cells: list[tuple[VariantResult, RuntimeSetting]], workload: Any, plan: _BenchPlan, per_cell: float, clock: _Clock
) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    round_s = 0.0
    for rnd in range(plan.rounds):
        started = time.perf_counter()
        # a round must fit in what is left (the first always runs: a choice needs figures)
        if rnd > 0 and started + round_s > clock.deadline:
            clock.say(f"budget: {rnd} of {plan.rounds} round(s) fit in {clock.budget_s:g}s")
            break
        for r, s in cells:
            clock.describe(f"bench {r.variant} {s.label} round {rnd + 1}")
            assert r.directory is not None
            samples.setdefault((r.variant, s.label), []).append(
                _measure(r.directory, s, workload, plan.concurrency, per_cell, warm_s=min(5.0, per_cell))
            )
            _tick(clock.bar)
        round_s = time.perf_counter() - started
    return samples


def _median_figures(
    bench_rows: list[VariantResult],
    settings: Sequence[RuntimeSetting],
    samples: dict[tuple[str, str], list[tuple[float, float, float]]],
    baseline: VariantResult | None,
) -> None:
    for r in bench_rows:
        for s in settings:
            runs = samples[(r.variant, s.label)]
            k = int(np.argsort([x[0] for x in runs])[len(runs) // 2])  # the median round
            rps, p50, p99 = runs[k]
            r.by_setting[s.label] = {
                "requests_per_s": round(rps, 2),
                "p50_ms": round(p50, 2),
                "p99_ms": round(p99, 2),
            }
            if r.throughput is None or rps > r.throughput:
                r.throughput, r.p50_ms, r.p99_ms, r.setting = rps, round(p50, 2), round(p99, 2), s
    if baseline is not None and baseline.throughput:
        for r in bench_rows:
            if r.throughput is not None:
                r.speedup = r.throughput / baseline.throughput


def _check_holdout(
    passed: list[VariantResult],
    chosen: VariantResult,
    holdout_texts: list[str],
    floors: dict[str, float],
    clock: _Clock,
) -> None:
    for r in sorted(passed, key=lambda r: r is not chosen):  # the chosen one first
        if r is not chosen and time.perf_counter() > clock.deadline:
            r.holdout = "skipped: budget spent"
            continue
        clock.describe(f"held-out checks {r.variant}")
        assert r.directory is not None
        r.holdout = _holdout(r.directory, holdout_texts, floors)


# -- steps -----------------------------------------------------------------------------------


def _check_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "ortbatch.json").is_file())):
        raise ExportError(f"tune: {out} exists and is not an ortbatch export directory; choose another -o")


def _model_ref(model: str | os.PathLike[str]) -> str:
    p = Path(model)
    if p.is_dir() and (p / "ortbatch.json").is_file():
        src = Manifest.load(p).source
        ref = src.get("model_ref") or src.get("model")
        if not ref:
            raise ExportError(f"tune: the manifest in {p} does not name its source model")
        return str(ref)
    return os.fspath(model)


def _check_model(model_ref: str) -> None:
    """A model no variant could be exported from (no such folder, a package that is not
    installed, a hub id offline and not in the cache) is one error here, before any variant
    is tried, not the same error once per variant after them all."""
    if model_ref.startswith("tiny:"):
        return  # built locally on demand: always there (and building it twice is wasted time)
    from . import hub
    from .recipes import resolve_model_ref

    hub.local_or_reachable(resolve_model_ref(model_ref))


def resolve_variants(variants: Sequence[Variant] | Sequence[str] | None) -> list[Variant]:
    known = candidates()
    if variants is None:
        return known
    by_name = {v.name: v for v in known}
    out: list[Variant] = []
    for v in variants:
        if isinstance(v, Variant):
            out.append(v)
        elif v in by_name:
            out.append(by_name[v])
        else:
            raise InvalidInputError(f"tune: unknown variant {v!r}; on this machine: {sorted(by_name)}")
    if not out:
        raise InvalidInputError("tune: no variants to try")
    return out


def _read_texts(path: str | os.PathLike[str]) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidInputError(f"tune: cannot read {path}: {exc.strerror or exc}") from exc
    texts = [t.strip() for t in lines if t.strip()]
    if not texts:
        raise InvalidInputError(f"tune: {path} has no texts")
    return texts


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _tick(bar: Any) -> None:
    if bar is not None:
        bar.update(1)


def _search(
    model: str,
    d: Path,
    var: Variant,
    rcp: Any,
    floors: dict[str, float],
    left: Callable[[], float],
    reserve_s: float,
    say: Progress,
) -> VariantResult:
    """Build ``var``; while its checks fail and it has fallbacks (each keeping more of the
    model in float), build the next, as long as one more build fits in ``left()`` minus
    ``reserve_s``. Returns the first that passes, or the last tried, with the rejected
    tries (quantization, worst metric) in ``attempts``."""
    tries = var.attempts()
    notes: list[str] = []
    spent = 0.0
    row: VariantResult | None = None
    for k, attempt in enumerate(tries):
        if row is not None:  # the previous try failed its checks
            if left() < reserve_s + row.export_s:
                notes.append(f"{len(tries) - k} more not tried: budget")
                break
            notes.append(f"{row.quantization}: {row.worst_metric}")
            say(f"  {var.name}: {notes[-1]}; trying {_qlabel(attempt)}")
            if row.directory is not None:
                shutil.rmtree(row.directory, ignore_errors=True)
        row = _build(model, d, attempt, rcp, floors)
        spent += row.export_s
        row.variant, row.quantization = var.name, _qlabel(attempt)
        if row.status != "failed":
            break
    assert row is not None
    row.export_s = spent
    row.attempts = notes
    return row


def _qlabel(var: Variant) -> str | None:
    return var.quantize.label if var.quantize is not None else None


def _build(model: str, d: Path, var: Variant, rcp: Any, floors: dict[str, float]) -> VariantResult:
    from ..errors import OrtBatchError
    from .exporter import export_model

    t = time.perf_counter()
    row = VariantResult(var.name, "error")
    dtype_key = "int8" if var.quantize is not None else var.dtype
    tolerances = {dtype_key: _tightened(rcp, var, dtype_key, floors)} if floors else None
    try:
        # keep_failed: a variant that fails its checks stays in its folder, so the table can
        # say which metric failed and by how much (tune deletes rejected variants itself)
        res = export_model(
            model,
            d,
            recipe=rcp,
            validate=True,
            raise_on_failure=False,
            keep_failed=True,
            tolerances=tolerances,
            **var.export_kwargs(),
        )
    except OrtBatchError as exc:
        row.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        row.export_s = time.perf_counter() - t
        return row
    row.export_s = time.perf_counter() - t
    row.directory = d
    row.onnx_mib = sum(f.stat().st_size for f in d.iterdir() if ".onnx" in f.name) / 2**20
    report = res.report
    row.worst_metric = _worst(report)
    if report.passed:
        row.status = "passed"
    else:
        row.status = "failed"
        reasons = [f"{c.name}: {c.reasons()[0]}" if c.reasons() else c.name for c in report.failed()]
        row.failure = "; ".join(reasons)[:300]
    return row


def _tightened(rcp: Any, var: Variant, dtype_key: str, floors: dict[str, float]) -> dict[str, float]:
    """The variant's tolerances with the user's floors: a floor only ever tightens."""
    from .recipes import tolerances_for

    task = rcp.task if rcp.task != "auto" else None
    base = tolerances_for(dtype_key, var.optimize, rcp.tolerances, task)
    out = dict(rcp.tolerances.get(dtype_key, {}))
    for key, floor in floors.items():
        out[key] = max(floor, base.get(key, 0.0))
    return out


def _worst(report: Any) -> str:
    """The task-metric comparison closest to (or furthest below) its floor."""
    worst: tuple[float, str] | None = None
    for chk in report.checks:
        for case in chk.cases:
            for c in case.comparisons:
                if c.metric is None or c.metric_value is None:
                    continue
                floor = c.tolerance.get(c.metric, 0.0)
                if c.metric == "cosine" and len(c.shape) >= 3:
                    floor = c.tolerance.get("token_cosine", floor)
                margin = c.metric_value - floor
                if worst is None or margin < worst[0]:
                    worst = (margin, f"{c.metric}={c.metric_value:.4f} ({c.output}, {chk.name}; floor {floor:g})")
    return worst[1] if worst else "-"


def _length_filtered_texts(export_dir: Path, low: int, high: int, texts: list[str] | None, dest: Path) -> Path:
    """Real texts whose token count is at least ``low`` (longer than ``high``: cut to ``high``
    tokens, by decoding the first ``high``), one per line in ``dest``."""
    from tokenizers import Tokenizer

    if texts is None:
        from ..bench.texts import TEXTS

        texts = list(TEXTS)
    tok = Tokenizer.from_file(os.fspath(export_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    kept = []
    for text, enc in zip(texts, tok.encode_batch(texts), strict=True):
        n = len(enc.ids)
        if n < low:
            continue
        if n > high:
            # keep the first high-2 word pieces plus the specials the tokenizer adds back
            text = tok.decode(enc.ids[1 : high - 1])
        kept.append(text.replace("\n", " "))
    if not kept:
        raise InvalidInputError(f"tune: no text has at least {low} tokens; give --texts or lower --lengths")
    dest.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return dest


_CYCLES = 64


def _measure(
    directory: Path, s: RuntimeSetting, workload: Any, concurrency: int, seconds: float, warm_s: float = 5.0
) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) of BatchedSession with setting ``s`` for about ``seconds``."""
    from ..bench.modes import run_clients
    from ..runtime.session import BatchedSession

    with BatchedSession(
        os.fspath(directory),
        workers=s.workers,
        max_batch_size=s.max_batch_size,
        max_batch_tokens=s.max_batch_tokens,
        max_queue=max(1024, 4 * concurrency),
    ) as bs:
        names = [o.name for o in bs.get_outputs()]

        def call(feed: dict[str, np.ndarray]) -> Any:
            return bs.run(names, feed)

        warm = list(range(min(len(workload), 2 * concurrency)))
        run_clients(
            "batched", call, workload, warm, concurrency, max_seconds=warm_s, keep=frozenset(), on_progress=None
        )
        # cycle the workload: the cell's time, not the number of distinct requests, ends it
        # (one pass of 512 requests took ~3 s of a 10 s cell on MiniLM, too short to measure)
        ids = list(range(len(workload))) * _CYCLES
        res = run_clients(
            "batched", call, workload, ids, concurrency, max_seconds=seconds, keep=frozenset(), on_progress=None
        )
    if res.errors:
        raise ExportError(
            f"tune: {res.errors} request(s) failed while benchmarking {directory.name}: {res.error_samples[:1]}"
        )
    rps = res.completed / res.elapsed_s if res.elapsed_s > 0 else 0.0
    lat = res.latencies_s
    p50, p99 = (float(np.percentile(lat, 50) * 1e3), float(np.percentile(lat, 99) * 1e3)) if lat.size else (0.0, 0.0)
    return rps, p50, p99


def _holdout(directory: Path, texts: list[str], floors: dict[str, float]) -> str:
    """The checks on the held-out texts (same tolerances as the variant's own checks)."""
    from .checks import validate

    report = validate(directory, samples=texts, save=False)
    status = "passed" if report.passed else "FAILED"
    return f"{status}, {_worst(report)}"


def _install(chosen: VariantResult, out: Path, result: TuneResult, work: Path, keep: bool) -> None:
    assert chosen.directory is not None and chosen.setting is not None
    m = Manifest.load(chosen.directory)
    m.extra["runtime"] = chosen.setting.to_dict()
    m.extra["tune"] = {
        "variant": chosen.variant,
        "requests_per_s": round(chosen.throughput or 0.0, 2),
        "speedup_vs_fp32": None if chosen.speedup is None else round(chosen.speedup, 3),
        "worst_metric": chosen.worst_metric,
        "report": "tune.json",
    }
    m.save()
    if out.exists():
        shutil.rmtree(out)
    shutil.move(os.fspath(chosen.directory), os.fspath(out))
    chosen.directory = out
    others = out.parent / f"{out.name}.variants"
    if others.exists():
        shutil.rmtree(others)
    for r in result.rows:
        if r is chosen or r.directory is None:
            continue
        if keep:
            others.mkdir(exist_ok=True)
            dest = others / _slug(r.variant)
            shutil.move(os.fspath(r.directory), os.fspath(dest))
            r.directory = dest
        else:
            r.directory = None


def _write_records(result: TuneResult, out: Path) -> None:
    (out / "tune.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    (out / "tune.md").write_text(result.table(markdown=True) + "\n", encoding="utf-8")
    try:
        plot(result, out / "tune.png")
    except ImportError as exc:  # matplotlib is in the bench extra
        log.info("tune: no plot (%s)", exc)


def plot(result: TuneResult, path: Path) -> None:
    """Throughput per variant at its best setting; failed checks drawn as empty bars at 0."""
    from .._extras import require

    matplotlib = require("matplotlib", "bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 3.8))
    xs = range(len(rows))
    heights = [r.throughput or 0.0 for r in rows]
    colors = [
        "tab:green"
        if result.chosen is not None and r.variant == result.chosen.variant
        else "tab:blue"
        if r.status == "passed"
        else "lightgrey"
        for r in rows
    ]
    ax.bar(xs, heights, color=colors)
    for x, r in zip(xs, rows, strict=True):
        label = f"{r.speedup:.2f}x" if r.speedup is not None else r.status
        ax.text(x, (r.throughput or 0.0), label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r.variant for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("requests / s (BatchedSession)")
    # the workload by its token lengths and source, never its file (a path in the tune's temp dir)
    length = result.workload.get("length") or {}
    span = f"{length['min']}-{length['max']} tokens" if "min" in length and "max" in length else "tokens"
    source = Path(str(result.workload.get("texts") or "built-in")).name
    ax.set_title(
        f"ortbatch tune: {result.workload.get('requests', '')} requests, {span} ({source} texts); "
        "green = chosen, blue = passed; failed or skipped: no bar",
        fontsize=9,
    )
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plain(rows: list[VariantResult]) -> str:
    return "\n".join(f"  {r.variant}: {r.status} {r.failure} {r.worst_metric}" for r in rows)
