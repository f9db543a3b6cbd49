"""Issue 28, acceptance 2: lm-evaluation-harness against ``ortbatch serve``, offline.

``lm_eval --model local-completions`` runs a loglikelihood task and a generate_until task, both
made here of local data (task YAMLs over jsonl files; no hub), against ``ortbatch serve`` on the
tiny GPT-2 export, its tokenizer the model's local folder; the same harness then runs them with
``--model hf`` on the transformers model. Per example, the loglikelihoods agree to 1e-3, the
greedy flags are the same, and so are the generated texts.

lm-eval is installed beside the test environment, not in it (its ``datasets`` pins an older
``fsspec`` and a newer ``huggingface_hub`` than transformers takes): ``.ci/run`` builds a side
venv that sees this one's packages and names its ``lm_eval`` in ``ORTBATCH_LM_EVAL``. Without
it the test is skipped, except in CI, where it fails.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ortbatch import BatchedGenerator

from .conftest import TinyModel

pytestmark = [pytest.mark.slow, pytest.mark.export, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny"
LOGLIKELIHOOD = [
    ("Once upon a time there was", " a little model"),
    ("The quick brown fox", " jumps over the lazy dog"),
    ("Continuous batching lets", " new requests join"),
    ("Héllo wörld:", " ünïcode, emoji 🙂"),
]
GENERATE = ["Once upon a time", "The quick brown", "Continuous batching", "Héllo wörld"]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
"""
LL_METRICS = "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
GEN_METRICS = (
    'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n'
    "metric_list:\n  - metric: exact_match\n"
)


def _lm_eval() -> str:
    found = os.environ.get("ORTBATCH_LM_EVAL") or shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("lm-eval is not installed: .ci/run installs it and sets ORTBATCH_LM_EVAL")
        pytest.skip("lm-eval is not installed (set ORTBATCH_LM_EVAL to its lm_eval)")
    return found


def _greedy_pair(tiny: TinyModel) -> tuple[str, str]:
    """A context and the model's own greedy continuation of it whose text tokenizes back into
    the same tokens after the context (as the harness splits them)."""
    with BatchedGenerator(tiny.export, max_batch_size=1) as gen:
        for context in [c for c, _ in LOGLIKELIHOOD] + GENERATE:
            for k in (3, 2, 1):
                out = gen.generate(context, k)
                start = gen.encode(context)
                whole = gen.encode(context + out.text)
                if whole[: len(start)] == start and whole[len(start) :] == list(out.token_ids):
                    return context, out.text
    raise AssertionError("no greedy continuation tokenizes back to itself")


def _tasks(root: Path, tiny: TinyModel) -> Path:
    """The two tasks and their data, with one loglikelihood example the model's own greedy
    continuation (so the greedy flag is true somewhere)."""
    rows = [{"context": c, "target": t} for c, t in [*LOGLIKELIHOOD, _greedy_pair(tiny)]]
    (root / "ll.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "gen.jsonl").write_text("".join(json.dumps({"context": c, "target": ""}) + "\n" for c in GENERATE))
    tasks = root / "tasks"
    tasks.mkdir()
    ll = TASK.format(name="ortbatch_ll", data=root / "ll.jsonl", kind="loglikelihood") + LL_METRICS
    gen_task = TASK.format(name="ortbatch_gen", data=root / "gen.jsonl", kind="generate_until") + GEN_METRICS
    (tasks / "ll.yaml").write_text(ll)
    (tasks / "gen.yaml").write_text(gen_task)
    return tasks


def _run(lm_eval: str, tasks: Path, out: Path, model: str, model_args: str, *extra: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["HF_HOME"] = str(out / "hf-home")  # the datasets cache, not the user's
    cmd = [lm_eval, "run", "--model", model, "--model_args", model_args, "--tasks", "ortbatch_ll", "ortbatch_gen"]
    cmd += ["--include_path", str(tasks), "--output_path", str(out), "--log_samples", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _samples(out: Path, task: str) -> dict[int, Any]:
    (path,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
    return {d["doc_id"]: d["filtered_resps"] for d in map(json.loads, Path(path).read_text().splitlines())}


class Serve:
    """``ortbatch serve EXPORT --name tiny --port 0`` in a subprocess."""

    def __init__(self, export: Path, log: Path, *extra: str) -> None:
        self.log = log
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "ortbatch.cli", "serve", str(export), "--name", NAME, "--port", "0"]
        cmd += ["--log-level", "warning", "--no-access-log", "--allow-unvalidated", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ))
        deadline = time.monotonic() + 120
        while not (m := re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)
        self.url = m.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._fh.close()


def test_lm_eval_over_ortbatch_serve_equals_lm_eval_on_transformers(tiny_gpt2: TinyModel, tmp_path: Path) -> None:
    lm_eval = _lm_eval()
    tasks = _tasks(tmp_path, tiny_gpt2)
    served, local = tmp_path / "served", tmp_path / "hf"
    server = Serve(tiny_gpt2.export, tmp_path / "serve.log")
    try:
        args = f"model={NAME},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
        args += f"tokenizer={tiny_gpt2.source},num_concurrent=2,max_retries=1"
        _run(lm_eval, tasks, served, "local-completions", args)
    finally:
        server.stop()
    _run(lm_eval, tasks, local, "hf", f"pretrained={tiny_gpt2.source},dtype=float32", "--device", "cpu")
    got, want = _samples(served, "ortbatch_ll"), _samples(local, "ortbatch_ll")
    assert sorted(got) == sorted(want) == list(range(len(LOGLIKELIHOOD) + 1))
    for doc in want:
        (ll, greedy), (ll_hf, greedy_hf) = got[doc][0], want[doc][0]
        assert abs(float(ll) - float(ll_hf)) < 1e-3, (doc, ll, ll_hf)
        assert greedy == greedy_hf, doc
    assert got[len(LOGLIKELIHOOD)][0][1] == "True"  # the model's own continuation is greedy
    assert _samples(served, "ortbatch_gen") == _samples(local, "ortbatch_gen")
