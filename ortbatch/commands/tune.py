"""``ortbatch tune MODEL|DIR -o OUT``: the fastest variant that still passes the checks."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._flags import positive_int

HELP = "build variants (fp32, ORT fusions, int8, GPU fp16), check each, benchmark those that pass, keep the fastest"


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _fraction(text: str) -> float:
    """A floor for a share of agreement (cosine, argmax, greedy): in (0, 1], as tune checks."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:  # False for nan too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="hub id, local model directory, pkg:<module>, or an ortbatch export directory")
    parser.add_argument("-o", "--output", required=True, help="where the chosen export goes")
    parser.add_argument(
        "--lengths", default="8-128", help="token lengths A-B of the benchmark requests (default 8-128)"
    )
    parser.add_argument(
        "--texts", default=None, help="file of real texts (one per line) to benchmark on (default: built-in corpus)"
    )
    parser.add_argument("--min-cosine", type=_fraction, default=None, help="floor for embedding cosine (e.g. 0.99)")
    parser.add_argument("--min-argmax", type=_fraction, default=None, help="floor for logits argmax agreement")
    parser.add_argument("--min-greedy", type=_fraction, default=None, help="floor for greedy-token agreement")
    parser.add_argument("--budget-s", type=_positive, default=600.0, help="wall-clock bound (default 600)")
    parser.add_argument(
        "--variants", default=None, help="comma-separated subset, e.g. fp32,O2,int8 (default: all that fit)"
    )
    parser.add_argument(
        "--holdout", default=None, help="text file checked after the choice, never used to choose (reported)"
    )
    parser.add_argument("--recipe", default=None, help="TOML recipe for the export's other settings")
    parser.add_argument("--requests", type=positive_int, default=512, help="distinct benchmark requests (default 512)")
    parser.add_argument("--concurrency", type=positive_int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--keep", action="store_true", help="keep the other variants in OUT.variants/")
    parser.add_argument("-v", "--verbose", action="store_true", help="third-party logs")


def run(args: argparse.Namespace) -> int:
    from ._progress import quiet_third_parties, stepper

    quiet_third_parties(args.verbose)
    from ..export.tune import DEFAULT_SETTINGS, resolve_variants, tune

    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    chosen = resolve_variants(variants)
    steps = len(chosen) + 3 * (len(chosen) * len(DEFAULT_SETTINGS))
    bar = _bar(steps)
    try:
        result = tune(
            args.model,
            args.output,
            lengths=args.lengths,
            texts=args.texts,
            min_cosine=args.min_cosine,
            min_argmax=args.min_argmax,
            min_greedy=args.min_greedy,
            budget_s=args.budget_s,
            keep=args.keep,
            variants=chosen,
            holdout=args.holdout,
            recipe=args.recipe,
            requests=args.requests,
            concurrency=args.concurrency,
            progress=stepper() if bar is None or getattr(bar, "disable", False) else None,
            bar=bar,
        )
    finally:
        if bar is not None:
            bar.close()
    print(result.table())
    c = result.chosen
    if c is not None and c.setting is not None:
        speed = f", {c.speedup:.2f}x fp32" if c.speedup is not None else ""
        print(
            f"\nchosen: {c.variant} ({c.setting.label}{speed}) -> {result.directory}  "
            f"[table: {result.directory / 'tune.md'}, plot: {result.directory / 'tune.png'}; {result.seconds:.0f}s]"
        )
    return 0


def _bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (CI logs, captured output)
    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr, disable=None)
