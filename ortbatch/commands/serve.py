"""``ortbatch serve DIR``: serve an export over HTTP (Open Inference Protocol / KServe v2)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ._flags import add_runtime_arguments, non_negative_float, port, positive_float, positive_int

HELP = (
    "serve export directories over HTTP (KServe v2 / Triton protocol with the model-repository extension, "
    "/v1/embeddings, /v1/rerank, /v1/classify, /tokenize, /metrics; text-generation-with-past exports: "
    "OpenAI /v1/completions and /v1/chat/completions)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_models(parser)
    _add_runtime(parser)
    _add_http(parser)
    _add_limits(parser.add_argument_group("connection limits (docs/serving.md)"))
    _add_ray(parser.add_argument_group("Ray Serve (pip install 'ortbatch[ray]'; see docs/scale-out.md)"))
    _add_logging(parser)


def _add_models(parser: argparse.ArgumentParser) -> None:
    """What to serve."""
    parser.add_argument(
        "directory",
        metavar="DIR",
        nargs="*",
        help="export directory (model.onnx + ortbatch.json); several serve them all, each named after its folder "
        "or NAME=DIR",
    )
    parser.add_argument(
        "--repository",
        metavar="ROOT",
        default=None,
        help="serve every subfolder of ROOT holding an ortbatch.json (named after the folder); folders added "
        "later load with POST /v2/repository/models/NAME/load. Models do not get fixed shares of the CPU: each "
        "is sized for every core, since an idle model's thread pools sleep and use none",
    )
    parser.add_argument(
        "--strict", action="store_true", help="with several models: refuse to start if any fails to load"
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="text endpoints cut inputs longer than the model's limit by default (else 400 unless the "
        'request says "truncate": true)',
    )
    parser.add_argument(
        "--lenient-params",
        action="store_true",
        help="accept request fields an endpoint does not read (generation: neither OpenAI nor vLLM defines "
        "them; embeddings and task endpoints: see docs/serving.md), logging each name once, instead of a 400 "
        "naming it",
    )
    parser.add_argument("--name", default=None, help="model name in URLs (default: the directory name)")
    parser.add_argument(
        "--allow-unvalidated",
        action="store_true",
        help="serve an export whose accuracy checks failed (validation.passed false in ortbatch.json); "
        "refused otherwise",
    )


def _add_runtime(parser: argparse.ArgumentParser) -> None:
    """How each model batches (the flags shared with ``bench``) and what a request may ask."""
    add_runtime_arguments(
        parser,
        max_batch_size=None,
        max_batch_size_help="rows per batch (default: the export's tuned setting, else 32)",
        max_batch_tokens_help="cap on rows x longest length per batch",
        latency_help="do not build the second, every-core CPU session for requests that arrive when idle "
        "(saves its memory)",
    )
    parser.add_argument(
        "--max-queue", type=positive_int, default=1024, help="requests allowed to wait; beyond that 429 (default 1024)"
    )
    parser.add_argument(
        "--timeout-s",
        type=positive_float,
        default=None,
        help="deadline per request before it runs; then 504 (default none)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=64 * 1024 * 1024,
        help="largest request body; larger is 413 (default 64 MiB)",
    )
    parser.add_argument("--no-normalize", action="store_true", help="do not L2-normalize /v1/embeddings vectors")
    parser.add_argument(
        "--graceful-timeout-s",
        type=non_negative_float,
        default=60.0,
        help="on SIGTERM, wait this long for in-flight requests (default 60)",
    )
    parser.add_argument(
        "--max-context-length",
        type=positive_int,
        default=None,
        help="generation exports: most positions a sequence may reach (default: the export's)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="generation exports: do not reuse the keys and values of prompt prefixes seen before "
        "(default: reused, on the in-place KV cache)",
    )


def _add_http(parser: argparse.ArgumentParser) -> None:
    """Where and how the server listens: address, gRPC, front ends, auth and TLS."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=port, default=8000, help="port (0: pick a free one; default 8000)")
    parser.add_argument(
        "--grpc-port",
        type=port,
        default=None,
        help="also serve the KServe v2 gRPC protocol on this port of --host (Triton's is 8001; 0: a free one)",
    )
    parser.add_argument(
        "--frontends",
        type=int,
        default=1,
        metavar="N",
        help="N front-end processes accept connections (HTTP and gRPC), parse and tokenize, over one engine "
        "process that owns every model's session or generator and batches (shared memory between them); "
        "a front end that dies is restarted. Default 1: everything in one process. Not with --ray",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (gRPC: the same metadata) on every route but the health checks "
        "(default: $ORTBATCH_API_KEY)",
    )
    parser.add_argument("--api-key-file", default=None, help="read the API key from this file's first line")
    parser.add_argument(
        "--otlp-endpoint",
        type=_otlp_url,
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces (OTLP; HTTP/protobuf, or gRPC with OTEL_EXPORTER_OTLP_PROTOCOL=grpc) to "
        "this collector, e.g. http://localhost:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT; unset: no tracing). "
        "Needs the tracing extra",
    )
    parser.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS (and TLS gRPC)")
    parser.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")


