"""Whisper's log-mel features in numpy, equal to transformers' ``WhisperFeatureExtractor``.

transformers computes them with ``torch.stft`` when torch is importable (always, where a
checkpoint is exported) and with its own numpy ``spectrogram`` otherwise; both are the
same recipe, which this module follows without torch:

1. the waveform (float32, mono, 16 kHz) is padded with zeros or cut to ``n_samples``
   (30 s) — or, for transformers' long-form path (``truncation=False, padding="longest"``),
   left as long as it is;
2. a centred STFT: ``n_fft // 2`` samples of *reflect* padding at both ends, a periodic
   Hann window of ``n_fft`` (400) samples every ``hop_length`` (160), the power spectrum;
   the last frame is dropped (``stft[..., :-1]``), so 30 s give exactly 3000 frames;
3. a Slaney-normalised, Slaney-scale mel filter bank (0 to 8 kHz, ``feature_size`` = 80
   or 128 filters) applied to the power spectrum;
4. ``log10(max(mel, 1e-10))``, floored at (the waveform's maximum - 8), then
   ``(x + 4) / 4``.

The maximum in step 4 is taken over the *whole* waveform (after padding), which is why the
long-form features of a 90-s file are not the concatenation of three 30-s extractions: the
decoder's windows are slices of one extraction (see :mod:`ortbatch.audio.whisper`).

The arithmetic runs in float64 and is returned as float32; transformers' torch path runs in
float32, so the two agree to about 1e-6 on these values (the tests hold them to 1e-4).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError, ManifestError

__all__ = [
    "FEATURE_EXTRACTOR_FILE",
    "FeatureSettings",
    "log_mel_spectrogram",
    "mel_filter_bank",
]

FEATURE_EXTRACTOR_FILE = "preprocessor_config.json"
_BLOCK_FRAMES = 4096


@dataclass(frozen=True)
class FeatureSettings:
    """What the features depend on: the fields of a ``WhisperFeatureExtractor``'s
    ``preprocessor_config.json`` (its defaults are whisper-tiny's)."""

    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400
    padding_value: float = 0.0

    def __post_init__(self) -> None:
        for key in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FeatureSettings.{key} must be a positive integer, got {value!r}")

    @property
    def n_samples(self) -> int:
        """Samples in one window (30 s at 16 kHz: 480000)."""
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        """Feature frames in one window (3000)."""
        return self.n_samples // self.hop_length

    def to_dict(self) -> dict[str, Any]:
        return {
            "feature_size": self.feature_size,
            "sampling_rate": self.sampling_rate,
            "hop_length": self.hop_length,
            "chunk_length": self.chunk_length,
            "n_fft": self.n_fft,
            "padding_value": self.padding_value,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = FEATURE_EXTRACTOR_FILE) -> FeatureSettings:
        """From a ``preprocessor_config.json`` (or the manifest's copy of it); refuses what
        these features would not reproduce (a dithered extractor adds random noise)."""
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: the feature extractor settings must be an object")
        kind = doc.get("feature_extractor_type")
        if kind is not None and kind != "WhisperFeatureExtractor":
            raise ManifestError(f"{where}: feature_extractor_type {kind!r} is not WhisperFeatureExtractor")
        dither = doc.get("dither", 0.0)
        if dither not in (0, 0.0, None):
            raise ManifestError(
                f"{where}: dither={dither!r} adds random noise to every extraction; ortbatch reproduces "
                "WhisperFeatureExtractor with dither 0.0 only"
            )
        kept = {k: doc[k] for k in cls().to_dict() if k in doc}
        try:
            return cls(**kept)
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> FeatureSettings:
        """Read ``preprocessor_config.json`` from a checkpoint or export directory."""
        path = Path(directory) / FEATURE_EXTRACTOR_FILE
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ManifestError(f"{path} is missing: a Whisper export needs its feature extractor settings") from None
        except (OSError, ValueError) as exc:
            raise ManifestError(f"{path} is not readable JSON: {exc}") from None
        return cls.from_dict(doc, str(path))


def _hz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    # linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per factor 6.4)
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[log_region] - 15.0))
    return freq


