"""Decoding with PyAV: every format OpenAI accepts, mono, 16 kHz, and a typed error for each
way a file can be unusable."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from ortbatch.audio import OPENAI_FORMATS, decode_audio, load_audio
from ortbatch.errors import InvalidInputError, RequestTooLargeError
from tests.audio.media import FORMATS, tone, write_audio


class _Unseekable:
    """A stream that can only be read (an upload being received): no declared duration."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._buf.read(n)


def _analytic(seconds: float, freq: float, amplitude: float) -> np.ndarray:
    return tone(seconds, freq, 16000, amplitude)


@pytest.mark.parametrize("ext", sorted(FORMATS))
def test_every_openai_format_decodes_to_16k_mono(ext: str, tmp_path: Path) -> None:
    assert ext in OPENAI_FORMATS
    left = tone(3.0, 440.0, 44100, 0.5)
    path = write_audio(tmp_path / f"clip.{ext}", np.stack([left, 0.5 * left]), 44100)
    audio = decode_audio(path)
    assert audio.sampling_rate == 16000 and audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert audio.source_channels == 2 and audio.name == str(path)
    # lossy codecs add priming/padding (AAC: up to 1024 + 1024 samples at 44.1 kHz)
    assert abs(audio.duration_s - 3.0) < 0.05, audio.duration_s
    spectrum = np.abs(np.fft.rfft(audio.samples))
    assert abs(np.argmax(spectrum) * 16000 / audio.samples.shape[0] - 440.0) < 1.0
    # the mean of the channels: (0.5 + 0.25) / 2, within what the lossy codecs change
    peak = float(np.abs(audio.samples[8000:40000]).max())
    assert abs(peak - 0.375) < (0.002 if ext in ("wav", "flac") else 0.03), peak


def test_lossless_16k_mono_comes_back_as_written(tmp_path: Path) -> None:
    clip = _analytic(2.0, 440.0, 0.5)
    for ext in ("wav", "flac"):
        got = load_audio(write_audio(tmp_path / f"m.{ext}", clip, 16000))
        assert got.shape == clip.shape
        assert float(np.abs(got - clip).max()) <= 1 / 32768  # 16-bit quantisation only


def test_resampling_keeps_the_signal(tmp_path: Path) -> None:
    """44.1 kHz and 22.05 kHz to 16 kHz: equal to the tone sampled at 16 kHz directly (no
    delay, no gain), away from the edges."""
    for rate in (44100, 22050, 8000):
        got = load_audio(write_audio(tmp_path / f"r{rate}.flac", tone(2.0, 440.0, rate, 0.5), rate))
        want = _analytic(2.0, 440.0, 0.5)
        assert abs(got.shape[0] - want.shape[0]) <= 1
        n = min(got.shape[0], want.shape[0])
        assert float(np.abs(got[800 : n - 800] - want[800 : n - 800]).max()) < 2e-3, rate


def test_bytes_file_objects_and_unseekable_streams(tmp_path: Path) -> None:
    path = write_audio(tmp_path / "c.ogg", tone(2.0), 16000)
    want = load_audio(path)
    data = path.read_bytes()
    for source in (data, bytearray(data), memoryview(data), io.BytesIO(data), _Unseekable(data)):
        np.testing.assert_array_equal(load_audio(source, name="c.ogg"), want)
    with path.open("rb") as f:
        np.testing.assert_array_equal(load_audio(f), want)
        assert not f.closed  # the caller's file stays the caller's


def test_spoken_sentence_resampled(spoken_files: list[Path], spoken_raw: tuple[np.ndarray, int]) -> None:
    raw, rate = spoken_raw
    audio = decode_audio(spoken_files[0])
    assert audio.source_rate == rate == 22050 and audio.source_channels == 1
    assert abs(audio.duration_s - raw.shape[0] / rate) < 1e-3
    assert 0.05 < float(np.abs(audio.samples).max()) <= 1.0


def test_not_audio(tmp_path: Path) -> None:
    text = tmp_path / "notes.mp3"
    text.write_text("these are not the sounds you are looking for\n" * 20, encoding="utf-8")
    with pytest.raises(InvalidInputError, match=r"notes\.mp3 is not an audio file") as info:
        load_audio(text)
    assert info.value.input_name == "file"
    with pytest.raises(InvalidInputError, match=r"upload\.wav is not an audio file"):
        load_audio(bytes(range(256)) * 8, name="upload.wav")


def test_empty(tmp_path: Path) -> None:
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(InvalidInputError, match=r"empty\.wav is empty \(0 bytes\)"):
        load_audio(empty)
    with pytest.raises(InvalidInputError, match=r"the uploaded audio is empty"):
        load_audio(b"")


def test_no_samples_and_no_audio_stream(tmp_path: Path) -> None:
    import av

    silent = tmp_path / "zero.wav"
    with wave.open(str(silent), "wb") as w:  # a header and no frames
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    with pytest.raises(InvalidInputError, match=r"zero\.wav holds no audio samples"):
        load_audio(silent)
    video = tmp_path / "video.mp4"
    with av.open(str(video), mode="w") as out:
        stream = out.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 40, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    with pytest.raises(InvalidInputError, match=r"video\.mp4 has no audio stream \(it holds video\)"):
        load_audio(video)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"cannot read .*nowhere\.wav"):
        load_audio(tmp_path / "nowhere.wav")


@pytest.mark.parametrize("ext", ["mp3", "flac", "webm", "mp4", "m4a"])
def test_truncated(ext: str, tmp_path: Path) -> None:
    whole = write_audio(tmp_path / f"whole.{ext}", tone(4.0, 440.0, 44100), 44100)
    data = whole.read_bytes()
    cut = tmp_path / f"cut.{ext}"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidInputError, match=r"cut\.\w+ (is truncated|is corrupt or truncated|.*damaged)"):
        load_audio(cut)


def test_longer_than_the_limit(tmp_path: Path) -> None:
    path = write_audio(tmp_path / "long.ogg", tone(5.0), 16000)
    # declared by the container: refused before decoding
    with pytest.raises(RequestTooLargeError, match=r"long\.ogg declares 5\.0 s of audio; the limit is 2 s"):
        load_audio(path, max_duration_s=2.0)
    # a stream with no declared duration: refused while decoding, at the limit
    with pytest.raises(RequestTooLargeError, match=r"up\.ogg holds more than 2\.\d s of audio; the limit is 2 s"):
        load_audio(_Unseekable(path.read_bytes()), name="up.ogg", max_duration_s=2.0)
    assert load_audio(path, max_duration_s=None).shape[0] == 80000
    with pytest.raises(ValueError, match="max_duration_s"):
        load_audio(path, max_duration_s=0)
