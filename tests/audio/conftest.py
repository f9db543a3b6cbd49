"""Test audio, made here: espeak-ng speaking known sentences (skipped without it), tones, silence."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.audio.media import SENTENCES, espeak, read_wav


@pytest.fixture(scope="session")
def audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audio")


@pytest.fixture(scope="session")
def spoken_files(audio_dir: Path) -> list[Path]:
    """WAV files (22050 Hz mono) of espeak-ng speaking :data:`SENTENCES`."""
    pytest.importorskip("av")  # everything spoken is decoded with PyAV (the audio extra)
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    return [espeak(text, audio_dir / f"spoken{i}.wav") for i, text in enumerate(SENTENCES)]


@pytest.fixture(scope="session")
def speech16k(spoken_files: list[Path]) -> np.ndarray:
    """The spoken sentences one after the other at 16 kHz (decoded with ortbatch), about 9 s."""
    from ortbatch.audio import load_audio

    return np.concatenate([load_audio(p) for p in spoken_files])


@pytest.fixture(scope="session")
def spoken_raw(spoken_files: list[Path]) -> tuple[np.ndarray, int]:
    """The first spoken sentence as espeak-ng wrote it (mono, its own rate)."""
    data, rate = read_wav(spoken_files[0])
    return data[0], rate
