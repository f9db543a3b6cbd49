"""``generate``'s decoding settings and logits processors, as transformers applies them. Pure numpy.

:class:`Decoding` holds the settings of transformers' ``GenerationConfig`` that decide which
tokens come out (beam search, lengths, the logits processors, sampling); ``None`` is "not set".
A request's :class:`Decoding` is completed from the checkpoint's ``generation_config.json``
(:func:`read_generation_config`) by :meth:`Decoding.over`, then from transformers' own defaults
(:meth:`Decoding.resolved`), as ``model.generate(**kwargs)`` starts from
``model.generation_config`` and lets each argument override one field.

:func:`process` applies the processors to a batch of rows, each with its own token history, in
the order of transformers' ``GenerationMixin._get_logits_processor`` (4.57):
repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens,
forced_bos_token_id, forced_eos_token_id, suppress_tokens, begin_suppress_tokens. Greedy and
sampled rows are processed on the raw logits, beams on their log-softmax (transformers does the
same, which matters for ``repetition_penalty``). A row's history is its decoder sequence: for an
encoder-decoder model the decoder start token and what was generated (the source is not part of
it, as in ``generate``), for a decoder-only model the prompt and what was generated.

What ``generate`` would apply and this module cannot is refused when the config is read
(:class:`~ortbatch.errors.ModelContractError` naming the setting), so a model is never served
with silently different tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError, ModelContractError
from .defaults import read_generation_config_json

__all__ = [
    "DECODING_FIELDS",
    "UNHONOURED",
    "Decoding",
    "ModelGeneration",
    "process",
    "read_generation_config",
]

#: generation_config.json settings that change ``generate``'s tokens and that ortbatch cannot
#: honour, each with the values that ask for nothing (transformers' defaults).
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "encoder_no_repeat_ngram_size": (None, 0),
    "encoder_repetition_penalty": (None, 1, 1.0),
    "forced_decoder_ids": (None, []),
    "sequence_bias": (None, {}, []),
    "exponential_decay_length_penalty": (None,),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0, 0.0),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "guidance_scale": (None, 1, 1.0),
    "stop_strings": (None, []),
    "watermarking_config": (None,),
    "token_healing": (None, False),
    "constraints": (None, []),
    "force_words_ids": (None, []),
    "typical_p": (None, 1, 1.0),
    "epsilon_cutoff": (None, 0, 0.0),
    "eta_cutoff": (None, 0, 0.0),
    "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type-strict, so that True does not pass for 1 nor 0 for False
    return value is None or any(type(value) is type(n) and value == n for n in neutral if n is not None)


@dataclass(frozen=True)
class Decoding:
    """How ``generate`` decodes one request (``None``: not set here; see :meth:`over`)."""

    max_new_tokens: int | None = None
    max_length: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    num_beams: int | None = None
    num_return_sequences: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "num_beams", "num_return_sequences"):
            _int_field(self, name, 1)
        for name in ("max_length", "min_length", "min_new_tokens", "no_repeat_ngram_size", "top_k"):
            _int_field(self, name, 0)
        for name in ("length_penalty", "repetition_penalty", "temperature", "top_p"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidInputError(f"{name} must be a finite number, got {value!r}", input_name=name)
            object.__setattr__(self, name, float(value))
        for name, lo in (("repetition_penalty", 0.0), ("temperature", 0.0)):
            if (v := getattr(self, name)) is not None and not v > lo and not (name == "temperature" and v == 0):
                raise InvalidInputError(f"{name} must be > {lo:g}, got {v!r}", input_name=name)
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p!r}", input_name="top_p")
        if self.early_stopping is not None and self.early_stopping not in (True, False, "never"):
            raise InvalidInputError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}",
                input_name="early_stopping",
            )
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise InvalidInputError(f"do_sample must be a bool, got {self.do_sample!r}", input_name="do_sample")
        if self.forced_bos_token_id is not None:
            _int_field(self, "forced_bos_token_id", 0)
        for name in ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _ids(name, [value] if isinstance(value, int) else value))
        if self.bad_words_ids is not None:
            value = self.bad_words_ids
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise InvalidInputError(
                    "bad_words_ids must be a list of lists of token ids", input_name="bad_words_ids"
                )
            words = tuple(_ids("bad_words_ids", w) for w in value)
            if any(not w for w in words):
                raise InvalidInputError("bad_words_ids holds an empty list", input_name="bad_words_ids")
            object.__setattr__(self, "bad_words_ids", words)

    def over(self, base: Decoding) -> Decoding:
        """This request's settings where set, ``base``'s (the model's) elsewhere."""
        return Decoding(**{f.name: _pick(getattr(self, f.name), getattr(base, f.name)) for f in _FIELDS})

    def resolved(self, prompt_length: int, default_max_new_tokens: int) -> Decoding:
        """Every field set: transformers' defaults where neither request nor model set one.

        ``max_new_tokens`` comes from the request's or the model's ``max_new_tokens``, else its
        ``max_length`` (which counts the decoder prompt, ``prompt_length`` tokens), else
        ``default_max_new_tokens`` (the engine's; transformers' own is ``max_length=20``)."""
        n_new = self.max_new_tokens
        if n_new is None and self.max_length is not None:
            n_new = max(1, self.max_length - prompt_length)
        if n_new is None:
            n_new = default_max_new_tokens
        sampling = bool(self.do_sample)
        out = dataclasses.replace(
            self,
            max_new_tokens=n_new,
            max_length=prompt_length + n_new,
            min_length=self.min_length or 0,
            min_new_tokens=self.min_new_tokens or 0,
            num_beams=self.num_beams or 1,
            num_return_sequences=self.num_return_sequences or 1,
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
            early_stopping=False if self.early_stopping is None else self.early_stopping,
            no_repeat_ngram_size=self.no_repeat_ngram_size or 0,
            bad_words_ids=self.bad_words_ids or (),
            suppress_tokens=self.suppress_tokens or (),
            begin_suppress_tokens=self.begin_suppress_tokens or (),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            do_sample=sampling,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=50 if self.top_k is None else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
        )
        out.check()
        return out

    def check(self) -> None:
        """Refuse what ``generate`` itself refuses (checked once resolved)."""
        beams, n = self.num_beams or 1, self.num_return_sequences or 1
        if beams > 1 and n > beams:
            raise InvalidInputError(
                f"num_return_sequences ({n}) must be <= num_beams ({beams})", input_name="num_return_sequences"
            )
        if beams == 1 and n > 1 and not self.do_sample:
            raise InvalidInputError(
                f"num_return_sequences={n} needs beam search (num_beams >= {n}) or sampling (do_sample=True): "
                "greedy decoding has one answer",
                input_name="num_return_sequences",
            )
        if beams > 1 and self.do_sample:
            raise InvalidInputError(
                "beam sampling (do_sample=True with num_beams > 1) is not supported; set one of them",
                input_name="num_beams",
            )
        if self.do_sample and self.temperature == 0:
            raise InvalidInputError(
                "temperature=0 with do_sample=True: sample with temperature > 0 or do_sample=False",
                input_name="temperature",
            )

    @property
    def greedy(self) -> bool:
        return not self.do_sample and (self.num_beams or 1) == 1


_FIELDS = dataclasses.fields(Decoding)
#: The names of :class:`Decoding`'s fields (the keyword arguments a request may set).
DECODING_FIELDS = frozenset(f.name for f in _FIELDS)


def _pick(mine: Any, base: Any) -> Any:
    return base if mine is None else mine


def _int_field(obj: Decoding, name: str, lo: int) -> None:
    value = getattr(obj, name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise InvalidInputError(f"{name} must be an integer >= {lo}, got {value!r}", input_name=name)
    object.__setattr__(obj, name, int(value))


def _ids(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidInputError(f"{name} must be a list of token ids, got {value!r}", input_name=name)
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise InvalidInputError(f"{name} must hold token ids (integers >= 0), got {v!r}", input_name=name)
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class ModelGeneration:
    """What a checkpoint's ``generation_config.json`` says: its :class:`Decoding` (empty when
    ignored or absent), its eos ids (``None``: it names none) and the decoder start token."""

    decoding: Decoding = field(default_factory=Decoding)
    eos_token_ids: tuple[int, ...] | None = None
    decoder_start_token_id: int | None = None
    pad_token_id: int | None = None


def read_generation_config(directory: Path, use: bool = True) -> ModelGeneration:
    """The export's ``generation_config.json``, as ``generate`` applies it; ``use=False``: only
    its token ids (eos, decoder start, pad), none of its decoding settings (``--generation-config
    ignore``). A setting ortbatch cannot honour is a :class:`ModelContractError` naming it."""
    path = directory / "generation_config.json"
    config = read_generation_config_json(directory)
    if config is None:
        return ModelGeneration()
    eos = config.get("eos_token_id")
    eos_ids = None if eos is None else tuple(int(i) for i in ([eos] if isinstance(eos, int) else eos))
    start = config.get("decoder_start_token_id")
    pad = config.get("pad_token_id")
    ids = dict(
        eos_token_ids=eos_ids,
        decoder_start_token_id=start if isinstance(start, int) else None,
        pad_token_id=pad if isinstance(pad, int) else None,
    )
    if not use:
        return ModelGeneration(**ids)  # type: ignore[arg-type]
    for name, neutral in UNHONOURED.items():
        if name in config and not _neutral(config[name], neutral):
            raise ModelContractError(
                f"{path}: {name}={json.dumps(config[name])[:60]} is not supported: transformers' generate applies "
                "it to every request and ortbatch cannot, so the tokens would differ; load with "
                f"generation_config='ignore' or remove {name} from {path.name}"
            )
    given = {k: config[k] for k in DECODING_FIELDS if config.get(k) is not None}
    try:
        decoding = Decoding(**given)
    except InvalidInputError as exc:
        raise ModelContractError(f"{path}: {exc}") from exc
    return ModelGeneration(decoding=decoding, **ids)  # type: ignore[arg-type]


# -- the processors ------------------------------------------------------------------------


def _banned_ngrams(history: Sequence[int], n: int) -> list[int]:
    """transformers' ``_calc_banned_ngram_tokens`` for one hypothesis."""
    cur = len(history)
    if cur + 1 < n:
        return []
    prefix = tuple(history[cur + 1 - n : cur])
    return [history[i + n - 1] for i in range(cur - n + 1) if tuple(history[i : i + n - 1]) == prefix]


def process(
    scores: np.ndarray,
    histories: Sequence[Sequence[int]],
    cfg: Decoding,
    eos_token_ids: Sequence[int],
    prompt_length: int,
) -> np.ndarray:
    """Apply ``cfg``'s processors to ``scores`` (``[rows, vocab]`` float32, changed in place and
    returned), row ``i`` having generated ``histories[i]`` (its decoder sequence so far, the
    ``prompt_length`` decoder prompt tokens included). ``cfg`` must be resolved."""
    rows, vocab = scores.shape
    cur = len(histories[0]) if rows else 0
    penalty = cfg.repetition_penalty
    if penalty is not None and penalty != 1.0:
        for i, h in enumerate(histories):
            idx = np.fromiter(h, np.int64, len(h))
            got = scores[i, idx]
            scores[i, idx] = np.where(got < 0, got * np.float32(penalty), got / np.float32(penalty))
    if cfg.no_repeat_ngram_size:
        for i, h in enumerate(histories):
            banned = _banned_ngrams(h, cfg.no_repeat_ngram_size)
            if banned:
                scores[i, banned] = -np.inf
    if cfg.bad_words_ids:
        eos = set(eos_token_ids)
        words = [w for w in cfg.bad_words_ids if not (len(w) == 1 and w[0] in eos)]
        singles = [w[0] for w in words if len(w) == 1]
        if singles:
            scores[:, singles] = -np.inf
        for w in words:
            if len(w) == 1:
                continue
            for i, h in enumerate(histories):
                if len(w) <= len(h) and tuple(h[len(h) - len(w) + 1 :]) == w[:-1]:
                    scores[i, w[-1]] = -np.inf
    eos_ids = list(eos_token_ids)
    if eos_ids and cfg.min_length and cur < cfg.min_length:
        scores[:, eos_ids] = -np.inf
    if eos_ids and cfg.min_new_tokens and cur - prompt_length < cfg.min_new_tokens:
        scores[:, eos_ids] = -np.inf
    if cfg.forced_bos_token_id is not None and cur == 1:
        scores[:, :] = -np.inf
        scores[:, cfg.forced_bos_token_id] = 0
    if cfg.forced_eos_token_id and cfg.max_length is not None and cur == cfg.max_length - 1:
        scores[:, :] = -np.inf
        scores[:, list(cfg.forced_eos_token_id)] = 0
    if cfg.suppress_tokens:
        scores[:, list(cfg.suppress_tokens)] = -np.inf
    if cfg.begin_suppress_tokens:
        begin = prompt_length if (prompt_length > 1 or cfg.forced_bos_token_id is None) else prompt_length + 1
        if cur == begin:
            scores[:, list(cfg.begin_suppress_tokens)] = -np.inf
    del vocab
    return scores


def check_ids(cfg: Decoding, vocab_size: int) -> None:
    """Every token id ``cfg`` names is inside the vocabulary (:class:`InvalidInputError` naming the field)."""
    groups: dict[str, Sequence[int]] = {
        "forced_bos_token_id": () if cfg.forced_bos_token_id is None else (cfg.forced_bos_token_id,),
        "forced_eos_token_id": cfg.forced_eos_token_id or (),
        "suppress_tokens": cfg.suppress_tokens or (),
        "begin_suppress_tokens": cfg.begin_suppress_tokens or (),
        "bad_words_ids": [i for w in cfg.bad_words_ids or () for i in w],
    }
    for name, ids in groups.items():
        outside = [i for i in ids if i >= vocab_size]
        if outside:
            raise InvalidInputError(
                f"{name} has id {outside[0]}, outside the vocabulary [0, {vocab_size})", input_name=name
            )