def _otlp_url(value: str) -> str:
    """An http(s) URL of an OTLP collector (argparse refuses anything else, exit 2)."""
    if not value.startswith(("http://", "https://")) or len(value) <= len("https://"):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {value!r}")
    return value


def _add_limits(limits: Any) -> None:
    limits.add_argument(
        "--header-timeout-s", type=positive_float, default=10.0, help="seconds to send headers (default 10)"
    )
    limits.add_argument(
        "--http",
        choices=("auto", "httptools", "h11"),
        default="auto",
        help="HTTP/1.1 parser: httptools (C, less CPU per request), h11 (pure Python), auto: httptools if "
        "installed (default)",
    )
    limits.add_argument(
        "--first-byte-timeout-s",
        type=positive_float,
        default=5.0,
        help="seconds a new connection has to send its first byte (default 5)",
    )
    limits.add_argument(
        "--max-idle-per-address",
        type=positive_int,
        default=100,
        help="connections one client address may hold without sending a byte; beyond it its oldest is closed. "
        "They never count toward --limit-concurrency (default 100)",
    )
    limits.add_argument(
        "--body-timeout-s", type=positive_float, default=60.0, help="seconds to send a body (default 60)"
    )
    limits.add_argument(
        "--limit-concurrency", type=positive_int, default=1000, help="connections at once; beyond: 503 (default 1000)"
    )
    limits.add_argument(
        "--max-text-chars",
        type=positive_int,
        default=100_000,
        help="longest text taken when the export sets no max sequence length; longer: 413 (default 100000)",
    )


def _add_ray(ray: Any) -> None:
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve on a Ray cluster: one deployment per DIR (or NAME=DIR), Ray's HTTP proxy on --host/--port",
    )
    ray.add_argument(
        "--ray-address", default=None, help="cluster to join, e.g. ray://head:10001 or auto (default: a local Ray)"
    )
    ray.add_argument("--replicas", type=positive_int, default=1, help="replicas per deployment (default 1)")
    ray.add_argument(
        "--replica-cpus",
        type=positive_float,
        default=1.0,
        help="CPUs per replica; its ONNX Runtime threads follow (default 1)",
    )
    ray.add_argument(
        "--replica-gpus", type=non_negative_float, default=0.0, help="GPUs per replica (1: one replica per GPU)"
    )
    ray.add_argument(
        "--ray-request-timeout-s",
        type=positive_float,
        default=None,
        help="the proxy's deadline per request: past it, 408 (even if its replica died; default none)",
    )


def _add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default info)",
    )
    parser.add_argument("--no-access-log", action="store_true", help="do not log every request")


_RAY_DEFAULTS = {
    "ray_address": None,
    "replicas": 1,
    "replica_cpus": 1.0,
    "replica_gpus": 0.0,
    "ray_request_timeout_s": None,
}


def run(args: argparse.Namespace) -> int:
    import sys

    from ..errors import OrtBatchError
    from ..serve.served.repository import ModelRepository, parse_model_args
    from ..serve.server import serve
    from ._target import export_target

    if not args.directory and args.repository is None:
        print("ortbatch serve: error: give an export DIR (or several, or --repository ROOT)", file=sys.stderr)
        return 2
    # one DIR keeps the one-model server; several, NAME=DIR or --repository: the repository
    one = args.directory[0] if len(args.directory) == 1 else ""
    many = args.repository is not None or not one or ("=" in one and not Path(one).exists())
    mistake = _flag_mistake(args, many)
    if mistake is not None:
        print(f"ortbatch serve: error: {mistake}", file=sys.stderr)
        return 2
    config = _config(args)
    if args.ray:
        return _serve_on_ray(args, config)
    if not many:  # one export: the same check and message as every command, and its recorded checks
        target = export_target(args.directory[0], onnx_file=True)
        refuse_failed_checks(target, args.allow_unvalidated)
        return serve(target, config)
    try:
        models = parse_model_args(args.directory)
        missing = [str(path) for _, path in models if not path.exists()]
        if missing:
            raise OrtBatchError(f"{', '.join(missing)} does not exist")
        for _, path in models:  # a failed export beside good ones is refused as one alone is
            refuse_failed_checks(path, args.allow_unvalidated)
        root = Path(args.repository) if args.repository is not None else None
        repository = ModelRepository(models, root=root, config=config, strict=args.strict)
        return serve(repository, config)
    except OrtBatchError as exc:
        print(f"ortbatch serve: error: {exc}", file=sys.stderr)
        return 2


