"""``ortbatch run EXPORT INPUT -o OUTPUT``: bulk inference over files (:mod:`ortbatch.bulk`).

Exit status: 0 when every row succeeded; 3 when the job finished but some rows failed
(listed in ``OUTPUT/_errors.jsonl``); 2 for a bad argument; 1 for any other error;
130 when interrupted (rerun the same command to resume).

``--ray`` runs the same job on Ray Data (:mod:`ortbatch.bulk.ray_data`), same output.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError, OrtBatchError
from ._flags import PROVIDERS_HELP, non_negative_float, positive_float, positive_int, providers_arg

if TYPE_CHECKING:
    from ..bulk import RunConfig

HELP = "compute an export's task for every row of JSONL/CSV/Parquet files (or an OpenAI Batch API file), resumably"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", help="an export directory (ortbatch.json): its task says what is computed")
    parser.add_argument("input", help="a .jsonl, .csv or .parquet file, a folder of them, or an OpenAI Batch API file")
    parser.add_argument("-o", "--output", required=True, help="the output folder (shards + manifest; resumable)")
    parser.add_argument("--text-column", default=None, help='the text column (default "text"; "prompt" to generate)')
    parser.add_argument("--pair-column", default=None, help="the second text of each pair (cross-encoders, NLI)")
    parser.add_argument("--id-column", default=None, help="a column copied to the output as id (and into errors)")
    parser.add_argument(
        "--input-format",
        default="auto",
        choices=["auto", "jsonl", "csv", "parquet", "openai-batch"],
        help="default: by suffix; a JSONL of custom_id/url/body lines is an OpenAI Batch API file",
    )
    parser.add_argument(
        "--format",
        dest="output_format",
        default=None,
        choices=["parquet", "jsonl"],
        help="output format (default parquet; the Batch API's JSONL for Batch API input)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=4096,
        help="rows read, sorted by length and committed together as one shard (default 4096): bounds memory",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut over-long inputs to the model's limit (for an OpenAI Batch API file: the default of a "
        '/v1/embeddings line\'s "truncate", as `serve --truncate` sets it)',
    )
    parser.add_argument(
        "--no-normalize",
        action="store_true",
        help="embeddings as pooled, not L2-normalized (an export without a sentence-transformers pipeline; "
        "one with a pipeline gives the pipeline's own vectors)",
    )
    parser.add_argument("--max-batch-size", type=int, default=None, help="rows per batch (default: the export's)")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    parser.add_argument(
        "--sampling",
        default=None,
        help="sample generations (default greedy): a JSON object of /v1/completions sampling fields, e.g. "
        '\'{"temperature": 0.8, "top_p": 0.95, "seed": 1}\'; each row draws with a seed derived from '
        "seed and its number",
    )
    parser.add_argument("--providers", default=None, type=providers_arg, help=PROVIDERS_HELP)
    parser.add_argument("--restart", action="store_true", help="discard this output's shards and start over")
    parser.add_argument("--quiet", action="store_true", help="no progress, only the summary")
    parser.add_argument(
        "--progress-every",
        type=positive_float,
        default=10.0,
        help="seconds between progress lines when not on a terminal",
    )
    _add_ray(parser.add_argument_group("Ray Data (pip install 'ortbatch[ray]'; see docs/bulk.md)"))


def _add_ray(ray: Any) -> None:
    ray.add_argument(
        "--ray", action="store_true", help="run the job on Ray Data: same output, same resume (the shard manifest)"
    )
    ray.add_argument(
        "--ray-address", default=None, help="cluster to join, e.g. auto or head:6379 (default: a local Ray)"
    )
    ray.add_argument(
        "--ray-concurrency",
        type=positive_int,
        default=None,
        help="workers, each owning one session (default: the cluster's CPUs / --ray-cpus)",
    )
    ray.add_argument(
        "--ray-cpus",
        type=positive_float,
        default=1.0,
        help="CPUs per worker; its ONNX Runtime threads follow (default 1)",
    )
    ray.add_argument("--ray-gpus", type=non_negative_float, default=0.0, help="GPUs per worker (1: one worker per GPU)")


def _sampling(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise RunArgumentError(
            f'--sampling must be a JSON object, e.g. \'{{"temperature": 0.8, "seed": 1}}\', got {text[:60]!r}'
        )
    return value


class RunArgumentError(OrtBatchError):
    """A flag of ``ortbatch run`` that cannot be honoured as given: a bad argument (exit 2)."""

    exit_code = 2


def _ray_options(args: argparse.Namespace) -> Any:
    from ..bulk import RayOptions

    given = [
        flag
        for flag, value, default in (
            ("--ray-address", args.ray_address, None),
            ("--ray-concurrency", args.ray_concurrency, None),
            ("--ray-cpus", args.ray_cpus, 1.0),
            ("--ray-gpus", args.ray_gpus, 0.0),
        )
        if value != default
    ]
    if not args.ray:
        if given:
            raise RunArgumentError(f"{given[0]} needs --ray")
        return None
    try:
        return RayOptions(args.ray_address, args.ray_concurrency, args.ray_cpus, args.ray_gpus)
    except InvalidInputError as exc:
        raise RunArgumentError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from ..bulk import run as run_job
    from ._target import export_target

    export = export_target(args.export, need_manifest=False)
    ray = _ray_options(args)
    try:
        config = _config(args, ray)
    except InvalidInputError as exc:  # a bad value of a flag: one line, exit 2
        raise RunArgumentError(str(exc)) from None
    try:
        summary = run_job(export, args.input, args.output, config)
    except InvalidInputError as exc:  # a setting the export cannot honour (rows never raise)
        raise RunArgumentError(str(exc)) from None
    except KeyboardInterrupt:
        print(
            "ortbatch run: interrupted; the committed shards are kept: rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    print(summary.describe(), file=sys.stderr)
    return summary.exit_code


def _config(args: argparse.Namespace, ray: Any) -> RunConfig:
    from ..bulk import RunConfig

    return RunConfig(
        text_column=args.text_column,
        pair_column=args.pair_column,
        id_column=args.id_column,
        input_format=args.input_format,
        output_format=args.output_format,
        window=args.window,
        truncate=args.truncate,
        normalize=not args.no_normalize,
        max_batch_size=args.max_batch_size,
        providers=args.providers,
        max_new_tokens=args.max_new_tokens,
        restart=args.restart,
        progress=False if args.quiet else None,
        progress_every_s=args.progress_every,
        ray=ray,
        sampling=_sampling(args.sampling),
    )
