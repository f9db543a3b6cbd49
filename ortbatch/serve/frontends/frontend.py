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
from types import FrameType
from typing import Any

from ...errors import OrtBatchError
from ..assembly import app_for, grpc_server_for
from ..http.connection import uvicorn_config
from .dealer import adopting_server
from .generation import GeneratorFace
from .models import FrontEndRepository, Record, front_end_view
from .proxy import ProxySession, SessionFace
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
    config: Any  # ServeConfig
    face: SessionFace | GeneratorFace | None
    #: where the engine deals this front end its HTTP connections (``dealer``)
    connections: socket.socket
    control: socket.socket
    requests: ArenaHandle
    responses: ArenaHandle
    grpc_port: int | None
    #: several models (a repository): each one's record; None: the one export
    #: ``directory`` (named ``name``, with ``face``)
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


def _run(spec: FrontEndSpec) -> int:
    stop = threading.Event()
    state: dict[str, Any] = {}

    def request_stop(*_: Any) -> None:
        stop.set()
        server = state.get("server")
        if server is not None:
            server.should_exit = True
        grpc = state.get("grpc")
        if grpc is not None:
            grpc.stop_soon(spec.config.graceful_timeout_s)

    def on_signal(sig: int, frame: FrameType | None) -> None:
        request_stop()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)

    config = spec.config

    def engine_lost() -> None:
        if stop.is_set():
            return
        print(
            f"ortbatch serve: front end {spec.index} (pid {os.getpid()}): the engine process is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        request_stop()
        repository = state.get("repository")
        if repository is not None:
            repository.engine_lost()
        threading.Timer(_ORPHAN_EXIT_S, os._exit, (1,)).start()

    # a repository's model updates, kept from the first frame on (one export gets none)
    updates: queue.SimpleQueue[Any] = queue.SimpleQueue()
    proxy = ProxySession(
        spec.control,
        None,  # the models' faces come through for_model
        Arena(spec.requests),
        Arena(spec.responses),
        on_engine_lost=engine_lost,
        on_message=updates.put if spec.models is not None else None,
    )
    proxy.on_stop = request_stop
    try:
        served: Any
        if spec.models is None:
            assert spec.face is not None
            served = front_end_view(proxy, 0, spec.face, Path(spec.directory), spec.name, config)
        else:
            served = state["repository"] = FrontEndRepository(
                link=proxy, records=spec.models, updates=updates, config=config
            )
        app = app_for(served, config)
        app.state.metrics.registry.register(_FrontEndCollector(spec.index))
        server = adopting_server(uvicorn_config(app, config), spec.connections)
        state["server"] = server
        grpc_server = grpc_server_for(
            served, dataclasses.replace(config, grpc_port=spec.grpc_port), app, reuse_port=True
        )
        if grpc_server is not None:
            state["grpc"] = grpc_server
    except OrtBatchError as exc:
        print(f"ortbatch serve: front end {spec.index}: error: {exc}", file=sys.stderr, flush=True)
        proxy.shutdown()
        return 2
    if stop.is_set():
        request_stop()

    def announce() -> None:
        while not server.started and not stop.is_set():
            time.sleep(0.01)
        if server.started:
            proxy.notify([("ready", os.getpid())])

    threading.Thread(target=announce, name="ortbatch-frontend-ready", daemon=True).start()
    server.run(sockets=[])
    if grpc_server is not None:
        grpc_server.stop(config.graceful_timeout_s)
    counts = app.state.counts
    rpc = grpc_server.counts if grpc_server is not None else None
    proxy.shutdown(
        [
            (
                "bye",
                {
                    "started": bool(server.started),
                    "accepted": counts.accepted,
                    "answered": counts.answered,
                    "abandoned": counts.abandoned,
                    "grpc_accepted": rpc.accepted if rpc else 0,
                    "grpc_answered": rpc.answered if rpc else 0,
                },
            )
        ]
    )
    return 0
