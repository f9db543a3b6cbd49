"""The report of the checks: one :class:`Comparison` per output and case, :class:`Case`,
:class:`CheckResult` per check and provider, and :class:`ValidationReport` with its table
and ``validation.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ValidationError

__all__ = ["NOT_RUN", "Case", "CheckResult", "Comparison", "ValidationReport", "shorten"]

#: the status of a check on a provider this machine cannot run (not in the onnxruntime
#: build, or no device): neither passed nor failed, and said so in the report
NOT_RUN = "not_run"


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
    """One check on one provider: ``status`` is passed, failed, skipped or not_run
    (:data:`NOT_RUN`: the provider cannot run on this machine)."""

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
        """True when no check failed (skipped checks and providers not run here do not fail;
        see :attr:`reference` and :meth:`not_run`)."""
        return bool(self.checks) and not any(c.status == "failed" for c in self.checks)

    @property
    def reference_skipped(self) -> bool:
        return not self.reference.get("available", False)

    def not_run(self) -> list[str]:
        """The requested providers this machine could not run (their checks are ``not_run``)."""
        return list(dict.fromkeys(c.provider for c in self.checks if c.status == NOT_RUN))

    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "failed"]

    def summary(self) -> str:
        ran = [c for c in self.checks if c.status not in ("skipped", NOT_RUN)]
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
        for provider in self.not_run():
            note = next(c.note for c in self.checks if c.provider == provider and c.status == NOT_RUN)
            text += f"; {provider.replace('ExecutionProvider', '')} NOT RUN ({note.removeprefix('not run: ')})"
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
            "not_run": self.not_run(),
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
            if chk.status in ("skipped", NOT_RUN) or not chk.cases:
                status = shorten(f"{chk.status.replace('_', ' ').upper()}{': ' + chk.note if chk.note else ''}", 70)
                rows.append((chk.name, prov, "-", *_NO_FIGURES, status))
                continue
            for case, comp in _rows(chk, verbose):
                if comp is None:
                    rows.append((chk.name, prov, case.label, *_NO_FIGURES, "FAIL: " + shorten(case.error or "", 60)))
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
                        "ok" if comp.passed else "FAIL: " + shorten(comp.message, 60),
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


def shorten(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, Path):
        return os.fspath(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
