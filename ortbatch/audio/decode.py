"""Audio files in, 16-kHz mono float32 samples out, with PyAV (the ``audio`` extra).

PyAV is FFmpeg's libraries in a wheel, the decoder faster-whisper uses: every format
OpenAI's ``/v1/audio/transcriptions`` accepts (flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav,
webm) and anything else FFmpeg reads that has an audio stream.

How the samples are made, and how that compares with the libraries ortbatch is checked
against:

* decoding, down-mixing to mono and resampling to 16 kHz are FFmpeg's (PyAV's
  ``AudioResampler``, a libavfilter graph over libswresample): the same library that
  transformers' pipeline runs as ``ffmpeg -ac 1 -ar 16000 -f f32le`` (its ``ffmpeg_read``)
  and faster-whisper runs through PyAV (``decode_audio``).
* the channels are resampled as they are and then averaged, ``(left + right) / 2``: what
  OpenAI's whisper (``ffmpeg -ac 1 -f s16le``) and faster-whisper (PyAV to ``s16`` mono) get,
  because swresample normalises its down-mix matrix for integer output. Asked for float
  mono, swresample would not normalise it and gives ``(left + right) / sqrt(2)``
  (``ffmpeg -ac 1 -f f32le``, transformers' ``ffmpeg_read``), 3 dB louder and able to clip;
  averaging after resampling equals down-mixing first (both are linear).
* the samples come out as float32, as transformers' ``ffmpeg_read`` asks for;
  faster-whisper asks for ``s16`` and divides by 32768, which quantises every sample to
  16 bits on the way. Float keeps what the file had.
* the log-mel features are then computed from these samples
  (:func:`ortbatch.audio.log_mel_spectrogram`); their parity with transformers'
  ``WhisperFeatureExtractor`` is measured on the same samples.

Every way a file can be unusable that can be told is an :class:`~ortbatch.errors.InvalidInputError` naming
the file (a server answers it with a 400): not audio, empty, no audio stream, corrupt or
truncated (decoding stops before the duration the container declares, or fails part-way:
a cut MP3, FLAC, WebM or MP4; a cut WAV or Ogg declares no total of its own, so it reads as
the shorter file it now is),
and, as :class:`~ortbatch.errors.RequestTooLargeError`, longer than ``max_duration_s``
(checked from the declared duration before decoding, and again while decoding, so a long
file is refused without being held in memory).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .._extras import require
from ..errors import InvalidInputError, RequestTooLargeError

__all__ = [
    "DEFAULT_MAX_DURATION_S",
    "OPENAI_FORMATS",
    "SAMPLING_RATE",
    "DecodedAudio",
    "decode_audio",
    "load_audio",
]

SAMPLING_RATE = 16000
#: the longest audio :func:`decode_audio` accepts unless told otherwise (two hours: about
#: 460 MB of float32 samples at 16 kHz)
DEFAULT_MAX_DURATION_S = 2 * 3600.0
#: the file types OpenAI's transcription endpoint lists
OPENAI_FORMATS = ("flac", "mp3", "mp4", "mpeg", "mpga", "m4a", "ogg", "wav", "webm")
# A file whose decoded audio falls this far short of the duration its container declares
# was cut: codec priming and padding (an AAC frame is 1024 samples, an MP3 frame 1152)
# are well under it.
_TRUNCATION_SLACK_S = 0.2
_TRUNCATION_SLACK_FRACTION = 0.02

AudioSource = str | os.PathLike[str] | bytes | bytearray | memoryview | BinaryIO


@dataclass(frozen=True)
class DecodedAudio:
    """Samples at ``sampling_rate`` (mono float32) and what the file was."""

    samples: np.ndarray
    sampling_rate: int
    name: str
    format: str  # the container FFmpeg found ("wav", "mp3", "mov,mp4,m4a,3gp,3g2,mj2", ...)
    codec: str
    source_rate: int
    source_channels: int

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / self.sampling_rate


def load_audio(
    source: AudioSource,
    *,
    name: str | None = None,
    sampling_rate: int = SAMPLING_RATE,
    max_duration_s: float | None = DEFAULT_MAX_DURATION_S,
) -> np.ndarray:
    """The file's audio as mono float32 samples at ``sampling_rate`` (see :func:`decode_audio`)."""
    return decode_audio(source, name=name, sampling_rate=sampling_rate, max_duration_s=max_duration_s).samples


