"""Whisper's decoding rules in numpy against transformers' own code, on the same logits and tokens."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from ortbatch.audio import whisper as W
from ortbatch.errors import InvalidInputError, ManifestError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin  # noqa: E402
from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE  # noqa: E402

# the ids of the released multilingual checkpoints (whisper-tiny .. large-v2)
EOT, SOT, NO_TS = 50257, 50258, 50363
LANG_TO_ID = {f"<|{code}|>": SOT + 1 + i for i, code in enumerate(list(LANGUAGES)[:99])}
TASK_TO_ID = {"translate": 50358, "transcribe": 50359}
VOCAB = 51865
TS = NO_TS + 1


def _generation_config(**overrides) -> GenerationConfig:
    base = dict(
        decoder_start_token_id=SOT,
        eos_token_id=EOT,
        pad_token_id=EOT,
        bos_token_id=EOT,
        no_timestamps_token_id=NO_TS,
        prev_sot_token_id=50361,
        lang_to_id=LANG_TO_ID,
        task_to_id=TASK_TO_ID,
        is_multilingual=True,
        suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92, 93, 50360],
        begin_suppress_tokens=[220, EOT],
        max_initial_timestamp_index=50,
        max_length=448,
    )
    base.update(overrides)
    return GenerationConfig(**base)


def _spec(gen: GenerationConfig) -> W.WhisperSpec:
    config = {"vocab_size": VOCAB, "max_target_positions": 448}
    return W.WhisperSpec.from_configs(gen.to_dict(), config, language_names=TO_LANGUAGE_CODE)


def test_spec_round_trips_and_refuses_a_checkpoint_without_timestamps() -> None:
    spec = _spec(_generation_config(forced_decoder_ids=[[1, None], [2, 50359]], alignment_heads=[[2, 3], [3, 0]]))
    assert W.WhisperSpec.from_dict(spec.to_dict()) == spec
    assert spec.timestamp_begin == TS and spec.language_names["english"] == "en"
    assert spec.forced_decoder_ids == ((1, None), (2, 50359)) and spec.alignment_heads == ((2, 3), (3, 0))
    with pytest.raises(ManifestError, match="no_timestamps_token_id"):
        W.WhisperSpec.from_configs({"decoder_start_token_id": SOT, "eos_token_id": EOT}, {"vocab_size": VOCAB})
    with pytest.raises(ManifestError, match="timestamp_begin"):
        W.WhisperSpec.from_dict({**spec.to_dict(), "timestamp_begin": 3})


# -- the initial tokens -------------------------------------------------------------------------


def _theirs_init(gen: GenerationConfig, task, language, timestamps, detected: int) -> list[int]:
    gen = GenerationConfig.from_dict(gen.to_dict())
    gen.task, gen.language, gen.return_timestamps = task, language, timestamps
    fake = SimpleNamespace(
        device=torch.device("cpu"),
        detect_language=lambda **kw: torch.tensor([detected]),
    )
    out = WhisperGenerationMixin._retrieve_init_tokens(
        fake, None, batch_size=1, generation_config=gen, config=SimpleNamespace(), num_segment_frames=3000, kwargs={}
    )
    return out[0].tolist()


@pytest.mark.parametrize(
    "forced",
    [None, [[1, None], [2, 50359]], [[1, LANG_TO_ID["<|en|>"]], [2, 50358], [3, NO_TS]]],
    ids=["no-forced", "forced-transcribe", "forced-en-translate-nots"],
)
def test_initial_tokens_equal_transformers(forced) -> None:
    gen = _generation_config(forced_decoder_ids=forced)
    spec = _spec(gen)
    detected = LANG_TO_ID["<|de|>"]
    for task, language, timestamps in itertools.product(
        [None, "transcribe", "translate"], [None, "en", "English", "<|fr|>", "DE"], [False, True]
    ):
        want = _theirs_init(gen, task, language, timestamps, detected)
        needs = W.needs_language(spec, task=task, language=language)
        got = W.initial_tokens(
            spec, task=task, language=language, timestamps=timestamps, detected_language_id=detected if needs else None
        )
        assert got == want, (task, language, timestamps)


def test_initial_tokens_refuse_unknown_languages_and_tasks() -> None:
    spec = _spec(_generation_config())
    with pytest.raises(InvalidInputError, match="language 'klingon'") as info:
        W.initial_tokens(spec, language="klingon")
    assert info.value.input_name == "language"
    with pytest.raises(InvalidInputError, match="task must be one of transcribe, translate"):
        W.initial_tokens(spec, task="summarize", language="en")
    with pytest.raises(ValueError, match="detected"):
        W.initial_tokens(spec)


def test_detect_language_equals_transformers() -> None:
    gen = _generation_config()
    spec = _spec(gen)
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, VOCAB)).astype(np.float32) * 4
    logits[:, EOT] = 100.0  # a likelier non-language token must not win

    class FakeModel:
        device = torch.device("cpu")

        def __call__(self, **kw):
            return SimpleNamespace(logits=torch.from_numpy(logits)[:, None, :].clone())

    want = WhisperGenerationMixin.detect_language(
        FakeModel(), input_features=torch.zeros(5, 80, 3000), generation_config=gen
    )
    np.testing.assert_array_equal(W.detect_language(spec, logits), want.numpy())


def test_prompt_tokens() -> None:
    spec = _spec(_generation_config())
    assert W.prompt_tokens(spec, [400, 500]) == [50361, 400, 500]
    with pytest.raises(InvalidInputError, match="special token id 50258"):
        W.prompt_tokens(spec, [400, SOT])
    with pytest.raises(InvalidInputError, match="at most 222"):
        W.prompt_tokens(spec, list(range(300)))


# -- logits ---------------------------------------------------------------------------------------


def _patterns(rng: np.random.Generator) -> list[list[int]]:
    def text() -> int:
        return int(rng.integers(300, EOT))

    def ts(at: int) -> int:
        return TS + at

    return [
        [],
        [ts(0)],
        [ts(0), text()],
        [ts(0), text(), ts(30)],
        [ts(0), text(), ts(30), ts(30)],
        [ts(3), text(), text(), ts(40), ts(41), text()],
        [text(), text()],
        [ts(1), ts(1)],
        [text(), ts(1400)],
        [ts(5), text(), ts(9), ts(9), text(), ts(12)],
    ]


@pytest.mark.parametrize("timestamps", [False, True])
def test_logit_rules_equal_transformers(timestamps: bool) -> None:
    gen = _generation_config()
    spec = _spec(gen)
    rng = np.random.default_rng(0)
    prefixes = [[SOT, LANG_TO_ID["<|en|>"], 50359], [50361, 700, 800, SOT, LANG_TO_ID["<|en|>"], 50359]]
    for prefix in prefixes:
        begin = len(prefix)
        theirs = [
            SuppressTokensAtBeginLogitsProcessor(gen.begin_suppress_tokens, begin_index=begin),
            SuppressTokensLogitsProcessor(gen.suppress_tokens),
        ]
        if timestamps:
            theirs.append(WhisperTimeStampLogitsProcessor(gen, begin_index=begin))
        ours = W.LogitRules(spec, timestamps=timestamps)
        for pattern in _patterns(rng):
            rows = 3
            seqs = np.array([prefix + pattern] * rows, dtype=np.int64)
            scores = rng.standard_normal((rows, VOCAB)).astype(np.float32) * 3
            scores[1, TS:] += 6.0  # a row where timestamps win by their total probability
            scores[2, TS + 10] = 30.0  # and one where a single timestamp is likeliest
            want = torch.from_numpy(scores.copy())
            for proc in theirs:
                want = proc(torch.from_numpy(seqs), want)
            got = ours(seqs, scores, begin)
            np.testing.assert_array_equal(got, want.numpy(), err_msg=f"{prefix} {pattern}")


def test_logit_rules_take_a_begin_index_per_row() -> None:
    """Rows decoded together may have prefixes of different lengths (a prompt on one row)."""
    gen = _generation_config()
    spec = _spec(gen)
    rng = np.random.default_rng(3)
    rules = W.LogitRules(spec, timestamps=True)
    rows = [[SOT, 50259, 50359], [50361, 700, SOT, 50259, 50359, TS, 900]]
    scores = rng.standard_normal((2, VOCAB)).astype(np.float32)
    got = rules(rows, scores, [3, 5])
    for k, (row, begin) in enumerate(zip(rows, [3, 5], strict=True)):
        alone = rules([row], scores[k : k + 1], begin)
        np.testing.assert_array_equal(got[k], alone[0])


# -- segments and windows ---------------------------------------------------------------------


def _theirs_segments(tokens: list[int], seek: int, window_frames: int):
    time_offset = torch.tensor([seek], dtype=torch.long).to(torch.float64) * 0.02 / 2
    segments, offset = WhisperGenerationMixin._retrieve_segment(
        seek_sequence=torch.tensor(tokens),
        seek_outputs=[None],
        time_offset=time_offset,
        timestamp_begin=TS,
        seek_num_frames=torch.tensor([window_frames]),
        time_precision=0.02,
        time_precision_features=0.01,
        input_stride=2,
        prev_idx=0,
        idx=0,
        return_token_timestamps=False,
        decoder_input_ids=torch.zeros(1, 4, dtype=torch.long),
    )
    return [(float(s["start"]), float(s["end"]), tuple(s["tokens"].tolist())) for s in segments], int(offset)


def test_segments_and_advance_equal_transformers() -> None:
    rng = np.random.default_rng(0)
    spec = _spec(_generation_config())
    cases = [*_patterns(rng), [TS + 0, 500, 600, TS + 250, TS + 250, 700, TS + 600, EOT]]
    cases += [[*p, EOT] for p in _patterns(rng) if p]
    for tokens, (seek, frames) in itertools.product(cases, [(0, 3000), (4410, 3000), (9000, 1234)]):
        if not tokens:
            continue
        want, want_offset = _theirs_segments(tokens, seek, frames)
        got, offset = W.split_segments(spec, tokens, time_offset=seek * 0.02 / 2, window_frames=frames)
        assert offset == want_offset, tokens
        assert [(s.start, s.end, s.tokens) for s in got] == want, tokens


def test_window_equals_transformers() -> None:
    rng = np.random.default_rng(0)
    features = rng.standard_normal((80, 7321)).astype(np.float32)
    for seek in (0, 2999, 3000, 6000, 7320):
        frames = min(3000, 7321 - seek)
        want = WhisperGenerationMixin._get_input_segment(
            torch.from_numpy(features)[None],
            torch.tensor([seek]),
            torch.tensor([frames]),
            3000,
            1,
            [0],
        )
        got, real = W.window(features, seek)
        assert real == frames
        np.testing.assert_array_equal(got, want[0].numpy())
    with pytest.raises(ValueError, match="outside"):
        W.window(features, 7321)
