"""Running a stacked batch on ONNX Runtime: providers, session options, IOBinding.

One :class:`Executor` per session; each worker thread asks it for its own
:class:`WorkerBinding` (an ``io_binding`` is never shared across threads).

* CPU: the stacked numpy arrays go to ``session.run``, which binds them in place (no
  copy); it is cheaper per call than the IOBinding API there (see ``Executor.binding``).
* CUDA / TensorRT: each stacked input is copied to the device once, outputs are bound
  on the device, and each output comes back in one copy per batch; splitting per
  request then works on numpy views.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._extras import require
from ..errors import ProviderError

__all__ = ["GPU_PROVIDERS", "WorkerBinding", "Executor", "build_session", "resolve_providers"]

log = logging.getLogger("ortbatch")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TRT = "TensorrtExecutionProvider"
GPU_PROVIDERS = frozenset({CUDA, TRT, "ROCMExecutionProvider", "MIGraphXExecutionProvider", "DmlExecutionProvider"})
_SHORTCUTS = {
    "cpu": [CPU],
    "cuda": [CUDA, CPU],
    "gpu": [CUDA, CPU],
    "tensorrt": [TRT, CUDA, CPU],
    "trt": [TRT, CUDA, CPU],
}

ProviderSpec = str | tuple[str, dict[str, Any]]


def _entry(item: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str):
        return item[0], dict(item[1] or {})
    if isinstance(item, Mapping):
        name = item.get("name") or item.get("provider")
        if isinstance(name, str):
            return name, dict(item.get("options") or {})
    raise ProviderError(f"cannot read execution provider entry {item!r}")


def resolve_providers(
    providers: str | Sequence[Any] | None,
    manifest_providers: Sequence[Any] = (),
    base_dir: str | os.PathLike[str] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """Turn the user's ``providers`` into ORT's ``[(name, options), ...]``.

    ``None`` picks CUDA when this onnxruntime build has it, else CPU. Strings
    ``"cpu"``, ``"cuda"``/``"gpu"``, ``"tensorrt"``/``"trt"`` are shortcuts; a list is
    taken as ORT takes it. Options a provider lacks are filled from the manifest's
    provider entries (e.g. the TensorRT profile shapes and cache paths written by
    ``ortbatch export --trt``). The manifest keeps cache paths relative to the export
    directory so it can be moved; they are made absolute under ``base_dir`` here.
    """
    from_manifest = dict(_entry(p) for p in manifest_providers)
    entries: list[tuple[str, dict[str, Any]]]
    if providers is None:
        ort = require("onnxruntime")
        names = [CUDA, CPU] if CUDA in ort.get_available_providers() else [CPU]
        entries = [(n, {}) for n in names]
    elif isinstance(providers, str):
        key = providers.lower()
        if key in _SHORTCUTS:
            entries = [(n, {}) for n in _SHORTCUTS[key]]
        else:
            entries = [_entry(providers)]
    else:
        entries = [_entry(p) for p in providers]
    resolved = [(name, opts or dict(from_manifest.get(name, {}))) for name, opts in entries]
    if base_dir is not None:
        from ..export.trt import resolve_cache_paths  # pure Python: no export extra needed

        resolved = [(n, resolve_cache_paths(o, base_dir) if n == TRT else o) for n, o in resolved]
    return resolved


def check_providers(session: Any, requested: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """ProviderError if a requested GPU provider is not active (ORT fell back to CPU)."""
    active = list(session.get_providers())
    missing = [name for name, _ in requested if name in GPU_PROVIDERS and name not in active]
    if missing:
        raise ProviderError(
            f"requested execution provider(s) {missing} are not active; the session runs on {active}. "
            "ONNX Runtime fell back (is onnxruntime-gpu installed, with matching CUDA/cuDNN/TensorRT "
            "libraries?). Pass providers=['CPUExecutionProvider'] to run on CPU on purpose."
        )


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def build_session(
    path: str | os.PathLike[str],
    providers: Sequence[tuple[str, dict[str, Any]]],
    workers: int,
    session_options: Any = None,
    *,
    latency: bool = False,
) -> Any:
    """Create an InferenceSession tuned for ``workers`` concurrent batches.

    On CPU, ``workers`` batches in flight share the cores: each run gets
    ``cores // workers`` intra-op threads, and thread-pool spinning is turned off
    when several runs overlap (spinning threads steal the cores the other run needs).
    ``latency=True`` builds the session for a run that is alone: every core, spinning
    during the run (as ORT's defaults, which direct ``session.run`` latency is measured
    with) but stopped when the run ends, so idle pool threads do not take the cores from
    batches that start next. User-supplied ``session_options`` are taken as they are.
    """
    ort = require("onnxruntime")
    available = ort.get_available_providers()
    unavailable = [name for name, _ in providers if name not in available]
    if unavailable:
        raise ProviderError(
            f"execution provider(s) {unavailable} are not in this onnxruntime build "
            f"(onnxruntime {ort.__version__} has {available}); install onnxruntime-gpu "
            "('pip install ortbatch[gpu]') for CUDA/TensorRT, or pass providers='cpu'"
        )
    if session_options is None:
        so = ort.SessionOptions()
        on_gpu = any(name in GPU_PROVIDERS for name, _ in providers)
        if not on_gpu:
            threads = max(1, cpu_count() // max(1, workers))
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            if latency:
                so.add_session_config_entry("session.force_spinning_stop", "1")
            elif workers > 1 and threads > 1:
                so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    else:
        so = session_options
    return ort.InferenceSession(os.fspath(path), sess_options=so, providers=list(providers))


class WorkerBinding:
    """A worker's own IOBinding (or nothing, for sessions without IOBinding)."""

    __slots__ = ("io",)

    def __init__(self, io: Any) -> None:
        self.io = io


