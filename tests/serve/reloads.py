"""What the repository tests that reload and unload under load share: a repository whose
``cls`` export is swapped between an old and a new classifier beside a steady ``rr``
reranker, the answers each should give, and HTTP clients that record every answer."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tinytasks import build_classifier, run_alone
from tokenizers import Tokenizer

TEXT = "the quick brown fox"


def probs(d: Path, text: str = TEXT) -> np.ndarray:
    """The export's class probabilities for ``text``, run alone."""
    e = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text)
    logits = run_alone(d, e.ids, e.type_ids).astype(np.float64)
    p = np.exp(logits - logits.max())
    return p / p.sum()


def swap_in(src: Path, dst: Path) -> None:
    """Replace the export in ``dst`` with ``src``'s, each file atomically."""
    for f in ("model.onnx", "ortbatch.json", "config.json", "tokenizer.json"):
        tmp = dst / (f + ".new")
        shutil.copy(src / f, tmp)
        tmp.replace(dst / f)


def changing_repository(tmp_path: Path, reranker: Path) -> dict[str, Any]:
    """``tmp_path/repo`` with ``cls`` (a copy of an old classifier, to be replaced by
    ``new``) and ``rr`` (``reranker``), and what each answers for :data:`TEXT`: the old and
    the new ``cls`` probabilities, ``rr``'s raw score."""
    old_src = build_classifier(tmp_path / "old-src", 3, seed=1)
    new_src = build_classifier(tmp_path / "new-src", 3, seed=7)
    root = tmp_path / "repo"
    (root / "cls").mkdir(parents=True)
    for f in old_src.iterdir():
        shutil.copy(f, root / "cls" / f.name)
    (root / "rr").symlink_to(reranker, target_is_directory=True)
    e = Tokenizer.from_file(str(reranker / "tokenizer.json")).encode("q", TEXT)
    expected = {"old": probs(old_src), "new": probs(new_src), "rr": float(run_alone(reranker, e.ids, e.type_ids)[0])}
    assert not np.allclose(expected["old"], expected["new"], atol=1e-3)
    return {"root": root, "old": old_src, "new": new_src, "expected": expected}


class Clients:
    """Threads asking ``cls`` (/v1/classify) and ``rr`` (/v1/rerank) until stopped; every
    answer is recorded in ``seen`` (probabilities, a score, or the status of a failure) and
    every failure other than a 503 naming ``cls`` in ``problems``."""

    def __init__(self, url: str, per_model: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.seen: dict[str, list[Any]] = {"cls": [], "rr": []}
        self.problems: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(m,)) for m in ("cls", "rr") for _ in range(per_model)]

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _run(self, model: str) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.stop.is_set():
                if model == "cls":
                    r = c.post("/v1/classify", json={"model": "cls", "input": TEXT})
                else:
                    r = c.post(
                        "/v1/rerank", json={"model": "rr", "query": "q", "documents": [TEXT], "raw_scores": True}
                    )
                if r.status_code != 200:
                    self.seen[model].append(r.status_code)
                    if model != "cls" or r.status_code != 503 or "'cls'" not in r.text:
                        self.problems.append(f"{model}: {r.status_code} {r.text}")
                    continue
                body = r.json()
                if model == "cls":
                    self.seen[model].append(np.array(body["data"][0]["probs"]))
                else:
                    self.seen[model].append(body["results"][0]["relevance_score"])

    def wait_for_answers(self, count: int = 8) -> None:
        """Until the last ``count`` answers of ``cls`` are all answers (not failures)."""
        while sum(isinstance(x, np.ndarray) for x in self.seen["cls"][-count:]) < count:
            threading.Event().wait(0.05)

    def check(self, expected: dict[str, Any], last: str) -> None:
        """Nothing failed but ``cls``'s 503s; ``cls`` answered the old and the new model and
        nothing else, ``last`` at the end; ``rr`` never failed and always answered its score."""
        assert not self.problems, self.problems[:5]
        answers = [x for x in self.seen["cls"] if isinstance(x, np.ndarray)]
        assert {which(a, expected) for a in answers} == {"old", "new"}  # both seen, nothing else
        assert which(answers[-1], expected) == last
        assert self.seen["rr"] and all(not isinstance(x, int) for x in self.seen["rr"])
        np.testing.assert_allclose(self.seen["rr"], expected["rr"], atol=1e-5)


def which(p: np.ndarray, expected: dict[str, Any]) -> str:
    """``"old"`` or ``"new"``: the ``cls`` model that answered ``p`` (or ``"neither"``)."""
    for kind in ("old", "new"):
        if np.allclose(p, expected[kind], atol=1e-5):
            return kind
    return "neither"
