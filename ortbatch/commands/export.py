"""``ortbatch export MODEL``: Hugging Face model -> checked ONNX export directory."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from .._ort import parse_provider_names
from ._flags import PROVIDERS_HELP, positive_int, providers_arg

# optimum-onnx and torch's exporter write nothing usable below this (as recipes.Recipe says)
_MIN_OPSET = 11


def opset_arg(text: str) -> int:
    """argparse ``type=``: an ONNX opset ortbatch can export (the upper bound depends on
    the installed torch and onnx, checked by export_model)."""
    value = int(text)
    if value < _MIN_OPSET:
        raise argparse.ArgumentTypeError(f"must be an ONNX opset of at least {_MIN_OPSET}, got {value}")
    return value


HELP = "export a Hugging Face model to ONNX (+ manifest, checks) for batched serving"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help="hub id, local directory, pkg:<module> (a package's model) or tiny:gpt2 (a small decoder trained "
        "here in seconds on a few sentences, for trying generation offline); default: the recipe's",
    )
    parser.add_argument("-o", "--output", help="output directory (default: ./exports/<model name>)")
    parser.add_argument(
        "--task",
        default=None,
        help="auto (default) or e.g. feature-extraction, "
        "text-classification, token-classification, text-generation-with-past",
    )
    parser.add_argument(
        "--opset",
        type=opset_arg,
        default=None,
        help="ONNX opset (default 18, optimum-onnx's; the same for the Python API and the recipes)",
    )
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default=None, help="weights/compute precision")
    parser.add_argument(
        "--optimize",
        choices=["O1", "O2", "O3", "O4"],
        default=None,
        help="ORT graph optimizations via optimum-onnx (O4 = O3 + fp16, needs --device cuda)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="where to export/optimize")
    parser.add_argument(
        "--trt",
        action="store_true",
        default=None,
        help="write TensorRT provider options (profile shapes, engine/timing caches)",
    )
    parser.add_argument("--max-batch-size", type=positive_int, default=None, help="rows per batch (default 64)")
    parser.add_argument(
        "--max-sequence-length",
        type=positive_int,
        default=None,
        help="longest input (default: the model's position limit)",
    )
    parser.add_argument("--recipe", default=None, help="TOML recipe (see export/*.toml); flags override it")
    parser.add_argument(
        "--providers",
        default=None,
        type=providers_arg,
        help=f"providers to check on, {PROVIDERS_HELP} (default: cpu)",
    )
    parser.add_argument(
        "--quantize",
        choices=["int8", "int8-static"],
        default=None,
        help="int8 variant: dynamic (per-channel weights) or static (calibrated on the recipe's samples); "
        "options in the recipe's [quantization] table",
    )
    parser.add_argument(
        "--pooling",
        choices=["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"],
        default=None,
        help="sentence embedding of a plain transformer (no modules.json): how its token embeddings are pooled "
        "(default mean); a sentence-transformers checkpoint always gets its own pipeline",
    )
    parser.add_argument("--no-validate", action="store_true", help="skip the accuracy checks")
    parser.add_argument(
        "--keep-failed",
        action="store_true",
        help="install an export whose checks failed (default: it goes to OUTPUT.failed, OUTPUT is left alone)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUTPUT even if it holds something other than an earlier export",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show third-party logs, every check case")


def _default_output(model: str) -> Path:
    name = model.removeprefix("pkg:").rstrip("/\\")
    name = os.path.basename(name) if os.path.isdir(name) else name.split("/")[-1]
    if name == "model" and model.startswith("pkg:"):
        name = model[4:]
    return Path("exports") / re.sub(r"[^\w.-]+", "-", name)


def _quantize(recipe: Any, mode: str | None) -> Any:
    """``--quantize MODE`` keeps the recipe's [quantization] options, with that mode."""
    if mode is None:
        return None
    if recipe.quantize is not None:
        return recipe.quantize.with_overrides(mode=mode)
    return mode


def run(args: argparse.Namespace) -> int:
    from ._progress import quiet_third_parties, stepper

    quiet_third_parties(args.verbose)
    from ..export import export_model
    from ..export.recipes import Recipe, load_recipe

    recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    model = args.model or recipe.model
    if model is None:
        print("ortbatch export: give a MODEL or a --recipe that names one")
        return 2
    out = Path(args.output) if args.output else _default_output(model)
    providers = parse_provider_names(args.providers) if args.providers else None
    step = stepper()
    had_export = out.is_dir() and any(out.iterdir())
    try:
        result = export_model(
            model,
            out,
            task=args.task,
            opset=args.opset,
            dtype=args.dtype,
            optimize=args.optimize,
            device=args.device,
            trt=args.trt,
            max_batch_size=args.max_batch_size,
            max_sequence_length=args.max_sequence_length,
            recipe=recipe,
            providers=providers,
            quantize=_quantize(recipe, args.quantize),
            pooling=args.pooling,
            validate=not args.no_validate,
            raise_on_failure=False,
            keep_failed=args.keep_failed,
            force=args.force,
            progress=step,
            quiet=False,  # quiet_third_parties above already decided, -v included
        )
    except KeyboardInterrupt:
        left = f"{out} is as it was before" if had_export else f"nothing was written to {out}"
        print(f"\nortbatch export: interrupted; {left} (the partial export was removed)", file=sys.stderr)
        return 130
    out = result.directory
    m = result.manifest
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    size = sum((out / f).stat().st_size for f in files if ".onnx" in f) / 2**20
    if result.report is not None:
        print(result.report.format_table(verbose=args.verbose))
    print(
        f"\nexport: {out}  task={m.source.get('task')}  dtype={m.source.get('dtype')}  "
        f"opset={m.source.get('opset')}  onnx={size:.1f} MiB  padding={m.padding_side}  "
        f"limits={m.limits}"
    )
    if result.report is None:
        print("checks: not run (--no-validate); run `ortbatch validate DIR` before serving")
        return 0
    if not result.report.passed:
        print(f"FAILED: {result.not_installed_message()}; see {out / 'validation.json'}")
        return 1
    return 0
