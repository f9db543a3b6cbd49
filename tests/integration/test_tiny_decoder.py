"""`tiny:gpt2`: a decoder and its tokenizer built offline, so `ortbatch export`, `generate`
and `serve` (completions and chat) can be tried on a new machine in a minute."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("optimum.exporters.onnx")
    from ortbatch.cli import main

    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("exports") / "tiny-gpt2"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTBATCH_CACHE", str(cache))
        assert main(["export", "tiny:gpt2", "-o", str(out)]) == 0
        from ortbatch.export.tiny import build_tiny

        assert build_tiny("gpt2") == cache / "tiny-gpt2-v2"  # built once, then reused from the cache
    return out


def test_export_of_tiny_gpt2_is_a_checked_generation_export(tiny_gpt2: Path) -> None:
    from ortbatch.manifest import Manifest

    m = Manifest.load(tiny_gpt2).verify()
    assert m.validation["passed"] is True and m.source["model_ref"] == "tiny:gpt2"
    assert m.source["task"] == "text-generation-with-past" and m.generation
    assert (tiny_gpt2 / "tokenizer.json").is_file()


def test_generate_continues_what_it_learned(tiny_gpt2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ortbatch.cli import main

    assert main(["generate", str(tiny_gpt2), "Once upon a time", "What is", "-n", "16"]) == 0
    out = capsys.readouterr().out
    assert "Once upon a time there was a little model that wanted to generate text." in out
    assert "What is the capital of France?" in out
    assert "[stop," in out  # it ends on </s>, like the sentences it was trained on


def test_serve_answers_completions_and_chat(tiny_gpt2: Path) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    from ortbatch.serve import BackgroundServer, ServedGenerator

    with BackgroundServer(ServedGenerator.load(tiny_gpt2)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post(
            "/v1/completions",
            json={"model": "tiny-gpt2", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(" there was a little model")
        messages = [{"role": "user", "content": "Tell me a story."}]
        r = c.post(
            "/v1/chat/completions",
            json={"model": "tiny-gpt2", "messages": messages, "max_tokens": 24, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert "Once upon a time" in r.json()["choices"][0]["message"]["content"]
