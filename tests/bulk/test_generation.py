"""A text-generation export through ``ortbatch run``: each prompt's generation equals
``BatchedGenerator.generate`` of that prompt alone (greedy), in input order; a prompt too
long for the context fails into the errors file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ortbatch

from .conftest import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.export]


def test_generations_equal_the_generator_alone(tmp_path: Path) -> None:
    from ortbatch import BatchedGenerator
    from tests.generation.conftest import CORPUS, _build

    model = _build("gpt2", tmp_path)
    prompts = [CORPUS[i % 4][: 5 + 7 * i] for i in range(7)]
    docs: list[object] = [{"prompt": p, "n": i} for i, p in enumerate(prompts)]
    docs.insert(3, {"prompt": "word " * 200, "n": "long"})  # past the 96-position context
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    summary = ortbatch.run(
        model.export,
        src,
        tmp_path / "out",
        window=4,
        max_new_tokens=8,
        id_column="n",
        output_format="jsonl",
        progress=False,
    )
    assert summary.rows == 8 and summary.failed == 1 and summary.exit_code == 3
    lines = [json.loads(x) for p in sorted((tmp_path / "out").glob("part-*")) for x in p.read_text().splitlines()]
    assert [x["id"] for x in lines] == list(range(7))
    with BatchedGenerator(model.export) as gen:
        for line, p in zip(lines, prompts, strict=True):
            want = gen.generate(p, 8)
            assert (line["text"], line["finish_reason"], line["completion_tokens"]) == (
                want.text,
                want.finish_reason,
                want.completion_tokens,
            )
    (err,) = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    assert err["id"] == "long" and err["row"] == 3