@lru_cache(maxsize=8)
def mel_filter_bank(n_mels: int, n_fft: int = 400, sampling_rate: int = 16000) -> np.ndarray:
    """Triangular Slaney filters from 0 Hz to 8 kHz, ``(n_fft // 2 + 1, n_mels)`` float64,
    as transformers' ``mel_filter_bank(norm="slaney", mel_scale="slaney")`` and librosa's
    ``filters.mel`` build them. Read-only (cached)."""
    edges_mel = np.linspace(_hz_to_mel_slaney(np.array([0.0]))[0], _hz_to_mel_slaney(np.array([8000.0]))[0], n_mels + 2)
    edges = _mel_to_hz_slaney(edges_mel)
    fft_freqs = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    bank *= (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[None, :]  # Slaney: equal area per filter
    bank.setflags(write=False)
    return bank


@lru_cache(maxsize=4)
def _hann(n_fft: int) -> np.ndarray:
    # periodic, as torch.hann_window and transformers' window_function("hann") make it
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)


def _fit(samples: np.ndarray, settings: FeatureSettings, padding: str) -> np.ndarray:
    if padding == "max_length":
        n = settings.n_samples
        if samples.shape[0] >= n:
            return samples[:n]
        return np.concatenate([samples, np.full(n - samples.shape[0], settings.padding_value, np.float32)])
    if padding == "longest":
        return samples
    raise ValueError(f"padding must be 'max_length' (30-s windows) or 'longest' (long-form), got {padding!r}")


def log_mel_spectrogram(
    samples: np.ndarray,
    settings: FeatureSettings | None = None,
    *,
    padding: str = "max_length",
) -> np.ndarray:
    """Whisper's input features of one mono waveform: ``(feature_size, frames)`` float32.

    ``padding="max_length"`` (what ``WhisperFeatureExtractor(audio)`` does by default): cut or
    zero-padded to one window, ``nb_max_frames`` (3000) frames. ``padding="longest"``
    (``truncation=False, padding="longest"``, transformers' long-form input): the whole
    waveform, ``len(samples) // hop_length`` frames, normalised over all of it.
    """
    settings = settings or FeatureSettings()
    wave = np.asarray(samples)
    if wave.ndim != 1:
        raise InvalidInputError(f"audio samples must be one mono channel (1-d), got shape {wave.shape}")
    if not np.issubdtype(wave.dtype, np.floating) and not np.issubdtype(wave.dtype, np.integer):
        raise InvalidInputError(f"audio samples must be numbers, got dtype {wave.dtype}")
    # transformers casts the waveform to float32 before anything else
    wave = _fit(wave.astype(np.float32, copy=False), settings, padding)
    if wave.shape[0] == 0:
        raise InvalidInputError("the audio has no samples")
    if not np.all(np.isfinite(wave)):
        raise InvalidInputError("the audio samples hold NaN or infinity")
    n_fft, hop = settings.n_fft, settings.hop_length
    half = n_fft // 2
    if wave.shape[0] <= half:
        # reflect padding needs more samples than half a window (torch.stft refuses too)
        raise InvalidInputError(
            f"the audio is too short for features: {wave.shape[0]} samples, at least {half + 1} needed"
        )
    padded = np.pad(wave.astype(np.float64), half, mode="reflect")
    n_frames = 1 + (padded.shape[0] - n_fft) // hop
    frames = np.lib.stride_tricks.as_strided(
        padded, shape=(n_frames - 1, n_fft), strides=(padded.strides[0] * hop, padded.strides[0]), writeable=False
    )  # the last frame is dropped, as transformers does
    bank = mel_filter_bank(settings.feature_size, n_fft, settings.sampling_rate)
    window = _hann(n_fft)
    mel = np.empty((frames.shape[0], settings.feature_size))
    # a block of frames at a time: an hour of audio is 360000 frames, 1 GB of float64 windows at once
    for start in range(0, frames.shape[0], _BLOCK_FRAMES):
        block = frames[start : start + _BLOCK_FRAMES]
        mel[start : start + block.shape[0]] = (np.abs(np.fft.rfft(block * window, axis=1)) ** 2) @ bank
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).T.astype(np.float32)
