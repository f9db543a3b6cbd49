"""``ortbatch generate DIR PROMPT...``: complete prompts with a decoder export, batched."""

from __future__ import annotations

import argparse

from ._flags import PROVIDERS_HELP, providers_arg

HELP = "generate completions for one or more prompts with a text-generation-with-past export"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="an export of --task text-generation-with-past (ortbatch or optimum)")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt texts, generated together")
    parser.add_argument(
        "-n", "--max-new-tokens", type=int, default=64, help="most tokens generated per prompt (default 64)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample only from the K most likely tokens (default: all)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample only from the most likely tokens whose probabilities add up to P (default 1: all)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling, for repeatable output")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument(
        "--max-batch-size", type=int, default=32, help="most sequences decoded together in one step (default 32)"
    )
    parser.add_argument(
        "--providers", default=None, type=providers_arg, help=f"{PROVIDERS_HELP} (default: CUDA if it loads, else CPU)"
    )
    parser.add_argument(
        "--max-context-length",
        type=int,
        default=None,
        help="most positions a sequence may reach (default: from the export; needed for ALiBi models such as BLOOM)",
    )
    parser.add_argument("--stream", action="store_true", help="print the first prompt's tokens as they come")
    parser.add_argument("--json", action="store_true", help="print each completion as a JSON line")


def run(args: argparse.Namespace) -> int:
    """What the export's model kind does for ``generate`` (a text-generation export completes
    the prompts together on one BatchedGenerator); an export of another kind, or of none, is
    refused in one line (exit 2)."""
    from ..serve.served.kinds import kind_for_export
    from ._target import export_target

    directory = export_target(args.directory)
    return kind_for_export(directory).generate(directory, args)
