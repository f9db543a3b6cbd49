"""Building an InferenceSession the one way ortbatch builds them.

* threads and spinning tuned for the number of batches in flight (CPU);
* ``disable_fallback``: since 1.31, ``InferenceSession.run`` catches an execution
  provider failure, prints it, and rebuilds the session on the fallback providers. Every
  IOBinding made from the old session then fails ("IOBinding must be used with the
  session that created it") and a parity check would compare CPU with CPU. With fallback
  off, the provider's own error reaches the caller (as :class:`InferenceError` from the
  run, :class:`ProviderError` at build time);
* a requested GPU provider that is not active is a :class:`ProviderError`;
* a model that does not load (truncated, corrupt, missing) is one
  :class:`ModelLoadError` with the path and ONNX Runtime's reason.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from .._extras import require
from ..errors import ModelLoadError, OrtBatchError, ProviderError
from .cpus import cpu_count
from .providers import CPU, CUDA, GPU_PROVIDERS, TRT, ProviderChain

__all__ = [
    "build_session",
    "check_active",
    "cpu_count",
    "cpu_session_options",
    "device_of",
    "load_error",
    "on_gpu",
    "plain_session",
]

# onnxruntime.capi.onnxruntime_pybind11_state exceptions that can only mean the model file
_MODEL_ERRORS = frozenset({"InvalidProtobuf", "NoSuchFile", "NoModel"})
_GPU_WORDS = ("ExecutionProvider", "CUDA", "cuda", "TensorRT", "tensorrt", "cuDNN", "cudnn", "cublas", "GPU")


def on_gpu(providers: Sequence[Any]) -> bool:
    """Whether a chain (names or ``(name, options)``) asks for a GPU provider."""
    return any((p if isinstance(p, str) else p[0]) in GPU_PROVIDERS for p in providers)


def load_error(exc: BaseException, where: str | os.PathLike[str], providers: Sequence[Any] = ()) -> OrtBatchError:
    """Map an exception raised while building a session to the ortbatch error that says
    what to do: :class:`ProviderError` when a requested GPU provider failed to start,
    :class:`ModelLoadError` when the model itself could not be read."""
    if isinstance(exc, OrtBatchError):
        return exc
    text = str(exc).strip()
    name = type(exc).__name__
    pybind = type(exc).__module__.endswith("onnxruntime_pybind11_state")
    if name == "EPFail":
        return ProviderError(f"{where}: the execution provider failed: {text}")
    if name in _MODEL_ERRORS or (name == "DecodeError" and "protobuf" in type(exc).__module__):
        return ModelLoadError(where, text or name)
    about_gpu = any(w in text.replace(os.fspath(where), "") for w in _GPU_WORDS)
    if on_gpu(providers) and (about_gpu or not pybind):
        return ProviderError(f"{where}: the execution provider failed to start: {text}")
    return ModelLoadError(where, text or name)


def cpu_session_options(cpus: int, workers: int, latency: bool = False) -> Any:
    """CPU session options for ``workers`` batches in flight sharing ``cpus`` cores: each
    run gets ``cpus // workers`` threads (at least one), and spinning is off when runs
    overlap (spinning threads steal the cores the other run needs). A latency session
    spins during its run, as ORT's defaults do, but stops when it ends so idle threads
    leave the cores to batches. Used with this machine's cores by :func:`build_session`,
    and with a Ray worker's share of a node by ``ortbatch.ray`` and ``ortbatch run --ray``."""
    ort = require("onnxruntime")
    so = ort.SessionOptions()
    threads = max(1, int(cpus) // max(1, workers))
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if latency:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    elif workers > 1 and threads > 1:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def _tuned_options(ort: Any, providers: ProviderChain, workers: int, latency: bool) -> Any:
    if on_gpu(providers):
        return ort.SessionOptions()
    return cpu_session_options(cpu_count(), workers, latency)


def build_session(
    model: str | os.PathLike[str] | bytes,
    providers: ProviderChain,
    *,
    workers: int = 1,
    session_options: Any = None,
    latency: bool = False,
    where: str | os.PathLike[str] | None = None,
) -> Any:
    """An InferenceSession on ``providers`` with fallback off, checked to be on them.

    ``session_options=None`` tunes threads for ``workers`` concurrent batches (see the
    module docstring); given options are taken as they are. ``where`` names the model in
    errors (default: the path). Raises :class:`ModelLoadError` or :class:`ProviderError`.
    """
    ort = require("onnxruntime")
    label = where if where is not None else (model if not isinstance(model, bytes) else "<model bytes>")
    available = ort.get_available_providers()
    unavailable = [name for name, _ in providers if name not in available]
    if unavailable:
        raise ProviderError(
            f"execution provider(s) {unavailable} are not in this onnxruntime build "
            f"(onnxruntime {ort.__version__} has {available}); install onnxruntime-gpu "
            "('pip install ortbatch[gpu]') for CUDA/TensorRT, or pass providers='cpu'"
        )
    so = _tuned_options(ort, providers, workers, latency) if session_options is None else session_options
    src = model if isinstance(model, bytes) else os.fspath(model)
    try:
        # enable_fallback=0: a provider that fails to start raises instead of being
        # replaced by CPU behind our back (older onnxruntime ignores the keyword). ORT's own
        # provider UserWarnings are dropped: check_active below says precisely what is missing.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="onnxruntime")
            sess = ort.InferenceSession(src, sess_options=so, providers=list(providers), enable_fallback=0)
    except Exception as exc:
        raise load_error(exc, label, providers) from exc
    if hasattr(sess, "disable_fallback"):
        sess.disable_fallback()  # and no silent rebuild when a run fails (see the docstring)
    check_active(sess, providers)
    return sess


def plain_session(model: str | os.PathLike[str], providers: ProviderChain | None = None, options: Any = None) -> Any:
    """A session with ONNX Runtime's own defaults (direct baselines, reading metadata)."""
    ort = require("onnxruntime")
    return build_session(
        model, providers or [(CPU, {})], session_options=options if options is not None else ort.SessionOptions()
    )


def check_active(session: Any, requested: Sequence[Any]) -> None:
    """ProviderError if a requested GPU provider is not active (ORT fell back to CPU)."""
    active = list(session.get_providers())
    names = [p if isinstance(p, str) else p[0] for p in requested]
    missing = [name for name in names if name in GPU_PROVIDERS and name not in active]
    if missing:
        raise ProviderError(
            f"requested execution provider(s) {missing} are not active; the session runs on {active}. "
            "ONNX Runtime could not start them (is there a GPU, and are the CUDA/cuDNN/TensorRT "
            "libraries that this onnxruntime-gpu needs on the library path?). Pass providers='cpu' "
            "to run on CPU on purpose."
        )


def device_of(session: Any) -> tuple[str, int]:
    """("cuda", device id) when the session's first provider runs on a CUDA device,
    else ("cpu", 0). The id comes from the provider's options, never assumed to be 0."""
    providers = list(session.get_providers()) if hasattr(session, "get_providers") else [CPU]
    if not providers or providers[0] not in (CUDA, TRT):
        return "cpu", 0
    opts: dict[str, Any] = {}
    if hasattr(session, "get_provider_options"):
        opts = dict(session.get_provider_options().get(providers[0], {}) or {})
    return "cuda", int(opts.get("device_id", 0) or 0)
