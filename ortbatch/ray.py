"""Past one machine: ortbatch exports on Ray Serve (the ``ortbatch[ray]`` extra).

:func:`build_app` makes one Ray Serve deployment per export. Each replica loads the
export itself and owns one :class:`~ortbatch.BatchedSession` (or, for a decoder-with-past
export, one :class:`~ortbatch.BatchedGenerator`), and mounts the very Starlette app that
``ortbatch serve`` runs as its ASGI ingress: the KServe v2 routes, ``/v1/embeddings``,
``/v1/completions`` (streamed too) and ``/metrics`` answer through Ray's HTTP proxy
exactly as they do from one process.

Batching stays inside the replica: requests that Ray routes to a replica join the
batches its session forms. Ray's ``@serve.batch`` is deliberately not stacked on top:
it would batch a second time in front of a batcher that already does, and one failing
request fails every request in its ``@serve.batch`` batch (PEERS.md), where
BatchedSession splits a failed batch and fails only the bad row. What Ray must be told
instead is to let many requests in: its ``max_ongoing_requests`` defaults to 5 per
replica, which starves any batcher; here it defaults to the session's own queue bound
(``max_queue``), so the replica answers 429 when full, as ``ortbatch serve`` does.

Each answer carries an ``x-ortbatch-replica`` header naming the replica that served
it (and ``/metrics`` through the proxy is that replica's own). The runtime and
``ortbatch.serve`` never import ray; only this module does.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ._extras import require
from ._ort.session import cpu_session_options
from .errors import OrtBatchError
from .serve.assembly import app_for
from .serve.config import ServeConfig
from .serve.served.loading import load_served

__all__ = [
    "REPLICA_HEADER",
    "RayApp",
    "app_builder",
    "build_app",
    "check_replica_health",
    "replica_threads",
    "run",
    "serve_on_ray",
]

#: response header naming the replica that answered (``<deployment>#<replica id>``)
REPLICA_HEADER = "x-ortbatch-replica"

_Message = MutableMapping[str, Any]


@dataclass(frozen=True)
class RayApp:
    """One export's Ray Serve application: pass to :func:`run` (or ``serve.run(app.application,
    name=app.name, route_prefix=app.route_prefix)``)."""

    name: str
    directory: Path
    route_prefix: str
    application: Any  # ray.serve.Application


def replica_threads(num_cpus: float, workers: int) -> int:
    """Intra-op threads per ONNX Runtime run in a replica given ``num_cpus``: the replica's
    CPUs shared among its ``workers`` batches in flight (at least one)."""
    return max(1, int(num_cpus) // max(1, workers))


def _session_options(num_cpus: float, workers: int) -> Any:
    """Session options sized to the replica's CPUs, not the machine's: several replicas
    share a node, and each sizing its thread pool to every core would oversubscribe it."""
    return cpu_session_options(int(num_cpus), workers)


class _ReplicaHeader:
    """ASGI wrapper adding :data:`REPLICA_HEADER` to every HTTP response."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.state = getattr(app, "state", None)
        self._value = replica.encode("latin-1", "replace")

    async def __call__(
        self, scope: _Message, receive: Callable[[], Awaitable[_Message]], send: Callable[[_Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: _Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self._value)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_named)


def load_replica_app(directory: str, config: ServeConfig, num_cpus: float, replica: str) -> tuple[Any, Any]:
    """Inside a replica: load the export (threads sized to ``num_cpus``) and build
    ``ortbatch serve``'s app for it. Returns ``(served, app)``."""

    def options(generation: bool) -> Any:
        # a generator runs one decode step at a time; a session has its workers in flight
        return _session_options(num_cpus, 1 if generation else _session_workers(directory, config))

    served = load_served(directory, config.name, config, options)
    try:
        app = app_for(served, config)
    except BaseException:
        served.close(drain=False)
        raise
    return served, _ReplicaHeader(app, replica)


def check_replica_health(served: Any) -> None:
    """What a replica's ``check_health`` reports to Ray: raises :class:`OrtBatchError` when
    the replica's session or generator no longer accepts requests (closed, or failed and
    closed itself), so Ray replaces the replica instead of routing requests into it."""
    if getattr(served, "closed", False) or not getattr(served, "ready", True):
        state = "closed" if getattr(served, "closed", False) else "not ready"
        raise OrtBatchError(f"replica of {getattr(served, 'name', '?')!r}: its session is {state}")


def _session_workers(directory: str, config: ServeConfig) -> int:
    """The batches a replica's session will run at once: the config's, else the export's
    tuned setting (``ortbatch tune``), else BatchedSession's default of 2."""
    if config.workers is not None:
        return config.workers
    from .manifest import MANIFEST_NAME, Manifest

    path = Path(directory)
    if (path / MANIFEST_NAME).is_file():
        return int(Manifest.load(path).runtime.get("workers") or 2)
    return 2


def _replica_class() -> Any:
    """The deployment class (built on first use, so importing this module needs no ray)."""
    serve = require("ray.serve", "ray")

    @serve.ingress()
    class OrtBatchReplica:
        """One replica: one loaded export and its app (the ingress Ray's proxy calls)."""

        def __init__(self, directory: str, config: ServeConfig, num_cpus: float) -> None:
            ctx = serve.get_replica_context()
            replica = f"{ctx.deployment}#{ctx.replica_id.unique_id}"
            self.served, self.app_ = load_replica_app(directory, config, num_cpus, replica)

        def __serve_build_asgi_app__(self) -> Any:
            # The app's lifespan shutdown closes the session with drain=True when Ray
            # stops the replica, so requests already in it are answered first.
            return self.app_

        def check_health(self) -> None:
            # Ray's controller calls this every health_check_period_s; three failures in a
            # row and it replaces the replica (a crashed replica is replaced at once).
            check_replica_health(self.served)

    return OrtBatchReplica


def _export_name(directory: Path, config: ServeConfig, several: bool) -> str:
    if config.name is not None and not several:
        return config.name
    return directory.resolve().name


def build_app(
    models: str | os.PathLike[str] | Sequence[str | os.PathLike[str] | tuple[str, str | os.PathLike[str]]],
    *,
    config: ServeConfig | None = None,
    replicas: int = 1,
    autoscaling: dict[str, Any] | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    deployment_options: dict[str, Any] | None = None,
) -> list[RayApp]:
    """One Ray Serve application per export directory in ``models``.

    Args:
        models: export directories, or ``(name, directory)`` pairs (each served by its own
            deployment; named by its directory, or ``config.name`` when there is one).
        config: the per-replica serving settings of ``ortbatch serve`` (batch size,
            queue, timeouts, API key, ...); its host/port are the proxy's, see :func:`run`.
        replicas: fixed number of replicas per deployment (ignored with ``autoscaling``).
        autoscaling: Ray's ``autoscaling_config``, e.g. ``{"min_replicas": 1,
            "max_replicas": 4, "target_ongoing_requests": 32}`` (queue depth per replica).
        ray_actor_options: resources per replica; ``{"num_cpus": 1}`` by default.
            ``{"num_gpus": 1}`` places one replica per GPU. CPU threads follow ``num_cpus``.
        max_ongoing_requests: requests Ray lets into one replica at once (default
            ``config.max_queue``; Ray's own default of 5 never lets a batch fill).
        deployment_options: any other ``serve.deployment`` option, applied last, e.g.
            ``{"health_check_period_s": 2}`` (how soon a crashed replica is noticed and
            replaced; Ray's default is 10 s) or ``{"graceful_shutdown_timeout_s": 30}``.

    With one export the application is mounted at ``/`` (URLs as ``ortbatch serve``'s);
    with several, each at ``/<name>`` (a client's base URL is ``http://proxy/<name>``).
    """
    serve = require("ray.serve", "ray")
    config = config or ServeConfig()
    entries = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    given = [(m[0], Path(m[1])) if isinstance(m, tuple) else (None, Path(m)) for m in entries]
    dirs = [d for _, d in given]
    if not dirs:
        raise OrtBatchError("build_app needs at least one export directory")
    for d in dirs:
        if not d.exists():
            raise OrtBatchError(f"export directory {d} does not exist")
    if replicas < 1:
        raise OrtBatchError(f"replicas must be at least 1, got {replicas}")
    several = len(dirs) > 1
    names = [name or _export_name(d, config, several) for name, d in given]
    if len(set(names)) != len(names):
        raise OrtBatchError(f"two exports have the same name ({names}); rename a directory")
    actor = {"num_cpus": 1, **(ray_actor_options or {})}
    num_cpus = float(actor["num_cpus"])
    options: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing_requests or config.max_queue,
        "ray_actor_options": actor,
    }
    if config.graceful_timeout_s is not None:
        options["graceful_shutdown_timeout_s"] = config.graceful_timeout_s
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    fixed = {"name", "ray_actor_options", "num_replicas", "autoscaling_config", "max_ongoing_requests"}
    clash = sorted(fixed & set(deployment_options or {}))
    if clash:
        raise OrtBatchError(f"deployment_options {clash}: pass them as build_app's own arguments")
    options.update(deployment_options or {})
    cls = _replica_class()
    apps = []
    for d, name in zip(dirs, names, strict=True):
        deployment = serve.deployment(cls, name=name, **options)
        replica_config = replace(config, name=name)
        apps.append(
            RayApp(
                name=name,
                directory=d,
                route_prefix=f"/{name}" if several else "/",
                application=deployment.bind(str(d.resolve()), replica_config, num_cpus),
            )
        )
    return apps


