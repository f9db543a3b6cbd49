"""The built-in accuracy checks and their report.

Four checks, run per execution provider on real tokenized sample texts:

1. ``reference_parity``: the ONNX model vs the PyTorch model, per output, with
   tolerances by dtype (elementwise ``|onnx - ref| <= atol + rtol * |ref|``) and a
   task metric: cosine similarity for embeddings and hidden states, argmax agreement
   for logits (rows whose top two reference logits are within tolerance of each other
   are ties and not counted), greedy-token agreement for generation. NaN/Inf are
   counted and always fail.
2. ``shape_generalisation``: batch sizes 1, 3 and 8, odd lengths, the maximum length
   and one below it, not the shape the export was traced at. Against the reference
   when there is one, else each row against the same row run alone.
3. ``batching_invariance``: each sample alone vs padded into a batch with the others
   (padding side and pad values from the manifest), trimmed back: what
   BatchedSession does must not change any answer. Decoders also generate greedily
   batched and alone.
4. ``provider_parity``: each requested GPU provider must really be active (ONNX
   Runtime falling back to CPU is a failure, not a warning) and agree with CPU; the
   checks above also run on it.

The checks collect every comparison before deciding; nothing is downgraded to a
warning. :class:`ValidationReport` renders as a table and is saved as
``validation.json``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from .._ort import (
    CPU,
    CUDA,
    TRT,
    arithmetic,
    build_session,
    fp32_parity_options,
    parity_tolerances,
    parse_provider_names,
    resolve_providers,
)
from .._ort.trt import resolve_cache_paths
from ..errors import ManifestError, ProviderError, ValidationError
from ..manifest import Manifest
from .recipes import DEFAULT_SAMPLES, tolerances_for
from .reference import Reference, load_reference

__all__ = ["CHECKS", "Case", "CheckResult", "Comparison", "ValidationReport", "validate"]

CHECKS = ("reference_parity", "shape_generalisation", "batching_invariance", "provider_parity", "finite_weights")
_GREEDY_TOKENS = 8


# -- report ------------------------------------------------------------------------------


@dataclass
class Comparison:
    """One output compared in one case."""

    output: str
    shape: list[int]
    passed: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    metric: str | None = None
    metric_value: float | None = None
    tolerance: dict[str, float] = field(default_factory=dict)
    nonfinite: int = 0
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Case:
    """One input configuration of a check (e.g. ``batch=3 len=13``)."""

    label: str
    comparisons: list[Comparison] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for c in self.comparisons)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "passed": self.passed,
            "error": self.error,
            "outputs": [c.to_dict() for c in self.comparisons],
        }


@dataclass
class CheckResult:
    """One check on one provider: ``status`` is passed, failed or skipped."""

    name: str
    provider: str
    status: str
    cases: list[Case] = field(default_factory=list)
    note: str = ""

    def reasons(self) -> list[str]:
        """One line per failure: which case, which output, by how much."""
        out = []
        for case in self.cases:
            if case.error:
                out.append(f"{case.label}: {case.error}")
            for c in case.comparisons:
                if not c.passed:
                    out.append(f"{case.label}: output {c.output!r} {c.message}")
        if not out and self.status == "failed" and self.note:
            out.append(self.note)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "provider": self.provider,
            "status": self.status,
            "note": self.note,
            "reasons": self.reasons(),
            "cases": [c.to_dict() for c in self.cases],
        }


@dataclass
class ValidationReport:
    """The result of :func:`validate`: every check on every provider."""

    directory: str
    task: str
    dtype: str
    providers: list[str]
    reference: dict[str, Any]
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    #: the tolerances the checks used on CPU, and the quantized variant (None: not quantized)
    tolerances: dict[str, float] = field(default_factory=dict)
    variant: str | None = None

    @property
    def passed(self) -> bool:
        """True when no check failed (skipped checks do not fail; see :attr:`reference`)."""
        return bool(self.checks) and not any(c.status == "failed" for c in self.checks)

    @property
    def reference_skipped(self) -> bool:
        return not self.reference.get("available", False)

    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "failed"]

    def summary(self) -> str:
        ran = [c for c in self.checks if c.status != "skipped"]
        failed = self.failed()
        text = f"{len(ran) - len(failed)} of {len(ran)} checks passed"
        if failed:
            parts = []
            for c in failed:
                reasons = c.reasons()
                first = reasons[0] if reasons else c.note
                more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
                parts.append(f"{c.name} on {c.provider}: {first}{more}")
            text += "; FAILED: " + "; ".join(parts)
        if self.reference_skipped:
            text += f"; reference parity SKIPPED: {self.reference.get('reason', '')}"
        return text

    def raise_for_failures(self) -> None:
        """Raise :class:`~ortbatch.ValidationError` (carrying this report) if a check failed."""
        if not self.passed:
            raise ValidationError(self.summary(), report=self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "directory": self.directory,
            "task": self.task,
            "dtype": self.dtype,
            "providers": self.providers,
            "reference": self.reference,
            "seconds": round(self.seconds, 2),
            "variant": self.variant,
            "tolerances": self.tolerances,
            "checks": [c.to_dict() for c in self.checks],
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n", encoding="utf-8")
        os.replace(tmp, p)
        return p

    def format_table(self, verbose: bool = False) -> str:
        """The terminal table: one row per check and output (worst case), or per case with verbose."""
        header = ("check", "provider", "case", "output", "shape", "max abs", "max rel", "metric", "tol", "result")
        rows: list[tuple[str, ...]] = []
        for chk in self.checks:
            prov = chk.provider.replace("ExecutionProvider", "")
            if chk.status == "skipped" or not chk.cases:
                status = _short(f"{chk.status.upper()}{': ' + chk.note if chk.note else ''}", 70)
                rows.append((chk.name, prov, "-", *_NO_FIGURES, status))
                continue
            for case, comp in _rows(chk, verbose):
                if comp is None:
                    rows.append((chk.name, prov, case.label, *_NO_FIGURES, "FAIL: " + _short(case.error or "", 60)))
                    continue
                metric = f"{comp.metric}={comp.metric_value:.5f}" if comp.metric_value is not None else "-"
                tol = f"atol={comp.tolerance.get('atol', 0):g}" if comp.tolerance else "-"
                rows.append(
                    (
                        chk.name,
                        prov,
                        case.label,
                        comp.output,
                        "x".join(map(str, comp.shape)) or "-",
                        _fmt(comp.max_abs_err),
                        _fmt(comp.max_rel_err),
                        metric,
                        tol,
                        "ok" if comp.passed else "FAIL: " + _short(comp.message, 60),
                    )
                )
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False))
        out = [line, "  ".join("-" * w for w in widths)]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) for r in rows]
        if self.reference_skipped:
            out.append(f"reference parity SKIPPED (ONNX-only checks ran): {self.reference.get('reason', '')}")
        if self.variant is not None:
            tol = ", ".join(f"{k}={v:g}" for k, v in self.tolerances.items())
            out.append(f"{self.variant} tolerances ({self.task}): {tol}")
        out.append(("PASSED: " if self.passed else "FAILED: ") + self.summary())
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format_table()


def _rows(chk: CheckResult, verbose: bool) -> list[tuple[Case, Comparison | None]]:
    """Per output, the failing or worst case (or every case with verbose)."""
    out: list[tuple[Case, Comparison | None]] = []
    worst: dict[str, tuple[Case, Comparison]] = {}
    for case in chk.cases:
        if case.error:
            out.append((case, None))
        for comp in case.comparisons:
            if verbose:
                out.append((case, comp))
                continue
            prev = worst.get(comp.output)
            if prev is None or _badness(comp) > _badness(prev[1]):
                worst[comp.output] = (case, comp)
    return out + list(worst.values())


def _badness(c: Comparison) -> tuple[int, float]:
    return (0 if c.passed else 1, c.max_rel_err or 0.0)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


_NO_FIGURES = ("-",) * 6  # output, shape, max abs, max rel, metric, tol of a row without a comparison


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, Path):
        return os.fspath(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# -- comparisons -------------------------------------------------------------------------


def _metric_kind(output: str) -> str | None:
    name = output.lower()
    if "logits" in name:
        return "argmax"
    if name.startswith(("present", "past")):
        return None
    return "cosine"


def _select(x: np.ndarray, axis: int | None, mask: np.ndarray | None, side: str) -> np.ndarray:
    """Valid positions only: rows of ``x`` along ``axis`` where ``mask`` (batch, len) is set."""
    if axis is None or mask is None or axis == x.ndim - 1:
        # A ragged last axis (e.g. QA start_logits) is compared whole, padded columns
        # included: both sides compute them the same way, and rows stay intact for argmax.
        return x
    moved = np.moveaxis(x, axis, 1)
    return moved[mask.astype(bool)]


def compare(
    output: str,
    got: np.ndarray,
    ref: np.ndarray,
    tol: Mapping[str, float],
    *,
    seq_axis: int | None = None,
    mask: np.ndarray | None = None,
    metric: str | bool | None = True,
) -> Comparison:
    """Compare one output; ``mask`` (batch, length) restricts a ragged ``seq_axis`` to
    real tokens. ``metric=True`` picks the task metric from the output's name."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    kind = _metric_kind(output) if metric is True else (metric or None)
    comp = Comparison(output=output, shape=list(got.shape), passed=False, tolerance=dict(tol))
    if got.shape != ref.shape:
        comp.message = f"shape {list(got.shape)} != expected {list(ref.shape)}"
        return comp
    g = _select(got, seq_axis, mask, "right").astype(np.float64)
    r = _select(ref, seq_axis, mask, "right").astype(np.float64)
    finite_ref = np.isfinite(r)
    comp.nonfinite = int(np.count_nonzero(~np.isfinite(g) & finite_ref))
    if comp.nonfinite:
        comp.message = f"{comp.nonfinite} NaN/Inf values (of {g.size}) where the expected value is finite"
        return comp
    if not finite_ref.all():
        comp.message = f"the expected output has {int((~finite_ref).sum())} NaN/Inf values"
        return comp
    if g.size == 0:
        comp.passed = True
        comp.max_abs_err = comp.max_rel_err = 0.0
        return comp
    atol, rtol = float(tol["atol"]), float(tol["rtol"])
    diff = np.abs(g - r)
    comp.max_abs_err = float(diff.max())
    comp.max_rel_err = float((diff / (np.abs(r) + atol)).max())
    excess = diff - (atol + rtol * np.abs(r))
    close = bool((excess <= 0).all())
    messages = []
    if not close:
        i = int(np.argmax(excess))
        messages.append(
            f"max abs err {comp.max_abs_err:.3g} exceeds atol={atol:g} + rtol={rtol:g}*|ref| "
            f"({int((excess > 0).sum())} of {diff.size} values; worst {g.flat[i]:.6g} vs {r.flat[i]:.6g})"
        )
    ok_metric = True
    # a per-token hidden state (batch, sequence, hidden) may have its own, looser floor
    floor = float(tol.get("token_cosine", tol.get("cosine", 1.0)) if got.ndim >= 3 else tol.get("cosine", 1.0))
    if kind == "cosine":
        a = g.reshape(-1, g.shape[-1]) if g.ndim > 1 else g.reshape(1, -1)
        b = r.reshape(-1, r.shape[-1]) if r.ndim > 1 else r.reshape(1, -1)
        denom = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        cos = np.where(denom > 0, (a * b).sum(axis=1) / np.maximum(denom, 1e-30), 1.0)
        comp.metric, comp.metric_value = "cosine", float(cos.min())
        ok_metric = comp.metric_value >= floor
        if not ok_metric:
            messages.append(
                f"min cosine similarity {comp.metric_value:.6f} < {floor} (by {floor - comp.metric_value:.4f})"
            )
    elif kind == "argmax":
        a = g.reshape(-1, g.shape[-1])
        b = r.reshape(-1, r.shape[-1])
        if b.shape[-1] > 1:
            top2 = np.sort(b, axis=1)[:, -2:]
            margin = top2[:, 1] - top2[:, 0]
            decisive = margin > 2 * (atol + rtol * np.abs(top2[:, 1]))
        else:
            decisive = np.zeros(len(b), dtype=bool)
        agree = a.argmax(axis=1) == b.argmax(axis=1)
        comp.metric = "argmax"
        comp.metric_value = float(agree[decisive].mean()) if decisive.any() else 1.0
        ok_metric = comp.metric_value >= tol["argmax"]
        if not ok_metric:
            messages.append(f"argmax agreement {comp.metric_value:.4f} < {tol['argmax']}")
    comp.passed = close and ok_metric
    comp.message = "; ".join(messages)
    return comp


