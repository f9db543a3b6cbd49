"""Whisper's decoding rules in numpy, as transformers' ``WhisperForConditionalGeneration.generate``
applies them, for an engine to call once per step on a batch of rows.

Each piece names the transformers code it reproduces, and ``tests/audio/test_whisper_rules.py``
runs both on the same logits and tokens:

* :class:`WhisperSpec`: the token ids and limits decoding needs, read from a checkpoint's
  ``generation_config.json`` and ``config.json`` at export and kept in the manifest;
* :func:`initial_tokens` (``_retrieve_init_tokens``): ``<|startoftranscript|>``, the
  language, the task and ``<|notimestamps|>``, from ``language``/``task`` or the checkpoint's
  ``forced_decoder_ids``; :func:`needs_language` says when the language must be detected
  first, :func:`detect_language` (``detect_language``) picks it from the first step's logits;
* :func:`prompt_tokens` (``get_prompt_ids`` + ``_prepare_decoder_input_ids``): the previous
  text before the initial tokens;
* :class:`LogitRules` (``SuppressTokensAtBeginLogitsProcessor``,
  ``SuppressTokensLogitsProcessor``, ``WhisperTimeStampLogitsProcessor``, in that order):
  one call per step on ``(rows, vocab)`` scores, each row with its own ``begin_index``;
* :func:`split_segments` (``_retrieve_segment``): the segments a window's tokens make and how
  far the window advances; :func:`window` (``_get_input_segment``) cuts the next window out
  of long-form features. Together they are transformers' sequential long-form algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidInputError, ManifestError

__all__ = [
    "INPUT_STRIDE",
    "TASKS",
    "TIME_PRECISION",
    "LogitRules",
    "Segment",
    "WhisperSpec",
    "detect_language",
    "initial_tokens",
    "language_id",
    "needs_language",
    "prompt_tokens",
    "split_segments",
    "window",
]

TASKS = ("transcribe", "translate")
#: seconds per timestamp token
TIME_PRECISION = 0.02
#: feature frames per encoder position (the two convolutions' strides: 1 and 2)
INPUT_STRIDE = 2


@dataclass(frozen=True)
class WhisperSpec:
    """What decoding a Whisper checkpoint needs, as its ``generation_config.json`` says."""

    decoder_start_token_id: int
    eos_token_id: int
    pad_token_id: int
    no_timestamps_token_id: int
    vocab_size: int
    max_target_positions: int = 448
    prev_sot_token_id: int | None = None
    lang_to_id: Mapping[str, int] = field(default_factory=dict)
    task_to_id: Mapping[str, int] = field(default_factory=dict)
    language_names: Mapping[str, str] = field(default_factory=dict)  # "english" -> "en"
    is_multilingual: bool = False
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    max_initial_timestamp_index: int | None = None
    forced_decoder_ids: tuple[tuple[int, int | None], ...] | None = None
    alignment_heads: tuple[tuple[int, int], ...] | None = None
    max_length: int | None = None

    @property
    def timestamp_begin(self) -> int:
        """The id of ``<|0.00|>``; every id from here on is a timestamp."""
        return self.no_timestamps_token_id + 1

    @property
    def no_speech_token_id(self) -> int:
        return self.no_timestamps_token_id - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "decoder_start_token_id": self.decoder_start_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "no_timestamps_token_id": self.no_timestamps_token_id,
            "timestamp_begin": self.timestamp_begin,
            "vocab_size": self.vocab_size,
            "max_target_positions": self.max_target_positions,
            "prev_sot_token_id": self.prev_sot_token_id,
            "lang_to_id": dict(self.lang_to_id),
            "task_to_id": dict(self.task_to_id),
            "language_names": dict(self.language_names),
            "is_multilingual": self.is_multilingual,
            "suppress_tokens": list(self.suppress_tokens),
            "begin_suppress_tokens": list(self.begin_suppress_tokens),
            "max_initial_timestamp_index": self.max_initial_timestamp_index,
            "forced_decoder_ids": None
            if self.forced_decoder_ids is None
            else [list(p) for p in self.forced_decoder_ids],
            "alignment_heads": None if self.alignment_heads is None else [list(p) for p in self.alignment_heads],
            "max_length": self.max_length,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str = "whisper") -> WhisperSpec:
        """From :meth:`to_dict`'s form (the manifest's ``whisper`` section)."""
        try:
            forced = doc.get("forced_decoder_ids")
            heads = doc.get("alignment_heads")
            spec = cls(
                decoder_start_token_id=int(doc["decoder_start_token_id"]),
                eos_token_id=int(doc["eos_token_id"]),
                pad_token_id=int(doc["pad_token_id"]),
                no_timestamps_token_id=int(doc["no_timestamps_token_id"]),
                vocab_size=int(doc["vocab_size"]),
                max_target_positions=int(doc.get("max_target_positions", 448)),
                prev_sot_token_id=None if doc.get("prev_sot_token_id") is None else int(doc["prev_sot_token_id"]),
                lang_to_id={str(k): int(v) for k, v in (doc.get("lang_to_id") or {}).items()},
                task_to_id={str(k): int(v) for k, v in (doc.get("task_to_id") or {}).items()},
                language_names={str(k): str(v) for k, v in (doc.get("language_names") or {}).items()},
                is_multilingual=bool(doc.get("is_multilingual", False)),
                suppress_tokens=tuple(int(t) for t in doc.get("suppress_tokens") or ()),
                begin_suppress_tokens=tuple(int(t) for t in doc.get("begin_suppress_tokens") or ()),
                max_initial_timestamp_index=(
                    None if doc.get("max_initial_timestamp_index") is None else int(doc["max_initial_timestamp_index"])
                ),
                forced_decoder_ids=None
                if forced is None
                else tuple((int(i), None if t is None else int(t)) for i, t in forced),
                alignment_heads=None if heads is None else tuple((int(a), int(b)) for a, b in heads),
                max_length=None if doc.get("max_length") is None else int(doc["max_length"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: not a Whisper decoding section ({type(exc).__name__}: {exc})") from None
        stated = doc.get("timestamp_begin")
        if stated is not None and stated != spec.timestamp_begin:
            raise ManifestError(f"{where}: timestamp_begin {stated} is not no_timestamps_token_id + 1")
        return spec

    @classmethod
    def from_configs(
        cls, generation: Mapping[str, Any], config: Mapping[str, Any], language_names: Mapping[str, str] | None = None
    ) -> WhisperSpec:
        """From a checkpoint's ``generation_config.json`` and ``config.json`` (as dicts).
        Token ids the generation config leaves out are taken from the model config, as
        transformers does; a checkpoint without ``no_timestamps_token_id`` is refused."""

        def pick(key: str) -> Any:
            value = generation.get(key)
            return value if value is not None else config.get(key)

        missing = [k for k in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id") if pick(k) is None]
        if missing:
            raise ManifestError(
                f"the checkpoint's generation_config.json has no {', '.join(missing)}: ortbatch decodes Whisper "
                "checkpoints whose generation config names their special tokens (as every released one does)"
            )
        eos = pick("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        pad = pick("pad_token_id")
        return cls.from_dict(
            {
                "decoder_start_token_id": pick("decoder_start_token_id"),
                "eos_token_id": eos,
                "pad_token_id": eos if pad is None else pad,
                "no_timestamps_token_id": generation["no_timestamps_token_id"],
                "vocab_size": config["vocab_size"],
                "max_target_positions": config.get("max_target_positions", 448),
                "prev_sot_token_id": generation.get("prev_sot_token_id"),
                "lang_to_id": generation.get("lang_to_id") or {},
                "task_to_id": generation.get("task_to_id") or {},
                "language_names": {
                    name: code
                    for name, code in (language_names or {}).items()
                    if f"<|{code}|>" in (generation.get("lang_to_id") or {})
                },
                "is_multilingual": generation.get("is_multilingual", False),
                "suppress_tokens": pick("suppress_tokens") or [],
                "begin_suppress_tokens": pick("begin_suppress_tokens") or [],
                "max_initial_timestamp_index": generation.get("max_initial_timestamp_index"),
                "forced_decoder_ids": pick("forced_decoder_ids"),
                "alignment_heads": generation.get("alignment_heads"),
                "max_length": generation.get("max_length"),
            },
            "generation_config.json",
        )


# -- the initial tokens ------------------------------------------------------------------


def language_id(spec: WhisperSpec, language: str) -> int:
    """The id of ``language``'s token: a code (``"en"``), a name (``"english"``) or the token
    (``"<|en|>"``), case-insensitive, as ``generate(language=...)`` takes it."""
    lowered = language.lower()
    if lowered in spec.lang_to_id:
        token = lowered
    elif lowered in spec.language_names:
        token = f"<|{spec.language_names[lowered]}|>"
    else:
        token = f"<|{lowered}|>"
    if token not in spec.lang_to_id:
        codes = sorted(t.strip("<|>") for t in spec.lang_to_id)
        raise InvalidInputError(
            f"language {language!r} is not one this model knows; use one of: {', '.join(codes) or 'none'}",
            input_name="language",
        )
    return spec.lang_to_id[token]


def _forced_prefix(spec: WhisperSpec, task: str | None, language: str | None) -> list[int | None]:
    tokens: list[int | None] = [spec.decoder_start_token_id]
    if task is None and language is None and spec.forced_decoder_ids:
        forced = list(spec.forced_decoder_ids)
        if forced[0][0] == 1:
            i = 1
            while forced and forced[0][0] == i:
                tokens.append(forced[0][1])
                forced = forced[1:]
                i += 1
    return tokens


def needs_language(spec: WhisperSpec, *, task: str | None = None, language: str | None = None) -> bool:
    """Whether the language must be detected (:func:`detect_language`) before
    :func:`initial_tokens`: no language given, none forced, and the model has language tokens."""
    if language is not None or not spec.lang_to_id:
        return False
    prefix = _forced_prefix(spec, task, language)
    return len(prefix) <= 1 or prefix[1] is None


def initial_tokens(
    spec: WhisperSpec,
    *,
    task: str | None = None,
    language: str | None = None,
    detected_language_id: int | None = None,
    timestamps: bool = False,
) -> list[int]:
    """The decoder's first tokens for one row, as ``_retrieve_init_tokens`` builds them:
    ``<|startoftranscript|>``, the language (given, forced, or ``detected_language_id``), the
    task (given, forced, or ``transcribe`` when only a language is given) and, without
    timestamps, ``<|notimestamps|>``."""
    if task is not None and task not in TASKS:
        raise InvalidInputError(f"task must be one of {', '.join(TASKS)}, got {task!r}", input_name="task")
    if task is not None and task not in spec.task_to_id:
        raise InvalidInputError(f"this model has no {task!r} task token", input_name="task")
    tokens = _forced_prefix(spec, task, language)
    if language is not None:
        lang: int | None = language_id(spec, language)
    elif needs_language(spec, task=task, language=language):
        if detected_language_id is None:
            raise ValueError("the language must be detected first (needs_language): pass detected_language_id")
        lang = detected_language_id
    else:
        lang = None
    if lang is not None:
        if len(tokens) > 1:
            tokens[1] = lang
        else:
            tokens.append(lang)
    if task is not None:
        task_id = spec.task_to_id[task]
        task_ids = set(spec.task_to_id.values())
        if any(t in task_ids for t in tokens):
            tokens = [task_id if t in task_ids else t for t in tokens]
        else:
            tokens.append(task_id)
    elif language is not None and spec.task_to_id and not any(t in spec.task_to_id.values() for t in tokens):
        tokens.append(spec.task_to_id["transcribe"])
    if not timestamps and tokens[-1] != spec.no_timestamps_token_id:
        tokens.append(spec.no_timestamps_token_id)
    elif timestamps and tokens[-1] == spec.no_timestamps_token_id:
        tokens = tokens[:-1]
    return [t for t in tokens if t is not None]


def detect_language(spec: WhisperSpec, logits: np.ndarray) -> np.ndarray:
    """The most likely language token per row, from the logits ``(rows, vocab)`` of the
    decoder's first step on ``[<|startoftranscript|>]`` (``WhisperGenerationMixin.detect_language``)."""
    if not spec.lang_to_id:
        raise InvalidInputError("this model has no language tokens to detect a language with", input_name="language")
    scores = np.asarray(logits)
    ids = np.fromiter(spec.lang_to_id.values(), dtype=np.int64)
    masked = np.full_like(scores, -np.inf)
    masked[:, ids] = scores[:, ids]
    return masked.argmax(axis=-1).astype(np.int64)


