"""Log-mel features in numpy against transformers' WhisperFeatureExtractor, on the same samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ortbatch.audio import FeatureSettings, log_mel_spectrogram, mel_filter_bank
from ortbatch.errors import InvalidInputError, ManifestError
from tests.audio.media import tone

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")  # transformers' own path (torch.stft) is the reference

TOL = 1e-4  # max abs difference, in the features' own units (about -1.5 .. 1.5)


def _extractor(n_mels: int):
    return transformers.WhisperFeatureExtractor(feature_size=n_mels)


def _clips(speech: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "speech 1 s": speech[:16000],
        "speech 7.3 s": speech[:116800],
        "speech all": speech,
        "speech 30 s": np.resize(speech, 480000),
        "speech 47 s (truncated)": np.resize(speech, 752000),
        "tone 2.5 s": tone(2.5, 300.0),
        "silence 3 s": np.zeros(48000, np.float32),
        "noise 4 s": (0.05 * rng.standard_normal(64000)).astype(np.float32),
        "odd length": speech[:16001],
        "float64 input": speech[:32000].astype(np.float64),
    }


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filter_bank_is_transformers(n_mels: int) -> None:
    np.testing.assert_allclose(mel_filter_bank(n_mels), _extractor(n_mels).mel_filters, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_padded_windows_equal_transformers(n_mels: int, speech16k: np.ndarray) -> None:
    fe, settings = _extractor(n_mels), FeatureSettings(feature_size=n_mels)
    for name, clip in _clips(speech16k).items():
        ref = fe(clip, sampling_rate=16000, return_tensors="np").input_features[0]
        ours = log_mel_spectrogram(clip, settings)
        assert ours.shape == ref.shape == (n_mels, 3000), name
        assert ours.dtype == np.float32
        diff = float(np.abs(ours - ref).max())
        assert diff <= TOL, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("n_mels", [80, 128])
def test_long_form_equals_transformers(n_mels: int, speech16k: np.ndarray) -> None:
    """``truncation=False, padding="longest"``: the un-padded features transformers' long-form
    generate slices its windows from, normalised over the whole file."""
    fe, settings = _extractor(n_mels), FeatureSettings(feature_size=n_mels)
    for name, clip in _clips(speech16k).items():
        kwargs = {"truncation": False, "padding": "longest", "return_attention_mask": True}
        ref = fe(clip, sampling_rate=16000, return_tensors="np", **kwargs)
        ours = log_mel_spectrogram(clip, settings, padding="longest")
        assert ours.shape == ref.input_features[0].shape == (n_mels, clip.shape[0] // 160), name
        assert ref.attention_mask.shape[1] == ours.shape[1]
        diff = float(np.abs(ours - ref.input_features[0]).max())
        assert diff <= TOL, f"{name}: max abs diff {diff}"


def test_long_form_is_not_per_window(speech16k: np.ndarray) -> None:
    """The floor (max - 8) is the whole file's: a loud part lifts a quiet part's floor."""
    quiet_then_loud = np.concatenate([0.001 * speech16k[:48000], speech16k[:48000]])
    whole = log_mel_spectrogram(quiet_then_loud, padding="longest")
    alone = log_mel_spectrogram(quiet_then_loud[:48000], padding="longest")
    assert not np.allclose(whole[:, :300], alone[:, :300], atol=1e-3)


def test_settings_from_a_saved_extractor(tmp_path: Path) -> None:
    fe = transformers.WhisperFeatureExtractor(feature_size=128, chunk_length=20)
    fe.save_pretrained(tmp_path)
    settings = FeatureSettings.load(tmp_path)
    assert settings.feature_size == 128
    assert settings.n_samples == fe.n_samples and settings.nb_max_frames == fe.nb_max_frames
    assert FeatureSettings.from_dict(settings.to_dict()) == settings
    clip = tone(25.0, 440.0)
    ref = fe(clip, sampling_rate=16000, return_tensors="np").input_features[0]
    ours = log_mel_spectrogram(clip, settings)
    assert ours.shape == ref.shape == (128, 2000)
    assert float(np.abs(ours - ref).max()) <= TOL


def test_settings_refuse_what_they_cannot_reproduce(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="dither"):
        FeatureSettings.from_dict({"feature_size": 80, "dither": 1e-5})
    with pytest.raises(ManifestError, match="WhisperFeatureExtractor"):
        FeatureSettings.from_dict({"feature_extractor_type": "Wav2Vec2FeatureExtractor"})
    with pytest.raises(ManifestError, match="feature_size"):
        FeatureSettings.from_dict({"feature_size": 0})
    with pytest.raises(ManifestError, match="missing"):
        FeatureSettings.load(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ManifestError, match="JSON"):
        FeatureSettings.load(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"hop_length": "160"}), encoding="utf-8")
    with pytest.raises(ManifestError, match="hop_length"):
        FeatureSettings.load(tmp_path)


def test_bad_samples_are_typed_errors() -> None:
    with pytest.raises(InvalidInputError, match="mono"):
        log_mel_spectrogram(np.zeros((2, 16000), np.float32))
    with pytest.raises(InvalidInputError, match="NaN"):
        log_mel_spectrogram(np.full(16000, np.nan, np.float32))
    with pytest.raises(InvalidInputError, match="no samples"):
        log_mel_spectrogram(np.zeros(0, np.float32), padding="longest")
    with pytest.raises(InvalidInputError, match="too short"):
        log_mel_spectrogram(np.zeros(100, np.float32), padding="longest")
    with pytest.raises(ValueError, match="padding"):
        log_mel_spectrogram(np.zeros(16000, np.float32), padding="right")
