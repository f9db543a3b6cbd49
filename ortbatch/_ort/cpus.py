"""How many cores this process may use: its CPU affinity, capped by its cgroup's CPU quota.

ONNX Runtime's thread pools are sized from this count (:func:`ortbatch._ort.build_session`).
A container's CPU limit (Kubernetes ``resources.limits.cpu``, ``docker run --cpus``) is a
quota, not an affinity: a pod limited to 2 CPUs on a 64-core node still has all 64 cores in
its affinity mask, and 64 threads per run would spend most of each period throttled. So the
tightest quota on the process's cgroup and its ancestors (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) caps the count, rounded up to whole cores, as
the JVM and Go runtimes do. No quota, or none readable: the affinity alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cgroup_cpu_limit", "cpu_count"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cpu_count() -> int:
    """The cores this process may use (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, limit)) if limit is not None else max(1, cores)


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int | None:
    """The tightest CPU quota on this process's cgroup and its ancestors, in whole cores
    (rounded up); ``None`` when there is none or it cannot be read. ``root`` is where the
    cgroup file systems are mounted, ``proc`` the process's ``/proc/self/cgroup``."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: at the root (unified) or at root/unified (hybrid)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            quotas += (q for d in _ancestors(base, path) if (q := _quota_v2(d)) is not None)
        elif "cpu" in controllers.split(","):  # cgroup v1: root/cpu,cpuacct (or its root/cpu link)
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            quotas += (q for d in _ancestors(base, path) if (q := _quota_v1(d)) is not None)
    return max(1, math.ceil(min(quotas))) if quotas else None


def _ancestors(base: Path, path: str) -> Iterator[Path]:
    """The cgroup's folder under ``base`` and each parent up to ``base``. Inside a container
    the path may name folders that its own mount does not show: those are skipped, and the
    mount's root (the container's cgroup) is still read."""
    parts = [p for p in path.strip("/").split("/") if p]
    for n in range(len(parts), -1, -1):
        folder = base.joinpath(*parts[:n])
        if folder.is_dir():
            yield folder


def _quota_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
