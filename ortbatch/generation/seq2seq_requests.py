"""An encoder-decoder request from submit to its last token. Pure Python and numpy.

:class:`SourceBuilder` turns a source (text, or token ids) and the request's ``src_lang`` /
``tgt_lang`` into encoder token ids and a ``forced_bos_token_id``, without touching shared
tokenizer state: the language token is placed as the checkpoint's tokenizer places it (the
``languages`` of the layout), around the text encoded without special tokens.
:class:`Seq2SeqRequest` carries one request's resolved :class:`~.decoding.Decoding`, its rows'
token histories, its beams, its text trackers and its futures through the engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from .beam import BeamSearch
from .decoding import Decoding
from .requests import Completion, ExportTokenizer, StreamToken
from .sampling import SamplingParams
from .seq2seq_layout import Seq2SeqLayout
from .text import TextTracker

__all__ = ["Seq2SeqRequest", "SourceBuilder"]


class SourceBuilder:
    """Source text or ids -> the encoder's token ids; languages -> their token ids."""

    def __init__(self, tokenizer: ExportTokenizer, layout: Seq2SeqLayout) -> None:
        self.tokenizer = tokenizer
        self.layout = layout

    def _code(self, name: str, code: str) -> int:
        langs = self.layout.languages
        if langs is None:
            raise InvalidInputError(f"{name}={code!r}: this model has no language codes", input_name=name)
        if not isinstance(code, str) or code not in langs.codes:
            accepted = ", ".join(sorted(langs.codes))
            raise InvalidInputError(
                f"{name}={code!r} is not a language of this model; accepted: {accepted}", input_name=name
            )
        return langs.codes[code]

    def target(self, tgt_lang: str | None) -> int | None:
        """The ``forced_bos_token_id`` of ``tgt_lang`` (``None``: not given)."""
        return None if tgt_lang is None else self._code("tgt_lang", tgt_lang)

    def ids(self, source: Any, src_lang: str | None) -> np.ndarray:
        """The encoder's token ids of ``source`` (1-D int64), checked."""
        if isinstance(source, str):
            if not source:
                raise InvalidInputError("source text is empty", input_name="source")
            if src_lang is None:
                ids = self.tokenizer.encode(source)
            else:
                lang = self._code("src_lang", src_lang)
                body = self.tokenizer.encode(source, add_special_tokens=False)
                eos = self.layout.eos_token_ids[0]
                assert self.layout.languages is not None
                if self.layout.languages.source_position == "prefix":
                    ids = [lang, *body, eos]
                else:
                    ids = [*body, eos, lang]
            arr = np.asarray(ids, np.int64)
        else:
            if src_lang is not None:
                raise InvalidInputError("src_lang applies to source text, not token ids", input_name="src_lang")
            try:
                arr = np.asarray(source)
            except (TypeError, ValueError) as exc:
                raise InvalidInputError(f"source must be text or token ids: {exc}", input_name="source") from exc
            if arr.ndim == 2 and arr.shape[0] == 1:
                arr = arr[0]
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise InvalidInputError(
                    f"token-id source must be 1-D integers, got {arr.dtype} {arr.shape}", input_name="source"
                )
            arr = arr.astype(np.int64)
        if arr.size == 0:
            raise InvalidInputError("source has no tokens", input_name="source")
        bad = (arr < 0) | (arr >= self.layout.vocab_size)
        if bad.any():
            pos = int(np.argmax(bad))
            raise InvalidInputError(
                f"source token {pos} is id {int(arr[pos])}, outside the vocabulary [0, {self.layout.vocab_size})",
                input_name="source",
            )
        top = self.layout.max_source_length
        if top is not None and arr.size > top:
            raise InvalidInputError(f"source has {arr.size} tokens, more than the model's {top}", input_name="source")
        return arr


@dataclass(eq=False)
class Seq2SeqRequest:
    """One request: ``rows`` decoder rows (its beams, or its sampled sequences), each with its
    token history (the decoder start token first); ``futures``: one per returned sequence."""

    id: int
    source: np.ndarray
    decoding: Decoding
    sampling: SamplingParams
    rngs: list[np.random.Generator | None]
    futures: list[Future[Completion]]
    trackers: list[TextTracker]
    deadline: float | None
    on_token: Callable[[StreamToken], None] | None
    submitted_at: float
    start_token: int
    beam: BeamSearch | None = None
    histories: list[list[int]] = field(default_factory=list)
    #: rows (not beams) that ended, with their finish reason
    ended: dict[int, str] = field(default_factory=dict)
    first_token_at: float | None = None
    done: bool = False

    @property
    def rows(self) -> int:
        return (self.decoding.num_beams or 1) if self.beam is not None else len(self.futures)

    def live(self) -> bool:
        """False once every future is settled (cancelled included): its rows may leave."""
        return not self.done and not all(f.done() for f in self.futures)

    def completion(self, row: int, tokens: Sequence[int], reason: str, now: float | None = None) -> Completion:
        now = time.monotonic() if now is None else now
        first = self.first_token_at if self.first_token_at is not None else now
        tracker = self.trackers[row]
        return Completion(
            text=tracker.text,
            token_ids=tuple(int(t) for t in tokens),
            finish_reason=reason,
            prompt_tokens=int(self.source.shape[0]),
            completion_tokens=len(tokens),
            stop_sequence=tracker.stop_string,
            time_to_first_token_s=first - self.submitted_at,
            total_time_s=now - self.submitted_at,
            index=row,
        )


_ids: Iterator[int] = itertools.count(1)


def next_request_id() -> int:
    return next(_ids)
