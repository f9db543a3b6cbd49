"""``ortbatch.json``: the contract between the exporter and the runtime.

Written by :func:`ortbatch.export_model` next to ``model.onnx``; read by
:class:`~ortbatch.BatchedSession`, ``validate``, ``bench`` and ``serve``. It says
everything the runtime must know to batch a model safely::

    {"format": 1, "model": "model.onnx",
     "source": {"model": "...", "task": "feature-extraction", "versions": {...}},
     "inputs":  {"input_ids": {"dtype": "int64", "axes": ["batch", "sequence"], "pad": 0}},
     "outputs": {"last_hidden_state": {"axes": ["batch", "sequence", null]}},
     "padding_side": "right",
     "limits": {"max_batch_size": 64, "max_sequence_length": 512},
     "providers": [...], "validation": {"passed": true, "report": "validation.json"}}

Axis names: ``"batch"`` marks the batch axis (always axis 0); any other string is
a *ragged* axis: inputs sharing that name are padded to the batch's longest, and
outputs carrying the same name are trimmed back per request. ``null`` is an axis
that is fixed or must not be touched.

Integrity: the exporter records each ONNX file's sha256 under
``components.<name>.sha256``. :meth:`Manifest.verify` is the one check every loader
(``validate``, :class:`~ortbatch.BatchedSession`, :class:`~ortbatch.BatchedGenerator`,
``serve``) runs: it refuses a model whose bytes changed since the export
(:class:`~ortbatch.errors.ModelIntegrityError`) and warns loudly
(:class:`UnvalidatedExportWarning`) about an export whose checks failed.

Only the standard library is used here so the runtime stays light.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ManifestError, ModelIntegrityError

__all__ = [
    "BATCH_AXIS",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SKIP_VERIFY_ENV",
    "InputSpec",
    "Manifest",
    "OutputSpec",
    "UnvalidatedExportWarning",
    "file_hash",
    "model_hash",
]

MANIFEST_NAME = "ortbatch.json"
FORMAT_VERSION = 1
BATCH_AXIS = "batch"
# Set to 1 to load a model whose sha256 no longer matches its manifest (at your own risk).
SKIP_VERIFY_ENV = "ORTBATCH_SKIP_VERIFY"


class UnvalidatedExportWarning(UserWarning):
    """The export's recorded checks failed (``validation.passed`` is false): its outputs
    may be wrong. ``ortbatch validate DIR`` says which check and by how much."""


_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "string",
    }
)


@dataclass(frozen=True)
class InputSpec:
    """One model input: its dtype, the role of each axis, and its padding value."""

    dtype: str
    axes: tuple[str | None, ...]
    pad: float | int | bool = 0

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "axes": list(self.axes), "pad": self.pad}


@dataclass(frozen=True)
class OutputSpec:
    """One model output: the role of each axis (``None`` for an untouched axis)."""

    axes: tuple[str | None, ...]
    dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"axes": list(self.axes)}
        if self.dtype is not None:
            d["dtype"] = self.dtype
        return d


@dataclass
class Manifest:
    """The parsed contents of ``ortbatch.json``. ``directory`` is where it was read from."""

    model: str = "model.onnx"
    inputs: dict[str, InputSpec] = field(default_factory=dict)
    outputs: dict[str, OutputSpec] = field(default_factory=dict)
    padding_side: str = "right"
    limits: dict[str, int] = field(default_factory=dict)
    providers: list[Any] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT_VERSION
    directory: Path | None = None

    # -- derived -------------------------------------------------------------------
    @property
    def model_path(self) -> Path:
        base = self.directory if self.directory is not None else Path(".")
        return base / self.model

    @property
    def max_batch_size(self) -> int | None:
        return self.limits.get("max_batch_size")

    @property
    def max_sequence_length(self) -> int | None:
        return self.limits.get("max_sequence_length")

    @property
    def runtime(self) -> dict[str, Any]:
        """Runtime settings chosen by ``ortbatch tune`` (``workers``, ``max_batch_size``,
        ``max_batch_tokens``), used by BatchedSession and ``ortbatch serve`` where the
        caller does not set them; ``{}`` when the export was not tuned."""
        value = self.extra.get("runtime") or {}
        where = f"{self.directory / MANIFEST_NAME}" if self.directory else MANIFEST_NAME
        if not isinstance(value, dict):
            raise ManifestError(f"{where}: 'runtime' must be an object, got {type(value).__name__}")
        out: dict[str, Any] = {}
        for key in ("workers", "max_batch_size", "max_batch_tokens"):
            v = value.get(key)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ManifestError(f"{where}: runtime.{key} must be a positive integer, got {v!r}")
            out[key] = v
        return out

    @property
    def pad_values(self) -> dict[str, float | int | bool]:
        return {name: spec.pad for name, spec in self.inputs.items()}

    # -- integrity -----------------------------------------------------------------
    def verify(self, *, skip: bool | None = None, warn: bool = True) -> Manifest:
        """Check the export before it is loaded; returns ``self`` so loaders can write
        ``Manifest.load(d).verify()``.

        * Each ONNX file whose sha256 the export recorded must still have it, else
          :class:`~ortbatch.errors.ModelIntegrityError` (the bytes changed: damaged
          disk, a partial copy, an edit). Hashing is done once per process for a file
          of a given size and mtime, so loading the same export again costs a ``stat``.
          ``skip=True`` (or ``ORTBATCH_SKIP_VERIFY=1`` in the environment) skips it.
        * An export whose checks failed (``validation.passed`` is false) is loaded
          with an :class:`UnvalidatedExportWarning` (``warn=False``: not, for the
          checks themselves, which are about to run again).
        """
        if skip is None:
            skip = os.environ.get(SKIP_VERIFY_ENV, "").strip().lower() not in ("", "0", "false", "no")
        if not skip:
            self._verify_contract()
            for name, path, expected in self._recorded_hashes():
                _verify_file(name, path, expected)
        if warn and self.validation.get("passed") is False:
            report = self.validation.get("report") or "validation.json"
            warnings.warn(
                UnvalidatedExportWarning(
                    f"{self.directory}: this export FAILED its accuracy checks (ortbatch.json says "
                    f"validation.passed=false; see {report}); its outputs may be wrong. Re-export it, or run "
                    f"`ortbatch validate {self.directory}` to see which check failed"
                ),
                stacklevel=2,
            )
        return self

    def _verify_contract(self) -> None:
        """The top-level ``model``, ``inputs`` and ``outputs`` are what the runtime pads,
        casts and trims by; the exporter read them from the graph and recorded them again
        next to the graph's sha256 (``components.<name>``). An edit of one (a dtype, an
        axis, an output removed, ``model`` pointed at another file) would batch the model
        by a contract it does not have: refused, naming the field."""
        components = self.extra.get("components")
        if not isinstance(components, dict) or not components:
            return  # an export written before components were recorded: nothing to compare
        where = self.directory / MANIFEST_NAME if self.directory is not None else Path(MANIFEST_NAME)
        main = [
            (str(name), comp)
            for name, comp in components.items()
            if isinstance(comp, dict) and comp.get("model") == self.model
        ]
        if not main:
            raise ModelIntegrityError(
                f"{where}: 'model' is {self.model!r}, which is not one of the files the export recorded "
                f"(components: {sorted(str(c.get('model')) for c in components.values() if isinstance(c, dict))}); "
                "the manifest was edited after the export. Re-export it",
                path=where,
            )
        name, comp = main[0]
        for section, current in (("inputs", self.inputs), ("outputs", self.outputs)):
            recorded = comp.get(section)
            if not isinstance(recorded, dict):
                continue
            now = {k: v.to_dict() for k, v in current.items()}
            for key in sorted(set(recorded) | set(now)):
                if key not in now:
                    problem = f"{section}.{key} is missing"
                elif key not in recorded:
                    problem = f"{section}.{key} is not an {section[:-1]} of {self.model}"
                elif now[key] != recorded[key]:
                    fields_ = sorted(
                        f for f in set(now[key]) | set(recorded[key]) if now[key].get(f) != recorded[key].get(f)
                    )
                    problem = "; ".join(
                        f"{section}.{key}.{f} is {now[key].get(f)!r} but the export recorded "
                        f"{recorded[key].get(f)!r} (components.{name}.{section}.{key}.{f})"
                        for f in fields_
                    )
                else:
                    continue
                raise ModelIntegrityError(
                    f"{where}: {problem}; the manifest was edited after the export and no longer describes "
                    f"{self.model}. Re-export it, or set {SKIP_VERIFY_ENV}=1 to load it anyway",
                    path=where,
                )

    def _recorded_hashes(self) -> list[tuple[str, Path, str]]:
        base = self.directory if self.directory is not None else Path(".")
        components = self.extra.get("components")
        found = []
        if isinstance(components, dict):
            for name, comp in components.items():
                if (
                    isinstance(comp, dict)
                    and isinstance(comp.get("sha256"), str)
                    and isinstance(comp.get("model"), str)
                ):
                    found.append((str(name), base / comp["model"], comp["sha256"]))
        return found

    # -- (de)serialisation ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": self.format,
            "model": self.model,
            "source": self.source,
            "inputs": {k: v.to_dict() for k, v in self.inputs.items()},
            "outputs": {k: v.to_dict() for k, v in self.outputs.items()},
            "padding_side": self.padding_side,
            "limits": self.limits,
            "providers": self.providers,
            "validation": self.validation,
        }
        if self.generation:
            d["generation"] = self.generation
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, data: Any, directory: Path | None = None) -> Manifest:
        where = f"{directory / MANIFEST_NAME}" if directory else MANIFEST_NAME
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
        fmt = data.get("format")
        if not isinstance(fmt, int):
            raise ManifestError(f"{where}: 'format' must be an integer, got {fmt!r}")
        if fmt > FORMAT_VERSION:
            raise ManifestError(
                f"{where}: format {fmt} is newer than this ortbatch understands ({FORMAT_VERSION}); upgrade ortbatch"
            )
        model = data.get("model", "model.onnx")
        if not isinstance(model, str) or not model:
            raise ManifestError(f"{where}: 'model' must be a file name, got {model!r}")
        inputs = {n: _input_spec(where, n, s) for n, s in _mapping(where, data, "inputs").items()}
        outputs = {n: _output_spec(where, n, s) for n, s in _mapping(where, data, "outputs").items()}
        side = data.get("padding_side", "right")
        if side not in ("left", "right"):
            raise ManifestError(f"{where}: padding_side must be 'left' or 'right', got {side!r}")
        limits = _mapping(where, data, "limits")
        for key, value in limits.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ManifestError(f"{where}: limits.{key} must be a positive integer, got {value!r}")
        providers = data.get("providers", [])
        if not isinstance(providers, list):
            raise ManifestError(f"{where}: 'providers' must be a list, got {type(providers).__name__}")
        known = {
            "format",
            "model",
            "source",
            "inputs",
            "outputs",
            "padding_side",
            "limits",
            "providers",
            "validation",
            "generation",
        }
        manifest = cls(
            model=model,
            inputs=inputs,
            outputs=outputs,
            padding_side=side,
            limits={k: v for k, v in limits.items() if v is not None},
            providers=providers,
            source=_mapping(where, data, "source"),
            validation=_mapping(where, data, "validation"),
            generation=_mapping(where, data, "generation"),
            extra={k: v for k, v in data.items() if k not in known},
            format=fmt,
            directory=directory,
        )
        manifest.runtime  # noqa: B018 - validates the tuned settings now, not at first use
        return manifest

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Manifest:
        """Read ``DIR/ortbatch.json``; :class:`ManifestError` if absent or malformed."""
        d = Path(directory)
        path = d / MANIFEST_NAME
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ManifestError(f"no {MANIFEST_NAME} in {d}: is this an ortbatch export directory?") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, directory=d)

    def save(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write ``ortbatch.json`` atomically into ``directory`` (default: where it was read)."""
        d = Path(directory) if directory is not None else self.directory
        if d is None:
            raise ManifestError("Manifest.save needs a directory")
        d.mkdir(parents=True, exist_ok=True)
        path = d / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        self.directory = d
        return path


