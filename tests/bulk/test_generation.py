"""A text-generation export through ``ortbatch run``: each prompt's generation equals
``BatchedGenerator.generate`` of that prompt alone (greedy), in input order; a prompt too
long for the context fails into the errors file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import ortbatch

from .conftest import cli, output_bytes, write_jsonl

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


# -- --sampling: serve's sampling fields, a seed per row ------------------------------------------
SAMPLING = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 5}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.generation.conftest import _build

    return _build("gpt2", tmp_path_factory.mktemp("sampling")).export


def test_sampling_fields_reach_sampling_params_as_serve_reads_them() -> None:
    from ortbatch.bulk.tasks import job_sampling
    from ortbatch.errors import InvalidInputError
    from ortbatch.generation import SamplingParams

    params = job_sampling({**SAMPLING, "stop": "fox", "min_p": 0.1, "logit_bias": {"7": -100}}, 8)
    want = SamplingParams(
        temperature=0.9, top_k=40, top_p=0.95, seed=5, stop=("fox",), min_p=0.1, logit_bias={7: -100.0}
    )
    assert params == dataclasses.replace(want, max_new_tokens=8)
    assert job_sampling(None, 8) == SamplingParams(max_new_tokens=8)  # greedy
    assert job_sampling({"seed": 1}, 8).temperature == 1.0  # serve's default temperature
    with pytest.raises(InvalidInputError, match="unknown parameter 'n'"):
        job_sampling({"n": 2}, 8)
    with pytest.raises(InvalidInputError, match=r"'temperature' must be in \[0, 2\]"):
        job_sampling({"temperature": 5}, 8)


def test_sampled_rows_equal_the_generator_with_the_rows_seed(gpt2: Path, tmp_path: Path) -> None:
    from ortbatch import BatchedGenerator
    from ortbatch.bulk.sources import Row
    from ortbatch.bulk.tasks import job_sampling, row_seed
    from tests.generation.conftest import CORPUS

    prompts = [CORPUS[i % 4][: 5 + 7 * i] for i in range(5)] + [CORPUS[0][:12]] * 3
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in prompts])
    common: dict[str, Any] = {"window": 3, "max_new_tokens": 8, "output_format": "jsonl", "progress": False}
    summary = ortbatch.run(gpt2, src, tmp_path / "out", sampling=SAMPLING, **common)
    assert summary.succeeded == len(prompts)
    lines = [json.loads(x) for p in sorted((tmp_path / "out").glob("part-*")) for x in p.read_text().splitlines()]
    params = job_sampling(SAMPLING, 8)
    with BatchedGenerator(gpt2) as gen:
        for k, (line, p) in enumerate(zip(lines, prompts, strict=True)):
            want = gen.generate(p, params=dataclasses.replace(params, seed=row_seed(5, Row(k))))
            assert (line["text"], line["completion_tokens"]) == (want.text, want.completion_tokens)
    assert len({line["text"] for line in lines[5:]}) > 1  # the same prompt, each row its own seed
    greedy = ortbatch.run(gpt2, src, tmp_path / "greedy", **common)
    assert greedy.succeeded == len(prompts)
    assert (tmp_path / "greedy" / "part-000000.jsonl").read_bytes() != (
        tmp_path / "out" / "part-000000.jsonl"
    ).read_bytes()


def test_a_sampled_job_sigkilled_then_rerun_gives_the_uninterrupted_bytes(gpt2: Path, tmp_path: Path) -> None:
    from tests.generation.conftest import CORPUS

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": CORPUS[i % 4][: 4 + 5 * i]} for i in range(9)])
    args = (str(gpt2), str(src), "--window", "3", "-n", "6", "--sampling", json.dumps({"temperature": 1.0}))
    whole = cli(*args, "-o", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    killed = cli(*args, "-o", str(tmp_path / "out"), env={"ORTBATCH_RUN_KILL_AT": "1:renamed"})
    assert killed.returncode == -9, killed.stderr
    again = cli(*args, "-o", str(tmp_path / "out"))
    assert again.returncode == 0 and "resumed after 3 rows" in again.stderr, again.stderr
    assert output_bytes(tmp_path / "out") == output_bytes(tmp_path / "whole")
    other = cli(*args[:-1], json.dumps({"temperature": 0.5}), "-o", str(tmp_path / "out"))
    assert other.returncode == 2 and "different task" in other.stderr  # another job: resume refuses it


def test_a_generation_window_sigkilled_mid_way_restores_its_finished_rows(gpt2: Path, tmp_path: Path) -> None:
    from tests.generation.conftest import CORPUS

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": CORPUS[i % 4][: 4 + 3 * i]} for i in range(12)])
    args = (str(gpt2), str(src), "-n", "6", "--sampling", json.dumps({"temperature": 1.0, "seed": 3}))
    whole = cli(*args, "-o", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    # one window of 12 rows: SIGKILL once its checkpoint holds 5 finished rows
    killed = cli(*args, "-o", str(tmp_path / "out"), env={"ORTBATCH_RUN_KILL_AT": "0:rows:5"})
    assert killed.returncode == -9, killed.stderr
    from ortbatch.bulk.checkpoint import journal_rows

    held = journal_rows(tmp_path / "out" / "_journal" / "000000.log")
    assert 5 <= held < 12
    again = cli(*args, "-o", str(tmp_path / "out"))
    assert again.returncode == 0, again.stderr
    assert f"resumed after 0 rows; {held} more restored from a checkpoint" in again.stderr, again.stderr
    assert output_bytes(tmp_path / "out") == output_bytes(tmp_path / "whole")
    assert not list((tmp_path / "out" / "_journal").iterdir())


def test_bad_sampling_is_a_one_line_cli_error(gpt2: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for value, said in [
        ('{"frobnicate": 1}', "unknown parameter 'frobnicate'"),
        ('{"max_tokens": 3}', "use --max-new-tokens"),
        ('{"temperature": 5}', "'temperature' must be in [0, 2]"),
        ("[1]", "must be a JSON object"),
        ("{not json", "must be a JSON object"),
    ]:
        proc = cli(str(gpt2), str(src), "-o", str(tmp_path / "out"), "--sampling", value)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2, proc.stderr
