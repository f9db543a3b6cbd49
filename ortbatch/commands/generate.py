"""``ortbatch generate DIR PROMPT...``: complete prompts with a decoder export, or translate /
summarize them with an encoder-decoder export, batched."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ._flags import PROVIDERS_HELP, providers_arg

HELP = "generate completions for one or more prompts with a text-generation-with-past export"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="an export of --task text-generation-with-past (ortbatch or optimum)")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt texts, generated together")
    parser.add_argument(
        "-n",
        "--max-new-tokens",
        type=int,
        default=None,
        help="most tokens generated per prompt (default 64; an encoder-decoder export's generation config first)",
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
    seq2seq = parser.add_argument_group("encoder-decoder exports (T5, BART, Marian, NLLB, ...)")
    seq2seq.add_argument("--num-beams", type=int, default=None, help="beam search (default: the generation config's)")
    seq2seq.add_argument("--src-lang", default=None, help="the source language code (NLLB, M2M100, mBART)")
    seq2seq.add_argument("--tgt-lang", default=None, help="the target language code (NLLB, M2M100, mBART)")


def run(args: argparse.Namespace) -> int:
    """What the export's model kind does for ``generate`` (a text-generation export completes
    the prompts together on one BatchedGenerator); an export of another kind, or of none, is
    refused in one line (exit 2)."""
    from ..serve.served.kinds import kind_for_export
    from ._target import export_target

    directory = export_target(args.directory)
    if _is_seq2seq_generation(Path(directory)):
        return _run_seq2seq(args, Path(directory))
    if args.max_new_tokens is None:
        args.max_new_tokens = 64
    return kind_for_export(directory).generate(directory, args)


def _is_seq2seq_generation(directory: Path) -> bool:
    """An encoder-decoder text export (its manifest's ``generation`` section is the seq2seq
    engine's): ``generate`` runs it on :class:`~ortbatch.generation.seq2seq.Seq2SeqGenerator`,
    which ``serve`` and ``run`` do not take yet (their model kind refuses it in one line)."""
    from ..manifest import MANIFEST_NAME, Manifest

    if not (directory / MANIFEST_NAME).is_file():
        return False
    generation = Manifest.load(directory).generation
    return bool(generation) and generation.get("kind") == "seq2seq"


def _run_seq2seq(args: argparse.Namespace, directory: Path) -> int:
    """The same command on an encoder-decoder export (:class:`Seq2SeqGenerator`)."""
    from ..generation.seq2seq import Seq2SeqGenerator

    options: dict[str, object] = {"seed": args.seed, "stop": args.stop}
    if args.temperature:
        options.update(do_sample=True, temperature=args.temperature, top_k=args.top_k or 0, top_p=args.top_p)
    for name in ("num_beams", "src_lang", "tgt_lang"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    with Seq2SeqGenerator(directory, max_batch_size=args.max_batch_size, providers=args.providers) as gen:
        results = [f.result() for f in [gen.submit(p, args.max_new_tokens, **options) for p in args.prompts]]
    for source, out in zip(args.prompts, results, strict=True):
        if args.json:
            fields = {"source": source, "text": out.text, "token_ids": list(out.token_ids)}
            print(
                json.dumps({**fields, "finish_reason": out.finish_reason, "completion_tokens": out.completion_tokens})
            )
        else:
            print(f"{out.text}\n[{out.finish_reason}, {out.completion_tokens} tokens]")
    return 0
