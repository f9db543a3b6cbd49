"""Building and running the Dockerfile's image with Debian's buildah, with no image registry:
the base image is made here with debootstrap.

Everything lives in one folder (buildah's ``--root``/``--runroot`` under it), removed at the end.
Containers run with ``--isolation chroot``: in the host's network (the server's ports are
reached on 127.0.0.1) and its process table (the test signals the container's PID 1 as the
kubelet does). ``podman run`` cannot be used here (crun: "cgroups in hybrid mode not supported").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .manifests import REPO

DEBIAN_MIRROR = os.environ.get("ORTBATCH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def missing_tools() -> list[str]:
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (debootstrap and buildah's chroot isolation)")
    return missing


def host_codename() -> str:
    """The host's Debian release (the base image is the same release: bookworm here)."""
    text = Path("/etc/os-release").read_text()
    found = re.search(r"^VERSION_CODENAME=(\w+)", text, re.MULTILINE)
    return found.group(1) if found else "bookworm"


def _run(args: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if out.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[:6])} ... exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    return out


def clean_checkout(dest: Path) -> Path:
    """The files a commit of this tree would hold (tracked, and new files git does not ignore),
    copied to ``dest``: the build context of a clean checkout."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60, cwd=REPO).stdout
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if src.is_file():  # a deleted but still tracked file is not in the tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@dataclass
class Buildah:
    """buildah with its own storage under ``root``."""

    root: Path
    seconds: dict[str, float] = field(default_factory=dict)

    def cmd(self, *args: str) -> list[str]:
        return ["buildah", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"), *args]

    def __call__(self, *args: str, timeout: float = 600) -> str:
        return _run(self.cmd(*args), timeout).stdout.strip()

    def timed(self, what: str, args: list[str], timeout: float, cwd: Path | None = None) -> str:
        start = time.monotonic()
        out = _run(args, timeout, cwd=cwd).stdout.strip()
        self.seconds[what] = time.monotonic() - start
        return out

    def base_images(self) -> tuple[str, str]:
        """Two local base images from one minimal Debian of the host's release: one with
        python3 and venv (as python:3.11-slim has), one without (as CUDA's runtime images are).
        Both trust what the host trusts: pip in the build reaches PyPI through this machine's
        network, which may sign TLS with its own CA."""
        rootfs = self.root / "rootfs"
        suite = host_codename()
        self.timed(
            f"debootstrap {suite}",
            [
                "debootstrap",
                "--variant=minbase",
                "--include=ca-certificates,python3,python3-venv",
                suite,
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            900,
        )
        shutil.copy2(HOST_CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        with_python = self._import(rootfs, "localhost/ortbatch-test-base:python")
        purge = "apt-get purge -y -q --autoremove 'python3*' 'libpython3*' && apt-get clean"
        _run(["chroot", str(rootfs), "sh", "-c", purge], 300, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        assert not (rootfs / "usr/bin/python3").exists()
        bare = self._import(rootfs, "localhost/ortbatch-test-base:bare")
        shutil.rmtree(rootfs)
        return with_python, bare

    def _import(self, rootfs: Path, image: str) -> str:
        """``rootfs`` as a local image (what ``podman import`` does)."""
        start = time.monotonic()
        tar = self.root / "rootfs.tar"
        _run(["tar", "-C", str(rootfs), "-cf", str(tar), "."], 300)
        ctr = self("from", "scratch")
        self("add", ctr, str(tar), "/")
        self("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ctr)
        self("config", "--env", "PIP_CERT=/etc/ssl/certs/ca-certificates.crt", ctr)
        self("commit", "--quiet", ctr, image)
        self("rm", ctr)
        tar.unlink()
        self.seconds[f"import {image}"] = time.monotonic() - start
        return image

    def build(self, context: Path, tag: str, **build_args: str) -> str:
        """``buildah bud`` of the context's Dockerfile, as ``docker build`` would (Docker's format
        keeps HEALTHCHECK)."""
        args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
        bud = self.cmd("bud", "--isolation", "chroot", "--format", "docker", *args, "-t", tag, "-f", "Dockerfile", ".")
        self.timed(f"build {tag}", bud, 1500, cwd=context)
        return tag

    def config(self, image: str) -> dict[str, Any]:
        """The image's Docker config (User, Entrypoint, Healthcheck, StopSignal, ...)."""
        return dict(json.loads(self("inspect", "--type", "image", image))["Docker"]["config"])

    def container(self, image: str) -> str:
        return self("from", "--quiet", image)

    def run(self, ctr: str, command: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> int:
        """Run ``command`` in ``ctr`` to its end; its exit status."""
        envs = [f"--env={k}={v}" for k, v in (env or {}).items()]
        out = subprocess.run(
            self.cmd("run", "--isolation", "chroot", *envs, ctr, "--", *command),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return out.returncode

    def output(self, ctr: str, command: list[str]) -> str:
        return self("run", "--isolation", "chroot", ctr, "--", *command, timeout=120)

    def clean(self) -> None:
        """Remove the working containers (which unmounts them), then the whole storage folder."""
        subprocess.run(self.cmd("rm", "--all"), capture_output=True, timeout=120, check=False)
        subprocess.run(["rm", "-rf", str(self.root)], capture_output=True, timeout=600, check=False)


@dataclass
class Served:
    """A server running in a container: its process (``buildah run``), its output so far."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    listening: threading.Event = field(default_factory=threading.Event)

    def read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
            if "listening on" in line:
                self.listening.set()
        self.listening.set()  # the process ended: nobody waits for a line that cannot come

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def pid1(self) -> int:
        """The container's first process (what the kubelet signals): the image's entry point's
        first word, found among the descendants of ``buildah run``."""
        children: dict[int, list[int]] = {}
        names: dict[int, str] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
            pid = int(stat.parent.name)
            children.setdefault(ppid, []).append(pid)
            names[pid] = name
        todo = [self.process.pid]
        while todo:
            pid = todo.pop(0)
            if names.get(pid) == "dumb-init":
                return pid
            todo += children.get(pid, [])
        raise AssertionError(f"no dumb-init under buildah run (pid {self.process.pid}):\n{self.text}")


@contextmanager
def serving(
    buildah: Buildah, image: str, *, env: dict[str, str], mounts: dict[Path, str], args: list[str]
) -> Iterator[Served]:
    """Run the image's entry point (with ``args``) in a new container, as the image's user, with
    ``mounts`` (host folder -> container path) read-only; yields once it listens (or has ended).
    Whatever still runs in the container afterwards is killed (SIGKILL), orphans included."""
    config = buildah.config(image)
    ctr = buildah.container(image)
    volumes = [f"--volume={host}:{path}:ro" for host, path in mounts.items()]
    envs = [f"--env={k}={v}" for k, v in env.items()]
    command = [*config["Entrypoint"], *(config.get("Cmd") or []), *args]
    process = subprocess.Popen(
        buildah.cmd("run", "--isolation", "chroot", *volumes, *envs, ctr, "--", *command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    served = Served(process)
    assert process.stdout is not None
    reader = threading.Thread(target=served.read, args=(process.stdout,), daemon=True)
    reader.start()
    namespace = None
    try:
        served.listening.wait(timeout=300)
        if process.poll() is None:  # the container's own mount namespace, which its processes share
            namespace = os.readlink(f"/proc/{served.pid1()}/ns/mnt")
        yield served
    finally:
        # every process left in the container, an orphan of a failed stop included
        for pid in _in_namespace(namespace):
            _kill(pid)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
        reader.join(timeout=30)
        process.stdout.close()
        buildah("rm", ctr)


def _in_namespace(namespace: str | None) -> list[int]:
    if namespace is None:
        return []
    found = []
    for ns in Path("/proc").glob("[0-9]*/ns/mnt"):
        try:
            if os.readlink(ns) == namespace:
                found.append(int(ns.parent.parent.name))
        except OSError:
            continue
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