def _mapping(where: str, data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: '{key}' must be an object, got {type(value).__name__}")
    return value


def _axes(where: str, what: str, axes: Any) -> tuple[str | None, ...]:
    if not isinstance(axes, list) or not all(a is None or isinstance(a, str) for a in axes):
        raise ManifestError(f"{where}: {what}.axes must be a list of names or nulls, got {axes!r}")
    if not axes or axes[0] != BATCH_AXIS:
        raise ManifestError(f"{where}: {what}.axes must start with {BATCH_AXIS!r}, got {axes!r}")
    if BATCH_AXIS in axes[1:]:
        raise ManifestError(f"{where}: {what}.axes names {BATCH_AXIS!r} twice: {axes!r}")
    return tuple(axes)


def _input_spec(where: str, name: str, spec: Any) -> InputSpec:
    what = f"inputs.{name}"
    if not isinstance(spec, dict):
        raise ManifestError(f"{where}: {what} must be an object")
    dtype = spec.get("dtype")
    if dtype not in _DTYPES:
        raise ManifestError(f"{where}: {what}.dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    pad = spec.get("pad", 0)
    if not isinstance(pad, (int, float, bool)):
        raise ManifestError(f"{where}: {what}.pad must be a number, got {pad!r}")
    return InputSpec(dtype=dtype, axes=_axes(where, what, spec.get("axes")), pad=pad)


def _output_spec(where: str, name: str, spec: Any) -> OutputSpec:
    what = f"outputs.{name}"
    if not isinstance(spec, dict):
        raise ManifestError(f"{where}: {what} must be an object")
    dtype = spec.get("dtype")
    if dtype is not None and dtype not in _DTYPES:
        raise ManifestError(f"{where}: {what}.dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return OutputSpec(axes=_axes(where, what, spec.get("axes")), dtype=dtype)


# -- hashing -------------------------------------------------------------------------


def file_hash(paths: Iterable[str | os.PathLike[str]], chunk: int = 1 << 20) -> str:
    """sha256 over the bytes of ``paths`` in the given order (names included)."""
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


def _model_files(model_path: str | os.PathLike[str]) -> list[Path]:
    path = Path(model_path)
    candidates = [
        path.with_name(path.name + "_data"),
        path.with_name(path.name + ".data"),
        path.with_name(path.stem + ".onnx_data"),
    ]
    return [path, *sorted({c for c in candidates if c.is_file()})]


def model_hash(model_path: str | os.PathLike[str]) -> str:
    """sha256 of an ONNX model file and its external-data files, if any.

    External data is found by name (``<model>.onnx_data``, ``<model>.onnx.data``,
    ``<model>_data``), which is how optimum and ortbatch write it; the graph itself is
    not parsed, so this needs no onnx install."""
    return file_hash(_model_files(model_path))


# (device, inode, size, mtime) of each file of a model -> its sha256, for files hashed in
# this process: a model loaded again (another session, a reload, the export just moved
# into place) is not read twice; any write changes the mtime, so it is hashed again.
_HASHED: dict[tuple[tuple[int, int, int, int], ...], str] = {}
_HASHED_LOCK = threading.Lock()


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _verify_file(name: str, path: Path, expected: str) -> None:
    try:
        files = _model_files(path)
        key = tuple(_identity(f) for f in files)
    except FileNotFoundError:
        raise ModelIntegrityError(
            f"{path}: the export's {name} model file is missing (ortbatch.json lists it); re-export it",
            path=path,
        ) from None
    with _HASHED_LOCK:
        digest = _HASHED.get(key)
    if digest is None:
        digest = model_hash(path)
        with _HASHED_LOCK:
            _HASHED[key] = digest
    if digest != expected:
        raise ModelIntegrityError(
            f"{path}: sha256 {digest[:16]}... does not match the {expected[:16]}... recorded at export: the file "
            f"changed after it was exported and checked (a damaged disk, a partial copy, an edit). Re-export it, "
            f"or set {SKIP_VERIFY_ENV}=1 to load it anyway",
            path=path,
        )
