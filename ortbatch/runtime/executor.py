"""The runtime's view of the ONNX Runtime layer: one worker = one IOBinding.

Everything that builds and runs sessions lives once in :mod:`ortbatch._ort`; this module
names the pieces BatchedSession uses (an :class:`Executor` per session, a
:class:`WorkerBinding` per worker thread).
"""

from __future__ import annotations

from .._ort import (
    GPU_PROVIDERS,
    WorkerBinding,
    build_session,
    check_active,
    cpu_count,
    resolve_providers,
)
from .._ort import DeviceRunner as Executor

__all__ = [
    "GPU_PROVIDERS",
    "WorkerBinding",
    "Executor",
    "build_session",
    "check_active",
    "cpu_count",
    "resolve_providers",
]