def run(apps: Sequence[RayApp]) -> None:
    """Deploy ``apps`` on the connected Ray cluster (call ``ray.init`` and ``serve.start``
    first: the latter sets the proxy's host and port) and return once every replica is up."""
    serve = require("ray.serve", "ray")
    for app in apps:
        serve.run(app.application, name=app.name, route_prefix=app.route_prefix, blocking=False)


def serve_on_ray(
    directories: Sequence[str | os.PathLike[str] | tuple[str, str | os.PathLike[str]]],
    config: ServeConfig,
    *,
    address: str | None = None,
    replicas: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    request_timeout_s: float | None = None,
) -> int:
    """``ortbatch serve --ray``: deploy the exports on a Ray cluster (``address``; None starts
    a local Ray), Ray's proxy on ``config.host``/``config.port``, until SIGTERM/SIGINT.
    Then a local Ray is shut down; on a cluster that was joined only these applications
    are deleted. Returns the exit code (2 for a mistake in what was asked).

    ``request_timeout_s`` is the proxy's deadline for every request (Ray's
    ``http_options.request_timeout_s``; a client may shorten it per request with the
    ``x-request-timeout-seconds`` header): past it the proxy answers 408 and cancels the
    request, whatever became of its replica. Ray applies it only when it starts Serve;
    joining a cluster whose Serve runs already keeps that one's."""
    import signal
    import threading

    mistake = _ray_mistake(config, num_cpus, num_gpus, request_timeout_s)
    if mistake is not None:
        return _fail(mistake)
    try:
        ray = require("ray", "ray")
        serve = require("ray.serve", "ray")
    except ImportError as exc:
        return _fail(str(exc))
    actor: dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        actor["num_gpus"] = num_gpus
    try:
        apps = build_app(directories, config=config, replicas=replicas, ray_actor_options=actor)
    except OrtBatchError as exc:
        return _fail(str(exc))
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        return _fail(f"could not connect to the Ray cluster at {address!r}: {exc}")
    # after ray.init, which installs a SIGTERM handler of its own for the driver
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        http: dict[str, Any] = {"host": config.host, "port": config.port}
        if request_timeout_s is not None:
            http["request_timeout_s"] = request_timeout_s
        serve.start(http_options=http, proxy_location="HeadOnly")
        run(apps)
        for app in apps:
            where = f"http://{config.host}:{config.port}{app.route_prefix.rstrip('/')}"
            print(
                f"ortbatch serve: model {app.name!r} on Ray ({replicas} replica(s)); listening on {where}",
                file=sys.stderr,
                flush=True,
            )
        stop.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if address is None:
            serve.shutdown()
        else:
            for app in apps:
                serve.delete(app.name)
        ray.shutdown()
    print("ortbatch serve: stopped", file=sys.stderr, flush=True)
    return 0