def compare_tokens(
    output: str, got: np.ndarray, ref: np.ndarray, tol: Mapping[str, float], ref_top2: np.ndarray | None = None
) -> Comparison:
    """Greedy-token agreement: per row, tokens that agree before the first divergence
    (after it, the continuations legitimately differ). With ``ref_top2`` (the reference's
    two best logits per step), a divergence where those are within tolerance of each other
    is a tie, not an error: that row counts as agreeing."""
    comp = Comparison(
        output=output,
        shape=list(got.shape),
        passed=False,
        metric="greedy",
        tolerance={k: tol[k] for k in ("greedy", "atol", "rtol") if k in tol},
    )
    if got.shape != ref.shape:
        comp.message = f"shape {list(got.shape)} != expected {list(ref.shape)}"
        return comp
    agree = 0
    ties = 0
    first_bad = None
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        diverge = np.nonzero(a != b)[0]
        n = int(diverge[0]) if len(diverge) else len(a)
        if n < len(a) and ref_top2 is not None:
            best, second = (float(x) for x in ref_top2[i, n])
            if best - second <= 2 * (tol.get("atol", 0.0) + tol.get("rtol", 0.0) * abs(best)):
                ties += 1
                n = len(a)
        agree += n
        if n < len(a) and first_bad is None:
            first_bad = (i, n, a.tolist(), b.tolist())
    comp.metric_value = agree / max(1, got.size)
    comp.passed = comp.metric_value >= tol["greedy"]
    notes = [f"{ties} row(s) diverged at a near-tie of the reference's top-2 logits"] if ties else []
    if first_bad and not comp.passed:
        i, n, a, b = first_bad
        notes.insert(
            0, f"greedy agreement {comp.metric_value:.3f} < {tol['greedy']}; row {i} diverges at token {n}: {a} vs {b}"
        )
    comp.message = "; ".join(notes)
    return comp


