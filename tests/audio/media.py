"""Test audio made here: espeak-ng speaking known sentences, tones, silence; written in the
formats OpenAI accepts with PyAV's encoders."""

from __future__ import annotations

import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np

#: container name and (codec, sample format) PyAV writes each extension with
FORMATS = {
    "wav": ("wav", "pcm_s16le", "s16"),
    "flac": ("flac", "flac", "s16"),
    "mp3": ("mp3", "libmp3lame", "fltp"),
    "ogg": ("ogg", "libopus", "flt"),
    "webm": ("webm", "libopus", "flt"),
    "mp4": ("mp4", "aac", "fltp"),
    "m4a": ("ipod", "aac", "fltp"),
}

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Batching many requests together makes speech recognition cheaper.",
    "Hello world, this is a test of the audio pipeline.",
)


def tone(seconds: float, freq: float = 440.0, rate: int = 16000, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def espeak(text: str, path: Path) -> Path:
    """A WAV file of espeak-ng speaking ``text`` (22050 Hz mono, as espeak-ng writes it)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
    subprocess.run([exe, "-w", str(path), text], check=True, capture_output=True, timeout=60)
    return path


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """Samples (channels, n) float32 and the rate, read with the standard library."""
    import wave

    with wave.open(str(path), "rb") as w:
        rate, channels, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
        raw = w.readframes(n)
    assert width == 2, width
    data = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    return data.reshape(-1, channels).T.copy(), rate


def write_audio(path: Path, samples: np.ndarray, rate: int) -> Path:
    """Encode ``samples`` ((n,) mono or (channels, n)) at ``rate`` in the format of ``path``'s suffix."""
    import av

    fmt, codec, sample_fmt = FORMATS[path.suffix.lstrip(".")]
    data = np.atleast_2d(np.asarray(samples, dtype=np.float32))
    channels = data.shape[0]
    layout = {1: "mono", 2: "stereo"}[channels]
    with av.open(str(path), mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate if codec != "libopus" else 48000)
        stream.layout = layout
        resampler = av.AudioResampler(format=sample_fmt, layout=layout, rate=stream.rate)
        frame = av.AudioFrame.from_ndarray(data.T.reshape(1, -1).copy(), format="flt", layout=layout)
        frame.sample_rate = rate
        frame.time_base = Fraction(1, rate)
        frame.pts = 0
        for f in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path
