"""One front-end process: the same HTTP app and gRPC service as ``ortbatch serve``, with
a :class:`~ortbatch.serve.frontends.proxy.ProxySession` where the BatchedSession was.

It loads the export's tokenizer and config, never the model (no ONNX Runtime session,
no second copy of the weights). It serves the HTTP connections the engine accepts and
deals it (:mod:`.dealer`) and the gRPC port the engine reserved (SO_REUSEPORT). It stops when the
engine says so (or on SIGTERM/SIGINT: Ctrl-C reaches every process of the group),
answers what it has received, reports its counts and exits; if the engine goes away it
fails what it holds with 503 / UNAVAILABLE and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import OrtBatchError
from ..assembly import app_for, grpc_server_for
from ..config import ServeConfig
from ..http.connection import uvicorn_config
from .dealer import adopting_server
from .models import FrontEndRepository, KindInfo, Record, front_end_view
from .proxy import ProxySession
from .transport import Arena, ArenaHandle

__all__ = ["FrontEndSpec", "run_frontend"]

log = logging.getLogger("ortbatch.serve")

# after the engine is gone, the longest a front end takes to answer what it holds and exit
_ORPHAN_EXIT_S = 5.0


@dataclass
class FrontEndSpec:
    """Everything a front-end process is started with (pickled by ``multiprocessing``;
    the sockets and arenas travel as file descriptors)."""

    index: int
    directory: str
    name: str
    config: ServeConfig
    info: KindInfo | None
    #: where the engine deals this front end its HTTP connections (``dealer``)
    connections: socket.socket
    control: socket.socket
    requests: ArenaHandle
    responses: ArenaHandle
    grpc_port: int | None
    #: several models (a repository): each one's record; None: the one export
    #: ``directory`` (named ``name``, with ``info``)
    models: list[Record] | None = None


class _FrontEndCollector:
    """``ortbatch_frontend{index,pid} 1``: which front end answered this scrape."""

    def __init__(self, index: int) -> None:
        self._index = str(index)
        self._pid = str(os.getpid())

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily(
            "ortbatch_frontend", "The front-end process that answered (--frontends)", labels=["index", "pid"]
        )
        g.add_metric([self._index, self._pid], 1)
        yield g


def run_frontend(spec: FrontEndSpec) -> None:
    """The front end's main (the target of its process)."""
    try:
        code = _run(spec)
    except KeyboardInterrupt:  # Ctrl-C before the handlers were in place
        code = 0
    sys.stderr.flush()
    os._exit(code)


class _Stop:
    """How this front end stops: on SIGTERM/SIGINT, on the engine's ``("stop",)``, or
    when the engine is gone (then it exits on its own after :data:`_ORPHAN_EXIT_S`)."""

    def __init__(self, spec: FrontEndSpec) -> None:
        self.spec = spec
        self.event = threading.Event()
        self.server: Any = None
        self.grpc: Any = None
        self.repository: FrontEndRepository | None = None

    def __call__(self, *_: Any) -> None:
        self.event.set()
        if self.server is not None:
            self.server.should_exit = True
        if self.grpc is not None:
            self.grpc.stop_soon(self.spec.config.graceful_timeout_s)

    def engine_lost(self) -> None:
        if self.event.is_set():
            return
        print(
            f"ortbatch serve: front end {self.spec.index} (pid {os.getpid()}): the engine process is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        self()
        if self.repository is not None:
            self.repository.engine_lost()
        threading.Timer(_ORPHAN_EXIT_S, os._exit, (1,)).start()


def _run(spec: FrontEndSpec) -> int:
    stop = _Stop(spec)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)
    # a repository's model updates, kept from the first frame on (one export gets none)
    updates: queue.SimpleQueue[Any] = queue.SimpleQueue()
    proxy = ProxySession(
        spec.control,
        None,  # each model's info comes through for_model
        Arena(spec.requests),
        Arena(spec.responses),
        on_engine_lost=stop.engine_lost,
        on_message=updates.put if spec.models is not None else None,
    )
    proxy.on_stop = stop
    try:
        app = _assemble(spec, proxy, updates, stop)
    except OrtBatchError as exc:
        print(f"ortbatch serve: front end {spec.index}: error: {exc}", file=sys.stderr, flush=True)
        proxy.shutdown()
        return 2
    if stop.event.is_set():
        stop()
    server, grpc_server = stop.server, stop.grpc

    def say_ready() -> None:
        while not server.started and not stop.event.is_set():
            time.sleep(0.01)
        if server.started:
            proxy.notify([("ready", os.getpid())])

    def tally() -> None:
        # the counts so far, told to the engine as they change: a front end killed before its
        # "bye" still has its requests in the exit report (up to the last tally)
        told = None
        while not stop.event.wait(_TALLY_S):
            now = _counts(server, app, grpc_server)
            if now != told:
                proxy.notify([("tally", now)])
                told = now

    threading.Thread(target=say_ready, name="ortbatch-frontend-ready", daemon=True).start()
    threading.Thread(target=tally, name="ortbatch-frontend-tally", daemon=True).start()
    server.run(sockets=[])
    if grpc_server is not None:
        grpc_server.stop(spec.config.graceful_timeout_s)
    proxy.shutdown([("bye", _counts(server, app, grpc_server))])
    return 0


#: seconds between a front end's tallies of its counts to the engine (when they changed)
_TALLY_S = 0.5


def _counts(server: Any, app: Any, grpc_server: Any) -> dict[str, Any]:
    """What this front end took and settled so far (its exit report's share)."""
    counts = app.state.counts
    rpc = grpc_server.counts if grpc_server is not None else None
    return {
        "started": bool(server.started),
        "accepted": counts.accepted,
        "answered": counts.answered,
        "abandoned": counts.abandoned,
        "grpc_accepted": rpc.accepted if rpc else 0,
        "grpc_answered": rpc.answered if rpc else 0,
    }


def _assemble(spec: FrontEndSpec, proxy: ProxySession, updates: queue.SimpleQueue[Any], stop: _Stop) -> Any:
    """What this front end serves (a view of the engine's model, or a repository of such
    views), its app, uvicorn server and gRPC server (kept on ``stop``); returns the app."""
    config = spec.config
    served: Any
    if spec.models is None:
        assert spec.info is not None
        served = front_end_view(proxy, 0, spec.info, Path(spec.directory), spec.name, config)
    else:
        served = stop.repository = FrontEndRepository(link=proxy, records=spec.models, updates=updates, config=config)
    app = app_for(served, config)
    app.state.metrics.registry.register(_FrontEndCollector(spec.index))
    stop.server = adopting_server(uvicorn_config(app, config), spec.connections)
    stop.grpc = grpc_server_for(served, dataclasses.replace(config, grpc_port=spec.grpc_port), app, reuse_port=True)
    return app
