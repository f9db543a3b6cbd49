"""Reading deploy/: the Kubernetes manifests, the kustomizations, the Dockerfile's settings and
the image's entry point, for the tests of this folder."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kubernetes"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
DOCKERFILE = REPO / "Dockerfile"


def manifest_files() -> list[Path]:
    """Every manifest under deploy/kubernetes (kustomizations apart)."""
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in KUBE.rglob("kustomization.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in manifest_files() for d in documents(p)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one manifest of ``kind`` (and ``name``) under deploy/kubernetes."""
    found = [d for _, d in all_documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} manifests named {name}"
    return found[0]


def containers(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The containers of a workload or a custom resource, wherever its pod specs are."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from containers(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from containers(item)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def prestop_seconds(container: dict[str, Any]) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def dockerfile_instruction(name: str) -> list[str]:
    """The arguments of each ``name`` instruction of the Dockerfile (continuations joined)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [
        line.split(None, 1)[1].strip()
        for line in text.splitlines()
        if line.split(None, 1)[:1] == [name] and len(line.split(None, 1)) == 2
    ]


def kustomize_command() -> list[str] | None:
    """``kustomize build`` or ``kubectl kustomize``, whichever is installed."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def kustomize_build(command: list[str], folder: Path) -> list[dict[str, Any]]:
    out = subprocess.run([*command, str(folder)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, f"{' '.join(command)} {folder}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def entrypoint_argv(env: dict[str, str], args: list[str], tmp: Path) -> list[str]:
    """The ``ortbatch`` command line the image's entry point runs under ``env`` and ``args``:
    the script itself, run by ``sh`` with an ``ortbatch`` on PATH that prints its arguments."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "ortbatch"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    environ = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env}
    out = subprocess.run(
        ["sh", str(ENTRYPOINT), *args], env=environ, capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()
