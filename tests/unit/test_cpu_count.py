"""``cpu_count``: the affinity capped by a container's CPU quota (cgroup v1 and v2), read
from fake cgroup trees laid out as the kernel mounts them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ortbatch._ort import cpus
from ortbatch._ort.cpus import cgroup_cpu_limit


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_dot_", ".")).write_text(text)


def _proc(tmp_path: Path, text: str) -> Path:
    proc = tmp_path / "cgroup"
    proc.write_text(text)
    return proc


def test_v2_quota_in_the_processs_own_cgroup_rounded_up(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(root, cgroup_dot_controllers="cpu memory", cpu_dot_max="max 100000\n")
    _write(root / "kubepods" / "pod1" / "ctr", cpu_dot_max="250000 100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/kubepods/pod1/ctr\n")) == 3


def test_v2_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(root, cgroup_dot_controllers="cpu")
    _write(root / "kubepods" / "pod1", cpu_dot_max="200000 100000\n")  # the pod's limit
    _write(root / "kubepods" / "pod1" / "ctr", cpu_dot_max="300000 100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/kubepods/pod1/ctr\n")) == 2
    _write(root / "kubepods" / "pod1" / "ctr", cpu_dot_max="max 100000\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/kubepods/pod1/ctr\n")) == 2


def test_v2_inside_a_cgroup_namespace_reads_the_mounts_root(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(root, cgroup_dot_controllers="cpu", cpu_dot_max="50000 100000\n")
    # the path names the host's folders, which the container's mount does not show
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/kubepods/pod1/ctr\n")) == 1


def test_v1_quota_under_cpu_cpuacct(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(root / "cpu,cpuacct", cpu_dot_cfs_quota_us="-1\n", cpu_dot_cfs_period_us="100000\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc", cpu_dot_cfs_quota_us="400000\n", cpu_dot_cfs_period_us="100000\n")
    proc = _proc(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n")
    assert cgroup_cpu_limit(root, proc) == 4


def test_no_quota_anywhere_is_none(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(root / "cpu", cpu_dot_cfs_quota_us="-1\n", cpu_dot_cfs_period_us="100000\n")
    _write(root / "unified", cpu_dot_max="max 100000\n")  # hybrid: v2 under unified/
    assert cgroup_cpu_limit(root, _proc(tmp_path, "1:cpu:/\n0::/\n")) is None


def test_unreadable_or_garbled_files_are_no_quota(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _write(root, cgroup_dot_controllers="cpu", cpu_dot_max="garbage\n")
    assert cgroup_cpu_limit(root, _proc(tmp_path, "0::/\n")) is None
    assert cgroup_cpu_limit(root, _proc(tmp_path, "no colons here\n")) is None
    assert cgroup_cpu_limit(root, tmp_path / "missing") is None


def test_cpu_count_is_the_affinity_capped_by_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1)
    assert cpus.cpu_count() == 1
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: affinity + 8)
    assert cpus.cpu_count() == affinity
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    assert cpus.cpu_count() == affinity
