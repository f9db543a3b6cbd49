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

Only the standard library is used here so the runtime stays light.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ManifestError

__all__ = ["BATCH_AXIS", "FORMAT_VERSION", "MANIFEST_NAME", "InputSpec", "Manifest", "OutputSpec"]

MANIFEST_NAME = "ortbatch.json"
FORMAT_VERSION = 1
BATCH_AXIS = "batch"
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
