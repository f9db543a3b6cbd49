"""``ortbatch export`` of a tiny random Whisper checkpoint, checked against transformers on
espeak-ng speech, and the static greedy transcriber against ``generate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")

from ortbatch.audio import log_mel_spectrogram
from ortbatch.audio.transcriber import WhisperGraphs, transcribe
from ortbatch.audio.whisper import WhisperSpec
from ortbatch.errors import ExportError, InvalidInputError
from tests.audio.whisper_tiny import build_whisper

pytestmark = [pytest.mark.export, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_whisper(tmp_path_factory.mktemp("whisper") / "src")


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def exported(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    from ortbatch.export import export_model

    return export_model(str(checkpoint), tmp_path_factory.mktemp("whisper-export") / "onnx")


@pytest.fixture(scope="module")
def graphs(exported) -> WhisperGraphs:
    return WhisperGraphs(exported.directory)


@pytest.fixture(scope="module")
def clips(speech16k: np.ndarray) -> list[np.ndarray]:
    """espeak-ng speech from 1 s to 30 s, and silence."""
    return [
        speech16k[:16000],
        speech16k[: 16000 * 5],
        speech16k,
        np.resize(speech16k, 480000),
        np.zeros(24000, np.float32),
    ]


def test_export_writes_what_decoding_needs(exported, checkpoint: Path) -> None:
    from transformers import GenerationConfig

    assert exported.passed, exported.report.summary()
    directory = exported.directory
    doc = json.loads((directory / "ortbatch.json").read_text(encoding="utf-8"))
    assert doc["source"]["task"] == "automatic-speech-recognition-with-past"
    assert doc["source"]["family"] == "speech-seq2seq"
    assert set(doc["components"]) == {"encoder", "decoder", "decoder_with_past"}
    gen = GenerationConfig.from_pretrained(checkpoint)
    spec = WhisperSpec.from_dict(doc["whisper"])
    assert spec.decoder_start_token_id == gen.decoder_start_token_id
    assert spec.no_timestamps_token_id == gen.no_timestamps_token_id
    assert dict(spec.lang_to_id) == gen.lang_to_id and dict(spec.task_to_id) == gen.task_to_id
    assert list(spec.suppress_tokens) == gen.suppress_tokens
    assert list(spec.begin_suppress_tokens) == gen.begin_suppress_tokens
    assert [list(h) for h in spec.alignment_heads or ()] == gen.alignment_heads
    assert spec.max_target_positions == 448 and spec.language_names["french"] == "fr"
    assert doc["features"]["feature_size"] == 80 and doc["features"]["chunk_length"] == 30
    for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx", "tokenizer.json"):
        assert (directory / name).is_file(), name
    names = {c["check"] for c in json.loads((directory / "validation.json").read_text(encoding="utf-8"))["checks"]}
    assert names == {"encoder parity", "decoder parity", "greedy tokens", "batching invariance"}


def test_checks_pass_on_espeak_speech(exported, reference, clips: list[np.ndarray]) -> None:
    from ortbatch.export.whisper import validate_whisper

    report = validate_whisper(exported.directory, reference=reference, clips=clips, save=False)
    assert report.passed, report.format_table(verbose=True)
    assert [c.status for c in report.checks] == ["passed"] * 4


def test_checks_fail_against_another_model(exported, checkpoint: Path, clips, tmp_path: Path) -> None:
    """The checks can fail: the same graphs against a checkpoint with other weights."""
    from transformers import WhisperForConditionalGeneration

    from ortbatch.export.whisper import validate_whisper

    other = WhisperForConditionalGeneration.from_pretrained(build_whisper(tmp_path / "other", seed=1)).eval()
    report = validate_whisper(exported.directory, reference=other, clips=clips[:2], save=False, greedy_tokens=4)
    failed = {c.name for c in report.failed()}
    assert {"encoder parity", "decoder parity", "greedy tokens"} <= failed
    assert "batching invariance" not in failed


def _generated(row: list[int], eos: int) -> list[int]:
    """What generate returns for a row without ``force_unique_generate_call``: the tokens of its
    segments, one window after another, padded with the end of text."""
    return row[: row.index(eos)] if eos in row else row


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"language": "en", "task": "transcribe"},
        {"language": "german", "task": "translate"},
        {"language": "en", "prompt": "Batching requests"},
    ],
    ids=["detected", "en", "german-translate", "prompt"],
)
def test_transcribe_equals_generate(graphs: WhisperGraphs, reference, clips, checkpoint: Path, options) -> None:
    import torch
    from transformers import WhisperProcessor

    spec = graphs.spec
    language, task = options.get("language"), options.get("task")
    prompt, timestamps = options.get("prompt"), options.get("timestamps", False)
    kwargs = {"language": language, "task": task, "return_timestamps": timestamps, "max_new_tokens": 12}
    if prompt is not None:
        kwargs["prompt_ids"] = torch.from_numpy(WhisperProcessor.from_pretrained(checkpoint).get_prompt_ids(prompt))
    features = np.stack([log_mel_spectrogram(c) for c in clips])
    with torch.inference_mode():
        out = reference.generate(torch.from_numpy(features), do_sample=False, num_beams=1, **kwargs)
    rows = (out["sequences"] if isinstance(out, dict) else out).tolist()
    theirs = [_generated(row, spec.eos_token_id) for row in rows]

    asked = {"language": language, "task": task, "prompt": prompt, "timestamps": timestamps, "max_new_tokens": 12}
    batched = transcribe(graphs, clips, **asked)
    assert isinstance(batched, list)
    assert [list(r.tokens) for r in batched] == theirs
    alone = [transcribe(graphs, c, **asked) for c in clips[:2]]
    assert [a.tokens for a in alone] == [b.tokens for b in batched[:2]]  # type: ignore[union-attr]
    if language is None:  # detected as generate detects it
        import torch as _torch

        with _torch.inference_mode():
            want = reference.detect_language(_torch.from_numpy(features)).tolist()
        assert [r.language_id for r in batched] == want
    if timestamps:
        for r in batched:
            starts = [s.start for s in r.segments]
            assert starts == sorted(starts) and all(0 <= s.start <= s.end <= 30 for s in r.segments)
    else:
        assert all(r.segments == () for r in batched)
    assert all(isinstance(r.text, str) for r in batched)


def test_refusals(exported, checkpoint: Path, graphs: WhisperGraphs, speech16k: np.ndarray, tmp_path: Path) -> None:
    from ortbatch.export import export_model

    with pytest.raises(ExportError, match="fp16 is not supported"):
        export_model(str(checkpoint), tmp_path / "fp16", dtype="fp16")
    with pytest.raises(ExportError, match="automatic-speech-recognition-with-past"):
        export_model(str(checkpoint), tmp_path / "nopast", task="automatic-speech-recognition")
    assert not (tmp_path / "fp16").exists() and not (tmp_path / "nopast").exists()
    long = np.resize(speech16k, 16000 * 40)
    with pytest.raises(InvalidInputError, match="needs timestamps=True"):
        transcribe(graphs, long)
    with pytest.raises(InvalidInputError, match="language 'klingon'"):
        transcribe(graphs, speech16k[:16000], language="klingon")
    with pytest.raises(InvalidInputError, match="exceed the model's 448 positions"):
        transcribe(graphs, speech16k[:16000], language="en", max_new_tokens=445)


def test_long_form_equals_generate(graphs: WhisperGraphs, reference, speech16k: np.ndarray) -> None:
    """transformers' sequential long-form algorithm on 75 s of speech: the same tokens."""
    import torch

    audio = np.resize(speech16k, 16000 * 75)
    features = log_mel_spectrogram(audio, padding="longest")
    with torch.inference_mode():
        out = reference.generate(
            torch.from_numpy(features[None]),
            language="en",
            task="transcribe",
            return_timestamps=True,
            return_segments=True,
            max_new_tokens=24,
            do_sample=False,
        )
    want = [[int(t) for t in seg["tokens"]] for seg in out["segments"][0]]
    got = transcribe(graphs, audio, language="en", task="transcribe", timestamps=True, max_new_tokens=24)
    assert [list(s.tokens) for s in got.segments] == want
    assert [(s.start, s.end) for s in got.segments] == [
        (float(s["start"]), float(s["end"])) for s in out["segments"][0]
    ]
    # random weights put timestamps anywhere (past the end of the audio too), as in transformers;
    # the windows still only move forward
    starts = [s.start for s in got.segments]
    assert starts == sorted(starts) and len(got.segments) > 1


