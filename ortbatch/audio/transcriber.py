"""A simple Whisper transcriber over an export's three graphs: static batches, greedy decoding.

**This is the non-continuous path.** It runs one batch from start to end: every clip of a
call is encoded together, then decoded step by step together until all have finished,
with ONNX Runtime sessions of its own. It is what ``ortbatch export`` checks an ASR export
with, and a way to use one in a script today; the continuous engine (encoder passes of newly
arrived windows together, decoder steps for every active window of every request) is the
encoder-decoder generator's job and will replace it for serving.

What it reproduces is transformers' ``WhisperForConditionalGeneration.generate`` with greedy
decoding: the same initial tokens (:func:`~ortbatch.audio.whisper.initial_tokens`, language
detection included), prompt, logit rules and, for audio longer than one window, the same
sequential long-form algorithm (one window at a time, each advancing to the last complete
segment; timestamps required, as transformers requires them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from .._extras import require
from .._ort.providers import CPU
from ..errors import InvalidInputError, ManifestError
from ..manifest import Manifest
from .decode import SAMPLING_RATE, AudioSource, load_audio
from .features import FeatureSettings, log_mel_spectrogram
from .whisper import (
    INPUT_STRIDE,
    TIME_PRECISION,
    LogitRules,
    Segment,
    WhisperSpec,
    detect_language,
    initial_tokens,
    needs_language,
    prompt_tokens,
    split_segments,
    window,
)

__all__ = ["Transcription", "WhisperGraphs", "transcribe"]

#: the manifest keys an ASR export records its decoding and features under
WHISPER_KEY = "whisper"
FEATURES_KEY = "features"


@dataclass(frozen=True)
class Transcription:
    """One clip's transcript: its text, the generated tokens (initial tokens excluded; end of
    text included when it came), the language token, and segments (with timestamps)."""

    text: str
    tokens: tuple[int, ...]
    language_id: int | None
    segments: tuple[Segment, ...] = ()


class WhisperGraphs:
    """The encoder, decoder and decoder-with-past of a Whisper export, as ONNX Runtime
    sessions, with what decoding needs (:class:`WhisperSpec`, :class:`FeatureSettings`)."""

    def __init__(self, directory: str | os.PathLike[str], providers: Sequence[str] | None = None) -> None:
        ort = require("onnxruntime", "cpu")
        self.directory = Path(directory)
        manifest = Manifest.load(self.directory).verify()
        extra = manifest.extra
        if WHISPER_KEY not in extra or FEATURES_KEY not in extra:
            raise ManifestError(f"{self.directory} is not a Whisper (automatic-speech-recognition) export")
        self.manifest = manifest
        self.spec = WhisperSpec.from_dict(extra[WHISPER_KEY], f"{self.directory}/ortbatch.json: whisper")
        self.features = FeatureSettings.from_dict(extra[FEATURES_KEY], f"{self.directory}/ortbatch.json: features")
        components = extra.get("components") or {}
        options = ort.SessionOptions()
        chosen = list(providers or [CPU])

        def session(name: str) -> Any:
            if name not in components:
                raise ManifestError(f"{self.directory}/ortbatch.json lists no {name} graph")
            return ort.InferenceSession(str(self.directory / components[name]["model"]), options, providers=chosen)

        self.encoder = session("encoder")
        self.decoder = session("decoder")
        self.decoder_with_past = session("decoder_with_past")
        self._past_inputs = [
            i.name for i in self.decoder_with_past.get_inputs() if i.name.startswith("past_key_values")
        ]
        self._decoder_outputs = [o.name for o in self.decoder.get_outputs()]
        self._past_outputs = [o.name for o in self.decoder_with_past.get_outputs()]
        self._tokenizer: Any = None

    # -- the graphs ------------------------------------------------------------------------
    def encode(self, features: np.ndarray) -> np.ndarray:
        """``(rows, n_mels, 3000)`` features → ``(rows, 1500, d_model)`` encoder states."""
        return self.encoder.run(None, {"input_features": np.ascontiguousarray(features, dtype=np.float32)})[0]

    def start(self, hidden: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The decoder on every row's first tokens (all rows the same length): the logits of
        every position and the cache for :meth:`step`."""
        outs = self.decoder.run(None, {"input_ids": tokens.astype(np.int64), "encoder_hidden_states": hidden})
        named = dict(zip(self._decoder_outputs, outs, strict=True))
        cache = {k.replace("present", "past_key_values", 1): v for k, v in named.items() if k.startswith("present")}
        return named["logits"], cache

    def step(self, tokens: np.ndarray, cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One decoder step: ``(rows, 1)`` tokens → ``(rows, 1, vocab)`` logits, the cache grown
        by one (the cross-attention keys and values stay as :meth:`start` made them)."""
        feed = {"input_ids": tokens.astype(np.int64), **{k: cache[k] for k in self._past_inputs}}
        outs = self.decoder_with_past.run(None, feed)
        named = dict(zip(self._past_outputs, outs, strict=True))
        grown = dict(cache)
        for k, v in named.items():
            if k.startswith("present"):
                grown[k.replace("present", "past_key_values", 1)] = v
        return named["logits"], grown

    # -- decoding ----------------------------------------------------------------------------
    def detect_languages(self, hidden: np.ndarray) -> np.ndarray:
        sot = np.full((hidden.shape[0], 1), self.spec.decoder_start_token_id, dtype=np.int64)
        logits, _ = self.start(hidden, sot)
        return detect_language(self.spec, logits[:, -1])

    def greedy(
        self, hidden: np.ndarray, prefixes: Sequence[Sequence[int]], rules: LogitRules, max_new_tokens: int
    ) -> list[list[int]]:
        """Greedy decoding of every row from its prefix (all the same length), ``rules``
        applied at each step, until every row has ended (end of text) or ``max_new_tokens``.
        Returns each row's generated tokens, end of text included, nothing after it."""
        lengths = {len(p) for p in prefixes}
        if len(lengths) != 1:
            raise ValueError("the rows of one static batch need prefixes of one length (the graphs take no mask)")
        begin = lengths.pop()
        sequences = np.array(prefixes, dtype=np.int64)
        done = np.zeros(len(prefixes), dtype=bool)
        eos = self.spec.eos_token_id
        logits, cache = self.start(hidden, sequences)
        for _ in range(max_new_tokens):
            scores = rules(sequences, logits[:, -1], begin)
            chosen = scores.argmax(axis=-1).astype(np.int64)
            chosen[done] = self.spec.pad_token_id
            sequences = np.concatenate([sequences, chosen[:, None]], axis=1)
            done |= chosen == eos
            if done.all():
                break
            logits, cache = self.step(chosen[:, None], cache)
        out = []
        for row in sequences[:, begin:].tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
        return out

    def text(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` without special and timestamp tokens (the tokenizer's
        ``tokenizer.json``, read with the ``tokenizers`` library)."""
        if self._tokenizer is None:
            tokenizers = require("tokenizers", "serve")
            path = self.directory / "tokenizer.json"
            if not path.is_file():
                raise ManifestError(f"{path} is missing: the export's tokenizer is needed to read the tokens")
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        return str(self._tokenizer.decode([t for t in tokens if t < self.spec.eos_token_id]))

    def encode_text(self, text: str) -> list[int]:
        self.text([])  # loads the tokenizer
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _samples(graphs: WhisperGraphs, audio: AudioSource | np.ndarray, max_duration_s: float | None) -> np.ndarray:
    if isinstance(audio, np.ndarray):
        return audio
    if graphs.features.sampling_rate != SAMPLING_RATE:  # pragma: no cover - every Whisper is 16 kHz
        raise ManifestError(f"this export's features are at {graphs.features.sampling_rate} Hz, not 16 kHz")
    return load_audio(audio, max_duration_s=max_duration_s)


def transcribe(
    export: str | os.PathLike[str] | WhisperGraphs,
    audio: AudioSource | np.ndarray | Sequence[AudioSource | np.ndarray],
    *,
    language: str | None = None,
    task: str | None = None,
    prompt: str | None = None,
    timestamps: bool = False,
    max_new_tokens: int | None = None,
    max_duration_s: float | None = 2 * 3600.0,
) -> Transcription | list[Transcription]:
    """Transcribe (or translate, ``task="translate"``) audio with a Whisper export, greedily,
    as transformers' ``generate`` would (the non-continuous path: see the module docstring).

    ``audio``: a file path, the file's bytes, 16-kHz mono float samples, or a list of them
    (a list gives a list back). Every clip runs transformers' sequential algorithm (window
    after window, each advanced to its last complete segment; a clip of at most 30 s is one
    padded window), the windows of all clips in one batch per pass. Audio longer than 30 s
    needs ``timestamps=True``, as transformers requires. ``language``: a code, name or token
    (default: detected); ``prompt``: previous text to condition on; ``max_new_tokens``: per
    window (default: as many as the model's ``max_target_positions`` leave).
    """
    graphs = export if isinstance(export, WhisperGraphs) else WhisperGraphs(export)
    many = isinstance(audio, (list, tuple))
    items: list[Any] = list(cast(Sequence[Any], audio)) if many else [audio]
    clips = [_samples(graphs, a, max_duration_s) for a in items]
    if not clips:
        return []
    settings, spec = graphs.features, graphs.spec
    prefix_prompt = prompt_tokens(spec, graphs.encode_text(" " + prompt.strip())) if prompt else []
    long = [i for i, c in enumerate(clips) if c.shape[0] > settings.n_samples]
    if long and not timestamps:
        raise InvalidInputError(
            f"the audio is longer than {settings.chunk_length} s: long-form transcription needs timestamps=True "
            "(as transformers requires)",
            input_name="timestamp_granularities",
        )
    results = _sequential(graphs, clips, language, task, prefix_prompt, timestamps, max_new_tokens)
    return results if many else results[0]


def _budget(spec: WhisperSpec, prefix_len: int, max_new_tokens: int | None) -> int:
    room = spec.max_target_positions - prefix_len
    if max_new_tokens is None:
        return room
    if max_new_tokens + prefix_len > spec.max_target_positions:
        raise InvalidInputError(
            f"max_new_tokens={max_new_tokens} and {prefix_len} initial tokens exceed the model's "
            f"{spec.max_target_positions} positions",
            input_name="max_new_tokens",
        )
    return max_new_tokens


def _decode_windows(
    graphs: WhisperGraphs,
    hidden: np.ndarray,
    language: str | None,
    task: str | None,
    prompt: list[int],
    timestamps: bool,
    max_new_tokens: int | None,
    detected: np.ndarray | None = None,
) -> list[tuple[list[int], int | None]]:
    spec = graphs.spec
    if needs_language(spec, task=task, language=language) and detected is None:
        detected = graphs.detect_languages(hidden)
    prefixes = []
    for row in range(hidden.shape[0]):
        lang_id = None if detected is None else int(detected[row])
        prefixes.append(
            prompt
            + initial_tokens(spec, task=task, language=language, detected_language_id=lang_id, timestamps=timestamps)
        )
    budget = _budget(spec, len(prefixes[0]), max_new_tokens)
    generated = graphs.greedy(hidden, prefixes, LogitRules(spec, timestamps=timestamps), budget)
    langs = [next((t for t in p if t in spec.lang_to_id.values()), None) for p in prefixes]
    return list(zip(generated, langs, strict=True))


def _sequential(
    graphs: WhisperGraphs,
    clips: list[np.ndarray],
    language: str | None,
    task: str | None,
    prompt: list[int],
    timestamps: bool,
    max_new_tokens: int | None,
) -> list[Transcription]:
    """transformers' sequential generate, greedy, without ``condition_on_prev_tokens`` (its
    default), for every clip at once. A clip's features: one padded window for at most 30 s,
    else the whole file's (``padding="longest"``). Each clip is decoded window after window
    from its ``seek``, advanced by :func:`split_segments` (with or without timestamps: a model
    that emits timestamp tokens anyway is decoded again from its last complete segment, as
    generate does); the windows of every clip still going are encoded and decoded as one
    batch. The language is detected once per clip, on its first window; the prompt goes
    before every window (``prompt_condition_type`` matters only with ``condition_on_prev_tokens``)."""
    spec, settings = graphs.spec, graphs.features
    features = [
        log_mel_spectrogram(c, settings, padding="max_length" if c.shape[0] <= settings.n_samples else "longest")
        for c in clips
    ]
    detected = None
    if needs_language(spec, task=task, language=language):
        firsts = np.stack([window(f, 0, settings.nb_max_frames)[0] for f in features])
        detected = graphs.detect_languages(graphs.encode(firsts))
    seeks = [0] * len(clips)
    segments: list[list[Segment]] = [[] for _ in clips]
    langs: list[int | None] = [None] * len(clips)
    while active := [i for i, f in enumerate(features) if seeks[i] < f.shape[-1]]:
        pieces = [window(features[i], seeks[i], settings.nb_max_frames) for i in active]
        hidden = graphs.encode(np.stack([p for p, _ in pieces]))
        rows_detected = None if detected is None else detected[active]
        decoded = _decode_windows(graphs, hidden, language, task, prompt, timestamps, max_new_tokens, rows_detected)
        for i, (_, real), (tokens, lang) in zip(active, pieces, decoded, strict=True):
            langs[i] = lang
            if tokens and tokens[-1] == spec.eos_token_id:  # generate drops it before splitting a window
                tokens = tokens[:-1]
            offset = seeks[i] * TIME_PRECISION / INPUT_STRIDE
            found, advance = split_segments(spec, tokens, time_offset=offset, window_frames=real)
            segments[i].extend(found)
            seeks[i] += advance
    out = []
    for segs, lang in zip(segments, langs, strict=True):
        tokens = [t for seg in segs for t in seg.tokens]
        out.append(
            Transcription(
                text=graphs.text(tokens),
                tokens=tuple(tokens),
                language_id=lang,
                segments=tuple(segs) if timestamps else (),
            )
        )
    return out
