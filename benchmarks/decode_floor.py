"""The most any KV-cache design could gain on a generation run: its decode steps with a free cache.

    python benchmarks/decode_floor.py --export WORKDIR/gpt2-small/onnx --new new-48.json --old old-48.json

``--new`` and ``--old`` are ``benchmarks/generation.py --modes continuous --json`` results of the
same workload (two versions of the code, or two cache modes). A decode step's cost is the
layers' weights (the same matrix products whatever the cache does), plus attention over the cache
and whatever the cache costs (copies, padding, bookkeeping). This script times the first part
alone, at several row counts, two ways, and keeps the cheaper: the export's own decoder, one new
token per row over a one-position past (ortbatch's session options, median of ``--reps`` runs), and
``BatchedGenerator``'s decode steps over a cache of 1 to ``--reps`` positions (its own graph and
cache, from its counters). It fits ``step(rows) = a + b * rows`` to those and
charges the ``--new`` run's ``decode_steps`` steps at its ``mean_decode_rows`` live rows. The run's
prefill time is kept as measured and everything outside the graph runs (sampling, scheduling)
counted as free. So

    ceiling tokens/s = tokens / (prefill_time_s + decode_steps * step(mean_decode_rows))

is an upper bound for any cache on this machine and model (attention that costs nothing, no rows
riding along, no Python), and ``ceiling / old tokens/s`` the largest speed-up over ``--old`` a
cache change could give. Both runs must be of the same workload (same tokens generated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def generator_steps(export: Path, rows: list[int], steps: int) -> dict[int, float]:
    """Seconds per decode step of :class:`ortbatch.BatchedGenerator` (its default graph and cache)
    with ``r`` one-token prompts decoding ``steps`` tokens together: a cache of 1 to ``steps``
    positions, so attention reads next to nothing. Keyed by the mean live rows it measured."""
    from ortbatch import BatchedGenerator
    from ortbatch.generation import SamplingParams

    out: dict[int, float] = {}
    with BatchedGenerator(export, max_batch_size=max(rows)) as gen:
        gen.generate([11], 2)  # warm-up
        for r in rows:
            before = gen.stats()
            futures = [gen.submit([11 + i], params=SamplingParams(max_new_tokens=steps + 1)) for i in range(r)]
            for f in futures:
                f.result()
            after = gen.stats()
            n = after.decode_steps - before.decode_steps
            live = (after.mean_decode_rows * after.decode_steps - before.mean_decode_rows * before.decode_steps) / n
            step = out[round(live)] = (after.decode_time_s - before.decode_time_s) / n
            print(f"  BatchedGenerator, {live:.1f} live rows: {step * 1e3:.2f} ms per step", file=sys.stderr)
    return out


def step_times(export: Path, rows: list[int], reps: int) -> dict[int, float]:
    """Median seconds of one step of the export's own decoder over a one-position past, per row count."""
    from ortbatch._ort import build_session, resolve_providers

    session = build_session(export / "model.onnx", resolve_providers("cpu"))
    inputs = {i.name: i for i in session.get_inputs()}
    heads, head_dim = (d for d in inputs["past_key_values.0.key"].shape[1:] if isinstance(d, int))
    out: dict[int, float] = {}
    for r in rows:
        feed: dict[str, Any] = {"input_ids": np.full((r, 1), 11, np.int64)}
        if "attention_mask" in inputs:
            feed["attention_mask"] = np.ones((r, 2), np.int64)
        if "position_ids" in inputs:
            feed["position_ids"] = np.ones((r, 1), np.int64)
        for name in inputs:
            if name.startswith("past_key_values."):
                feed[name] = np.zeros((r, heads, 1, head_dim), np.float32)
        for _ in range(3):
            session.run(None, feed)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - t0)
        out[r] = statistics.median(times)
        print(f"  {r} rows: {out[r] * 1e3:.2f} ms per step", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", type=Path, required=True, help="the text-generation-with-past export both runs served")
    p.add_argument("--new", type=Path, required=True, help="generation.py --json of the run whose steps are charged")
    p.add_argument("--old", type=Path, required=True, help="generation.py --json of the run to compare with")
    p.add_argument("--rows", default="1,8,16,24,32,48")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    new, old = (json.loads(f.read_text())["results"][0] for f in (args.new, args.old))
    if new["tokens"] != old["tokens"]:
        raise SystemExit(f"not the same workload: {new['tokens']} tokens against {old['tokens']}")
    if not new.get("decode_steps"):
        raise SystemExit(f"{args.new} has no decode_steps: write it with this tree's benchmarks/generation.py")
    load = os.getloadavg()[0]
    rows = [int(x) for x in args.rows.split(",")]
    sys.path.insert(0, str(ROOT))
    export_graph = step_times(args.export, rows, args.reps)
    generator = generator_steps(args.export, rows, args.reps)
    # the cheaper of the two per row count: a lower bound whichever graph is faster over an empty cache
    measured = {r: min(t, generator.get(r, t)) for r, t in export_graph.items()}
    xs, ys = np.array(list(measured), float), np.array(list(measured.values()))
    b, a = np.polyfit(xs, ys, 1)
    step = a + b * new["mean_decode_rows"]
    floor_s = new["prefill_time_s"] + new["decode_steps"] * step
    ceiling = new["tokens"] / floor_s
    result = {
        "load_average_at_start": load,
        "step_ms_by_rows": {r: t * 1e3 for r, t in measured.items()},
        "export_graph_step_ms": {r: t * 1e3 for r, t in export_graph.items()},
        "generator_step_ms": {r: t * 1e3 for r, t in generator.items()},
        "step_ms_fit": {"a": a * 1e3, "b_per_row": b * 1e3},
        "new": {k: new[k] for k in ("tokens", "wall_s", "tokens_per_s", "decode_steps", "mean_decode_rows")}
        | {k: new[k] for k in ("decode_time_s", "prefill_time_s")},
        "old_tokens_per_s": old["tokens_per_s"],
        "free_cache_step_ms": step * 1e3,
        "free_cache_decode_s": new["decode_steps"] * step,
        "ceiling_tokens_per_s": ceiling,
        "new_over_old": new["tokens_per_s"] / old["tokens_per_s"],
        "ceiling_over_old": ceiling / old["tokens_per_s"],
    }
    print(
        f"{new['decode_steps']} decode steps at {new['mean_decode_rows']:.1f} live rows: {step * 1e3:.1f} ms each "
        f"with a free cache ({new['decode_steps'] * step:.2f} s; the run took {new['decode_time_s']:.2f} s in decode "
        f"steps), prefill {new['prefill_time_s']:.2f} s as measured\n"
        f"ceiling {ceiling:.0f} tokens/s = {ceiling / old['tokens_per_s']:.2f}x the old run's "
        f"{old['tokens_per_s']:.0f}; the new run: {new['tokens_per_s']:.0f} tokens/s = "
        f"{new['tokens_per_s'] / old['tokens_per_s']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