def test_validate_dispatches_to_the_whisper_checks(exported) -> None:
    """``ortbatch validate DIR`` on a speech export runs these checks (here ONNX-only)."""
    from ortbatch.export import validate

    report = validate(exported.directory, use_reference=False, save=False)
    assert [(c.name, c.status) for c in report.checks] == [
        ("reference parity", "skipped"),
        ("batching invariance", "passed"),
    ]
    assert report.passed


def test_transcribe_a_spoken_file(graphs: WhisperGraphs, spoken_files: list[Path]) -> None:
    from ortbatch.audio import load_audio

    from_file = transcribe(graphs, spoken_files[1], language="en", max_new_tokens=8)
    from_samples = transcribe(graphs, load_audio(spoken_files[1]), language="en", max_new_tokens=8)
    assert isinstance(from_file, type(from_samples)) and from_file == from_samples
    assert from_file.language_id == graphs.spec.lang_to_id["<|en|>"]


def test_a_128_bin_checkpoint(tmp_path: Path, speech16k: np.ndarray) -> None:
    """large-v3's feature size: 128 mel bins through export, checks and transcription."""
    from ortbatch.export import export_model

    source = build_whisper(tmp_path / "src128", n_mels=128, layers=1)
    result = export_model(str(source), tmp_path / "onnx128")
    assert result.passed, result.report.summary()
    graphs = WhisperGraphs(result.directory)
    assert graphs.features.feature_size == 128
    assert transcribe(graphs, speech16k[:32000], language="en", max_new_tokens=4).tokens


def test_other_speech_architectures_are_refused_up_front() -> None:
    from types import SimpleNamespace

    from ortbatch.errors import UnsupportedModelError
    from ortbatch.export.recipes import Recipe
    from ortbatch.export.whisper import check_recipe

    s2t = SimpleNamespace(model="facebook/s2t-small", model_type="speech-to-text", task="automatic-speech-recognition")
    with pytest.raises(UnsupportedModelError, match=r"'speech-to-text'.*Whisper checkpoints"):
        check_recipe(Recipe(), s2t)
