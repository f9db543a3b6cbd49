"""``ortbatch validate DIR``: run the built-in accuracy checks on an export directory."""

from __future__ import annotations

import argparse

from ._flags import PROVIDERS_HELP, providers_arg


def _sample(text: str) -> str:
    """argparse ``type=``: a sample text to check on; an empty one checks nothing (a recipe
    refuses it too)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a sample must be a non-empty text")
    return text


HELP = "run the accuracy checks (reference parity, shapes, batching, providers) on an export"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="an `ortbatch export` output directory")
    parser.add_argument(
        "--providers",
        default=None,
        type=providers_arg,
        help=f"providers to check, {PROVIDERS_HELP} (default: the manifest's)",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference (ONNX-only checks)")
    parser.add_argument(
        "--samples", nargs="+", type=_sample, default=None, help="texts to check on (default: the manifest's)"
    )
    parser.add_argument("--no-save", action="store_true", help="do not rewrite validation.json / ortbatch.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="every case, third-party logs")


def run(args: argparse.Namespace) -> int:
    from ._progress import quiet_third_parties, stepper
    from ._target import export_target

    directory = export_target(args.directory, need_manifest=True)
    quiet_third_parties(args.verbose)
    from ..export import validate

    report = validate(
        directory,
        providers=args.providers,
        samples=args.samples,
        use_reference=not args.no_reference,
        save=not args.no_save,
        progress=stepper(),
    )
    print(report.format_table(verbose=args.verbose))
    return 0 if report.passed else 1
