"""Tables (terminal and markdown), the JSON file and the plot of a benchmark run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_overhead", "markdown_tables", "plot", "text_tables", "write_json"]

_COLUMNS = ("mode", "clients", "req/s", "tokens/s", "p50 ms", "p95 ms", "p99 ms", "rows/batch", "padding", "done")


def _rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in data["results"]:
        lat = r["latency_ms"]
        # the oracle is offline; its clients figure only says which run it sat next to
        clients = f"({r['concurrency']})" if r["mode"] == "oracle" else str(r["concurrency"])
        done = f"{r['completed']}" + ("*" if r["truncated"] else "") + (f" ({r['errors']} err)" if r["errors"] else "")
        rows.append(
            [
                r["mode"],
                clients,
                f"{r['requests_per_s']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                _ms(lat["p50"]),
                _ms(lat["p95"]),
                _ms(lat["p99"]),
                f"{r['mean_rows_per_batch']:.2f}",
                f"{r['padding_fraction']:.1%}",
                done,
            ]
        )
    return rows


def _ms(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _ratio_rows(data: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in data["ratios"]:
        out.append(
            [
                str(r["concurrency"]),
                _x(r.get("batched_over_direct")),
                _x(r.get("batched_over_oracle")),
                _x(r.get("oracle_over_direct")),
                _x(r.get("p50_batched_over_direct")),
            ]
        )
    return out


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


_RATIO_COLUMNS = ("clients", "batched/direct", "batched/oracle", "oracle/direct", "p50 batched/direct")


def _text_table(header: Sequence[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _md_table(header: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if k else "---" for k in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def text_tables(data: dict[str, Any]) -> str:
    parts = [_text_table(_COLUMNS, _rows(data))]
    if any(len(r) > 1 for r in data["ratios"]):
        parts.append(_text_table(_RATIO_COLUMNS, _ratio_rows(data)))
    notes = _notes(data)
    if notes:
        parts.append("\n".join(notes))
    if data.get("overhead"):
        parts.append(format_overhead(data["overhead"]))
    return "\n\n".join(parts)


def markdown_tables(data: dict[str, Any]) -> str:
    parts = [_md_table(_COLUMNS, _rows(data))]
    if any(len(r) > 1 for r in data["ratios"]):
        parts.append(_md_table(_RATIO_COLUMNS, _ratio_rows(data)))
    notes = _notes(data)
    if notes:
        parts.append("\n".join(f"- {n}" for n in notes))
    return "\n\n".join(parts)


def _notes(data: dict[str, Any]) -> list[str]:
    notes = ["oracle: offline batches in one stream; (c) = measured next to the runs with c clients"]
    if any(r["truncated"] for r in data["results"]):
        notes.append("* stopped by the --duration cap before every request was sent")
    for mode, check in data.get("checks", {}).items():
        if isinstance(check, dict) and check.get("ok") is False:
            notes.append(f"OUTPUT MISMATCH: {mode} differs from direct: {check}")
    return notes


def format_overhead(o: dict[str, Any]) -> str:
    lines = [f"runtime overhead ({o['model']}, lengths {o['lengths']}, {o['requests']} requests):"]
    for row in o["rows"]:
        lines.append(
            f"  {row['label']:<44} {row['us_per_request']:8.1f} us/request wall"
            f"  {row['cpu_us_per_request']:8.1f} us CPU  (rows/batch {row['mean_rows_per_batch']:.1f})"
        )
    return "\n".join(lines)


def write_json(data: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


def plot(series: dict[str, list[tuple[int, float, float]]], path: str | Path, title: str) -> None:
    """Two panels against concurrency: throughput and p99 latency, one line per mode/peer.

    ``series[label] = [(concurrency, requests_per_s, p99_ms), ...]``.
    """
    from .._extras import require

    matplotlib = require("matplotlib", "bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in series.items():
        pts = sorted(points)
        xs = [p[0] for p in pts]
        style = "--" if label.startswith("oracle") else "-"
        ax1.plot(xs, [p[1] for p in pts], style, marker="o", label=label)
        ax2.plot(xs, [p[2] for p in pts], style, marker="o", label=label)
    levels = sorted({p[0] for points in series.values() for p in points})
    for ax, ylabel in ((ax1, "requests / s"), (ax2, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        # ticks at the concurrencies run, labelled 1, 2, 4, ... (a log axis would say 2^0, 2^1, ...)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def series_from(data: dict[str, Any], prefix: str = "") -> dict[str, list[tuple[int, float, float]]]:
    out: dict[str, list[tuple[int, float, float]]] = {}
    for r in data["results"]:
        out.setdefault(prefix + r["mode"], []).append((r["concurrency"], r["requests_per_s"], r["latency_ms"]["p99"]))
    return out
