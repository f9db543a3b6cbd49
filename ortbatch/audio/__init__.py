"""Audio for speech models, without torch: files in, Whisper's log-mel features out.

* :func:`decode_audio` / :func:`load_audio`: any file FFmpeg reads (every format OpenAI's
  transcription endpoint accepts) to 16-kHz mono float32 samples, with PyAV (the ``audio``
  extra); unusable files are :class:`~ortbatch.errors.InvalidInputError` naming the file.
* :func:`log_mel_spectrogram` and :class:`FeatureSettings`: the features transformers'
  ``WhisperFeatureExtractor`` computes, in numpy (30-s windows, or long-form).
* :mod:`ortbatch.audio.whisper`: Whisper's decoding rules as numpy functions an engine calls
  once per step on a batch of rows (timestamps, language detection, prompts, task and
  language tokens, segments, the long-form window advance).
* :func:`transcribe` over an export's graphs (:class:`WhisperGraphs`): static batches, greedy,
  equal to transformers' ``generate`` — the non-continuous path until the encoder-decoder
  engine serves Whisper.

Only numpy is imported with this package; PyAV when a file is decoded, onnxruntime when an
export is loaded.
"""

from .decode import DEFAULT_MAX_DURATION_S, OPENAI_FORMATS, SAMPLING_RATE, DecodedAudio, decode_audio, load_audio
from .features import FEATURE_EXTRACTOR_FILE, FeatureSettings, log_mel_spectrogram, mel_filter_bank
from .transcriber import Transcription, WhisperGraphs, transcribe

__all__ = [
    "DEFAULT_MAX_DURATION_S",
    "OPENAI_FORMATS",
    "SAMPLING_RATE",
    "DecodedAudio",
    "decode_audio",
    "load_audio",
    "FEATURE_EXTRACTOR_FILE",
    "FeatureSettings",
    "log_mel_spectrogram",
    "mel_filter_bank",
    "Transcription",
    "WhisperGraphs",
    "transcribe",
]
