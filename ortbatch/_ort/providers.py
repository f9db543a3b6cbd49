"""Execution-provider names, the shortcuts users type, and resolving a request.

One table, :data:`SHORTCUTS`, serves every command and API: ``cpu``, ``cuda`` (alias
``gpu``), ``tensorrt`` (alias ``trt``), or a full ONNX Runtime name such as
``CUDAExecutionProvider``. A comma-separated string (``"cpu,cuda,trt"`` or
``"cpu, cuda, tensorrt"``) is accepted wherever a list is. Anything else is a
:class:`ProviderError` that names the valid spellings.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .._extras import require
from ..errors import ProviderError

__all__ = [
    "CPU",
    "CUDA",
    "GPU_PROVIDERS",
    "SHORTCUTS",
    "TRT",
    "ProviderChain",
    "canonical_name",
    "default_providers",
    "fallback_names",
    "parse_provider_names",
    "probe_providers",
    "resolve_providers",
]

log = logging.getLogger("ortbatch")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TRT = "TensorrtExecutionProvider"
GPU_PROVIDERS = frozenset(
    {
        CUDA,
        TRT,
        "NvTensorRTRTXExecutionProvider",
        "ROCMExecutionProvider",
        "MIGraphXExecutionProvider",
        "DmlExecutionProvider",
    }
)
#: word -> the provider chain it stands for (ONNX Runtime tries them in order). TensorRT
#: hands the nodes it cannot build to CUDA, as ONNX Runtime recommends, then CPU.
SHORTCUTS: dict[str, tuple[str, ...]] = {
    "cpu": (CPU,),
    "cuda": (CUDA, CPU),
    "gpu": (CUDA, CPU),
    "tensorrt": (TRT, CUDA, CPU),
    "trt": (TRT, CUDA, CPU),
}
_VALID = "cpu, cuda (or gpu), tensorrt (or trt), or a full ONNX Runtime name such as CUDAExecutionProvider"

#: ``[(name, options), ...]`` exactly as ``InferenceSession(providers=...)`` takes it.
ProviderChain = list[tuple[str, dict[str, Any]]]

# An Identity model (float[1] -> float[1], opset 13, IR 8), serialized once with
# onnx.helper so the probe needs no onnx install (tests/unit/test_ort_layer.py rebuilds it).
_PROBE_MODEL = (
    b'\x08\x08\x12\x08ortbatch:;\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x05probeZ\x0f\n\x01x\x12\n\n\x08\x08\x01'
    b"\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01B\x04\n\x00\x10\r"
)


def _known_names() -> frozenset[str]:
    try:
        ort = require("onnxruntime")
        return frozenset(ort.get_all_providers())
    except ImportError:
        return frozenset()


def canonical_name(word: str) -> str:
    """The ONNX Runtime name of one provider word (``"trt"`` -> ``TensorrtExecutionProvider``)."""
    text = word.strip()
    key = text.lower()
    if key in SHORTCUTS:
        return SHORTCUTS[key][0]
    known = _known_names()
    for name in known or GPU_PROVIDERS | {CPU}:
        if name.lower() == key:
            return name
    if text.endswith("ExecutionProvider") and not known:
        return text  # no onnxruntime to ask; a build that lacks it says so at session build
    raise ProviderError(f"unknown execution provider {word!r}; use {_VALID}")


def fallback_names(name: str) -> tuple[str, ...]:
    """``name`` and the providers ONNX Runtime hands the nodes it cannot run to: the
    :data:`SHORTCUTS` chain that ``name`` leads (TensorRT, CUDA, CPU), else ``name`` then CPU."""
    for chain in SHORTCUTS.values():
        if chain[0] == name:
            return chain
    return (name,) if name == CPU else (name, CPU)


def _words(spec: str | Sequence[Any]) -> list[Any]:
    if isinstance(spec, str):
        words = [w.strip() for w in spec.split(",")]
        if not any(words):
            raise ProviderError(f"empty provider list {spec!r}; use {_VALID}")
        if not all(words):
            raise ProviderError(f"empty entry in the provider list {spec!r}; use {_VALID}")
        return words
    return list(spec)


def parse_provider_names(spec: str | Sequence[str]) -> list[str]:
    """Providers to *check or report* (one name per word, in order, without repeats):
    ``"cpu,cuda,trt"`` and ``"cpu, cuda, tensorrt"`` both give CPU, CUDA, TensorRT."""
    names = []
    for w in _words(spec):
        if not isinstance(w, str):
            raise ProviderError(f"cannot read execution provider {w!r}; use {_VALID}")
        names.append(canonical_name(w))
    return list(dict.fromkeys(names))


def _entry(item: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return canonical_name(item), {}
    if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str):
        return canonical_name(item[0]), dict(item[1] or {})
    if isinstance(item, Mapping):
        name = item.get("name") or item.get("provider")
        if isinstance(name, str):
            return canonical_name(name), dict(item.get("options") or {})
    raise ProviderError(f"cannot read execution provider entry {item!r}")


def _chain(requested: str | Sequence[Any]) -> ProviderChain:
    entries: ProviderChain = []
    for item in _words(requested):
        if isinstance(item, str) and item.strip().lower() in SHORTCUTS:
            entries.extend((n, {}) for n in SHORTCUTS[item.strip().lower()])
        else:
            entries.append(_entry(item))
    seen: dict[str, dict[str, Any]] = {}
    for name, opts in entries:  # a shortcut's tail may repeat an explicit entry: keep the first
        if name not in seen:
            seen[name] = opts
    return list(seen.items())


def resolve_providers(
    requested: str | Sequence[Any] | None,
    manifest_providers: Sequence[Any] = (),
    base_dir: str | os.PathLike[str] | None = None,
) -> ProviderChain:
    """Turn a user's ``providers`` into ONNX Runtime's ``[(name, options), ...]``.

    ``None``: CUDA when a probe session really gets it, else CPU (see
    :func:`default_providers`). A shortcut expands to its chain (``"trt"`` is TensorRT,
    CUDA, CPU); a list is taken in order. Each provider's options are the manifest's
    (e.g. the TensorRT profiles and caches written by ``ortbatch export --trt``) with the
    user's options laid over them one key at a time: asking for
    ``("TensorrtExecutionProvider", {"trt_fp16_enable": False})`` keeps the manifest's
    profiles and caches. Relative TensorRT cache paths resolve under ``base_dir`` (the
    export directory), never the current directory.
    """
    from_manifest: dict[str, dict[str, Any]] = {}
    for p in manifest_providers:
        name, opts = _entry(p)
        from_manifest.setdefault(name, opts)
    chain = default_providers() if requested is None else _chain(requested)
    resolved = [(name, {**from_manifest.get(name, {}), **opts}) for name, opts in chain]
    if base_dir is not None:
        from .trt import resolve_cache_paths

        resolved = [(n, resolve_cache_paths(o, base_dir) if n == TRT else o) for n, o in resolved]
    return resolved


@functools.cache
def probe_providers(names: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """(providers a tiny session built with ``names`` really gets, the error if it raised).

    ``get_available_providers()`` lists what the wheel was *built* with (onnxruntime-gpu
    lists CUDA and TensorRT on a machine without CUDA); only a session shows what loads.
    Cached: one probe per chain and process.
    """
    ort = require("onnxruntime")
    missing = [n for n in names if n not in ort.get_available_providers()]
    if missing:
        return (), f"{missing} not in this onnxruntime build"
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        # ORT's UserWarning about a provider it lacks is dropped: the providers returned say it
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="onnxruntime")
            sess = ort.InferenceSession(_PROBE_MODEL, sess_options=so, providers=list(names), enable_fallback=0)
    except Exception as exc:  # a provider that cannot even register (TensorRT without its libraries)
        return (), f"{type(exc).__name__}: {exc}"
    return tuple(sess.get_providers()), ""


@functools.lru_cache(maxsize=1)
def _default_names() -> tuple[str, ...]:
    ort = require("onnxruntime")
    if CUDA not in ort.get_available_providers():
        return (CPU,)
    active, error = probe_providers((CUDA, CPU))
    if CUDA in active:
        return (CUDA, CPU)
    log.warning(
        "onnxruntime %s has the CUDA execution provider but it does not load here (%s); running on CPU. "
        "Pass providers='cuda' to make that an error, or providers='cpu' to silence this.",
        ort.__version__,
        error or "no usable GPU, or the CUDA/cuDNN libraries are missing",
    )
    return (CPU,)


def default_providers() -> ProviderChain:
    """What ``providers=None`` means: CUDA then CPU when CUDA really loads, else CPU (said
    once per process, as a warning, when an installed GPU build cannot use a GPU)."""
    return [(n, {}) for n in _default_names()]
