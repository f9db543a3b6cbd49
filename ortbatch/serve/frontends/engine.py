"""The engine: ``ortbatch serve DIR --frontends N`` (N >= 2).

This process loads the export and owns its one BatchedSession or BatchedGenerator (one
queue, so batching stays global), or every model of a repository
(:mod:`~ortbatch.serve.frontends.models`). It binds the HTTP socket and reserves the gRPC
port, then starts N front-end processes (``spawn``: never a fork of a process that runs
ONNX Runtime's threads) that serve on them (:mod:`~ortbatch.serve.frontends.frontend`).

Per front end, one :class:`FrontEndLink`: a reader thread takes its frames and submits
each request straight to ``BatchedSession.submit`` / ``submit_many`` / ``submit_each``
(the feeds are views of the request arena, not copies) or ``BatchedGenerator.submit``,
and a sender thread writes the answers (outputs into the response arena; a generation's
tokens and Completion in the frame) as they complete, every answer ready at that moment
in one frame.

Supervision: a front end that dies is restarted (backoff 0.5 s doubling to 10 s, reset
after it has run 30 s); its requests still queued are cancelled (dropped unrun), those
already running have their results discarded, and its arenas go with it. The others are
untouched. SIGTERM/SIGINT: each front end stops accepting, answers what it received and
reports its counts; then the session drains and closes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from ...errors import SessionClosedError
from ...runtime.scheduler import Slot
from ...runtime.session import BatchedSession
from ..assembly import ExitCounts, announce, exit_report, say, served_summary, with_grpc
from ..config import ServeConfig
from ..listen import bind_socket, reserve_port, url_of, warn_if_exposed
from ..served.loading import load_served
from ..served.repository import ModelRepository
from .dealer import ConnectionDealer, channel_pair
from .frontend import FrontEndSpec, run_frontend
from .models import EngineModels, engine_side
from .transport import Arena, BlockAllocator, FrameReader, encode_error, pack_tensors, unpack_tensors, write_frame

__all__ = ["FrontEndLink", "serve_frontends"]

log = logging.getLogger("ortbatch.serve")

#: bytes of shared memory per front end per direction (touched pages only are backed)
ARENA_BYTES = 256 * 1024 * 1024
_START_TIMEOUT_S = 120.0
_BACKOFF_S = (0.5, 10.0)
_HEALTHY_AFTER_S = 30.0


class FrontEndLink:
    """The engine's side of one front end: its socket, arenas and requests in flight.

    ``sessions``: the session the front end's requests go to, or a mapping from model key
    to session (a repository's models; the engine updates it as models load).
    ``on_control(link, message)`` gets the front end's repository requests (``load``,
    ``unload``, ``released``), on the reader thread; ``on_drop(link)`` is called once the
    front end is gone.
    """

    def __init__(
        self,
        sessions: Any,
        sock: socket.socket,
        requests: Arena,
        responses: Arena,
        *,
        on_control: Callable[[FrontEndLink, tuple[Any, ...]], None] | None = None,
        on_drop: Callable[[FrontEndLink], None] | None = None,
    ) -> None:
        self.sessions: Mapping[int, Any] = sessions if isinstance(sessions, Mapping) else {0: sessions}
        self.on_control = on_control
        self.on_drop = on_drop
        self.sock = sock
        self.requests = requests
        self.responses = responses
        self._resp_alloc = BlockAllocator(responses.size)
        self.inflight: dict[int, Any] = {}
        self.ready = threading.Event()
        self.pid: int | None = None
        self.counts: dict[str, Any] | None = None
        #: the front end's latest tally of its counts (its "bye" may never come: a SIGKILL)
        self.tally: dict[str, Any] | None = None
        self.closed = threading.Event()
        self._drop_lock = threading.Lock()
        #: requests still in the engine when the front end went away (dropped or discarded)
        self.dropped = 0
        self._cond = threading.Condition()
        self._out: list[tuple[Any, ...]] = []
        self._reader = FrameReader(sock)
        self._threads = [
            threading.Thread(target=self._read_loop, name="ortbatch-engine-reader", daemon=True),
            threading.Thread(target=self._send_loop, name="ortbatch-engine-sender", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- from the front end --------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                frame = self._reader.read()
                if frame is None:
                    break
                messages, payload = frame
                runs: list[tuple[Any, ...]] = []
                for msg in messages:
                    if msg[0] == "run":  # a frame's runs are queued together (one wake-up)
                        runs.append(msg)
                        continue
                    if runs:
                        self._submit_runs(runs, payload)
                        runs = []
                    self._handle(msg, payload)
                if runs:
                    self._submit_runs(runs, payload)
        except Exception:
            log.exception("engine: a front end's message could not be handled; dropping the front end")
        finally:
            self.drop()

    def _handle(self, msg: tuple[Any, ...], payload: bytearray) -> None:
        kind = msg[0]
        if kind == "run":
            _, key, rid, names, specs, timeout_s = msg
            self._submit(key, [rid], names, [specs], timeout_s, payload, many=False)
        elif kind == "many":
            _, key, rids, names, specs, timeout_s = msg
            self._submit(key, rids, names, specs, timeout_s, payload, many=True)
        elif kind == "gen":
            _, key, rid, request, stream = msg
            self._generate(key, rid, request, stream)
        elif kind == "cancel":
            fut = self.inflight.get(msg[1])
            if fut is not None:
                fut.cancel()  # False once it runs: its answer comes and is discarded there
        elif kind == "free":
            for block in msg[1]:
                self._resp_alloc.free(block)
        elif kind == "stats":
            _, token, key = msg
            session = self.sessions.get(key)
            self._post(("msg", ("stats", token, session.stats() if session is not None else None)))
        elif kind == "ready":
            self.pid = msg[1]
            self.ready.set()
        elif kind == "bye":
            self.counts = msg[1]
        elif kind == "tally":
            self.tally = msg[1]
        elif self.on_control is not None:
            self.on_control(self, msg)

    def _session(self, key: int) -> Any:
        session = self.sessions.get(key)
        if session is None:  # a model unloaded meanwhile (a front end holds none it was not given)
            raise SessionClosedError("the model is no longer loaded; the request was not run")
        return session

    def _submit(
        self, key: int, rids: list[int], names: Any, specs: list[Any], timeout_s: Any, payload: bytearray, many: bool
    ) -> None:
        try:
            session = self._session(key)
            feeds = [dict(unpack_tensors(s, self.requests, payload, copy=False)) for s in specs]
            if many:
                futures = session.submit_many(feeds, names, timeout_s=timeout_s)
            else:
                futures = [session.submit(feeds[0], names, timeout_s=timeout_s)]
        except Exception as exc:
            for rid in rids:
                self._post(("err", rid, exc))
            return
        for rid, fut in zip(rids, futures, strict=True):
            self._track(rid, fut)

    def _submit_runs(self, runs: list[tuple[Any, ...]], payload: bytearray) -> None:
        """Single requests of one frame, each admitted or refused on its own (those of
        one model together)."""
        by_key: dict[int, list[tuple[Any, ...]]] = {}
        for msg in runs:
            by_key.setdefault(msg[1], []).append(msg)
        for key, group in by_key.items():
            try:
                session = self._session(key)
            except Exception as exc:
                for msg in group:
                    self._post(("err", msg[2], exc))
                continue
            self._submit_each(session, group, payload)

    def _submit_each(self, session: Any, runs: list[tuple[Any, ...]], payload: bytearray) -> None:
        submit_each = getattr(session, "submit_each", None)
        if submit_each is None:  # a duck-typed session: one by one
            for msg in runs:
                self._handle(msg, payload)
            return
        items = []
        for _, _key, rid, names, specs, timeout_s in runs:
            try:
                feed = dict(unpack_tensors(specs, self.requests, payload, copy=False))
            except Exception as exc:
                self._post(("err", rid, exc))
                continue
            items.append((rid, (feed, names, timeout_s)))
        if not items:
            return
        # a BatchedSession settles an _Answer per request, which posts itself: no Future,
        # Condition or done-callback each; in flight before it is queued (it may settle
        # at once)
        answers = [_Answer(self, rid) for rid, _ in items] if isinstance(session, BatchedSession) else None
        if answers is not None:
            for answer in answers:
                self.inflight[answer.rid] = answer
        batch = [item for _, item in items]
        try:
            outcomes = submit_each(batch) if answers is None else submit_each(batch, slots=answers)
        except Exception as exc:
            for rid, _ in items:
                self.inflight.pop(rid, None)
                self._post(("err", rid, exc))
            return
        for (rid, _), outcome in zip(items, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self.inflight.pop(rid, None)
                self._post(("err", rid, outcome))
            elif answers is None:
                self._track(rid, outcome)

    def _generate(self, key: int, rid: int, request: tuple[Any, ...], stream: bool) -> None:
        """A generation request for the generator ``key``: ``admitted`` once queued, a
        ``tok`` per token when streamed, then its Completion (``done``) or its error."""
        prompt, params, timeout_s = request
        on_token = partial(self._token, rid) if stream else None
        try:
            generator = self._session(key)
            if params.n == 1:
                fut = generator.submit(prompt, params=params, timeout_s=timeout_s, on_token=on_token)
            else:  # n choices, prefilled once, answer together
                fut = _all_of(generator.submit_choices(prompt, params=params, timeout_s=timeout_s, on_token=on_token))
        except Exception as exc:
            self._post(("err", rid, exc))
            return
        self._post(("msg", ("admitted", rid)))
        self._track(rid, fut, "gen")

    def _token(self, rid: int, token: Any) -> None:
        # on the generator's thread, before its future settles: the order is kept
        self._post(("msg", ("tok", rid, token)))

    def _track(self, rid: int, fut: Any, kind: str = "fut") -> None:
        """A request in the engine: its answer goes back when ``fut`` is done."""
        self.inflight[rid] = fut
        fut.add_done_callback(partial(self._done, rid, kind))

    def _done(self, rid: int, kind: str, fut: Any) -> None:
        self._post((kind, rid, fut))

    def _post(self, item: tuple[Any, ...]) -> None:
        with self._cond:
            self._out.append(item)
            if len(self._out) == 1:
                self._cond.notify()

    # -- to the front end ----------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._out:
                    if self.closed.is_set():
                        if not self.inflight:
                            return
                        # a dead front end's running requests: wait for them to finish
                        self._cond.wait(0.5)
                        if not self._out:
                            continue
                        break
                    self._cond.wait()
                items, self._out = self._out, []
            if self.closed.is_set():
                # the front end is gone: nothing to tell it; results are discarded
                for item in items:
                    if item[0] in ("fut", "gen"):
                        self.inflight.pop(item[1], None)
                if not self.inflight:
                    return
                continue
            messages: list[Any] = []
            payload = bytearray()
            for item in items:
                kind = item[0]
                if kind == "msg":
                    messages.append(item[1])
                    continue
                rid = item[1]
                if kind == "err":
                    messages.append(("err", rid, encode_error(item[2])))
                    continue
                fut = item[2]
                self.inflight.pop(rid, None)
                if fut.cancelled():
                    messages.append(("gone", rid))
                    continue
                exc = fut.exception()
                if exc is not None:
                    messages.append(("err", rid, encode_error(exc)))
                    continue
                if kind == "gen":
                    messages.append(("done", rid, fut.result()))
                    continue
                outs = fut.result()
                specs, block = pack_tensors((("", o) for o in outs), self.responses, self._resp_alloc, payload)
                messages.append(("ok", rid, specs, block))
            try:
                write_frame(self.sock, messages, payload)
            except OSError:
                self.drop()

    def send(self, messages: list[Any]) -> None:
        """Queue control messages (e.g. ``("stop",)``) for the front end."""
        for m in messages:
            self._post(("msg", m))

    def drop(self) -> None:
        """The front end closed its end or died: drop what it still has queued."""
        with self._drop_lock:
            if self.closed.is_set():
                return
            self.closed.set()
        self.dropped = len(self.inflight)
        for fut in list(self.inflight.values()):
            fut.cancel()
        with self._cond:
            self._cond.notify()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader if it still waits
        except OSError:
            pass
        self._reader.close()
        self.sock.close()
        self.requests.close()
        self.responses.close()
        if self.on_drop is not None:
            self.on_drop(self)


class _Answer(Slot):
    """One request's outcome in the engine in place of a ``Future``: the BatchedSession
    (a worker, the deadline reaper, ``close``) settles it, and it posts itself to its
    link's sender, with the methods of a done Future that the sender reads."""

    __slots__ = ("_link", "rid")

    def __init__(self, link: FrontEndLink, rid: int) -> None:
        super().__init__()
        self._link = link
        self.rid = rid

    def _on_settled(self) -> None:
        self._link._post(("fut", self.rid, self))

    #: a cancel is posted the same way (under the slot's lock: posting takes only the link's)
    _on_cancelled = _on_settled

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        return self._result


