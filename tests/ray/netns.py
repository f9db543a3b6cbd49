"""Ray listens on all interfaces (hard-coded), so the Ray cluster tests run only inside a
network namespace that has nothing but loopback. A module's outer test calls
:func:`rerun_in_loopback_namespace`, which re-runs the module under ``unshare -n`` with only
``lo`` up (skipped, with the reason, where unshare is not permitted); the cluster tests are
marked :data:`inner_only` and run only in that inner run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

INNER = "ORTBATCH_RAY_NETNS"
IN_NETNS = os.environ.get(INNER) == "1"
inner_only = pytest.mark.skipif(not IN_NETNS, reason="runs inside the loopback-only namespace (the test below)")
outer_only = pytest.mark.skipif(IN_NETNS, reason="this is the inner run")
#: Ray's own modules warn about their internals (deprecations, resource tracking)
RAY_WARNINGS = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning:ray.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:ray.*"),
]


def rerun_in_loopback_namespace(module_file: str, timeout_s: int) -> None:
    """Run the pytest module ``module_file`` in ``unshare -n`` with only ``lo`` up; fail with
    its output unless every test there passed (the inner run's timeout: ``timeout_s`` - 100)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare or ip is not installed: cannot make a loopback-only network namespace for Ray")
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare -n is not permitted here ({probe.stderr.strip()}); Ray must not listen on the network")
    inner = f"timeout={timeout_s - 300}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-x", "-p", "no:cacheprovider", "-o", inner, module_file]
    proc = subprocess.run(
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd],
        env={**os.environ, INNER: "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s - 100,
    )
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    assert re.search(r"\b\d+ passed\b", proc.stdout), proc.stdout[-3000:]
