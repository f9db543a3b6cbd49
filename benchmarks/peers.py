"""One command for docs/benchmarks.md: ortbatch's own modes and its peers, same workload, same model.

    python benchmarks/peers.py --export DIR [--lengths 8-16,8-128] [--requests 1000]

For each length distribution it runs, each in its own process:
  1. ``ortbatch bench DIR`` — direct / batched / oracle at ``--concurrency`` (default 1,4,16,64),
     plus the per-request overhead measurement (first workload only);
  2. the peers at ``--peer-concurrency`` (default 64): batch-inference SeqBatcher and
     BucketSeqBatcher, PyTriton (Triton's dynamic batcher), Ray Serve (inside ``unshare -n``
     with only loopback). A peer that is not installed is reported as skipped.
Then it checks that every system served byte-identical requests (workload digests), evaluates
the issue-6 targets, and writes the report's markdown and plots into ``--out`` (default
out/peers/); ``--docs`` rewrites the generated sections of the tracked docs/benchmarks.md and
its plots instead, for a deliberate docs update.

Peers are dev-only and live in their own virtual environments (their pins conflict:
PyTriton needs numpy<2): ``--peers-python`` (batch-inference, Ray) and ``--triton-python``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ortbatch.bench.report import markdown_tables  # noqa: E402

PEERS = ("bi-seq", "bi-bucket", "pytriton", "ray")
LABELS = {
    "bi-seq": "batch-inference SeqBatcher",
    "bi-bucket": "batch-inference BucketSeqBatcher",
    "pytriton": "Triton dynamic batcher (PyTriton, HTTP)",
    "ray": "Ray Serve @serve.batch (handle)",
    "direct": "ortbatch bench: direct session.run",
    "batched": "ortbatch BatchedSession",
    "oracle": "offline oracle (one stream)",
    "direct-tuned": "direct session.run, intra_op_num_threads=1, no spinning",
}


def sh(cmd: list[str], *, env: dict[str, str] | None = None, log: Path, timeout: float) -> int:
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    with log.open("w") as fh:
        try:
            return subprocess.run(
                cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            print(f"  timed out after {timeout:.0f} s (log: {log})", file=sys.stderr)
            return 124


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", required=True, type=Path, help="export directory (MiniLM from the demo)")
    p.add_argument("--lengths", default="8-16,8-128")
    p.add_argument("--concurrency", default="1,4,16,64", help="for ortbatch's own modes")
    p.add_argument("--peer-concurrency", default="64")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--duration", type=float, default=120.0, help="cap per run, seconds")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--python", default=sys.executable, help="python with ortbatch installed")
    p.add_argument("--peers-python", default=os.environ.get("ORTBATCH_PEERS_PYTHON", "/root/peers-venv/bin/python"))
    p.add_argument("--triton-python", default=os.environ.get("ORTBATCH_TRITON_PYTHON", "/root/triton-venv/bin/python"))
    p.add_argument("--out", type=Path, default=REPO / "out" / "peers", help="JSON and logs")
    p.add_argument(
        "--docs",
        action="store_true",
        help="rewrite the tracked docs/benchmarks.md and its plots (default: benchmarks.md and plots in --out)",
    )
    p.add_argument(
        "--no-tuned-direct",
        dest="tuned_direct",
        action="store_false",
        help="skip the extra direct run with intra_op_num_threads=1 and no spinning",
    )
    p.add_argument("--skip-ortbatch", action="store_true", help="reuse the ortbatch JSON already in --out")
    return p.parse_args(argv)


def docs_path(args: argparse.Namespace) -> Path:
    """Where the markdown goes (its plots beside it): the tracked docs only with --docs."""
    return REPO / "docs" / "benchmarks.md" if args.docs else args.out / "benchmarks.md"


def main() -> int:
    args = parse_args()
    docs = docs_path(args)

    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = [os.getloadavg()]
    workloads = [w.strip() for w in args.lengths.split(",") if w.strip()]
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    report: dict[str, Any] = {
        "started": started,
        "export": str(args.export),
        "workloads": {},
        "commands": [],
        "peer_concurrency": args.peer_concurrency,
    }
    for k, lengths in enumerate(workloads):
        tag = lengths.replace(":", "_").replace("/", "_")
        own = args.out / f"ortbatch-{tag}.json"
        cmd = [
            args.python,
            "-m",
            "ortbatch.cli",
            "bench",
            str(args.export),
            "--concurrency",
            args.concurrency,
            "--requests",
            str(args.requests),
            "--duration",
            str(args.duration),
            "--lengths",
            lengths,
            "--max-batch-size",
            str(args.max_batch_size),
            "--json",
            str(own),
            "--no-progress",
            "--plot",
            str(docs.parent / f"benchmarks-cpu-{tag}.png"),
        ]
        if k > 0:
            cmd.append("--no-overhead")
        report["commands"].append(_public(cmd))
        if not args.skip_ortbatch:
            rc = sh(cmd, env=env, log=args.out / f"ortbatch-{tag}.log", timeout=3600)
            if rc not in (0, 1):
                print(f"ortbatch bench failed (rc {rc}); see {args.out}/ortbatch-{tag}.log", file=sys.stderr)
                return rc
        entry: dict[str, Any] = {"ortbatch": json.loads(own.read_text()), "peers": {}, "skipped": {}}
        if args.tuned_direct:
            # is the gain batching, or only BatchedSession's thread settings? direct with one
            # intra-op thread per call and no spinning (the best direct setting here, PEERS.md)
            tuned = args.out / f"direct-tuned-{tag}.json"
            tcmd = [
                args.python,
                "-m",
                "ortbatch.cli",
                "bench",
                str(args.export),
                "--modes",
                "direct",
                "--concurrency",
                args.peer_concurrency,
                "--requests",
                str(args.requests),
                "--duration",
                str(args.duration),
                "--lengths",
                lengths,
                "--json",
                str(tuned),
                "--no-progress",
                "--no-overhead",
                "--baseline-option",
                "intra_op_num_threads=1",
                "--baseline-option",
                "session.intra_op.allow_spinning=0",
            ]
            report["commands"].append(_public(tcmd))
            reuse = args.skip_ortbatch and tuned.exists()
            if reuse or sh(tcmd, env=env, log=args.out / f"direct-tuned-{tag}.log", timeout=3600) in (0, 1):
                entry["direct_tuned"] = json.loads(tuned.read_text())
        for peer in peers:
            pj = args.out / f"{peer}-{tag}.json"
            python = args.triton_python if peer == "pytriton" else args.peers_python
            pcmd = [
                python,
                str(REPO / "benchmarks" / "peer_run.py"),
                "--system",
                peer,
                "--export",
                str(args.export),
                "--lengths",
                lengths,
                "--concurrency",
                args.peer_concurrency,
                "--requests",
                str(args.requests),
                "--duration",
                str(args.duration),
                "--max-batch-size",
                str(args.max_batch_size),
                "--json",
                str(pj),
            ]
            penv = dict(env)
            if peer == "pytriton":
                # pyenv Pythons: Triton's Python backend needs the interpreter's LIBDIR
                libdir = _libdir(python)
                penv["LD_LIBRARY_PATH"] = os.pathsep.join(x for x in (libdir, env.get("LD_LIBRARY_PATH", "")) if x)
            if peer == "ray":
                # Serve replicas listen on all interfaces: give Ray a network namespace with only loopback
                pcmd = ["unshare", "-n", "sh", "-c", "ip link set lo up && exec " + shlex.join(pcmd)]
            report["commands"].append(_public(pcmd))
            if not Path(python).exists():
                entry["skipped"][peer] = f"no interpreter at {python}"
                print(f"  {peer}: skipped (no interpreter at {python})", file=sys.stderr)
                continue
            pj.unlink(missing_ok=True)
            rc = sh(pcmd, env=penv, log=args.out / f"{peer}-{tag}.log", timeout=1800)
            if rc == 3:
                entry["skipped"][peer] = "not installed"
                print(f"  {peer}: skipped (not installed)", file=sys.stderr)
            elif rc != 0 or not pj.exists():
                entry["skipped"][peer] = f"failed (exit {rc}; log {args.out / f'{peer}-{tag}.log'})"
                print(f"  {peer}: FAILED rc={rc}", file=sys.stderr)
            else:
                entry["peers"][peer] = json.loads(pj.read_text())
        report["workloads"][lengths] = entry
        loads.append(os.getloadavg())
    report["loadavg"] = [[round(x, 2) for x in load] for load in loads]
    (args.out / "peers-report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_docs(report, docs)
    print(f"wrote {docs}", file=sys.stderr)
    return 0


def _libdir(python: str) -> str:
    try:
        out = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return sysconfig.get_config_var("LIBDIR") or ""


def _public(cmd: list[str]) -> str:
    text = shlex.join(cmd)
    return text.replace(str(REPO) + "/", "").replace(sys.executable, "python")


# -- docs ----------------------------------------------------------------------------------------
def _at(data: dict[str, Any], mode: str, c: int) -> dict[str, Any] | None:
    return next((r for r in data["results"] if r["mode"] == mode and r["concurrency"] == c), None)


def _differs(data: dict[str, Any], r: dict[str, Any], digest: str) -> bool:
    """Another request set than ortbatch's. A run cut short by --duration served a prefix of the
    same set (marked *), so only its workload digest can be compared."""
    if data["workload"]["digest"] != digest:
        return True
    return not r.get("truncated") and r["request_digest"] != digest


def peers_table(report: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    lines = [
        "| workload | system | clients | req/s | tokens/s | p50 ms | p99 ms | rows/batch | padding "
        "| vs direct | ortbatch batched ÷ system |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    series: dict[str, Any] = {}
    for lengths, entry in report["workloads"].items():
        own = entry["ortbatch"]
        digest = own["workload"]["digest"]
        levels = sorted({r["concurrency"] for peer in entry["peers"].values() for r in peer["results"]}) or [64]
        for c in levels:
            direct = _at(own, "direct", c)
            batched = _at(own, "batched", c)
            rows: list[tuple[str, dict[str, Any]]] = []
            for mode in ("direct", "batched", "oracle"):
                r = _at(own, mode, c)
                if r:
                    rows.append((mode, r))
            tuned = entry.get("direct_tuned")
            r = _at(tuned, "direct", c) if tuned else None
            if r:
                if _differs(tuned, r, digest):
                    r = dict(r, note="DIFFERENT REQUESTS")
                rows.append(("direct-tuned", r))
            for peer, data in entry["peers"].items():
                r = _at(data, peer, c)
                if r:
                    if _differs(data, r, digest):
                        r = dict(r, note="DIFFERENT REQUESTS")
                    rows.append((peer, r))
            for name, r in rows:
                lat = r["latency_ms"]
                vs_direct = r["requests_per_s"] / direct["requests_per_s"] if direct else float("nan")
                mine = batched["requests_per_s"] / r["requests_per_s"] if batched and r["requests_per_s"] else None
                star = "*" if r.get("truncated") else ""
                lines.append(
                    f"| {lengths} | {LABELS.get(name, name)}{star}{' ' + r['note'] if 'note' in r else ''} | {c} | "
                    f"{r['requests_per_s']:.1f} | {r['tokens_per_s']:.0f} | {lat['p50']:.1f} | {lat['p99']:.1f} | "
                    f"{r['mean_rows_per_batch']:.2f} | {r['padding_fraction']:.1%} | {vs_direct:.2f}x | "
                    f"{'-' if name == 'batched' or mine is None else f'{mine:.2f}x'} |"
                )
                series.setdefault(lengths, {})[name] = r["requests_per_s"]
        for peer, why in entry["skipped"].items():
            lines.append(f"| {lengths} | {LABELS.get(peer, peer)} | - | skipped: {why} | | | | | | | |")
    return "\n".join(lines), series


def targets(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(target, figure, threshold, met) for each issue-6 CPU target."""
    out: list[tuple[str, str, str, bool | None]] = []
    need_bd = {"8-16": 1.6, "8-128": 1.25}
    for lengths, entry in report["workloads"].items():
        own = entry["ortbatch"]
        c = 64 if _at(own, "batched", 64) else max(r["concurrency"] for r in own["results"])
        ratio = next((r for r in own["ratios"] if r["concurrency"] == c), {})
        b = _at(own, "batched", c)
        if lengths in need_bd and "batched_over_direct" in ratio:
            v = ratio["batched_over_direct"]
            out.append(
                (
                    f"batched ÷ direct, {lengths}, {c} clients",
                    f"{v:.2f}x",
                    f">= {need_bd[lengths]}x",
                    v >= need_bd[lengths],
                )
            )
        if "batched_over_oracle" in ratio:
            v = ratio["batched_over_oracle"]
            out.append((f"batched ÷ oracle, {lengths}, {c} clients", f"{v:.2f}x", ">= 1.0x", v >= 1.0))
        for peer, need in (("bi-seq", 1.5), ("bi-bucket", 1.3)):
            data = entry["peers"].get(peer)
            r = _at(data, peer, c) if data else None
            if r and _differs(data, r, own["workload"]["digest"]):
                out.append(
                    (f"batched ÷ {LABELS[peer]}, {lengths}", "different requests: not comparable", f">= {need}x", None)
                )
            elif b and r and r["requests_per_s"]:
                v = b["requests_per_s"] / r["requests_per_s"]
                out.append((f"batched ÷ {LABELS[peer]}, {lengths}", f"{v:.2f}x", f">= {need}x", v >= need))
            else:
                out.append((f"batched ÷ {LABELS[peer]}, {lengths}", "not measured", f">= {need}x", None))
        tuned = entry.get("direct_tuned")
        t = _at(tuned, "direct", c) if tuned else None
        if b and t and t["requests_per_s"]:
            v = b["requests_per_s"] / t["requests_per_s"]
            out.append(
                (
                    f"(for reference) batched ÷ direct with 1 thread/call and no spinning, {lengths}",
                    f"{v:.2f}x",
                    "-",
                    None,
                )
            )
        if lengths == "8-128" and b:
            v = b["padding_fraction"]
            out.append((f"padding fraction, {lengths}, {c} clients", f"{v:.1%}", "<= 15%", v <= 0.15))
        one = next((r for r in own["ratios"] if r["concurrency"] == 1), None)
        if one and "p50_batched_over_direct" in one:
            v = one["p50_batched_over_direct"]
            out.append((f"one client: p50 batched ÷ direct, {lengths}", f"{v:.3f}", "<= 1.05", v <= 1.05))
        if own.get("overhead"):
            v = own["overhead"]["us_per_request_at_saturation"]
            out.append(
                (
                    f"runtime overhead per request ({own['overhead']['concurrency']} clients, identity model)",
                    f"{v:.0f} µs",
                    "< 100 µs",
                    v < 100,
                )
            )
    return out


