"""Model kinds: what each kind of export is served as, declared once and read by everything
that serves it.

A :class:`ModelKind` says, for one kind of export, everything the rest of ortbatch must know
of it: how it recognises an export from its manifest (:meth:`ModelKind.recognises`), how it
loads (:meth:`~ModelKind.load`) and how a front end stands in for it (``--frontends``:
:meth:`~ModelKind.engine_side`, :meth:`~ModelKind.front_end_view`), its HTTP routes, the
routes whose body names the model (:attr:`~ModelKind.body_routes`), its metrics, its gRPC
mapping, its OpenAPI operations and refusals, its request-field table, the startup line's
summary, what ``ortbatch generate`` does with it and which ``ortbatch run`` task computes it.
The transports, the repository, the front ends, Ray Serve, ``ortbatch run``, ``generate`` and
``serve`` read the declaration (:func:`kind_of` a served thing, :func:`kind_for_export` a
directory) instead of asking ``isinstance`` each on its own: a new kind is one declaration
and one :func:`register`, with no edit in a transport (as vLLM mounts its routes from a
model's ``supported_tasks`` and Triton's HTTP and gRPC read one model configuration).

This module is the core's registry and the declaration's shape; it imports no transport.
The two kinds ortbatch ships (``encoder``: :class:`~.model.ServedModel`, ``decoder``:
:class:`~.generator.ServedGenerator`) are declared whole in :mod:`ortbatch.serve.kinds`,
above the transports (their routes are the transports'), and registered by importing
``ortbatch.serve`` (which every import of a ``ortbatch.serve.*`` module does first).

Which kind an export is: the kinds that are not a fallback are asked first, in the order they
were registered; then the exports known and **not served yet** (:func:`declare_unserved`: an
encoder-decoder generation export, until its kind is registered); then the fallback kinds
(the encoder serves any other graph, as it always has). An export none of them takes is
refused by :class:`UnservedExportError`, one line naming what it is and which kinds exist.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from ...errors import UnsupportedModelError
from ...manifest import MANIFEST_NAME, Manifest

__all__ = [
    "BODY_ROUTES",
    "ExportFacts",
    "ModelKind",
    "UnservedExportError",
    "declare_unserved",
    "kind_for_export",
    "kind_named",
    "kind_of",
    "owner_of",
    "register",
    "registered",
    "unregister",
]


class UnservedExportError(UnsupportedModelError):
    """No registered kind serves this export (``serve``, ``generate`` and ``run`` refuse it):
    the message names what it is and which kinds exist. A bad argument on the command line
    (exit 2), as :class:`~ortbatch.commands._target.TargetError`."""

    exit_code = 2


@dataclass(frozen=True)
class ExportFacts:
    """What the kinds recognise an export by: its directory, its manifest (None without
    ``ortbatch.json``: an optimum export or a bare graph) and the ONNX files in it."""

    directory: Path

    @classmethod
    def of(cls, directory: str | Path) -> ExportFacts:
        return cls(Path(directory))

    @cached_property
    def manifest(self) -> Manifest | None:
        if not (self.directory / MANIFEST_NAME).is_file():
            return None
        return Manifest.load(self.directory)

    @property
    def source(self) -> Mapping[str, Any]:
        return self.manifest.source if self.manifest is not None else {}

    @property
    def task(self) -> str | None:
        """The export's task (``source.task`` of its manifest), else None."""
        task = self.source.get("task")
        return task if isinstance(task, str) else None

    @cached_property
    def onnx_files(self) -> frozenset[str]:
        if not self.directory.is_dir():
            return frozenset()
        return frozenset(p.name for p in self.directory.glob("*.onnx"))

    @cached_property
    def config(self) -> Mapping[str, Any]:
        """The model's ``config.json`` (empty when there is none or it is not JSON)."""
        try:
            data = json.loads((self.directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def describe(self) -> str:
        """What the export is, in the words of a refusal: its task and main graph."""
        parts = [f"task {self.task!r}"] if self.task else []
        if self.manifest is not None:
            parts.append(f"graph {self.manifest.model}")
        elif self.onnx_files:
            parts.append("graphs " + ", ".join(sorted(self.onnx_files)))
        return f"{self.directory} ({', '.join(parts)})" if parts else str(self.directory)


class ModelKind:
    """One kind of export, declared once. Subclass it, set the class attributes, override
    what the kind serves, and :func:`register` an instance.

    The defaults say "nothing": no routes, no gRPC inference, no ``generate``, no bulk task,
    so a kind only spells out what it offers. ``served`` below is what :meth:`load` returns
    (an instance of :attr:`served_type`); ``body`` the server's
    :class:`~ortbatch.serve.http.plumbing.BodyLimits`.
    """

    #: the kind's name (in ``serve``'s refusals and the repository's startup lines)
    name: ClassVar[str] = ""
    #: what an export of this kind is, after "is" ("an encoder export")
    description: ClassVar[str] = ""
    #: the class :meth:`load` returns (:func:`kind_of` finds the kind of a served thing by it)
    served_type: ClassVar[type] = object
    #: asked last, after every other kind and the unserved exports (the encoder)
    fallback: ClassVar[bool] = False
    #: routes whose JSON body names the model (a repository dispatches them by it): path ->
    #: endpoint (an endpoint of :meth:`endpoints`); another kind's app refuses them (400)
    body_routes: ClassVar[Mapping[str, str]] = {}
    #: the word the repository's startup lines use for a loaded model of this kind
    index_label: ClassVar[str] = "model"
    #: the ``ortbatch run`` task family that computes it (``bulk.dispatch.task_for``), None: not run
    bulk_task: ClassVar[str | None] = None

    # -- recognising and loading --------------------------------------------------------------
    def recognises(self, export: ExportFacts) -> bool:
        """Whether this kind serves ``export``."""
        raise NotImplementedError

    def load(
        self,
        directory: Path,
        name: str | None,
        config: Any,
        session_options: Callable[[bool], Any] | None = None,
    ) -> Any:
        """What the export serves as, built with ``config``'s settings (a
        :class:`~ortbatch.serve.config.ServeConfig`); ``session_options(generation)``, when
        given, makes the ONNX Runtime session options (Ray sizes threads to a replica)."""
        raise NotImplementedError

    def warm_up(self, served: Any) -> None:
        """Run one smallest request before the repository says the model is ready."""

    # -- what it serves ------------------------------------------------------------------------
    def endpoints(self, served: Any) -> dict[str, str]:
        """Body-routed endpoint -> ``""`` when ``served`` serves it, else why not."""
        return dict.fromkeys(self.body_routes.values(), "")

    def summary(self, served: Any) -> str:
        """What ``serve``'s startup line says is served (``model 'name' (SUMMARY)``)."""
        return self.description

    def text_view(self, served: Any) -> Any:
        """The ``{name}_text`` entry answering beside ``served`` (None: none)."""
        return None

    def version(self, served: Any, found: Any) -> str:
        """The version entry ``found`` (``served`` or its text view) answers as."""
        return str(getattr(found, "version", "1"))

    def kserve_metadata(self, served: Any, entries: Any) -> dict[str, Any]:
        """Entry name -> its KServe v2 metadata, for the OpenAPI infer examples (none: no
        infer route)."""
        return {}

    def request_fields(self, served: Any) -> Mapping[str, frozenset[str]]:
        """Route -> the JSON fields its requests may carry (besides ``model``)."""
        return {}

    def generate(self, directory: Path, args: Any) -> int:
        """``ortbatch generate DIR PROMPT...`` (its exit code); the default refuses."""
        raise UnservedExportError(f"{directory} is {self.description}: `ortbatch generate` takes {_generating()}")

    def bulk_source(self, path: Path, options: Any, batch_rows: int) -> Any:
        """The rows ``ortbatch run`` reads from ``path`` when the kind reads inputs of its own
        (a folder of images: a :class:`~ortbatch.bulk.sources.Source`-like object); None: the
        ordinary JSONL/CSV/Parquet source."""
        return None

    def make_bulk_task(self, export_dir: Path, options: Any) -> Any:
        """The ``ortbatch run`` task of a kind that brings its own (None: the bulk task family
        :attr:`bulk_task` names, built by ``ortbatch.bulk``)."""
        return None

    # -- transports -----------------------------------------------------------------------------
    def http_routes(self, served: Any, body: Any) -> list[Any]:
        """The HTTP routes serving ``served`` (health, ``/v1/models`` and ``/metrics`` are
        every app's)."""
        return []

    def operations(self) -> Mapping[tuple[str, str], Any]:
        """``(METHOD, path)`` -> its OpenAPI ``Operation`` (``http.openapi_schemas``), for
        routes the shared table does not describe; in the document of a model of this kind
        alone, they describe its routes in place of the shared table's (an image export's
        ``/v1/embeddings``)."""
        return {}

    def schemas(self) -> Mapping[str, Any]:
        """OpenAPI schemas :meth:`operations` refer to, by name (in the documents of servers
        holding a model of this kind)."""
        return {}

    def metrics(self, served: Any) -> Any:
        """The app's :class:`~ortbatch.serve.metrics.ServerMetrics` with ``served``'s counters."""
        from ..metrics import ServerMetrics

        return ServerMetrics()

    def collector(self, served: Any) -> Any:
        """The Prometheus collector of ``served``'s runtime counters in a repository's
        ``/metrics`` (None: none)."""
        return None

    def refusal(self, path: str, name: str, owner: ModelKind) -> str:
        """What a body-routed ``path`` of kind ``owner`` answers (400) when it names a model
        of this kind, alone or in a repository."""
        return f"{path}: model {name!r} is {self.description}; {path} is served by {owner.description}"

    def openapi_refusal(self, served: Any, method: str, path: str, endpoints: Mapping[str, str]) -> str:
        """Why ``served``'s app mounts ``method path`` only to refuse it (``""``: it serves it)."""
        endpoint = BODY_ROUTES.get(path)
        if endpoint is None:
            return ""
        owner = owner_of(endpoint)
        if owner is not self:
            return f"served by {owner.description}"
        return endpoints.get(endpoint, "")

    def grpc_model(self, found: Any) -> Any:
        """What answers the gRPC inference RPCs for entry ``found`` (``served`` or its text
        view): itself by default (a v2 model with ``metadata()`` and ``infer``)."""
        return found

    # -- behind --frontends ---------------------------------------------------------------------
    def engine_side(self, served: Any) -> tuple[Any, Any]:
        """What front ends reach of ``served`` in the engine (its session or generator), and
        what a front end must know of it (picklable)."""
        raise UnsupportedModelError(f"{self.description} is not served behind --frontends")

    def front_end_view(self, link: Any, key: int, info: Any, directory: Path, name: str, config: Any) -> Any:
        """A front end's served model over the engine's model ``key``."""
        raise UnsupportedModelError(f"{self.description} is not served behind --frontends")

    def __repr__(self) -> str:
        return f"<model kind {self.name!r}>"


def _generating() -> str:
    names = [k.description for k in _KINDS if type(k).generate is not ModelKind.generate]
    return " or ".join(names) or "no registered kind"


#: registered kinds, in registration order
_KINDS: list[ModelKind] = []


@dataclass(frozen=True)
class _Unserved:
    what: str
    serving: str
    recognises: Callable[[ExportFacts], bool]


_UNSERVED: list[_Unserved] = []


def register(kind: ModelKind) -> ModelKind:
    """Add ``kind`` (replacing a kind of the same name); returns it."""
    if not kind.name:
        raise ValueError(f"{type(kind).__name__} has no name")
    unregister(kind.name)
    _KINDS.append(kind)
    return kind


def unregister(name: str) -> ModelKind | None:
    """Take the kind ``name`` out (None when there was none)."""
    for kind in _KINDS:
        if kind.name == name:
            _KINDS.remove(kind)
            return kind
    return None


def registered() -> tuple[ModelKind, ...]:
    return tuple(_KINDS)


def kind_named(name: str) -> ModelKind:
    for kind in _KINDS:
        if kind.name == name:
            return kind
    raise KeyError(f"no model kind {name!r}; registered: {_names()}")


def declare_unserved(what: str, serving: str, recognises: Callable[[ExportFacts], bool]) -> None:
    """Exports ``recognises`` takes are refused (``X is WHAT: SERVING is not served yet``)
    unless a registered kind that is not a fallback takes them first."""
    _UNSERVED.append(_Unserved(what, serving, recognises))


def _names() -> str:
    return ", ".join(f"{k.name} ({k.description})" for k in _KINDS) or "none"


def _in_order() -> Iterator[ModelKind]:
    yield from (k for k in _KINDS if not k.fallback)
    yield from (k for k in _KINDS if k.fallback)


def kind_for_export(directory: str | Path) -> ModelKind:
    """The kind that serves the export in ``directory``; :class:`UnservedExportError` when
    none does."""
    export = ExportFacts.of(directory)
    for kind in _KINDS:
        if not kind.fallback and kind.recognises(export):
            return kind
    for unserved in _UNSERVED:
        if unserved.recognises(export):
            raise UnservedExportError(
                f"{export.describe()} is {unserved.what}: {unserved.serving} is not served yet; "
                f"the kinds served are: {_names()}"
            )
    for kind in _KINDS:
        if kind.fallback and kind.recognises(export):
            return kind
    raise UnservedExportError(f"no model kind serves {export.describe()}; the kinds served are: {_names()}")


def kind_of(served: Any) -> ModelKind:
    """The kind of a served thing (what a kind's :meth:`~ModelKind.load` returned): the one
    place that asks a served object's class."""
    for kind in _in_order():
        if isinstance(served, kind.served_type):
            return kind
    raise TypeError(f"{type(served).__name__} is no registered model kind's; registered: {_names()}")


def owner_of(endpoint: str) -> ModelKind:
    """The kind whose body routes serve ``endpoint``."""
    for kind in _KINDS:
        if endpoint in kind.body_routes.values():
            return kind
    raise KeyError(endpoint)


class _BodyRoutes(Mapping[str, str]):
    """Every registered kind's :attr:`~ModelKind.body_routes`, in registration order (read
    live: a kind registered later adds its own)."""

    def _merged(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind in _KINDS:
            for path, endpoint in kind.body_routes.items():
                out.setdefault(path, endpoint)
        return out

    def __getitem__(self, path: str) -> str:
        return self._merged()[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())


#: routes whose model is named in the JSON body -> endpoint (a repository dispatches them)
BODY_ROUTES: Mapping[str, str] = _BodyRoutes()


#: an encoder-decoder export's task (``ortbatch export --task``, optimum's names)
SEQ2SEQ_TASKS = frozenset(
    {"text2text-generation", "text2text-generation-with-past", "seq2seq-lm", "seq2seq-lm-with-past"}
)


def _is_seq2seq(export: ExportFacts) -> bool:
    """An encoder-decoder export: its manifest's task or family says so, or (optimum's export,
    no manifest) an encoder graph beside decoder graphs."""
    if export.task in SEQ2SEQ_TASKS or export.source.get("family") == "seq2seq":
        return True
    files = export.onnx_files
    return "encoder_model.onnx" in files and any(f.startswith("decoder_") for f in files)


#: a speech-recognition export's task (Whisper: ``ortbatch export`` writes the with-past one)
SPEECH_TASKS = frozenset({"automatic-speech-recognition", "automatic-speech-recognition-with-past"})


def _is_speech(export: ExportFacts) -> bool:
    """A speech-recognition export (Whisper): its manifest's task or family says so, or its
    ``config.json`` is a Whisper model's."""
    return (
        export.task in SPEECH_TASKS
        or export.source.get("family") == "speech-seq2seq"
        or export.config.get("model_type") == "whisper"
    )


# asked in this order: a Whisper export is also an encoder-decoder one, and its refusal says more
declare_unserved("a speech-recognition (Whisper) export", "speech recognition", _is_speech)
declare_unserved("an encoder-decoder (seq2seq) export", "encoder-decoder generation", _is_seq2seq)