def _fail(message: str) -> int:
    print(f"ortbatch serve: error: {message}", file=sys.stderr, flush=True)
    return 2


def _ray_mistake(config: ServeConfig, num_cpus: float, num_gpus: float, request_timeout_s: float | None) -> str | None:
    """What in the request cannot be served through Ray's proxy (None: nothing)."""
    if config.grpc_port is not None:
        return "--grpc-port is not served through Ray's proxy; use HTTP (KServe v2 and OpenAI routes)"
    if config.ssl_certfile is not None:
        return "--ssl-certfile with --ray: terminate TLS in front of Ray's proxy (e.g. the Kubernetes ingress)"
    if not 0 < config.port < 65536:
        return f"--ray needs a fixed --port (1-65535), got {config.port}"
    if not (0 < num_cpus < math.inf and 0 <= num_gpus < math.inf):  # NaN fails both
        return "--replica-cpus must be positive and --replica-gpus not negative"
    if request_timeout_s is not None and not 0 < request_timeout_s < math.inf:
        return f"--ray-request-timeout-s must be positive, got {request_timeout_s}"
    return None


def app_builder(args: dict[str, Any]) -> Any:
    """The application builder for Ray's config files and KubeRay's ``RayService``
    (``import_path: ortbatch.ray:app_builder``). ``args``: ``directory`` (the export, as
    the replicas' nodes see it), optionally ``replicas``, ``autoscaling``,
    ``ray_actor_options``, ``max_ongoing_requests``, ``deployment_options``, and any :class:`ServeConfig` field
    (``max_batch_size``, ``timeout_s``, ``api_key``, ...)."""
    rest = dict(args)
    try:
        directory = rest.pop("directory")
    except KeyError:
        raise OrtBatchError("ortbatch.ray:app_builder needs args.directory (the export directory)") from None
    own = ("replicas", "autoscaling", "ray_actor_options", "max_ongoing_requests", "deployment_options")
    kw = {k: rest.pop(k) for k in own if k in rest}
    fields = set(ServeConfig.__dataclass_fields__)
    unknown = sorted(set(rest) - fields)
    if unknown:
        raise OrtBatchError(f"ortbatch.ray:app_builder: unknown args {unknown} (ServeConfig fields: {sorted(fields)})")
    (app,) = build_app(directory, config=ServeConfig(**rest), **kw)
    return app.application