class Executor:
    """Runs one stacked feed through the session; see the module docstring."""

    def __init__(self, session: Any) -> None:
        self.session = session
        providers = list(session.get_providers()) if hasattr(session, "get_providers") else [CPU]
        self.device = "cuda" if providers and providers[0] in (CUDA, TRT) else "cpu"
        self.device_id = 0
        if self.device == "cuda":
            opts = (
                session.get_provider_options().get(providers[0], {}) if hasattr(session, "get_provider_options") else {}
            )
            self.device_id = int(opts.get("device_id", 0) or 0)
        self.use_binding = hasattr(session, "io_binding") and hasattr(session, "run_with_iobinding")
        self._ort: Any = require("onnxruntime") if self.use_binding else None

    def binding(self) -> WorkerBinding:
        # On CPU, session.run already binds the stacked numpy arrays in place (no input copy)
        # and is measurably cheaper per call than the IOBinding API's five Python round trips
        # (identity model: ~15 us vs ~77 us per batch), so IOBinding is used where it pays:
        # on the device, where it keeps inputs and outputs off the host between copies.
        return WorkerBinding(self.session.io_binding() if self.use_binding and self.device != "cpu" else None)

    def run_plain(self, feed: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        """``session.run`` without IOBinding (typed ORT errors; string tensors)."""
        return list(self.session.run(list(output_names), dict(feed)))

    def run(
        self, binding: WorkerBinding, feed: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> list[np.ndarray]:
        io = binding.io
        if io is None or any(a.dtype == object for a in feed.values()):
            return self.run_plain(feed, output_names)
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        # GPU: one host->device copy per input, outputs stay on the device until one copy back.
        keep = []
        for name, arr in feed.items():
            value = self._ort.OrtValue.ortvalue_from_numpy(arr, "cuda", self.device_id)
            keep.append(value)
            io.bind_ortvalue_input(name, value)
        for name in output_names:
            io.bind_output(name, "cuda", self.device_id)
        self.session.run_with_iobinding(io)
        outs = [v.numpy() for v in io.get_outputs()]
        del keep
        return outs