# -- running the ONNX model --------------------------------------------------------------


class _Model:
    """The ONNX sessions of one export on one provider, with feed builders per family."""

    def __init__(self, manifest: Manifest, sessions: dict[str, Any], tokenizer: Any) -> None:
        self.m = manifest
        self.sessions = sessions
        self.family = str(manifest.source.get("family", "encoder"))
        self.side = manifest.padding_side
        self.pads = manifest.pad_values
        comps = manifest.extra.get("components") or {}
        self.component_io = {k: v for k, v in comps.items()} if comps else {}
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        self.start_id = _decoder_start(manifest)

    # generic ------------------------------------------------------------------------
    def run(self, component: str, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.sessions[component]
        names = [i.name for i in sess.get_inputs()]
        missing = [n for n in names if n not in feed]
        if missing:
            raise KeyError(f"no value for input(s) {missing}")
        outs = sess.run(None, {n: feed[n] for n in names})
        return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=False)}

    def inputs(self, component: str) -> list[Any]:
        return list(self.sessions[component].get_inputs())

    def output_axes(self, component: str) -> dict[str, list[str | None]]:
        if component in self.component_io:
            return {k: v["axes"] for k, v in self.component_io[component]["outputs"].items()}
        return {k: list(v.axes) for k, v in self.m.outputs.items()}

    # feeds -------------------------------------------------------------------------
    def pad_rows(self, rows: Sequence[Sequence[int]], side: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        side = side or self.side
        n = max(len(r) for r in rows)
        ids = np.full((len(rows), n), self.pads.get("input_ids", self.pad_id), dtype=np.int64)
        mask = np.zeros((len(rows), n), dtype=np.int64)
        for i, r in enumerate(rows):
            if side == "left":
                ids[i, n - len(r) :] = r
                mask[i, n - len(r) :] = 1
            else:
                ids[i, : len(r)] = r
                mask[i, : len(r)] = 1
        return ids, mask

    def feed(self, component: str, ids: np.ndarray, mask: np.ndarray, **extra: np.ndarray) -> dict[str, np.ndarray]:
        """Inputs for ``component``: ids/mask plus zeros for token types, positions from the
        mask, empty past key values, and whatever ``extra`` supplies."""
        feed: dict[str, np.ndarray] = {}
        for arg in self.inputs(component):
            name = arg.name
            if name in extra:
                feed[name] = extra[name]
            elif name == "input_ids":
                feed[name] = ids
            elif name in ("attention_mask", "encoder_attention_mask"):
                feed[name] = mask
            elif name == "token_type_ids":
                feed[name] = np.zeros_like(ids)
            elif name == "position_ids":
                feed[name] = _positions(mask)
            elif name.startswith("past_key_values"):
                shape = [ids.shape[0]] + [d if isinstance(d, int) else 0 for d in arg.shape[1:]]
                feed[name] = np.zeros(shape, dtype=_np_dtype(arg.type))
            else:
                raise KeyError(f"the checks do not know how to fill input {name!r} of {component}")
        return feed

    # greedy generation ----------------------------------------------------------------
    def greedy(self, rows: Sequence[Sequence[int]], new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Greedy continuation of all rows at once, batched (left padding for decoders).
        Returns the tokens (rows, steps) and each step's two best logits (rows, steps, 2)."""
        if self.family == "seq2seq":
            return self._greedy_seq2seq(rows, new_tokens)
        ids, mask = self.pad_rows(rows, "left")
        has_past = any(i.name.startswith("past_key_values") for i in self.inputs("model"))
        out, tops = [], []
        feed = self.feed("model", ids, mask)
        seq = ids
        for _ in range(new_tokens):
            res = self.run("model", feed)
            nxt = res["logits"][:, -1].argmax(axis=-1).astype(np.int64)
            out.append(nxt)
            tops.append(_top2(res["logits"][:, -1]))
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            if has_past:
                past = {k.replace("present", "past_key_values"): v for k, v in res.items() if k.startswith("present")}
                feed = self.feed("model", nxt[:, None], mask, position_ids=_positions(mask)[:, -1:], **past)
            else:
                seq = np.concatenate([seq, nxt[:, None]], axis=1)
                feed = self.feed("model", seq, mask)
        return np.stack(out, axis=1), np.stack(tops, axis=1)

    def _greedy_seq2seq(self, rows: Sequence[Sequence[int]], new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = self.pad_rows(rows, "right")
        enc = self.run("encoder", self.feed("encoder", ids, mask))["last_hidden_state"]
        b = len(rows)
        dec = np.full((b, 1), self.start_id, dtype=np.int64)
        res = self.run("decoder", self.feed("decoder", dec, mask, encoder_hidden_states=enc))
        out, tops = [], []
        enc_past = {
            k.replace("present", "past_key_values"): v
            for k, v in res.items()
            if k.startswith("present") and ".encoder." in k
        }
        for step in range(new_tokens):
            nxt = res["logits"][:, -1].argmax(axis=-1).astype(np.int64)
            out.append(nxt)
            tops.append(_top2(res["logits"][:, -1]))
            if step == new_tokens - 1:
                break
            past = {
                k.replace("present", "past_key_values"): v
                for k, v in res.items()
                if k.startswith("present") and ".decoder." in k
            }
            res = self.run(
                "decoder_with_past",
                self.feed("decoder_with_past", nxt[:, None], mask, encoder_hidden_states=enc, **past, **enc_past),
            )
        return np.stack(out, axis=1), np.stack(tops, axis=1)


def _top2(logits: np.ndarray) -> np.ndarray:
    """(rows, vocab) -> (rows, 2): the best and second-best logit of each row."""
    return np.sort(logits.astype(np.float64), axis=-1)[:, -2:][:, ::-1]


def _positions(mask: np.ndarray) -> np.ndarray:
    pos = np.cumsum(mask, axis=1) - 1
    return np.where(mask > 0, pos, 0).astype(np.int64)


def _np_dtype(ort_type: str) -> Any:
    return {
        "tensor(float)": np.float32,
        "tensor(float16)": np.float16,
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(bool)": np.bool_,
        "tensor(double)": np.float64,
    }.get(ort_type, np.float32)


def _decoder_start(manifest: Manifest) -> int:
    cfg_path = (manifest.directory or Path(".")) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    for key in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    return 0


def _vocab_size(manifest: Manifest, tokenizer: Any) -> int:
    n = len(tokenizer)
    try:
        cfg = json.loads(((manifest.directory or Path(".")) / "config.json").read_text(encoding="utf-8"))
        if isinstance(cfg.get("vocab_size"), int):
            n = min(n, cfg["vocab_size"])
    except (OSError, ValueError):
        pass
    return n


# -- sessions and providers ----------------------------------------------------------------


def _component_files(manifest: Manifest) -> dict[str, str]:
    comps = manifest.extra.get("components") or {}
    if comps:
        return {k: v["model"] for k, v in comps.items()}
    return {"model": manifest.model}


def _provider_entry(name: str, manifest: Manifest, component: str | None = None) -> tuple[str, dict[str, Any]]:
    """``name``'s options as a session on this export gets them: the manifest's, merged per
    key by the one resolver (cache paths under the export directory); for TensorRT, the
    component's own profiles when the export wrote them (an encoder-decoder's encoder and
    decoder take different inputs)."""
    base = manifest.directory or Path(".")
    opts = resolve_providers([name], manifest.providers, base)[0][1]
    comp = (manifest.extra.get("components") or {}).get(component or "") or {}
    if name == TRT and comp.get("tensorrt"):
        opts = {**opts, **resolve_cache_paths(comp["tensorrt"], base)}
    return name, opts


def _chain_for(provider: str, manifest: Manifest, component: str, dtype: str) -> list[tuple[str, dict[str, Any]]]:
    ort = require("onnxruntime")
    names = [provider]
    # TensorRT hands the nodes it cannot build to the next provider: CUDA, as ORT recommends.
    if provider == TRT and CUDA in ort.get_available_providers():
        names.append(CUDA)
    if provider != CPU:
        names.append(CPU)
    chain = [_provider_entry(n, manifest, component) for n in names]
    if dtype == "fp32":  # check fp32 parity in fp32: TF32 off where the provider has the switch
        chain = [(n, fp32_parity_options(n, o)) for n, o in chain]
    return chain


def _sessions(
    manifest: Manifest, provider: str, dtype: str = "fp32"
) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
    """Sessions for every component on ``provider`` (CPU as the fallback ORT requires),
    the options ``provider`` got, or (None, why the provider is not really in use, {})."""
    ort = require("onnxruntime")
    available = ort.get_available_providers()
    if provider not in available:
        return (
            None,
            f"{provider} is not available in this onnxruntime build (available: {available}); "
            "install onnxruntime-gpu with matching CUDA/TensorRT libraries",
            {},
        )
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sessions = {}
    used: dict[str, Any] = {}
    for comp, fname in _component_files(manifest).items():
        chain = _chain_for(provider, manifest, comp, dtype)
        used = used or chain[0][1]
        try:
            # build_session turns fallback off and refuses a session that is not on `provider`
            sessions[comp] = build_session((manifest.directory or Path(".")) / fname, chain, session_options=so)
        except ProviderError as exc:
            return None, f"requested {provider}, which is not active: {exc}", {}
    return sessions, "", used


# -- the checks ------------------------------------------------------------------------


class _CheckContext:
    def __init__(
        self,
        model: _Model,
        ref: Reference | None,
        tol: Mapping[str, float],
        samples: list[list[int]],
        max_seq: int,
        vocab: int,
        seed: int,
        quantized: bool = False,
    ) -> None:
        self.quantized = quantized
        self.model = model
        self.ref = ref
        self.tol = tol
        self.samples = samples
        self.max_seq = max_seq
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def random_ids(self, batch: int, length: int) -> np.ndarray:
        low = min(5, self.vocab - 1)  # skip the first ids, where most tokenizers keep specials
        return self.rng.integers(low, self.vocab, size=(batch, length), dtype=np.int64)


def _seq_axis(
    axes: Sequence[str | None], role_prefixes: tuple[str, ...] = ("sequence", "total_sequence", "encoder_sequence")
) -> int | None:
    for i, a in enumerate(axes):
        if i > 0 and a is not None and a in role_prefixes:
            return i
    return None


def _case(label: str, fn: Callable[[Case], None]) -> Case:
    case = Case(label)
    try:
        fn(case)
    except Exception as exc:  # a failing run is the finding, recorded per case
        text = str(exc).strip()
        case.error = f"{type(exc).__name__}: {_short(text.splitlines()[0] if text else '', 300)}"
    return case


def _reference_parity(ctx: _CheckContext) -> list[Case]:
    m, ref, tol = ctx.model, ctx.ref, ctx.tol
    assert ref is not None
    rows = ctx.samples
    cases = []
    if m.family == "encoder":

        def run(case: Case) -> None:
            ids, mask = m.pad_rows(rows)
            feed = m.feed("model", ids, mask)
            got = m.run("model", feed)
            want = ref.encoder(feed, list(got))
            axes = m.output_axes("model")
            for name, value in got.items():
                if name not in want:
                    case.comparisons.append(
                        Comparison(
                            name, list(value.shape), True, message="not compared: the PyTorch model has no such output"
                        )
                    )
                    continue
                case.comparisons.append(
                    compare(name, value, want[name], tol, seq_axis=_seq_axis(axes.get(name, [])), mask=mask)
                )

        cases.append(_case(f"{len(rows)} samples, {m.side}-padded", run))
    elif m.family == "decoder":

        def run_logits(case: Case) -> None:
            ids, mask = m.pad_rows(rows, "left")
            feed = m.feed("model", ids, mask)
            got = m.run("model", feed)["logits"]
            want = ref.decoder_logits(feed)
            case.comparisons.append(compare("logits", got, want, tol, seq_axis=1, mask=mask))

        cases.append(_case(f"{len(rows)} samples, left-padded", run_logits))
    else:

        def run_seq2seq(case: Case) -> None:
            ids, mask = m.pad_rows(rows, "right")
            enc = m.run("encoder", m.feed("encoder", ids, mask))["last_hidden_state"]
            case.comparisons.append(
                compare("encoder.last_hidden_state", enc, ref.encoder_hidden(ids, mask), tol, seq_axis=1, mask=mask)
            )
            dec = np.full((len(rows), 1), m.start_id, dtype=np.int64)
            got = m.run("decoder", m.feed("decoder", dec, mask, encoder_hidden_states=enc))["logits"]
            case.comparisons.append(compare("decoder.logits", got, ref.seq2seq_logits(ids, mask, dec), tol))

        cases.append(_case(f"{len(rows)} samples, right-padded", run_seq2seq))
    if m.family in ("decoder", "seq2seq"):

        def run_greedy(case: Case) -> None:
            got, _ = m.greedy(rows, _GREEDY_TOKENS)
            want, top2 = ref.greedy([list(r) for r in rows], _GREEDY_TOKENS, m.pad_id, m.start_id)
            case.comparisons.append(compare_tokens("greedy_tokens", got, want, tol, top2))

        cases.append(_case(f"greedy {_GREEDY_TOKENS} tokens, {len(rows)} prompts", run_greedy))
    return cases


def _shape_cases(ctx: _CheckContext) -> list[tuple[int, int]]:
    top = ctx.max_seq
    shapes = [(1, 7), (3, 13), (8, 5), (2, max(1, top - 1)), (1, top)]
    return [(b, min(length, top)) for b, length in shapes]


def _shape_generalisation(ctx: _CheckContext) -> list[Case]:
    m, ref, tol = ctx.model, ctx.ref, ctx.tol
    if ctx.quantized:  # random token ids are far from real text: int8 has its own floors there
        tol = {
            **tol,
            "cosine": tol.get("random_cosine", tol["cosine"]),
            "token_cosine": tol.get("random_cosine", tol["cosine"]),
            "argmax": tol.get("random_argmax", tol["argmax"]),
        }
    comp_name = "encoder" if m.family == "seq2seq" else "model"
    axes = m.output_axes(comp_name)
    cases = []
    for batch, length in _shape_cases(ctx):
        ids = ctx.random_ids(batch, length)
        mask = np.ones_like(ids)

        def run(
            case: Case, ids: np.ndarray = ids, mask: np.ndarray = mask, batch: int = batch, length: int = length
        ) -> None:
            feed = m.feed(comp_name, ids, mask)
            got = m.run(comp_name, feed)
            if ref is not None:
                if m.family == "encoder":
                    want = ref.encoder(feed, list(got))
                elif m.family == "decoder":
                    want = {"logits": ref.decoder_logits(feed)}
                else:
                    want = {"last_hidden_state": ref.encoder_hidden(ids, mask)}
            else:  # ONNX-only: each row must equal the same row run alone
                want = {}
                singles = [
                    m.run(comp_name, m.feed(comp_name, ids[i : i + 1], mask[i : i + 1])) for i in range(len(ids))
                ]
                for name in got:
                    want[name] = np.concatenate([s[name] for s in singles], axis=0)
            for name, value in got.items():
                _check_dims(case, name, value, axes.get(name, []), batch, length)
                if name in want:
                    case.comparisons.append(compare(name, value, want[name], tol))

        cases.append(_case(f"batch={batch} len={length}", run))
    if m.family == "decoder" and any(i.name.startswith("past_key_values") for i in m.inputs("model")):
        cases.append(_case("decode step batch=3 past=13", lambda case: _decode_step(ctx, case, 3, 13)))
    return cases


def _decode_step(ctx: _CheckContext, case: Case, batch: int, past: int) -> None:
    m, ref, tol = ctx.model, ctx.ref, ctx.tol
    ids = ctx.random_ids(batch, past + 1)
    mask = np.ones_like(ids)
    pre = m.run("model", m.feed("model", ids[:, :past], mask[:, :past]))
    kv = {k.replace("present", "past_key_values"): v for k, v in pre.items() if k.startswith("present")}
    step = m.run("model", m.feed("model", ids[:, past:], mask, position_ids=_positions(mask)[:, past:], **kv))
    if ref is not None:
        want = ref.decoder_logits({"input_ids": ids, "attention_mask": mask, "position_ids": _positions(mask)})
    else:
        want = m.run("model", m.feed("model", ids, mask))["logits"]
    case.comparisons.append(compare("logits", step["logits"], want[:, -1:], tol))


def _check_dims(case: Case, name: str, value: np.ndarray, axes: Sequence[str | None], batch: int, length: int) -> None:
    problems = []
    if value.ndim == 0 or value.shape[0] != batch:
        problems.append(f"batch dim {value.shape[:1]} != {batch}")
    for i, a in enumerate(axes):
        if (
            i > 0
            and i < value.ndim
            and a in ("sequence", "total_sequence", "encoder_sequence")
            and value.shape[i] != length
        ):
            problems.append(f"axis {i} ({a}) is {value.shape[i]}, expected {length}")
    if problems:
        case.comparisons.append(Comparison(name, list(value.shape), False, message="; ".join(problems)))


def _batching_invariance(ctx: _CheckContext) -> list[Case]:
    m, tol = ctx.model, ctx.tol
    rows = ctx.samples
    comp_name = "encoder" if m.family == "seq2seq" else "model"
    side = "right" if m.family == "seq2seq" else m.side
    cases = []

    def run(case: Case) -> None:
        ids, mask = m.pad_rows(rows, side)
        batched = m.run(comp_name, m.feed(comp_name, ids, mask))
        alone = [m.run(comp_name, m.feed(comp_name, *m.pad_rows([r], side))) for r in rows]
        for name, value in batched.items():
            want: list[np.ndarray] = []
            got: list[np.ndarray] = []
            for i, single in enumerate(alone):
                ref = single[name]
                row = value[i : i + 1]
                if row.shape != ref.shape:
                    slices = []
                    for ax, (n_b, n_a) in enumerate(zip(row.shape, ref.shape, strict=False)):
                        if n_b == n_a:
                            slices.append(slice(None))
                        elif side == "left":
                            slices.append(slice(n_b - n_a, None))
                        else:
                            slices.append(slice(0, n_a))
                        if n_a > n_b:
                            raise ValueError(f"output {name!r} axis {ax} is {n_a} alone but {n_b} batched")
                    row = row[tuple(slices)]
                if ctx.quantized and row.ndim > 1:
                    got.append(row.reshape(-1, row.shape[-1]))
                    want.append(ref.reshape(-1, ref.shape[-1]))
                else:
                    got.append(row.reshape(-1))
                    want.append(ref.reshape(-1))
            # dynamic int8 scales activations over the whole batch, so rows move a little
            # with their batch mates: judged by the task metric per row, not elementwise alone
            if ctx.quantized and value.ndim > 1:
                row_tol = {**tol, "cosine": tol.get("token_cosine", tol["cosine"])} if value.ndim >= 3 else tol
                comp = compare(name, np.concatenate(got), np.concatenate(want), row_tol)
            else:
                comp = compare(name, np.concatenate(got), np.concatenate(want), tol, metric=None)
            comp.shape = list(value.shape)
            if not comp.passed:
                comp.message = f"changes when padded into a batch of {len(rows)} ({side} padding): {comp.message}"
            case.comparisons.append(comp)

    cases.append(_case(f"{len(rows)} samples alone vs batched", run))
    if m.family in ("decoder", "seq2seq"):

        def run_greedy(case: Case) -> None:
            batched, _ = m.greedy(rows, _GREEDY_TOKENS)
            singles = [m.greedy([r], _GREEDY_TOKENS) for r in rows]
            alone = np.concatenate([t for t, _ in singles], axis=0)
            top2 = np.concatenate([t2 for _, t2 in singles], axis=0)
            case.comparisons.append(compare_tokens("greedy_tokens", batched, alone, {**tol, "greedy": 1.0}, top2))

        cases.append(_case(f"greedy {_GREEDY_TOKENS} tokens alone vs batched", run_greedy))
    return cases


def _provider_parity(ctx: _CheckContext, cpu: _Model) -> list[Case]:
    m, tol = ctx.model, ctx.tol
    rows = ctx.samples
    comp_name = "encoder" if m.family == "seq2seq" else "model"
    side = "right" if m.family == "seq2seq" else m.side

    def run(case: Case) -> None:
        ids, mask = m.pad_rows(rows, side)
        got = m.run(comp_name, m.feed(comp_name, ids, mask))
        want = cpu.run(comp_name, cpu.feed(comp_name, ids, mask))
        axes = m.output_axes(comp_name)
        for name, value in got.items():
            case.comparisons.append(
                compare(name, value, want[name], tol, seq_axis=_seq_axis(axes.get(name, [])), mask=mask)
            )

    return [_case(f"{len(rows)} samples vs CPU", run)]


def _finite_weights(manifest: Manifest) -> CheckResult:
    """NaN/Inf in any stored weight fails, whatever the samples exercise (see weights.py)."""
    from .weights import nonfinite_weights

    base = manifest.directory or Path(".")
    cases = []
    for name in _component_files(manifest).values():
        case = Case(name)
        try:
            read, bad = nonfinite_weights(base / name)
        except Exception as exc:  # a file onnx cannot parse: a finding, not a crash
            case.error = f"cannot read the weights: {type(exc).__name__}: {exc}"
        else:
            nonfinite = len(bad)
            message = "; ".join(bad[:3]) + (f" (+{nonfinite - 3} more)" if nonfinite > 3 else "")
            case.comparisons.append(Comparison("weights", [read], passed=not bad, nonfinite=nonfinite, message=message))
        cases.append(case)
    return CheckResult("finite_weights", "any", _status(cases), cases)


def _status(cases: list[Case]) -> str:
    return "passed" if all(c.passed for c in cases) else "failed"


def _normalise_providers(providers: Sequence[str] | str | None, manifest: Manifest) -> list[str]:
    if providers is None:
        providers = manifest.validation.get("providers") or [CPU]
    names = parse_provider_names(providers)  # the one spelling table; unknown names refused
    out = [CPU] + [p for p in names if p != CPU]  # CPU is always the baseline
    return list(dict.fromkeys(out))


def validate(
    directory: str | os.PathLike[str],
    providers: Sequence[str] | str | None = None,
    *,
    samples: Sequence[str] | None = None,
    reference: Any = None,
    use_reference: bool = True,
    tolerances: Mapping[str, float] | None = None,
    save: bool = True,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> ValidationReport:
    """Run the built-in checks on an export directory.

    Args:
        directory: an ``ortbatch export`` directory (with ``ortbatch.json``).
        providers: execution providers to check (names or ``cpu``/``cuda``/``trt``);
            CPU is always checked as the baseline. Default: the manifest's.
        samples: texts to tokenize (default: the manifest's, from the recipe).
        reference: an already loaded PyTorch model (default: load ``source.model``).
        use_reference: ``False`` runs the ONNX-only checks.
        tolerances: overrides for this run (keys atol, rtol, cosine, argmax, greedy).
        save: write ``validation.json`` and record the result in ``ortbatch.json``.

    Returns:
        The :class:`ValidationReport`; it does not raise when a check fails (see
        :meth:`ValidationReport.raise_for_failures`). When the PyTorch model cannot be
        loaded, reference parity is reported as skipped and says why.
    """
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    manifest = Manifest.load(directory).verify(warn=False)
    if manifest.directory is None:  # pragma: no cover - load always sets it
        raise ManifestError("manifest has no directory")
    provider_list = _normalise_providers(providers, manifest)  # before anything slow: a typo fails fast
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.fspath(manifest.directory))
    dtype = str(manifest.source.get("dtype", "fp32"))
    quantization = manifest.source.get("quantization")
    variant = str(quantization.get("mode", "int8")) if isinstance(quantization, dict) else None
    stored_tol = manifest.validation.get("tolerances") or (
        tolerances_for("int8", None, None, str(manifest.source.get("task", "")))
        if variant is not None
        else tolerances_for(dtype, manifest.source.get("optimize"))
    )
    base_tol = {**stored_tol, **(tolerances or {})}
    fp16_tol = {**(manifest.validation.get("tolerances_fp16") or tolerances_for("fp16")), **(tolerances or {})}
    texts = list(samples or manifest.validation.get("samples") or DEFAULT_SAMPLES)
    max_seq = int(manifest.max_sequence_length or 512)
    family = str(manifest.source.get("family", "encoder"))
    rows = [ids[:max_seq] for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    if family == "decoder":
        rows = [r[: max_seq - _GREEDY_TOKENS] or [tokenizer.eos_token_id or 0] for r in rows]

    ref: Reference | None = None
    reason = "not requested (--no-reference / use_reference=False)"
    if use_reference:
        say("loading the PyTorch reference")
        ref, reason = load_reference(manifest.source, reference)
    report = ValidationReport(
        directory=os.fspath(manifest.directory),
        task=str(manifest.source.get("task", "")),
        dtype=dtype,
        providers=provider_list,
        reference={"available": ref is not None, "reason": reason},
        tolerances=dict(base_tol),
        variant=variant,
    )
    vocab = _vocab_size(manifest, tokenizer)
    cpu_model: _Model | None = None
    for provider in provider_list:
        sessions, why, opts = _sessions(manifest, provider, dtype)
        if sessions is None:
            report.checks.append(CheckResult("provider_parity", provider, "failed", note=why))
            for name in CHECKS[:3]:
                report.checks.append(CheckResult(name, provider, "skipped", note=f"{provider} is not active"))
            continue
        model = _Model(manifest, sessions, tokenizer)
        # from the arithmetic really used: TF32 (TensorRT fp32), fp16 inside an fp16 engine
        tol = parity_tolerances(arithmetic(provider, opts, dtype), base_tol, fp16_tol)
        ctx = _CheckContext(model, ref, tol, rows, max_seq, vocab, seed, quantized=variant is not None)
        short = provider.replace("ExecutionProvider", "")
        if ref is not None:
            say(f"[{short}] reference parity")
            cases = _reference_parity(ctx)
            report.checks.append(CheckResult("reference_parity", provider, _status(cases), cases))
        else:
            report.checks.append(
                CheckResult("reference_parity", provider, "skipped", note=f"no PyTorch reference: {reason}")
            )
        say(f"[{short}] shape generalisation")
        cases = _shape_generalisation(ctx)
        report.checks.append(
            CheckResult(
                "shape_generalisation",
                provider,
                _status(cases),
                cases,
                note="" if ref is not None else "ONNX-only: rows vs the same rows alone",
            )
        )
        say(f"[{short}] batching invariance")
        cases = _batching_invariance(ctx)
        report.checks.append(CheckResult("batching_invariance", provider, _status(cases), cases))
        if provider == CPU:
            cpu_model = model
        elif cpu_model is not None:
            say(f"[{short}] provider parity")
            cases = _provider_parity(ctx, cpu_model)
            report.checks.append(CheckResult("provider_parity", provider, _status(cases), cases))
    say("finite weights")
    report.checks.append(_finite_weights(manifest))
    report.seconds = time.perf_counter() - t0
    if save:
        report.save(manifest.directory / "validation.json")
        manifest.validation = {
            **manifest.validation,
            "passed": report.passed,
            "report": "validation.json",
            "reference_parity": "skipped" if ref is None else "ran",
        }
        manifest.save()
    return report
