"""The runtime's view of the ONNX Runtime layer: one worker = one IOBinding.

Everything that builds and runs sessions lives once in :mod:`ortbatch._ort`; this module
names the pieces BatchedSession uses (an :class:`Executor` per session, a
:class:`Binding` per worker thread).
"""

from __future__ import annotations

from .._ort import (
    GPU_PROVIDERS,
    Binding,
    build_session,
    check_active,
    cpu_count,
    resolve_providers,
)
from .._ort import DeviceRunner as Executor

__all__ = ["GPU_PROVIDERS", "Binding", "Executor", "build_session", "check_active", "cpu_count", "resolve_providers"]
