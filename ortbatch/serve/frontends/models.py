"""Several models over front-end processes: ``ortbatch serve DIR DIR ... --frontends N`` and
``ortbatch serve --repository ROOT --frontends N``.

The engine owns the :class:`~ortbatch.serve.served.repository.ModelRepository` (every model's
BatchedSession; loads, reloads and unloads), through :class:`EngineModels`. Each front
end serves a :class:`FrontEndRepository`: the same repository class, whose models are
views of the engine's (:meth:`~ortbatch.serve.frontends.proxy.ProxySession.for_model`),
so its HTTP and gRPC routes, errors and index are the one-process repository's.

* Each model the engine loads gets a **key**; a front end's request names it. A model is
  a BatchedSession (what a front end knows of it: :class:`~ortbatch.serve.frontends.proxy.SessionInfo`) or a
  BatchedGenerator (:class:`~ortbatch.serve.frontends.generation.GeneratorInfo`).
* The engine tells every front end of each change, as a :data:`Record` ``(name,
  directory, state, reason, key, info)``: at start, in the front end's spec; later, in a
  ``("model", *record)`` message after each load, reload or unload.
* A front end **holds** each model it was given: the engine counts the hold as one
  request in flight on that model, so a reload or an unload waits for it, until the front
  end says ``("released", key)``. It says so once it no longer serves that model and its
  own last request on it has been answered (or the engine lets go for it when it dies).
* A load or unload asked of a front end (HTTP or gRPC) goes to the engine as
  ``("load" | "unload", token, name)``; the engine does it, tells every front end the
  outcome, waits until each has applied it (``("sync", token)``, answered ``("synced",
  token)`` once everything before it is applied), then answers ``("reply", token,
  error)``: when the client gets its answer, every front end serves the outcome.
* An unload first tells every front end the model is gone (their new requests get 503),
  then unloads: that waits for every front end's release, so the requests they had
  already taken are answered before the session closes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import ModelNotFoundError, ModelUnavailableError, SessionClosedError
from ..config import ServeConfig
from ..served.kinds import kind_named, kind_of
from ..served.repository import READY, UNAVAILABLE, Loaded, ModelRepository
from .transport import decode_error, encode_error

__all__ = ["EngineModels", "FrontEndRepository", "KindInfo", "Record", "engine_side", "front_end_view"]

log = logging.getLogger("ortbatch.serve")

#: the longest a load or unload waits for the front ends to apply it before answering
_SYNC_TIMEOUT_S = 60.0


class KindInfo(NamedTuple):
    """What a front end knows of one engine model: its model kind's name and what the kind's
    :meth:`~ortbatch.serve.served.kinds.ModelKind.engine_side` said of it (a
    :class:`~ortbatch.serve.frontends.proxy.SessionInfo`, a
    :class:`~ortbatch.serve.frontends.generation.GeneratorInfo`)."""

    kind: str
    info: Any


class Record(NamedTuple):
    """One model as the engine tells a front end (it crosses the link as a plain tuple)."""

    name: str
    #: its export directory
    directory: str
    state: str
    reason: str
    #: the engine's key for it, None when it is not loaded
    key: int | None
    #: what the front end knows of its session or generator, None when it is not loaded
    info: KindInfo | None


def engine_side(served: Any) -> tuple[Any, KindInfo]:
    """What front ends reach of a served model in the engine, and what a front end must know
    of it, as its kind says (a ServedModel's BatchedSession, a ServedGenerator's
    BatchedGenerator)."""
    kind = kind_of(served)
    backend, info = kind.engine_side(served)
    return backend, KindInfo(kind.name, info)


def front_end_view(link: Any, key: int, info: KindInfo, directory: Path, name: str, config: ServeConfig) -> Any:
    """The front end's served model for the engine's model ``key``, as its kind stands in for
    it (a ServedModel over a :class:`~ortbatch.serve.frontends.proxy.ModelProxy`, a
    ServedGenerator over a :class:`~ortbatch.serve.frontends.generation.ProxyGenerator`)."""
    kind, inner = KindInfo(*info)
    return kind_named(kind).front_end_view(link, key, inner, directory, name, config)


class EngineModels:
    """The engine's side: which session each key names, and what each front end holds.

    ``sessions`` is the mapping every :class:`~ortbatch.serve.frontends.engine.FrontEndLink`
    looks keys up in; :meth:`attach`, :meth:`on_control` and :meth:`detach` are the links'
    hooks.
    """

    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository
        #: key -> the BatchedSession or BatchedGenerator it names (read by the links' reader threads)
        self.sessions: dict[int, Any] = {}
        self._keys: dict[Loaded, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: per link: what it was last told of each model (key or None, state, reason)
        self._given: dict[Any, dict[str, tuple[int | None, str, str]]] = {}
        #: per link: the models it holds, by key
        self._held: dict[Any, dict[int, Loaded]] = {}
        #: barriers (:meth:`_sync`): token -> the links that have not caught up yet
        self._syncing: dict[int, set[Any]] = {}
        self._synced = threading.Condition(self._lock)

    # -- the links' hooks --------------------------------------------------------------
    def attach(self, link: Any) -> list[Record]:
        """A new front end: every model's record for its spec (taking its holds); it is
        told of every change after this."""
        with self._lock:
            self._given[link], self._held[link] = {}, {}
            states = self._states()
            return [r for name in states if (r := self._offer(link, name, states)) is not None]

    def detach(self, link: Any) -> None:
        """A front end that is gone: let go of what it held."""
        with self._lock:
            held = self._held.pop(link, {})
            self._given.pop(link, None)
            for waiting in self._syncing.values():
                waiting.discard(link)
            self._synced.notify_all()
        for loaded in held.values():
            self.repository.release(loaded)
        self._sweep()

    def on_control(self, link: Any, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "released":
            with self._lock:
                loaded = self._held.get(link, {}).pop(msg[1], None)
            if loaded is not None:
                self.repository.release(loaded)
            self._sweep()
        elif kind == "synced":
            with self._lock:
                self._syncing.get(msg[1], set()).discard(link)
                self._synced.notify_all()
        elif kind in ("load", "unload"):
            _, token, name = msg
            # a load builds sessions and an unload waits for requests: never on the reader
            threading.Thread(
                target=self._change, args=(link, kind, token, name), name=f"ortbatch-engine-{kind}", daemon=True
            ).start()
        else:
            log.warning("engine: unknown message %r from a front end", kind)

    # -- changes -----------------------------------------------------------------------
    def _change(self, link: Any, kind: str, token: int, name: str) -> None:
        error: Exception | None = None
        try:
            if kind == "load":
                self.repository.load_now(name)
            else:
                self._gone_everywhere(name)
                self.repository.unload_now(name)  # waits for every front end's release
        except Exception as exc:
            error = exc
        try:
            told = self.publish(name)
            if told:
                self._sync(told)
        except Exception as exc:  # a bug here must not leave the asking client waiting forever
            log.exception("engine: cannot tell the front ends about model %r", name)
            error = error or exc
        finally:
            link.send([("reply", token, None if error is None else encode_error(error))])

    def _sync(self, links: list[Any]) -> None:
        """Wait until each of ``links`` has applied what it was told so far (or is gone),
        so a client finds the outcome on whichever front end it asks next."""
        with self._lock:
            token = next(self._ids)
            waiting = self._syncing[token] = set(links) & set(self._given)
            for link in waiting:
                link.send([("sync", token)])
            self._synced.wait_for(lambda: not waiting, timeout=_SYNC_TIMEOUT_S)
            del self._syncing[token]

    def _gone_everywhere(self, name: str) -> None:
        """Tell every front end that ``name`` no longer serves (before the unload waits)."""
        with self._lock:
            states = self._states()
            if name not in states:
                return  # unload_now says 404
            directory = states[name][0]
            for link, given in self._given.items():
                if given.get(name, (None,))[0] is not None:
                    given[name] = (None, UNAVAILABLE, "unloaded")
                    link.send([("model", name, directory, UNAVAILABLE, "unloaded", None, None)])

    def publish(self, name: str) -> list[Any]:
        """Tell every front end what ``name`` is now, where that changed; returns the
        links told."""
        told = []
        with self._lock:
            states = self._states()
            if name in states:
                for link in list(self._given):
                    record = self._offer(link, name, states)
                    if record is not None:
                        link.send([("model", *record)])
                        told.append(link)
        self._sweep()
        return told

    # -- bookkeeping (under the lock) --------------------------------------------------
    def _states(self) -> dict[str, tuple[str, str, str]]:
        return {n: (str(d), state, reason) for n, d, state, reason in self.repository.states()}

    def _offer(self, link: Any, name: str, states: dict[str, tuple[str, str, str]]) -> Record | None:
        """``name``'s record for ``link`` (holding the model for it), or None when the
        link was told exactly that already."""
        directory, state, reason = states[name]
        try:
            loaded: Loaded | None = self.repository.acquire(name)
        except (ModelNotFoundError, ModelUnavailableError):
            loaded = None
        given = self._given[link]
        if loaded is None:
            if given.get(name) == (None, state, reason):
                return None
            given[name] = (None, state, reason)
            return Record(name, directory, state, reason, None, None)
        backend, info = engine_side(loaded.served)
        key = self._keys.get(loaded)
        if key is None:
            key = self._keys[loaded] = next(self._ids)
            self.sessions[key] = backend
        if given.get(name) == (key, READY, ""):
            self.repository.release(loaded)  # it holds this one already
            return None
        given[name] = (key, READY, "")
        self._held[link][key] = loaded
        return Record(name, directory, READY, "", key, info)

    def _sweep(self) -> None:
        """Forget the keys of models retired with nothing left on them."""
        with self._lock:
            held = {loaded for h in self._held.values() for loaded in h.values()}
            for loaded, key in list(self._keys.items()):
                if loaded.retired and loaded not in held:
                    del self._keys[loaded]
                    self.sessions.pop(key, None)


@dataclass(eq=False)
class FrontEndRepository(ModelRepository):
    """A front end's repository: the engine's models, each a view over ``link``.

    Built from the records of the front end's spec; the engine's later ``model`` and
    ``reply`` messages (put in ``updates`` by the link's reader thread) are applied in
    order on a thread of this repository's. ``load``/``unload`` ask the engine.
    """

    link: Any = None
    records: list[Record] = field(default_factory=list)
    #: where the link's reader puts the engine's messages (give it to the ProxySession as
    #: ``on_message=updates.put`` so none that come before this is built are missed)
    updates: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    _views: dict[str, int | None] = field(default_factory=dict, init=False)
    _waiters: dict[int, tuple[threading.Event, list[Any]]] = field(default_factory=dict, init=False)
    _tokens: Any = field(default_factory=lambda: itertools.count(1), init=False)

    def __post_init__(self) -> None:
        self.models = [(r[0], Path(r[1])) for r in self.records]
        super().__post_init__()
        for record in self.records:
            self.apply(record)
        self._started = True  # the engine's startup load is done
        threading.Thread(target=self._apply_updates, name="ortbatch-frontend-models", daemon=True).start()

    # -- from the engine ---------------------------------------------------------------
    def _apply_updates(self) -> None:
        while True:
            msg = self.updates.get()
            if msg is None:
                return
            try:
                if msg[0] == "model":
                    self.apply(msg[1:])
                elif msg[0] == "sync":  # everything before it is applied
                    self.link.notify([("synced", msg[1])])
                elif msg[0] == "reply":
                    _, token, error = msg
                    waiter = self._waiters.pop(token, None)
                    if waiter is not None:
                        waiter[1].append(None if error is None else decode_error(*error))
                        waiter[0].set()
            except Exception:  # one bad update must not stop the later ones
                log.exception("front end: cannot apply the engine's %r message", msg[0])

    def apply(self, record: Record | tuple[Any, ...]) -> None:
        """Serve ``record``'s model (a view of the engine's), or take it out of service."""
        name, directory, state, reason, key, info = Record(*record)
        if key is not None and self._views.get(name) == key:
            return
        loaded = None
        if key is not None and info is not None:
            try:
                loaded = self._view(name, Path(directory), key, info)
            except Exception as exc:  # the engine loaded it, this process cannot serve it
                log.warning("front end: model %r cannot be served here: %s", name, exc)
                state, reason = UNAVAILABLE, f"failed to load in a front end: {exc}"
                self._release(key)
                key = None
        self._views[name] = key
        self.install(name, Path(directory), loaded, state, reason)

    def _view(self, name: str, directory: Path, key: int, info: KindInfo) -> Loaded:
        assert self.config is not None  # set by ModelRepository.__post_init__
        loaded = self._wrap(front_end_view(self.link, key, info, directory, name, self.config))
        loaded.on_retired = partial(self._release, key)
        return loaded

    def _release(self, key: int) -> None:
        self.link.notify([("released", key)])

    def engine_lost(self) -> None:
        """The engine is gone: loads and unloads waiting for it fail."""
        for token in list(self._waiters):
            waiter = self._waiters.pop(token, None)
            if waiter is not None:
                waiter[1].append(SessionClosedError("the engine process is gone"))
                waiter[0].set()

    # -- asked of this front end -------------------------------------------------------
    def load_now(self, name: str) -> None:
        """Ask the engine to load (or reload) ``name``; returns once this front end serves
        the outcome."""
        self._ask("load", name)

    def unload_now(self, name: str) -> None:
        """Ask the engine to unload ``name``; returns once every front end's requests on it
        are answered and its session is closed."""
        self._ask("unload", name)

    def _ask(self, kind: str, name: str) -> None:
        token = next(self._tokens)
        event, box = threading.Event(), list[Any]()
        self._waiters[token] = (event, box)
        if self.link.engine_gone:
            self._waiters.pop(token, None)
            raise SessionClosedError("the engine process is gone")
        self.link.notify([(kind, token, name)])
        event.wait()
        if box and box[0] is not None:
            raise box[0]

    def close(self, drain: bool = True) -> None:
        super().close(drain)
        self.updates.put(None)