def prompt_tokens(spec: WhisperSpec, text_ids: Sequence[int]) -> list[int]:
    """The previous-text prefix for ``generate(prompt_ids=...)``: ``<|startofprev|>`` and the
    prompt's text tokens (the tokenizer's ids of ``" " + text.strip()``), which go before
    :func:`initial_tokens`. Special tokens in the text are refused, as ``get_prompt_ids`` does;
    a prompt that leaves fewer than one token of room in ``max_target_positions`` too."""
    if spec.prev_sot_token_id is None:
        raise InvalidInputError("this model has no <|startofprev|> token for a prompt", input_name="prompt")
    ids = [int(t) for t in text_ids]
    special = [t for t in ids if t >= spec.eos_token_id]
    if special:
        raise InvalidInputError(f"the prompt holds special token id {special[0]}; give plain text", input_name="prompt")
    if len(ids) + 1 >= spec.max_target_positions // 2:
        raise InvalidInputError(
            f"the prompt is {len(ids)} tokens; at most {spec.max_target_positions // 2 - 2} fit",
            input_name="prompt",
        )
    return [spec.prev_sot_token_id, *ids]


# -- logits, per step ------------------------------------------------------------------------


class LogitRules:
    """The processors ``generate`` puts before choosing each token, for rows decoded together:
    ``begin_suppress_tokens`` at each row's first step, ``suppress_tokens`` always, and with
    ``timestamps`` the timestamp rules (``<|notimestamps|>`` never; timestamps in pairs and
    never decreasing; the first token a timestamp no later than ``max_initial_timestamp_index``;
    a timestamp whenever their total probability beats every text token)."""

    def __init__(self, spec: WhisperSpec, *, timestamps: bool = False) -> None:
        self.spec = spec
        self.timestamps = timestamps
        self._suppress = np.asarray(spec.suppress_tokens, dtype=np.int64)
        self._begin = np.asarray(spec.begin_suppress_tokens, dtype=np.int64)

    def __call__(
        self, sequences: Sequence[Sequence[int]] | np.ndarray, scores: np.ndarray, begin_index: int | Sequence[int]
    ) -> np.ndarray:
        """``scores`` (rows, vocab) for the next token of each row of ``sequences`` (each row's
        tokens so far, prompt and initial tokens included); ``begin_index``: where each row's
        generated tokens start (one number for all rows, or one per row). Returns new scores."""
        out = np.array(scores, dtype=np.float32, copy=True)
        rows = [np.asarray(s, dtype=np.int64) for s in sequences]
        if len(rows) != out.shape[0]:
            raise ValueError(f"{len(rows)} sequences for {out.shape[0]} rows of scores")
        if isinstance(begin_index, (int, np.integer)):
            begins = [int(begin_index)] * len(rows)
        else:
            begins = [int(b) for b in begin_index]
        if len(begins) != len(rows):
            raise ValueError(f"{len(begins)} begin indices for {len(rows)} rows")
        at_begin = np.array([len(r) == b for r, b in zip(rows, begins, strict=True)])
        if self._begin.size and at_begin.any():
            out[np.ix_(at_begin, self._begin[self._begin < out.shape[1]])] = -np.inf
        if self._suppress.size:
            out[:, self._suppress[self._suppress < out.shape[1]]] = -np.inf
        if self.timestamps:
            self._timestamp_rules(rows, begins, at_begin, out)
        return out

    def _timestamp_rules(
        self, rows: list[np.ndarray], begins: list[int], at_begin: np.ndarray, out: np.ndarray
    ) -> None:
        spec = self.spec
        ts = spec.timestamp_begin
        out[:, spec.no_timestamps_token_id] = -np.inf
        for k, (row, begin) in enumerate(zip(rows, begins, strict=True)):
            seq = row[begin:]
            last_was_ts = len(seq) >= 1 and seq[-1] >= ts
            penultimate_was_ts = len(seq) < 2 or seq[-2] >= ts
            if last_was_ts:
                if penultimate_was_ts:  # a pair closed: text next
                    out[k, ts:] = -np.inf
                else:  # an opened pair: another timestamp (or end of text) next
                    out[k, : spec.eos_token_id] = -np.inf
            stamps = seq[seq >= ts]
            if stamps.size:
                # never decreasing; after a pair, not the same one again
                last = stamps[-1] if last_was_ts and not penultimate_was_ts else stamps[-1] + 1
                out[k, ts:last] = -np.inf
        if at_begin.any():
            out[at_begin, :ts] = -np.inf
            if spec.max_initial_timestamp_index is not None:
                out[at_begin, ts + spec.max_initial_timestamp_index + 1 :] = -np.inf
        # a timestamp when all of them together are likelier than any text token (float32, as torch)
        with np.errstate(divide="ignore", invalid="ignore"):
            logprobs = out - _logsumexp(out)
            ts_logprob = _logsumexp(logprobs[:, ts:])[:, 0]
            text_max = logprobs[:, :ts].max(axis=-1)
        out[ts_logprob > text_max, :ts] = -np.inf


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(x - top).sum(axis=-1, keepdims=True)) + top


