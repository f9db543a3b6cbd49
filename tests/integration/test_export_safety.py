"""Nothing lost: an export is built beside its target and moved into place only when it is
complete and checked. Ctrl-C (a real SIGINT to a real `ortbatch export`) at any point, a
failed check or a refused target leaves what was there byte for byte."""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.signals import sigint_default

pytestmark = pytest.mark.export


def _snapshot(d: Path) -> dict[str, str]:
    return {
        os.fspath(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


@pytest.fixture(scope="module")
def earlier(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete, checked export of tiny bert: what must survive."""
    from ortbatch.export import export_model

    out = tmp_path_factory.mktemp("earlier") / "bert"
    assert export_model(tiny_model("bert"), out, samples=["Hello world!", "ok"]).passed
    return out


def _interrupt_export(src: Path, target: Path, after: str) -> subprocess.CompletedProcess[str]:
    """Run `ortbatch export src -o target`, send SIGINT once a progress line containing
    ``after`` is printed, and return what the command did."""
    err: list[str] = []
    lines: queue.Queue[str | None] = queue.Queue()
    with subprocess.Popen(
        [sys.executable, "-m", "ortbatch.cli", "export", str(src), "-o", str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,  # SIGINT must not stay ignored when the suite runs in a background job
    ) as proc:

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while True:
                line = lines.get(timeout=240)
                if line is None:
                    pytest.fail(f"the export ended before {after!r}: {''.join(err)}")
                err.append(line)
                if after in line:
                    proc.send_signal(signal.SIGINT)
                    break
            proc.wait(timeout=240)
            assert proc.stdout is not None
            out = proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(timeout=30)
    while (line := lines.get(timeout=1)) is not None:
        err.append(line)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(err))


@pytest.mark.parametrize(
    "after",
    [
        "exporting bert",  # while optimum traces and writes the ONNX graph
        "batching invariance",  # the last check, just before the move into place
    ],
)
def test_sigint_during_export_leaves_the_earlier_export_byte_identical(
    earlier: Path, tiny_model, tmp_path: Path, after: str
) -> None:
    import shutil

    target = tmp_path / "bert"
    shutil.copytree(earlier, target)
    before = _snapshot(target)
    assert {"model.onnx", "ortbatch.json", "validation.json"} <= set(before)
    done = _interrupt_export(tiny_model("bert"), target, after)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"interrupted; {target} is as it was before" in done.stderr
    assert _snapshot(target) == before
    assert _leftovers(target) == []  # the partial build was removed
    assert not target.with_name("bert.failed").exists()


def test_sigint_into_a_new_target_writes_nothing(tiny_model, tmp_path: Path) -> None:
    target = tmp_path / "new"
    done = _interrupt_export(tiny_model("bert"), target, "reference parity")  # while the checks run
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert f"nothing was written to {target}" in done.stderr
    assert not target.exists() and _leftovers(target) == []


def test_reexport_replaces_an_earlier_export_and_says_so(earlier: Path, tiny_model, tmp_path: Path) -> None:
    import shutil

    from ortbatch.export import export_model

    target = Path(shutil.copytree(earlier, tmp_path / "bert"))
    (target / "trt_cache").mkdir()  # what an old export left must not survive into the new one
    said: list[str] = []
    res = export_model(tiny_model("bert"), target, samples=["ok"], progress=said.append)
    assert res.installed and res.directory == target and res.passed
    assert any(f"replacing the earlier export in {target}" in s and "checks passed" in s for s in said), said
    assert not (target / "trt_cache").exists()
    assert _leftovers(target) == []
    assert res.report.directory == os.fspath(target)  # validation.json names the final place, not the build


def test_a_folder_that_is_not_an_export_needs_force(tiny_model, tmp_path: Path) -> None:
    from ortbatch import ExportError
    from ortbatch.export import export_model

    target = tmp_path / "notes"
    target.mkdir()
    (target / "thesis.txt").write_text("years of work")
    with pytest.raises(ExportError, match=r"not an ortbatch export \(1 entries: thesis.txt\).*--force"):
        export_model(tiny_model("bert"), target, samples=["ok"])
    assert (target / "thesis.txt").read_text() == "years of work"
    assert _leftovers(target) == []
    res = export_model(tiny_model("bert"), target, samples=["ok"], force=True)
    assert res.installed and (target / "model.onnx").is_file() and not (target / "thesis.txt").exists()


def test_an_export_that_fails_its_checks_does_not_replace_a_good_one(earlier: Path, tiny_model, tmp_path: Path) -> None:
    import shutil

    from ortbatch.export import export_model
    from ortbatch.export.recipes import Recipe

    target = Path(shutil.copytree(earlier, tmp_path / "bert"))
    before = _snapshot(target)
    impossible = Recipe(samples=("Hello world!", "ok"), tolerances={"fp32": {"atol": 0.0, "rtol": 0.0, "cosine": 1.0}})
    res = export_model(tiny_model("bert"), target, recipe=impossible, raise_on_failure=False)
    assert not res.passed and not res.installed
    assert res.directory == tmp_path / "bert.failed" and (res.directory / "validation.json").is_file()
    assert _snapshot(target) == before
    assert "left as it was" in res.not_installed_message()
    kept = export_model(tiny_model("bert"), target, recipe=impossible, raise_on_failure=False, keep_failed=True)
    assert kept.installed and kept.directory == target and not kept.passed


def test_cli_keep_failed_and_force_flags(tiny_model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ortbatch.cli import main

    target = tmp_path / "stuff"
    target.mkdir()
    (target / "keep.me").write_text("x")
    assert main(["export", str(tiny_model("bert")), "-o", str(target)]) == 1
    err = capsys.readouterr().err
    assert "--force" in err and "Traceback" not in err
    assert (target / "keep.me").is_file()


def test_api_and_cli_agree_on_the_opset_and_the_api_hides_third_party_warnings(
    tiny_model, tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    from ortbatch.export import export_model
    from ortbatch.export.recipes import DEFAULT_OPSET, Recipe, load_recipe

    root = Path(__file__).resolve().parents[2]
    assert Recipe().opset == DEFAULT_OPSET == load_recipe(root / "export" / "minilm.toml").opset
    assert load_recipe(root / "export" / "gpt2.toml").opset == DEFAULT_OPSET
    res = export_model(tiny_model("bert"), tmp_path / "api", samples=["ok"])
    assert res.manifest.source["opset"] == DEFAULT_OPSET
    # torch's tracer and transformers warn during every export; none of it reaches the caller
    assert [str(w.message) for w in recwarn] == []


@pytest.mark.parametrize(
    ("architectures", "task"),
    [
        (["BertForPreTraining"], None),
        (["BertForNextSentencePrediction"], None),
        (["BertModel"], "feature-extraction"),
        (["BertForMaskedLM"], "fill-mask"),
        (None, "feature-extraction"),
    ],
)
def test_task_auto_never_drops_a_head_it_cannot_name(tmp_path: Path, architectures, task) -> None:
    """--task auto on a checkpoint saved with a head no supported task has (NSP, pre-training)
    is refused, naming the head; it used to export the bare encoder as feature-extraction,
    answers the checkpoint's model never gives. A checkpoint without a head still embeds."""
    pytest.importorskip("optimum.exporters.onnx")
    from transformers import BertConfig

    from ortbatch.errors import UnsupportedModelError
    from ortbatch.export.tasks import resolve_model

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, architectures=architectures).save_pretrained(
        tmp_path
    )
    if task is None:
        with pytest.raises(UnsupportedModelError, match=f"{architectures[0]}.*Pass --task"):
            resolve_model(str(tmp_path), "auto")
        assert resolve_model(str(tmp_path), "feature-extraction").task == "feature-extraction"
    else:
        assert resolve_model(str(tmp_path), "auto").task == task