def _flag_mistake(args: argparse.Namespace, many: bool) -> str | None:
    """What is wrong with the flags taken together, before anything is read from disk."""
    if many and args.name is not None:
        return "--name names one model; with several, use NAME=DIR"
    if not args.ray:
        for flag, default in _RAY_DEFAULTS.items():
            if getattr(args, flag) != default:
                return f"--{flag.replace('_', '-')} needs --ray"
    if args.frontends < 1:
        return f"--frontends must be 1 or more, got {args.frontends}"
    if args.frontends > 1 and args.ray:
        return "--frontends and --ray do not go together (Ray runs its own replicas)"
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        return "TLS needs both --ssl-certfile and --ssl-keyfile"
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if path is not None and not Path(path).is_file():
            return f"{flag} {path} is not a file"
    return None


def _config(args: argparse.Namespace) -> Any:
    """The ServeConfig the flags ask for (the API key read from its file or the environment)."""
    from ..serve.auth import resolve_api_key
    from ..serve.config import ServeConfig

    return ServeConfig(
        host=args.host,
        port=args.port,
        name=args.name,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
        max_delay_ms=args.max_delay_ms,
        max_queue=args.max_queue,
        workers=args.workers,
        latency_session=False if args.no_latency_session else None,
        timeout_s=args.timeout_s,
        providers=args.providers,
        max_body_bytes=args.max_body_bytes,
        normalize_embeddings=not args.no_normalize,
        graceful_timeout_s=args.graceful_timeout_s,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        max_context_length=args.max_context_length,
        prefix_cache=args.prefix_cache,
        grpc_port=args.grpc_port,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        header_timeout_s=args.header_timeout_s,
        http_parser=args.http,
        body_timeout_s=args.body_timeout_s,
        limit_concurrency=args.limit_concurrency,
        first_byte_timeout_s=args.first_byte_timeout_s,
        max_idle_per_address=args.max_idle_per_address,
        max_text_chars=args.max_text_chars,
        truncate=args.truncate,
        frontends=args.frontends,
        allow_unvalidated=args.allow_unvalidated,
        lenient_params=args.lenient_params,
        otlp_endpoint=args.otlp_endpoint,
    )


def refuse_failed_checks(target: Path, allow_unvalidated: bool) -> None:
    """Refuse an export no registered model kind serves (one line naming what it is and the
    kinds there are: :func:`~ortbatch.serve.served.kinds.kind_for_export`) and one whose
    recorded accuracy checks failed (unless allowed); warn about one that was never checked."""
    import sys

    from ..manifest import MANIFEST_NAME, Manifest
    from ..serve.served.kinds import kind_for_export
    from ..serve.served.loading import refuse_unvalidated

    kind_for_export(target)

    if not (target / MANIFEST_NAME).is_file():
        return
    refuse_unvalidated(target, allow_unvalidated)
    passed = Manifest.load(target).validation.get("passed")
    if passed is None:
        print(
            f"ortbatch serve: warning: {target} was never checked (exported with --no-validate); "
            f"`ortbatch validate {target}` checks it",
            file=sys.stderr,
        )


def _serve_on_ray(args: argparse.Namespace, config: Any) -> int:
    """``--ray``: the DIRs (or NAME=DIRs) as Ray Serve deployments (ortbatch.ray)."""
    import sys

    from ..errors import OrtBatchError
    from ..ray import serve_on_ray
    from ..serve.served.repository import parse_model_args

    if args.repository is not None:
        print("ortbatch serve: error: --repository is not served on Ray; give the export DIRs", file=sys.stderr)
        return 2
    try:
        models = parse_model_args(args.directory)
        missing = [str(path) for _, path in models if not path.exists()]
        if missing:
            raise OrtBatchError(f"{', '.join(missing)} does not exist")
    except OrtBatchError as exc:
        print(f"ortbatch serve: error: {exc}", file=sys.stderr)
        return 2
    for _, path in models:
        refuse_failed_checks(path, args.allow_unvalidated)
    if len(models) == 1 and args.name is not None:
        models = [(args.name, models[0][1])]
    return serve_on_ray(
        models,
        config,
        address=args.ray_address,
        replicas=args.replicas,
        num_cpus=args.replica_cpus,
        num_gpus=args.replica_gpus,
        request_timeout_s=args.ray_request_timeout_s,
    )
