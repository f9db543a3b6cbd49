"""The tutorials in notebooks/ run, top to bottom, on the API as it is.

Each notebook is executed in a fresh Jupyter kernel (nbclient) with a deadline of its own; a
cell that raises fails the test with the cell and its traceback. The notebooks assert their own
claims (batched equals alone, the broken export fails the right check, ...), so a change that
breaks what a tutorial shows breaks CI. Committed notebooks carry no outputs, and every cell
that draws a plot must produce an image when run. A server or any other process started from
a notebook must be gone when its kernel is (the kernel signals its own children on shutdown; a
process that escaped it, found by its working directory, fails the test and is killed).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
KERNEL = "ortbatch-notebook-tests"

# Per-notebook deadline for all its cells together: a guard against a hang, not a speed target.
# Measured on a 2-core machine shared by six busy sessions (load ~12): 01 170 s, 04 79 s, 02 54 s,
# 03 31 s, 05 9 s; about 100 s of CPU for all five.
DEADLINE_S = {"01-quickstart": 480}
DEFAULT_DEADLINE_S = 300

# A cell that draws with matplotlib (plt.show(), plt.subplots(...), ...) must show an image.
PLOT_CALL = re.compile(r"\bplt\.(show|subplots|figure|imshow|bar|plot)\(")


def _names(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


def test_the_notebooks_are_there() -> None:
    expected = {"01-quickstart", "02-accuracy-checks", "03-serving", "04-generation", "05-custom-collator"}
    assert expected <= set(_names(NOTEBOOKS))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_committed_notebook_has_no_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("language") == "python"
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs or execution counts; clear them before committing"
    # what a widget or an editor leaves behind is output too
    assert "widgets" not in nb.metadata, f"{path.name}: widget state in the metadata"
    assert all(not c.get("attachments") for c in nb.cells), f"{path.name}: a cell has attachments"


def test_readme_links_every_notebook() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        assert f"(notebooks/{path.name})" in readme, f"README.md does not link notebooks/{path.name}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's layout the notebooks rely on: they run from ``notebooks/``
    (as Jupyter runs them), write to ``notebooks/exports/`` and read ``../export/*.toml``.
    Shared by the notebooks of one run, so 03 reuses the export 01 made."""
    root = tmp_path_factory.mktemp("notebooks-run")
    (root / "notebooks").mkdir()
    (root / "export").symlink_to(REPO / "export", target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A kernel spec for this very interpreter (a user-wide ``python3`` spec might name another
    Python), and the environment the kernel starts with."""
    spec = tmp_path_factory.mktemp("jupyter") / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    env = dict(os.environ)
    env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(spec.parent.parent), env.get("JUPYTER_PATH")]))
    # the checkout's ortbatch, also in processes the notebooks start (`ortbatch serve`)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    env.pop("MPLBACKEND", None)  # the kernel's inline backend is what turns figures into outputs
    return env


def _processes_under(root: Path) -> list[str]:
    psutil = pytest.importorskip("psutil")
    found = []
    for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
        cwd = proc.info.get("cwd") or ""
        if proc.pid != os.getpid() and cwd.startswith(str(root)):
            found.append(f"{proc.pid}: {' '.join(proc.info.get('cmdline') or [])}")
    return found


def _kill(pid: int) -> None:
    import psutil

    try:
        psutil.Process(pid).kill()
    except psutil.Error:
        pass


@pytest.mark.slow
@pytest.mark.export
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_runs(path: Path, workdir: Path, kernel_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("JUPYTER_PATH", kernel_env["JUPYTER_PATH"])  # where the kernel spec is looked up

    nb = nbformat.read(path, as_version=4)
    deadline = time.monotonic() + DEADLINE_S.get(path.stem, DEFAULT_DEADLINE_S)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        # every cell may use what is left of the notebook's deadline
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        resources={"metadata": {"path": str(workdir / "notebooks")}},
        allow_errors=False,
        record_timing=False,
    )
    try:
        client.execute(env=kernel_env)
    finally:
        # the kernel is gone; nothing it started may outlive it (a server left running
        # would hold its port and its memory for as long as the machine runs)
        leftover = _processes_under(workdir)
        for _ in range(100):
            if not leftover:
                break
            time.sleep(0.1)
            leftover = _processes_under(workdir)
        for pid in leftover:  # not left behind for the next test either
            _kill(int(pid.split(":")[0]))
        assert not leftover, f"{path.name} left processes running: {leftover}"

    missing = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        and PLOT_CALL.search(cell.source)
        and not any("image/png" in out.get("data", {}) for out in cell.outputs)
    ]
    assert not missing, f"{path.name}: cells {missing} draw a plot but no image came out"
    # a warning printed in a tutorial is a defect the reader sees (e.g. tqdm's "IProgress not
    # found" when ipywidgets is missing: it is in the dev and notebooks extras)
    warned = [
        (i, out.get("text", "")[:300])
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("name") == "stderr" and "Warning" in out.get("text", "")
    ]
    assert not warned, f"{path.name}: cells print warnings: {warned}"
