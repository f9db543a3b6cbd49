"""The one layer that talks to ONNX Runtime's provider machinery.

Everything that builds sessions and runs them lives here, once: the provider names and
their shortcuts (``cpu``, ``cuda``/``gpu``, ``tensorrt``/``trt``), resolving a user's
request against the manifest's options (merged one key at a time), building a session
(threads, spinning, the latency session, ``disable_fallback``), checking that what was
asked for is really active, IOBinding runs, the TensorRT options and the tolerances a
provider's arithmetic calls for. ``runtime``, ``generation``, ``export.checks`` and
``bench`` all use it; nothing else names an execution provider.

Private: the names may change between releases. Pure Python at import time; onnxruntime
is imported when a session is built.
"""

from __future__ import annotations

from .binding import DeviceRunner, WorkerBinding
from .providers import (
    CPU,
    CUDA,
    GPU_PROVIDERS,
    SHORTCUTS,
    TRT,
    ProviderChain,
    canonical_name,
    default_providers,
    fallback_names,
    parse_provider_names,
    probe_providers,
    resolve_providers,
)
from .session import (
    build_session,
    check_active,
    cpu_count,
    device_of,
    load_error,
    on_gpu,
    plain_session,
)
from .tolerance import arithmetic, fp32_parity_options, output_tolerance, parity_tolerances

__all__ = [
    "CPU",
    "CUDA",
    "GPU_PROVIDERS",
    "SHORTCUTS",
    "TRT",
    "WorkerBinding",
    "arithmetic",
    "DeviceRunner",
    "ProviderChain",
    "build_session",
    "canonical_name",
    "check_active",
    "cpu_count",
    "default_providers",
    "device_of",
    "fallback_names",
    "fp32_parity_options",
    "load_error",
    "on_gpu",
    "output_tolerance",
    "parity_tolerances",
    "parse_provider_names",
    "plain_session",
    "probe_providers",
    "resolve_providers",
]