class _FrontEnd:
    """One front-end slot: its current process and link, restarted when it dies."""

    def __init__(self, index: int, start: Callable[[int], tuple[Any, FrontEndLink, socket.socket]]) -> None:
        self.index = index
        self._start = start
        self.process: Any = None
        self.link: FrontEndLink | None = None
        #: the engine's end of the channel its HTTP connections are dealt over
        self.channel: socket.socket | None = None
        self.started_at = 0.0
        self.failures = 0
        self.restart_at: float | None = None
        #: restarted, and "restarted" not yet said (it is once the new process serves)
        self.announce = False
        self.counts: list[dict[str, Any]] = []

    def start(self) -> None:
        self.close_channel()
        self.process, self.link, self.channel = self._start(self.index)
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def serving(self) -> bool:
        """Whether it serves now (started, ready, its link open): connections go to it.
        Read from the dealer's thread, so it asks nothing of the process itself."""
        link = self.link
        return self.restart_at is None and link is not None and link.ready.is_set() and not link.closed.is_set()

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


@dataclass(eq=False)
class _Engine:
    """What the engine serves (one export, or a repository through :class:`EngineModels`),
    and how it starts a front-end process over it."""

    directory: str | Path | ModelRepository
    config: ServeConfig
    #: what is closed at the end: the served model, or the repository
    closer: Any
    #: what the startup line says is served
    what: str
    #: the sessions (or generators) the links look keys up in
    sessions: Any
    #: one export's session (or generator) info (None for a repository: each model's goes in its record)
    info: Any = None
    name: str | None = None
    models: EngineModels | None = None
    grpc_port: int | None = None

    @classmethod
    def load(cls, directory: str | Path | ModelRepository, config: ServeConfig) -> _Engine:
        if isinstance(directory, ModelRepository):
            directory.load_all()  # strict: raises, having closed what it loaded
            models = EngineModels(directory)
            return cls(directory, config, directory, served_summary(directory), models.sessions, models=models)
        served = load_served(directory, config.name, config)
        sessions, info = engine_side(served)
        return cls(directory, config, served, served_summary(served), sessions, info, served.name)

    def start(self, index: int) -> tuple[Any, FrontEndLink, socket.socket]:
        """Start front end ``index``: its process, its link, and the channel its
        connections are dealt through."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        deal_ours, deal_theirs = channel_pair()
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        requests = Arena.create(ARENA_BYTES, f"ortbatch-fe{index}-requests")
        responses = Arena.create(ARENA_BYTES, f"ortbatch-fe{index}-responses")
        models = self.models
        hooks: dict[str, Any] = {}
        if models is not None:
            hooks = {"on_control": models.on_control, "on_drop": models.detach}
        link = FrontEndLink(self.sessions, ours, requests, responses, **hooks)
        spec = FrontEndSpec(
            index=index,
            directory=str(self.directory) if models is None else "",
            name=self.name or "",
            config=self.config,
            info=self.info,
            connections=deal_theirs,
            control=theirs,
            requests=requests.handle,
            responses=responses.handle,
            grpc_port=self.grpc_port,
            models=models.attach(link) if models is not None else None,
        )
        proc = multiprocessing.get_context("spawn").Process(
            target=run_frontend, args=(spec,), name=f"ortbatch-frontend-{index}", daemon=False
        )
        # the child starts with SIGINT ignored (it installs its own handler), so a Ctrl-C
        # while it is still importing is no KeyboardInterrupt traceback
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, old)
        theirs.close()
        deal_theirs.close()
        return proc, link, deal_ours

    def announce(self, slots: list[_FrontEnd], url: str) -> None:
        config = self.config
        host = f"[{config.host}]" if ":" in config.host else config.host
        address = f"{host}:{self.grpc_port}" if self.grpc_port is not None else None
        pids = ", ".join(str(s.process.pid) for s in slots)
        if self.models is not None:
            over = "one engine (one session per model)"
        else:
            over = f"one {type(self.sessions).__name__}"
        processes = f"{len(slots)} front-end processes (pids {pids}) over {over}"
        what = with_grpc(self.what, address, config.ssl_certfile is not None)
        announce(self.closer, what, url, before=[processes])


def _reserve_grpc(config: ServeConfig, sock: socket.socket, closer: Any) -> socket.socket | None:
    """The gRPC port the front ends share (None without gRPC); on a failure the HTTP
    socket and ``closer`` are closed."""
    try:
        return reserve_port(config.host, config.grpc_port) if config.grpc_port is not None else None
    except BaseException:
        sock.close()
        closer.close(drain=False)
        raise


def serve_frontends(directory: str | Path | ModelRepository, config: ServeConfig) -> int:
    """``ortbatch serve DIR`` (or a model repository: several models, ``--repository``)
    with ``config.frontends`` front-end processes; returns the exit code as
    :func:`~ortbatch.serve.server.serve` does."""
    warn_if_exposed(config)
    # bound before loading: a port in use is said at once, not after the model has loaded
    sock = bind_socket(config.host, config.port, config.backlog)
    try:
        engine = _Engine.load(directory, config)
    except BaseException:
        sock.close()
        raise
    grpc_hold = _reserve_grpc(config, sock, engine.closer)
    engine.grpc_port = grpc_hold.getsockname()[1] if grpc_hold is not None else None
    stopping = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    slots = [_FrontEnd(i + 1, engine.start) for i in range(config.frontends)]
    dealer = ConnectionDealer(sock, lambda: [s.channel for s in slots if s.serving and s.channel is not None])
    code = 0
    try:
        for slot in slots:
            slot.start()
        dealer.start()
        if not _wait_ready(slots, stopping):
            code = 1
        else:
            engine.announce(slots, url_of(sock, config.ssl_certfile is not None))
            _supervise(slots, stopping)
    finally:
        dealer.stop()
        sock.close()  # new connections are refused from here; the front ends drain theirs
        _stop_all(slots, config.graceful_timeout_s)
        for s, h in previous.items():
            signal.signal(s, h)
        if grpc_hold is not None:
            grpc_hold.close()
        engine.closer.close(drain=True)
    return _report(slots, config.graceful_timeout_s) if code == 0 else code


def _wait_ready(slots: list[_FrontEnd], stopping: threading.Event) -> bool:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not all(s.link is not None and s.link.ready.is_set() for s in slots):
        for s in slots:
            if s.process.exitcode is not None:
                say(f"error: front end {s.index} exited while starting (exit code {s.process.exitcode})")
                return False
        if stopping.is_set():
            return False
        if time.monotonic() > deadline:
            say(f"error: the front ends did not start within {_START_TIMEOUT_S:g} s")
            return False
        time.sleep(0.02)
    return True


def _supervise(slots: list[_FrontEnd], stopping: threading.Event) -> None:
    """Until told to stop: restart a front end that died, with backoff."""
    from multiprocessing.connection import wait

    while not stopping.is_set():
        live = [s.process.sentinel for s in slots if s.restart_at is None]
        if live:
            wait(live, timeout=0.1)
        else:
            stopping.wait(0.1)
        now = time.monotonic()
        for s in slots:
            if stopping.is_set():
                return
            if s.restart_at is None and s.process.exitcode is not None:
                code = s.process.exitcode
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                s.failures = 0 if now - s.started_at > _HEALTHY_AFTER_S else s.failures + 1
                delay = min(_BACKOFF_S[0] * 2 ** max(s.failures - 1, 0), _BACKOFF_S[1])
                if s.link is not None:
                    s.link.drop()
                    s.counts += _final_counts(s.link)
                dropped = s.link.dropped if s.link is not None else 0
                say(
                    f"front end {s.index} (pid {s.process.pid}) died ({how}); {dropped} request(s) it held "
                    f"were dropped; restarting it in {delay:g} s"
                )
                s.process.join(0)
                s.restart_at = now + delay
            elif s.restart_at is not None and now >= s.restart_at:
                s.start()
                s.announce = True
            elif s.announce and s.link is not None and s.link.ready.is_set():
                # said once it serves (the loop keeps watching the others meanwhile)
                s.announce = False
                say(f"front end {s.index} restarted (pid {s.process.pid})")


def _stop_all(slots: list[_FrontEnd], grace: float | None) -> None:
    """Tell every front end to stop, wait for them to answer what they hold and exit."""
    for s in slots:
        if s.process is not None and s.process.exitcode is None and s.link is not None:
            s.link.send([("stop",)])
    limit = time.monotonic() + (grace if grace is not None else 3600.0) + 15.0
    for s in slots:
        if s.process is None:
            continue
        s.process.join(max(limit - time.monotonic(), 0.1))
        if s.process.exitcode is None:
            say(f"front end {s.index} (pid {s.process.pid}) did not stop; killing it")
            s.process.kill()
            s.process.join(5)
        if s.link is not None:
            s.link.closed.wait(5)  # its reader has seen the end of the stream (and the counts)
            s.link.drop()
            if s.restart_at is None:
                s.counts += _final_counts(s.link)
        s.close_channel()


def _final_counts(link: FrontEndLink) -> list[dict[str, Any]]:
    """A front end's share of the exit report once it is gone: its "bye", or when it died
    without one (killed), its last tally, with the requests the engine dropped for it (and any
    it had not answered) counted as lost with it."""
    if link.counts is not None:
        return [link.counts]
    if link.tally is None:
        return []
    last = dict(link.tally)
    settled = int(last.get("answered", 0)) + int(last.get("abandoned", 0))
    lost = max(int(last.get("accepted", 0)) - settled, link.dropped)
    last["accepted"] = settled + lost
    last["lost"] = lost
    last["grpc_lost"] = int(last.get("grpc_accepted", 0)) - int(last.get("grpc_answered", 0))
    return [last]


def _report(slots: list[_FrontEnd], grace: float | None) -> int:
    """The exit report (:func:`~ortbatch.serve.assembly.exit_report`) over every front
    end's counts, each one's share named."""
    totals = ExitCounts()
    per = []
    started = True
    for s in slots:
        if not s.counts:
            started = False
        for c in s.counts:
            for k in vars(totals):
                setattr(totals, k, getattr(totals, k) + int(c.get(k, 0)))
        mine = sum(int(c.get("accepted", 0)) + int(c.get("grpc_accepted", 0)) for c in s.counts)
        per.append(f"{s.index}: {mine}")
    return exit_report(totals, started=started, grace=grace, grpc=True, by_front_end=", ".join(per))


def _all_of(futures: list[Any]) -> concurrent.futures.Future[Any]:
    """A future of every one of ``futures``' results (the first error fails it; cancelling it
    cancels them all)."""
    whole: concurrent.futures.Future[Any] = concurrent.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_fut: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
        try:
            if failed is not None:
                whole.set_exception(failed.exception())
            elif any(f.cancelled() for f in futures):
                whole.cancel()
            elif last:
                whole.set_result([f.result() for f in futures])
        except concurrent.futures.InvalidStateError:
            pass  # settled already (by another choice, or cancelled by the front end)

    def cancel_all(done: Any) -> None:
        if done.cancelled():
            for f in futures:
                f.cancel()

    whole.add_done_callback(cancel_all)
    for f in futures:
        f.add_done_callback(one_done)
    return whole