def write_docs(report: dict[str, Any], docs: Path) -> None:
    docs.parent.mkdir(parents=True, exist_ok=True)
    text = docs.read_text() if docs.exists() else ""
    first = next(iter(report["workloads"].values()))["ortbatch"]
    m = first["machine"]
    machine = (
        f"{m['cpu']}, {m['cores']} cores (shared with other work: load average "
        f"{' → '.join('/'.join(str(x) for x in load) for load in report['loadavg'])} during the run), "
        f"{m['platform']}, Python {m['python']}, numpy {m['numpy']}, onnxruntime {m['onnxruntime']}. "
        f"Run started {report['started']}."
    )
    sections = {"machine": machine, "commands": "```\n" + "\n".join(report["commands"]) + "\n```"}
    cpu_parts = []
    for lengths, entry in report["workloads"].items():
        own = entry["ortbatch"]
        tag = lengths.replace(":", "_").replace("/", "_")
        s = own["settings"]
        b = s.get("batched", {})
        cpu_parts.append(
            f"### {lengths} tokens ({own['workload']['requests']} requests, {own['workload']['tokens']} tokens, "
            f"digest `{own['workload']['digest'][:12]}`)\n\n" + markdown_tables(own) + "\n\n"
            f"Settings — direct and oracle: `{_fmt_session(s.get('direct', s.get('oracle', {})).get('session', {}))}`; "
            f"batched: workers={b.get('workers')}, `{_fmt_session(b.get('session', {}))}`"
            + (f" (runs alone: `{_fmt_session(b['latency_session'])}`), " if b.get("latency_session") else ", ")
            + f"max_batch_size={b.get('max_batch_size')}, max_batch_tokens={b.get('max_batch_tokens')}, "
            + f"max_delay_ms={b.get('max_delay_ms')}. Output check vs direct: "
            + ", ".join(
                f"{k} max |diff| {max(v['max_abs_diff'].values(), default=0):.1e}"
                for k, v in own["checks"].items()
                if isinstance(v, dict)
            )
            + f".\n\n![throughput and p99 latency, {lengths} tokens](benchmarks-cpu-{tag}.png)"
        )
    sections["cpu"] = "\n\n".join(cpu_parts)
    over = first.get("overhead")
    if over:
        rows = ["| measurement | µs/request (wall) | CPU µs/request | rows/batch |", "|---|---:|---:|---:|"]
        rows += [
            f"| {r['label']} | {r['us_per_request']:.1f} | {r['cpu_us_per_request']:.1f} | "
            f"{r['mean_rows_per_batch']:.1f} |"
            for r in over["rows"]
        ]
        sections["overhead"] = (
            f"Identity model (both inputs copied to outputs), lengths {over['lengths']}, "
            f"{over['requests']} requests per row, workers={over['workers']}.\n\n" + "\n".join(rows)
        )
    table, series = peers_table(report)
    clients = report.get("peer_concurrency", "64")
    legend = (
        "\n\n`*` = stopped by the `--duration` cap: it served a prefix of the same requests."
        if "*" in table.replace("**", "")
        else ""
    )
    sections["peers"] = table + legend + f"\n\n![requests/s by system at {clients} clients](benchmarks-peers.png)"
    tl = ["| target | measured | needed | met |", "|---|---:|---:|:---:|"]
    for t, v, need, ok in targets(report):
        verdict = "yes" if ok else "no" if ok is False else "-" if need == "-" else "n/a"
        tl.append(f"| {t} | {v} | {need} | {verdict} |")
    sections["targets"] = "\n".join(tl)
    for name, body in sections.items():
        text = _replace(text, name, body)
    docs.write_text(text)
    _peers_plot(series, docs.parent / "benchmarks-peers.png", clients)


def _fmt_session(s: dict[str, Any]) -> str:
    if not s:
        return "?"
    return (
        f"intra_op_num_threads={s.get('intra_op_num_threads')}, "
        f"spinning={s.get('intra_op_allow_spinning')}, {','.join(s.get('providers', []))}"
    )


def _replace(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    block = f"{begin}\n{body}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _m: block, text)
    return text + f"\n\n{block}\n"


def _peers_plot(series: dict[str, dict[str, float]], path: Path, clients: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(series)
    systems = list(dict.fromkeys(s for w in workloads for s in series[w]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        vals = [series[w].get(s, 0.0) for s in systems]
        colors = [
            "tab:green" if s == "batched" else "tab:gray" if s in ("direct", "oracle", "direct-tuned") else "tab:blue"
            for s in systems
        ]
        ax.barh(range(len(systems)), vals, color=colors)
        ax.set_yticks(range(len(systems)), [LABELS.get(s, s) for s in systems], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"requests / s ({clients} clients, higher is better)")
        ax.set_title(f"{w} tokens", fontsize=10)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