# -- segments and the long-form window --------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """A piece of a transcript between two timestamps: seconds from the start of the audio."""

    start: float
    end: float
    tokens: tuple[int, ...]


def split_segments(
    spec: WhisperSpec, tokens: Sequence[int], *, time_offset: float, window_frames: int
) -> tuple[list[Segment], int]:
    """The segments one window's generated ``tokens`` (after the initial tokens, end of text
    included if it came) make, and how many feature frames the window advances, as
    ``_retrieve_segment`` does: ``time_offset`` is where the window starts (seconds),
    ``window_frames`` how many real (unpadded) frames it held.

    Two timestamps in a row end a segment. A window ending on a single timestamp has no
    speech after it and advances whole; otherwise the text after the last pair is cut off
    mid-speech and dropped, and the window advances to the last pair's timestamp. Without
    any pair the whole window is one segment ending at its last timestamp (or its end)."""
    seq = np.asarray(tokens, dtype=np.int64)
    ts = spec.timestamp_begin
    is_ts = seq >= ts
    single_ending = is_ts[-2:].tolist() == [False, True]
    pairs = (np.nonzero(is_ts[:-1] & is_ts[1:])[0] + 1).tolist()
    segments: list[Segment] = []
    if pairs:
        slices = list(pairs)
        if single_ending:
            slices.append(len(seq))
        else:
            slices[-1] += 1
        last = 0
        for i, cut in enumerate(slices):
            piece = seq[last:cut]
            end_at = -1 if i != len(slices) - 1 or single_ending else -2
            segments.append(
                Segment(
                    start=time_offset + float(piece[0] - ts) * TIME_PRECISION,
                    end=time_offset + float(piece[end_at] - ts) * TIME_PRECISION,
                    tokens=tuple(int(t) for t in piece),
                )
            )
            last = cut
        if single_ending:
            advance = window_frames
        else:
            advance = int(seq[last - 2] - ts) * INPUT_STRIDE
    else:
        stamps = seq[is_ts]
        # window_frames * 0.01 s per frame, counted in 0.02-s timestamp steps (the same float
        # expression as transformers', so the same rounding)
        last_pos: float = int(window_frames * 0.01 / TIME_PRECISION)
        if stamps.size and stamps[-1] != ts:
            last_pos = float(stamps[-1] - ts)
        segments.append(
            Segment(
                start=time_offset,
                end=time_offset + last_pos * TIME_PRECISION,
                tokens=tuple(int(t) for t in seq),
            )
        )
        advance = window_frames
    return segments, advance


def window(features: np.ndarray, seek: int, frames: int = 3000) -> tuple[np.ndarray, int]:
    """The window of long-form ``features`` ``(n_mels, total)`` starting at frame ``seek``:
    ``(n_mels, frames)`` zero-padded past the end (as transformers pads it: zeros, not the
    features of silence), and how many real frames it holds."""
    total = features.shape[-1]
    if not 0 <= seek < total:
        raise ValueError(f"seek {seek} is outside the features (0..{total - 1})")
    real = min(frames, total - seek)
    piece = features[..., seek : seek + real]
    if real < frames:
        pad = [(0, 0)] * (features.ndim - 1) + [(0, frames - real)]
        piece = np.pad(piece, pad)
    return np.ascontiguousarray(piece, dtype=np.float32), real
