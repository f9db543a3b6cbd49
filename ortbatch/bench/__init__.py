"""``ortbatch bench``: measure BatchedSession against direct ``session.run`` and an offline oracle.

One run serves one seeded request set through every mode and concurrency level:
:mod:`.workload` makes the requests, :mod:`.loadgen` plays the clients, :mod:`.modes` runs
direct / batched / oracle, :mod:`.overhead` prices the runtime per request, :mod:`.report`
prints, writes JSON and plots. Needs the ``bench`` extra (matplotlib, tqdm, onnx) for plots,
progress bars and the overhead model; the measurements themselves need only numpy and
onnxruntime.
"""

from __future__ import annotations

from .runner import MODES, SCHEMA, BenchConfig, BenchRun, run_bench
from .workload import LengthSpec, Workload, make_workload, parse_lengths

__all__ = [
    "MODES",
    "SCHEMA",
    "BenchConfig",
    "BenchRun",
    "LengthSpec",
    "Workload",
    "make_workload",
    "parse_lengths",
    "run_bench",
]