def decode_audio(
    source: AudioSource,
    *,
    name: str | None = None,
    sampling_rate: int = SAMPLING_RATE,
    max_duration_s: float | None = DEFAULT_MAX_DURATION_S,
) -> DecodedAudio:
    """Decode ``source`` (a path, the file's bytes, or a binary file object) to mono
    float32 samples at ``sampling_rate``.

    ``name`` is how errors call the file (default: the path, or ``"the uploaded audio"``).
    ``max_duration_s`` (``None``: no limit) refuses longer audio with
    :class:`~ortbatch.errors.RequestTooLargeError`.

    Raises:
        InvalidInputError: not audio, empty, no audio stream, corrupt or truncated.
        RequestTooLargeError: longer than ``max_duration_s``.
    """
    if not isinstance(sampling_rate, int) or isinstance(sampling_rate, bool) or sampling_rate < 1:
        raise ValueError(f"sampling_rate must be a positive integer, got {sampling_rate!r}")
    if max_duration_s is not None and not max_duration_s > 0:
        raise ValueError(f"max_duration_s must be positive (or None), got {max_duration_s!r}")
    av = require("av", "audio")
    label, stream_in, owned = _open_source(source, name)
    try:
        container = av.open(stream_in, mode="r", metadata_errors="ignore")
    except av.FFmpegError as exc:
        if owned:
            stream_in.close()
        raise InvalidInputError(
            f"{label} is not an audio file FFmpeg can read, or is damaged ({_reason(exc)}); "
            f"send one of: {', '.join(OPENAI_FORMATS)}",
            input_name="file",
        ) from None
    try:
        return _decode(av, container, label, sampling_rate, max_duration_s)
    finally:
        container.close()
        if owned:
            stream_in.close()


def _open_source(source: AudioSource, name: str | None) -> tuple[str, BinaryIO, bool]:
    """How errors call the file, a binary stream of it, and whether it is ours to close."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        label = name or "the uploaded audio"
        if not data:
            raise InvalidInputError(f"{label} is empty (0 bytes)", input_name="file")
        return label, io.BytesIO(data), True
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        label = name or os.fspath(path)
        try:
            size = path.stat().st_size
            handle = path.open("rb")
        except OSError as exc:
            raise InvalidInputError(f"cannot read {label}: {exc.strerror or exc}", input_name="file") from None
        if size == 0:
            handle.close()
            raise InvalidInputError(f"{label} is empty (0 bytes)", input_name="file")
        return label, handle, True
    if hasattr(source, "read"):
        label = name or str(getattr(source, "name", "") or "the uploaded audio")
        return label, source, False
    raise TypeError(f"audio must be a path, bytes or a binary file object, got {type(source).__name__}")


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "strerror", None) or exc)


def _mono(frame: Any) -> np.ndarray:
    planes = frame.to_ndarray()  # (channels, samples) for planar float
    return planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)


def _declared_duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    return None


def _too_long(label: str, seconds: float, limit: float, declared: bool) -> RequestTooLargeError:
    how = "declares" if declared else "holds more than"
    return RequestTooLargeError(
        f"{label} {how} {seconds:.1f} s of audio; the limit is {limit:g} s ({limit / 60:g} min)"
    )


def _decode(av: Any, container: Any, label: str, rate: int, max_duration_s: float | None) -> DecodedAudio:
    if not container.streams.audio:
        kinds = sorted({s.type for s in container.streams}) or ["nothing"]
        raise InvalidInputError(f"{label} has no audio stream (it holds {', '.join(kinds)})", input_name="file")
    stream = container.streams.audio[0]
    declared = _declared_duration(container, stream)
    if max_duration_s is not None and declared is not None and declared > max_duration_s:
        raise _too_long(label, declared, max_duration_s, declared=True)
    limit = None if max_duration_s is None else int(max_duration_s * rate) + 1
    # planar float in the stream's own channels; averaged below (see the module docstring)
    resampler = av.AudioResampler(format="fltp", rate=rate)
    pieces: list[np.ndarray] = []
    total = 0
    frames: Iterator[Any] = container.decode(stream)
    while True:
        try:
            frame = next(frames)
        except StopIteration:
            break
        except av.FFmpegError as exc:
            at = total / rate
            raise InvalidInputError(
                f"{label} is corrupt or truncated: decoding failed after {at:.2f} s ({_reason(exc)})",
                input_name="file",
            ) from None
        frame.pts = None  # the resampler's filter graph needs no timestamps; broken ones only upset it
        for out in resampler.resample(frame):
            pieces.append(_mono(out))
            total += pieces[-1].shape[0]
        if limit is not None and total > limit:
            assert max_duration_s is not None
            raise _too_long(label, total / rate, max_duration_s, declared=False)
    for out in resampler.resample(None):  # what the resampler still holds
        pieces.append(_mono(out))
        total += pieces[-1].shape[0]
    if total == 0:
        raise InvalidInputError(f"{label} holds no audio samples", input_name="file")
    if limit is not None and total > limit:
        assert max_duration_s is not None
        raise _too_long(label, total / rate, max_duration_s, declared=False)
    got = total / rate
    if declared is not None and declared - got > max(_TRUNCATION_SLACK_S, _TRUNCATION_SLACK_FRACTION * declared):
        raise InvalidInputError(
            f"{label} is truncated: it declares {declared:.2f} s of audio but only {got:.2f} s could be decoded",
            input_name="file",
        )
    samples = np.concatenate(pieces).astype(np.float32, copy=False)
    ctx = stream.codec_context
    return DecodedAudio(
        samples=samples,
        sampling_rate=rate,
        name=label,
        format=str(container.format.name),
        codec=str(ctx.name),
        source_rate=int(ctx.sample_rate or 0),
        source_channels=int(ctx.channels or 0),
    )
