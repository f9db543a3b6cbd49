"""Many models in one server: the model repository behind ``ortbatch serve DIR DIR ...``
and ``ortbatch serve --repository ROOT``.

Each model is an export directory served by its own :class:`~ortbatch.serve.ServedModel`
(one BatchedSession) or :class:`~ortbatch.serve.ServedGenerator` (one BatchedGenerator),
so requests to one model are batched together and never with another's. Names are the
folder names (``NAME=DIR`` overrides one); under ``--repository ROOT`` every subfolder
holding an ``ortbatch.json`` is a model, and a folder added later can be loaded by name.

Lifecycle, as Triton's model-control API speaks it (``POST /v2/repository/index``,
``.../models/{name}/load``, ``.../unload``):

* ``load`` of a model that is not loaded builds it, warms it up (one smallest request, so
  the first real request does not pay for lazy initialisation) and then serves it; a
  ``load`` of a loaded model is a reload: the new export is built while the old one keeps
  serving, then swapped in; requests already on the old one finish on it, and only then is
  it closed. A reload that fails leaves the old model serving (and says why).
* ``unload`` takes the model out at once (new requests get a 503 naming it) and returns
  after every request already on it has been answered and its session is closed.
* At startup every model is loaded in turn; one that fails is reported by name
  (``index`` shows ``UNAVAILABLE`` and the reason) while the others serve, unless
  ``strict``. ``/v2/health/ready`` is ready once every model has been through that
  startup load and at least one serves (a model loaded later does not make it unready).

Threads: models are not given fixed shares of the cores. Each model's sessions are sized
for the whole machine, as a single model's are (``cores // workers`` intra-op threads per
batch in flight, plus the every-core latency session), because an idle model costs no CPU:
its ONNX Runtime pools do not spin between runs (spinning is off when batches overlap and
stopped after each latency run). A model that is busy alone gets every core; models busy
at the same time share the cores through the OS scheduler. A fixed split would leave
cores idle whenever one model is quiet, which is most of the time for most mixes.

Threads: the repository is shared by the HTTP server's event loop and the gRPC server's
(``--grpc-port``), which run on different threads. Its bookkeeping (acquire/release, the
swap of a loaded model) is guarded by one lock, and ``load``/``unload`` run in a thread of
their own (they block on building and closing sessions anyway), serialised per model by a
thread lock, so they may be awaited from either loop. A caller that stops waiting (a
client that disconnects) does not cut a load or unload short: it completes, and the index
shows its result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InvalidInputError, ModelLoadFailedError, ModelNotFoundError, ModelUnavailableError, OrtBatchError
from ...manifest import MANIFEST_NAME
from ..config import ServeConfig
from .kinds import kind_of
from .loading import load_served
from .model import TEXT_MODEL_SUFFIX
from .servable import Servable

__all__ = [
    "LOADING",
    "LOAD_PARAMETERS",
    "READY",
    "UNAVAILABLE",
    "UNLOAD_PARAMETERS",
    "ModelRepository",
    "check_parameters",
    "discover",
    "parse_model_args",
]

log = logging.getLogger("ortbatch.serve")

READY = "READY"
LOADING = "LOADING"
UNAVAILABLE = "UNAVAILABLE"
#: the exporter's folder for an export whose checks failed (``X.failed``): never a repository model
FAILED_SUFFIX = ".failed"

#: parameters of Triton's load and unload requests this server takes (HTTP and gRPC): a
#: model is always loaded from its export directory, so ``config`` and ``file:...``
#: overrides are refused; ``unload_dependents`` has nothing to act on and is accepted.
LOAD_PARAMETERS: frozenset[str] = frozenset()
UNLOAD_PARAMETERS = frozenset({"unload_dependents"})


def check_parameters(names: Iterable[str], allowed: frozenset[str]) -> None:
    """Refuse (InvalidInputError) the parameters of a load/unload request not in ``allowed``."""
    unknown = sorted(set(names) - allowed)
    if unknown:
        raise InvalidInputError(
            f"parameters {unknown} are not supported (the model is loaded from its export directory)",
            input_name="parameters",
        )


def discover(root: str | Path) -> list[tuple[str, Path]]:
    """``(name, directory)`` for every subfolder of ``root`` holding an ``ortbatch.json``,
    sorted by name. ``X.failed`` folders are skipped (logged): the exporter leaves an export
    whose checks failed there for inspection, it is not a model to serve."""
    base = Path(root)
    if not base.is_dir():
        raise OrtBatchError(f"model repository {base} is not a directory")
    found = [d for d in sorted(base.iterdir()) if _holds_manifest(d)]
    for d in found:
        if d.name.endswith(FAILED_SUFFIX):
            log.warning("skipping %s: a failed export (its accuracy checks failed), not a model to serve", d)
    return [(d.name, d) for d in found if not d.name.endswith(FAILED_SUFFIX)]


def _holds_manifest(folder: Path) -> bool:
    """Whether ``folder`` is a folder holding an ``ortbatch.json``. One the server may not
    read (the root-only ``lost+found`` at the top of a mounted volume) holds none: skipped
    and logged, not a crash."""
    try:
        return folder.is_dir() and (folder / MANIFEST_NAME).is_file()
    except OSError as exc:
        log.warning("skipping %s: cannot read it (%s)", folder, exc.strerror or exc)
        return False


def parse_model_args(args: Sequence[str]) -> list[tuple[str, Path]]:
    """``DIR`` (named after the folder) or ``NAME=DIR`` items -> ``(name, directory)``;
    a name given twice is an error."""
    out: list[tuple[str, Path]] = []
    for arg in args:
        name, sep, rest = arg.partition("=")
        if sep and name and "/" not in name and not Path(arg).exists():
            path = Path(rest)
        else:
            name, path = "", Path(arg)
        out.append((name or (path.resolve().name or "model"), path))
    return _unique(out)


def _unique(models: Iterable[tuple[str, Path]]) -> list[tuple[str, Path]]:
    seen: dict[str, Path] = {}
    for name, path in models:
        if name in seen:
            raise OrtBatchError(f"two models are named {name!r} ({seen[name]} and {path}); name one NAME=DIR")
        seen[name] = path
    return list(seen.items())


@dataclass(eq=False)
class Loaded:
    """One loaded model: what serves it, the endpoints it serves (a kind of
    :func:`~.text_tasks.served_endpoints` -> ``""`` or why not), and the requests on it now."""

    served: Any
    endpoints: dict[str, str]
    in_flight: int = 0
    retired: bool = False
    #: set once retired and the last request on it has been released
    idle: threading.Event = field(default_factory=threading.Event)
    #: called once it is retired and closed (a front end tells the engine it let go)
    on_retired: Callable[[], None] | None = None

    def kind(self) -> str:
        """What the startup lines call it (its kind's ``index_label``: ``model``, ``generator``)."""
        return kind_of(self.served).index_label


@dataclass(eq=False)
class _Entry:
    name: str
    directory: Path
    state: str = UNAVAILABLE
    reason: str = "not loaded"
    loaded: Loaded | None = None
    #: serialises this model's loads and unloads (held while one builds or drains)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class ModelRepository:
    """The models one server serves, by name.

    Args:
        models: ``(name, export directory)`` pairs (see :func:`parse_model_args`).
        root: a repository folder: its model subfolders are added (:func:`discover`), and
            ``load`` of a name not yet known looks for ``root/name``.
        config: how each model's BatchedSession / BatchedGenerator is built (the
            ``ortbatch serve`` flags; default :class:`~ortbatch.serve.ServeConfig`).
        strict: :meth:`load_all` raises when any model fails to load.
        loader: ``loader(directory, name) -> served`` (default: what ``ortbatch serve``
            builds for the export); for tests and embedding applications.

    Call :meth:`load_all` before serving it (``ortbatch serve`` does).
    """

    models: Sequence[tuple[str, Path]] = ()
    root: Path | None = None
    config: ServeConfig | None = None
    strict: bool = False
    loader: Callable[[Path, str], Servable] | None = None
    name: str = "repository"
    _entries: dict[str, _Entry] = field(default_factory=dict, init=False)
    _retiring: set[Loaded] = field(default_factory=set, init=False)
    #: guards the bookkeeping shared by the HTTP and gRPC threads
    _mutex: threading.Lock = field(default_factory=threading.Lock, init=False)
    _closed: bool = field(default=False, init=False)
    _started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = ServeConfig()
        found = discover(self.root) if self.root is not None else []
        for name, path in _unique([*self.models, *found]):
            self._entries[name] = _Entry(name, Path(path))
        if not self._entries:
            where = f" under {self.root}" if self.root is not None else ""
            raise OrtBatchError(f"no models to serve{where} (a model is a folder holding {MANIFEST_NAME})")

    # -- loading -----------------------------------------------------------------------
    def _build(self, directory: Path, name: str) -> Loaded:
        """Load, warm up and wrap one export (blocking)."""
        assert self.config is not None
        if not directory.exists():
            raise OrtBatchError(f"{directory} does not exist")
        served = self.loader(directory, name) if self.loader is not None else load_served(directory, name, self.config)
        try:
            _warm_up(served)
            return self._wrap(served)
        except BaseException:
            served.close(drain=False)
            raise

    def _wrap(self, served: Any) -> Loaded:
        """``served`` as a loaded model, with the endpoints it serves."""
        return Loaded(served, kind_of(served).endpoints(served))

    def load_all(self) -> list[tuple[str, str]]:
        """Load every model (blocking, at startup); returns ``(name, reason)`` for each that
        failed. With ``strict`` the first failure closes what was loaded and raises."""
        failed = []
        for entry in self._entries.values():
            entry.state, entry.reason = LOADING, "loading"
            try:
                entry.loaded = self._build(entry.directory, entry.name)
            except Exception as exc:
                entry.state, entry.reason = UNAVAILABLE, f"failed to load: {exc}"
                log.warning("model %r (%s) failed to load: %s", entry.name, entry.directory, exc)
                if self.strict:
                    self.close(drain=False)
                    raise OrtBatchError(f"model {entry.name!r} ({entry.directory}) failed to load: {exc}") from exc
                failed.append((entry.name, str(exc)))
                continue
            entry.state, entry.reason = READY, ""
        self._started = True
        return failed

    async def load(self, name: str) -> None:
        """Load ``name``, or reload it from its directory if loaded (the old one serves
        until the new one is ready, then drains). Raises :class:`~ortbatch.errors.ModelLoadFailedError`
        when it cannot be loaded (a loaded model keeps serving),
        :class:`~ortbatch.errors.ModelNotFoundError` when there is no such model."""
        await _in_thread(self.load_now, name)

    async def unload(self, name: str) -> None:
        """Take ``name`` out of service; returns once its in-flight requests are answered
        and its session is closed. Unloading a model that is not loaded is a no-op."""
        await _in_thread(self.unload_now, name)

    def load_now(self, name: str) -> None:
        """:meth:`load`, blocking the calling thread."""
        with self._mutex:
            entry = self._entries.get(name)
        if entry is None:
            # only a direct child of the root: a name such as ".." must not reach outside it
            plain = name not in (".", "..") and not any(c in name for c in "/\\")
            path = self.root / name if self.root is not None and plain else None
            if path is not None and name.endswith(FAILED_SUFFIX):
                failed = f"a {FAILED_SUFFIX} folder is a failed export, not a model"
                raise ModelNotFoundError(f"unknown model {name!r}: {failed}")
            try:
                found = path is not None and (path / MANIFEST_NAME).is_file()
            except OSError:  # a name the filesystem cannot hold (ENAMETOOLONG over 255 bytes): no such folder
                found = False
            if path is None or not found:
                where = f" and {self.root} has no folder {name!r} with {MANIFEST_NAME}" if self.root else ""
                raise ModelNotFoundError(f"unknown model {name!r}: not in the repository{where}")
            with self._mutex:
                entry = self._entries.setdefault(name, _Entry(name, path))
        with entry.lock:
            old = entry.loaded
            if old is None:
                self._set_state(entry, LOADING, "loading")
            try:
                new = self._build(entry.directory, name)
            except Exception as exc:
                reason = f"failed to load: {exc}"
                if old is None:
                    self._set_state(entry, UNAVAILABLE, reason)
                log.warning("model %r failed to load: %s", name, exc)
                kept = "; the loaded model keeps serving" if old is not None else ""
                raise ModelLoadFailedError(f"model {name!r} {reason}{kept}") from None
            with self._mutex:
                closed = self._closed
                if not closed:
                    entry.loaded, entry.state, entry.reason = new, READY, ""
            if closed:
                new.served.close(False)
                raise ModelUnavailableError("the server is shutting down")
            if old is not None:
                self._retire_soon(old)

    def _set_state(self, entry: _Entry, state: str, reason: str) -> None:
        with self._mutex:  # the index reads both together, from another thread
            entry.state, entry.reason = state, reason

    def unload_now(self, name: str) -> None:
        """:meth:`unload`, blocking the calling thread."""
        with self._mutex:
            entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFoundError(f"unknown model {name!r}")
        with entry.lock:
            with self._mutex:
                old = entry.loaded
                entry.loaded, entry.state, entry.reason = None, UNAVAILABLE, "unloaded"
            if old is not None:
                self._retire(old)

    def _retire(self, old: Loaded) -> None:
        """Wait for the last request on ``old`` (no new one can reach it), then close it."""
        with self._mutex:
            old.retired = True
            self._retiring.add(old)
            if old.in_flight == 0:
                old.idle.set()
        try:
            old.idle.wait()
            old.served.close(True)
        finally:
            with self._mutex:
                self._retiring.discard(old)
            if old.on_retired is not None:
                old.on_retired()

    def _retire_soon(self, old: Loaded) -> None:
        threading.Thread(target=self._retire, args=(old,), name="ortbatch-retire", daemon=True).start()

    def install(self, name: str, directory: Path, loaded: Loaded | None, state: str, reason: str) -> None:
        """Serve ``loaded`` as ``name`` (a model built elsewhere: a front end's view of the
        engine's), or with None take ``name`` out of service, recording ``state`` and
        ``reason``; the model it replaces is retired on a thread of its own (closed once
        its last request is answered)."""
        with self._mutex:
            entry = self._entries.setdefault(name, _Entry(name, Path(directory)))
            old = entry.loaded
            entry.loaded, entry.state, entry.reason = loaded, state, reason
        if old is not None and old is not loaded:
            self._retire_soon(old)

    def states(self) -> list[tuple[str, Path, str, str]]:
        """``(name, directory, state, reason)`` of every model."""
        with self._mutex:
            return [(e.name, e.directory, e.state, e.reason) for e in self._entries.values()]

    # -- requests ----------------------------------------------------------------------
    def acquire(self, name: str) -> Loaded:
        """The loaded model ``name``, counted as in use until :meth:`release`
        (:class:`~ortbatch.errors.ModelNotFoundError` unknown,
        :class:`~ortbatch.errors.ModelUnavailableError` not loaded now)."""
        with self._mutex:
            entry = self._entries.get(name)
            if entry is None:
                raise ModelNotFoundError(f"unknown model {name!r}; this server serves {sorted(self._entries)}")
            loaded = entry.loaded
            if loaded is None or self._closed:
                raise ModelUnavailableError(f"model {name!r} is not available: {entry.reason}")
            loaded.in_flight += 1
            return loaded

    def release(self, loaded: Loaded) -> None:
        with self._mutex:
            loaded.in_flight -= 1
            if loaded.in_flight == 0 and loaded.retired:
                loaded.idle.set()

    def _snapshot(self) -> list[_Entry]:
        with self._mutex:  # a load on another thread may add an entry meanwhile
            return list(self._entries.values())

    def serving(self, endpoint: str) -> list[str]:
        """Names of the loaded models that serve ``endpoint`` (a key of
        :func:`~ortbatch.serve.served.text_tasks.served_endpoints`, or ``"completions"``)."""
        return [
            e.name for e in self._snapshot() if e.loaded is not None and e.loaded.endpoints.get(endpoint, "no") == ""
        ]

    def loaded(self) -> list[tuple[str, Loaded]]:
        return [(e.name, e.loaded) for e in self._snapshot() if e.loaded is not None]

    # -- views -------------------------------------------------------------------------
    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index: ``{name, version, state, reason}`` per model, and the
        text-in entry (``{name}_text``) of each model that has one."""
        with self._mutex:  # each entry's state, reason and model as one load or unload left them
            entries = [(e.name, e.state, e.reason, e.loaded) for e in self._entries.values()]
        out = []
        for name, state, reason, loaded in sorted(entries, key=lambda e: e[0]):
            if ready_only and state != READY:
                continue
            item: dict[str, Any] = {"name": name, "state": state, "reason": reason}
            if loaded is not None:
                item["version"] = getattr(loaded.served, "version", "1")
            out.append(item)
            text_name = getattr(loaded.served, "text_model_name", None) if loaded is not None else None
            if text_name is not None and text_name not in self._entries:
                out.append({**item, "name": text_name})
        return out

    def base_name(self, name: str) -> str:
        """The model that serves entry ``name`` (``minilm_text`` -> ``minilm``)."""
        if name not in self._entries and name.endswith(TEXT_MODEL_SUFFIX):
            base = name[: -len(TEXT_MODEL_SUFFIX)]
            if base in self._entries:
                return base
        return name

    @property
    def ready(self) -> bool:
        """Every model has been through its startup load (:meth:`load_all`) and at least one
        serves. A model loaded later (a new folder, a reload) does not make the server
        unready while it loads: the others keep serving, and so does a reloaded one."""
        states = [e.state for e in self._snapshot()]
        return self._started and not self._closed and READY in states

    @property
    def closed(self) -> bool:
        return self._closed

    def status_lines(self) -> list[str]:
        """One line per model, for the server's startup message."""
        lines = []
        for e in self._snapshot():
            if e.loaded is None:
                lines.append(f"model {e.name!r} ({e.directory}): {e.state}, {e.reason}")
                continue
            on = sorted(k for k, v in e.loaded.endpoints.items() if not v)
            lines.append(f"model {e.name!r} ({e.directory}): {e.state}, {e.loaded.kind()}; endpoints {on}")
        return lines

    def close(self, drain: bool = True) -> None:
        """Close every model (draining queued requests by default). Blocking."""
        with self._mutex:
            self._closed = True
            # the models being retired too: closing twice is harmless, and a server that
            # stops while a reload drains must not leave the old session's threads behind
            todo = [(e.name, e.loaded) for e in self._entries.values() if e.loaded is not None]
            todo += [("(retired)", old) for old in list(self._retiring)]
        for name, loaded in todo:
            try:
                loaded.served.close(drain)
            except Exception:  # one model's close must not keep the others open
                log.exception("closing model %r failed", name)


async def _in_thread(fn: Callable[[str], None], name: str) -> None:
    """Run ``fn(name)`` in a thread of its own and wait for it. Not the default executor:
    a load waiting for another load of the same model would hold one of its few threads.
    The wait is shielded, so a cancelled caller leaves the operation to finish."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            fn(name)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=run, name=f"ortbatch-repository-{fn.__name__.strip('_')}", daemon=True).start()
    waiting = asyncio.wrap_future(done)
    try:
        await asyncio.shield(waiting)
    except asyncio.CancelledError:
        # nobody will read the outcome now; say so instead of a "never retrieved" warning
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise


def _warm_up(served: Any) -> None:
    """Run one smallest request (its kind's ``warm_up``), so the model reports ready only after
    ONNX Runtime has run it once (and a broken export fails here, at load, not on a user's
    request)."""
    kind_of(served).warm_up(served)
