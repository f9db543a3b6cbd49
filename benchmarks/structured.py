"""What constrained decoding costs a batch: half the rows JSON-schema-constrained vs none.

    python benchmarks/structured.py --preset gpt2-mini --requests 32 --rounds 3 --markdown out/structured.md

One :class:`ortbatch.BatchedGenerator`, one process, the same requests (random token-id
prompts, sampled at ``--temperature`` with a seed each, default 1; 0 is greedy) served in
alternating rounds (which mode goes first alternates too):

- ``free``: no row constrained;
- ``half``: every other request follows a JSON schema (the schemas of
  ``benchmarks/grammar_engines.py``, in turn), the rest as in ``free``.

Reported: generated tokens/s of each round (wall clock) and tokens per CPU-second of this
process (steadier on a shared machine), the ratios of the medians (issue 29 asks
``half >= 0.8 x free``), each schema's compile time (a cold ``GrammarCompiler``), and that
a schema seen before compiles nothing (the compiler's counters across a round).

The model is the ``--preset`` of ``benchmarks/generation.py`` (random weights, exported once into
``--workdir``) with a real-sized tokenizer: the byte-level BPE of ``--preset``'s vocabulary size
that ``grammar_engines.py`` trains, so masks are computed over the whole vocabulary. Its eos is
that tokenizer's ``<|endoftext|>``. A random model rarely closes a JSON string, so constrained
rows, like free ones, mostly run to ``--new-tokens``: both modes keep the same rows busy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import PRESETS, build_model
from grammar_engines import EOS, SCHEMAS, bench_tokenizer, write_report


def prepare_export(preset: str, workdir: Path) -> Path:
    """The preset's export with the real-sized tokenizer and its eos, in ``workdir/preset/structured``."""
    out = workdir / preset / "structured"
    if (out / "model.onnx").is_file():
        return out
    export = build_model(preset, workdir)
    vocab = PRESETS[preset]["vocab_size"]
    tokenizer = bench_tokenizer(vocab, workdir)
    shutil.copytree(export, out, dirs_exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (out / name).unlink(missing_ok=True)
    shutil.copy(tokenizer, out / "tokenizer.json")
    eos = json.loads(tokenizer.read_text())["added_tokens"][0]
    assert eos["content"] == EOS
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.is_file():
            config = json.loads(path.read_text())
            config["eos_token_id"] = eos["id"]
            path.write_text(json.dumps(config, indent=2))
    return out


def run_round(gen: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, float, int]:
    """Submit every request at once; (seconds until the last is done, this process's CPU
    seconds meanwhile, tokens generated)."""
    from ortbatch.generation import SamplingParams

    assert all(isinstance(p, SamplingParams) for p in params)
    t0, c0 = time.perf_counter(), time.process_time()
    futures = [gen.submit(p, params=q) for p, q in zip(prompts, params, strict=True)]
    outs = [f.result() for f in futures]
    return time.perf_counter() - t0, time.process_time() - c0, sum(len(o.token_ids) for o in outs)


def compile_times(export: Path, vocab: int, eos: Sequence[int]) -> list[dict[str, Any]]:
    """Each schema's compile on a cold compiler (the tokenizer built first, apart)."""
    from ortbatch.generation.constrained import Constraint, GrammarCompiler

    compiler = GrammarCompiler(export / "tokenizer.json", vocab, eos)
    try:
        t0 = time.perf_counter()
        compiler.compile(Constraint("regex", "warm-up"))  # builds the engine's tokenizer
        tokenizer_s = time.perf_counter() - t0
        out = [{"schema": "(tokenizer from tokenizer.json)", "compile_ms": 1e3 * tokenizer_s}]
        for name, schema, _ in SCHEMAS:
            constraint = Constraint("json_schema", json.dumps(schema))
            t0 = time.perf_counter()
            compiled = compiler.compile(constraint)
            wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            compiler.compile(constraint)
            again = time.perf_counter() - t0
            out.append(
                {
                    "schema": name,
                    "compile_ms": 1e3 * compiled.compile_s,
                    "wall_ms": 1e3 * wall,
                    "cached_us": 1e6 * again,
                }
            )
        assert compiler.compiles == 1 + len(SCHEMAS)
        return out
    finally:
        compiler.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-mini")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "ortbatch-bench")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating")
    p.add_argument("--temperature", type=float, default=1.0, help="every request's (0: greedy)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)

    from ortbatch import BatchedGenerator
    from ortbatch.generation import SamplingParams

    export = prepare_export(args.preset, args.workdir)
    rs = np.random.RandomState(0)
    vocab = PRESETS[args.preset]["vocab_size"]
    prompts = [rs.randint(10, vocab - 10, size=args.prompt_length).tolist() for _ in range(args.requests)]
    free = [
        SamplingParams(temperature=args.temperature, seed=i, max_new_tokens=args.new_tokens)
        for i in range(args.requests)
    ]
    half = [
        dataclasses.replace(free[i], json_schema=SCHEMAS[(i // 2) % len(SCHEMAS)][1]) if i % 2 == 0 else free[i]
        for i in range(args.requests)
    ]
    results: dict[str, list[float]] = {"free": [], "half": []}
    per_cpu: dict[str, list[float]] = {"free": [], "half": []}
    with BatchedGenerator(export, max_batch_size=args.max_batch_size, max_new_tokens=args.new_tokens) as gen:
        eos = list(gen.layout.eos_token_ids)
        run_round(gen, prompts, half)  # warm-up: the session, the engine's tokenizer, every schema's compile
        compiles, hits = gen.grammars.compiles, gen.grammars.hits
        for r in range(args.rounds):
            # alternate which mode goes first, so a load that drifts during the run favours neither
            for mode, params in (("free", free), ("half", half))[:: 1 if r % 2 == 0 else -1]:
                seconds, cpu, tokens = run_round(gen, prompts, params)
                results[mode].append(tokens / seconds)
                per_cpu[mode].append(tokens / cpu)
                print(f"{mode}: {tokens} tokens in {seconds:.2f}s ({cpu:.2f} CPU-s)", file=sys.stderr)
        compiled_in_rounds = gen.grammars.compiles - compiles
        cache_hits = gen.grammars.hits - hits
    times = compile_times(export, vocab, eos)
    ratio = statistics.median(results["half"]) / statistics.median(results["free"])
    cpu_ratio = statistics.median(per_cpu["half"]) / statistics.median(per_cpu["free"])
    load = os.getloadavg()
    header = (
        f"{args.preset} ({vocab} tokens), {args.requests} requests of {args.prompt_length} prompt tokens, "
        f"{args.new_tokens} new tokens, temperature {args.temperature:g}, max_batch_size {args.max_batch_size}, "
        f"{args.rounds} rounds "
        f"each; {platform.machine()} ({os.cpu_count()} cores), "
        f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    )
    lines = [
        header,
        "",
        "| mode | tokens/s per round | median | tokens per CPU-s per round | median |",
        "|---|---|---|---|---|",
        *(
            f"| {m} | {', '.join(f'{v:.1f}' for v in results[m])} | {statistics.median(results[m]):.1f} "
            f"| {', '.join(f'{v:.1f}' for v in per_cpu[m])} | {statistics.median(per_cpu[m]):.1f} |"
            for m in ("free", "half")
        ),
        "",
        f"half / free = **{ratio:.2f}** (wall clock), {cpu_ratio:.2f} (per CPU-s); during the timed rounds "
        f"(every schema seen in the warm-up round): {compiled_in_rounds} compiles, {cache_hits} cache hits",
        "",
        "| schema | compile (ms) | compile + queue (ms) | cached lookup (us) |",
        "|---|---|---|---|",
        *(
            f"| {t['schema']} | {t['compile_ms']:.1f} | {t.get('wall_ms', t['compile_ms']):.1f} | "
            f"{t.get('cached_us', float('nan')):.0f} |"
            for t in times
        ),
    ]
    record = {"header": header, "tokens_per_s": results, "tokens_per_cpu_s": per_cpu, "ratio": ratio}
    record.update(cpu_ratio=cpu_ratio, compiles_in_rounds=compiled_in_rounds)
    record.update(cache_hits=cache_hits, compile=times)
    write_report("\n".join(lines) + "\n", record, args.markdown, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
