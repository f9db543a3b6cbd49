"""From a caller's prompt and parameters to a checked request; what a request returns.

Pure Python and numpy. :class:`RequestFactory` turns a prompt (text or token ids) and
one :class:`SamplingParams` into a :class:`GenerationRequest`, raising
:class:`InvalidInputError` at submit for anything that could never run (empty prompt,
ids outside the vocabulary, longer than the context or the token budget, stop strings
without a tokenizer). The request then carries its own state (tokens so far, text,
future) through the scheduler until it is settled.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from .._extras import require
from .._lifecycle import request_future
from ..errors import InvalidInputError
from .constrained import CompiledGrammar, GrammarCompiler
from .processors import RowState, TokenLogprob
from .sampling import SamplingParams
from .text import TextTracker

__all__ = [
    "Completion",
    "ExportTokenizer",
    "GenerationRequest",
    "RequestFactory",
    "SamplingOptions",
    "StreamToken",
    "TokenLogprob",
    "sampling_params",
]


@dataclass(frozen=True)
class Completion:
    """The result of one request.

    ``token_ids`` are the generated ids (the eos id included when generation ended on
    it, as transformers' ``generate`` returns it); ``text`` is their decoded text, without
    special tokens and cut before a matched stop string. ``finish_reason`` is ``"stop"``
    (eos or a stop string; ``stop_sequence`` says which string) or ``"length"``
    (``max_new_tokens`` reached).

    ``logprobs``: one :class:`TokenLogprob` per generated token when ``logprobs`` was asked
    (else ``None``); ``prompt_logprobs``: one per prompt token when ``prompt_logprobs`` was
    asked, ``None`` for the first (nothing precedes it), with ``prompt_token_ids`` beside
    them. ``index``: which of the ``n`` choices this is.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    prompt_token_ids: tuple[int, ...] = ()
    index: int = 0


@dataclass(frozen=True)
class StreamToken:
    """One generated token as streamed: its id, the text that became final with it
    (may be empty while a multi-byte character or a possible stop string is incomplete),
    its index, and ``finish_reason`` on the last one; ``logprob`` (its :class:`TokenLogprob`)
    when ``logprobs`` was asked; ``choice``: which of the ``n`` choices it belongs to;
    ``prompt_logprobs``: on each choice's first token when ``prompt_logprobs`` was asked
    (as :attr:`Completion.prompt_logprobs`), so a stream can show them before the end."""

    token_id: int
    text: str
    index: int
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None
    choice: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class SamplingOptions(TypedDict, total=False):
    """The fields of :class:`SamplingParams` that ``submit`` / ``generate`` / ``stream``
    also take as keyword arguments (``max_new_tokens`` is their second positional one)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    stop: str | Sequence[str] | None
    seed: int | None
    min_p: float
    min_tokens: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float | None
    logit_bias: Mapping[int, float]
    logprobs: int | None
    prompt_logprobs: int | None
    n: int
    json_schema: Mapping[str, Any] | str | None
    json_object: bool
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None


_OPTION_NAMES = frozenset(SamplingOptions.__annotations__)


def sampling_params(
    params: SamplingParams | None, max_new_tokens: int | None, options: Mapping[str, Any]
) -> SamplingParams:
    """``params`` (default: greedy) with the keyword ``options`` and ``max_new_tokens`` in
    place of its own values where given: the keyword arguments are a shorthand for it."""
    unknown = sorted(set(options) - _OPTION_NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; sampling takes {sorted(_OPTION_NAMES)}")
    changes: dict[str, Any] = {k: (() if k == "stop" and v is None else v) for k, v in options.items()}
    if max_new_tokens is not None:
        changes["max_new_tokens"] = max_new_tokens
    if params is None:
        return SamplingParams(**changes)
    return dataclasses.replace(params, **changes) if changes else params


@dataclass(eq=False)
class GenerationRequest:
    """One request from submit to its last token: owned by the scheduler once queued."""

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    params: SamplingParams
    rng: np.random.Generator | None
    tracker: TextTracker
    future: Future[Completion]
    deadline: float | None
    on_token: Callable[[StreamToken], None] | None
    submitted_at: float
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    done: bool = False  # settled (result, error or cancelled): its row leaves at the next step
    #: Penalty/bias/min_tokens memory; ``None`` on the fast path (no extras asked).
    state: RowState | None = None
    #: Which of the ``n`` choices; the request holding choice 0 is ``leader`` of the others.
    choice: int = 0
    leader: GenerationRequest | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    #: what the generator's observer said of it when it was queued (``ortbatch._observe``)
    tag: Any = None

    @property
    def reserved_tokens(self) -> int:
        """What the request may occupy of the cache: its prompt and every token it may add."""
        return int(self.prompt.shape[0]) + self.max_new_tokens

    def completion(self, finish_reason: str, now: float | None = None) -> Completion:
        now = time.monotonic() if now is None else now
        first = self.first_token_at if self.first_token_at is not None else now
        return Completion(
            text=self.tracker.text,
            token_ids=tuple(self.generated),
            finish_reason=finish_reason,
            prompt_tokens=int(self.prompt.shape[0]),
            completion_tokens=len(self.generated),
            stop_sequence=self.tracker.stop_string,
            time_to_first_token_s=first - self.submitted_at,
            total_time_s=now - self.submitted_at,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=tuple(int(i) for i in self.prompt) if self.prompt_logprobs is not None else (),
            index=self.choice,
        )


class ExportTokenizer:
    """The export's ``tokenizer.json``, loaded on first use (``tokenizers`` is optional:
    token-id prompts need none)."""

    def __init__(self, directory: Path, name: str | None) -> None:
        self._directory = directory
        self._path = directory / name if name else None
        self._tokenizer: Any = None
        #: Why there is no tokenizer (``None`` while there may be one).
        self.error: str | None = None

    def get(self) -> Any:
        """The ``tokenizers.Tokenizer``, or ``None`` when the export has none."""
        if self._tokenizer is None and self.error is None:
            if self._path is None or not self._path.is_file():
                self.error = f"{self._directory} has no tokenizer.json"
            else:
                tokenizers = require("tokenizers", "serve")
                self._tokenizer = tokenizers.Tokenizer.from_file(str(self._path))
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.get()
        if tok is None:
            raise InvalidInputError(f"text prompt given but {self.error}: pass token ids", input_name="prompt")
        return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        tok = self.get()
        if tok is None:
            raise InvalidInputError(f"{self.error}: cannot decode", input_name="prompt")
        return str(tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_fn(self, skip_special_tokens: bool = True) -> Callable[[Sequence[int]], str] | None:
        tok = self.get()
        if tok is None:
            return None
        return lambda ids: tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (what OpenAI's ``bytes`` field holds; a token may be part of
        a UTF-8 character). Byte-level BPE tokens (GPT-2 style) map back through their byte
        alphabet, SentencePiece byte-fallback tokens (``<0x0A>``) are that byte, ``▁`` a space;
        any other token is the UTF-8 of its text."""
        tok = self.get()
        if tok is None:
            raise InvalidInputError(f"{self.error}: no token bytes", input_name="prompt")
        table = _byte_decoder()
        out: list[bytes] = []
        for i in ids:
            piece = tok.id_to_token(int(i)) or ""
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            elif piece and all(ch in table for ch in piece) and tok.decode([int(i)]) != piece:
                out.append(bytes(table[ch] for ch in piece))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


@dataclass
class RequestFactory:
    """Checks a prompt and its parameters against the model's limits; builds the request."""

    tokenizer: ExportTokenizer
    vocab_size: int
    max_context_length: int
    max_tokens_in_flight: int
    default_max_new_tokens: int
    default_timeout_s: float | None
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1), init=False, repr=False)

    eos_token_ids: tuple[int, ...] = ()
    #: Compiles a constrained request's grammar at submit (``None``: constraints refused).
    grammars: GrammarCompiler | None = None

    def build(
        self,
        prompt: Any,
        params: SamplingParams,
        timeout_s: float | None,
        on_token: Callable[[StreamToken], None] | None,
        now: float,
    ) -> GenerationRequest:
        """One request (``params.n`` must be 1; :meth:`build_choices` makes ``n``)."""
        if params.n != 1:
            raise InvalidInputError(f"n={params.n}: use submit_choices for several choices", input_name="n")
        return self.build_choices(prompt, params, timeout_s, on_token, now)[0]

    def build_choices(
        self,
        prompt: Any,
        params: SamplingParams,
        timeout_s: float | None,
        on_token: Callable[[StreamToken], None] | None,
        now: float,
    ) -> list[GenerationRequest]:
        """``params.n`` requests of one prompt: choice 0 leads (its prefill is shared), each
        with its own random generator: choice 0 seeded by ``seed`` as a lone request is,
        choice ``i`` by ``(seed, i)``, so a seeded ``n`` is reproducible."""
        ids, n_new, timeout = self.check(prompt, params, timeout_s)
        grammar = self.compile(params)
        base = secrets.randbits(64) if params.seed is None else params.seed
        reqs: list[GenerationRequest] = []
        for choice in range(params.n):
            rng = None
            if not params.greedy:
                seed: Any = base if choice == 0 else np.random.SeedSequence([base, choice])
                rng = np.random.Generator(np.random.PCG64(seed))
            stops, include = tuple(params.stop), params.include_stop_str_in_output
            req = GenerationRequest(
                id=next(self._ids),
                prompt=ids,
                max_new_tokens=n_new,
                params=params,
                rng=rng,
                tracker=TextTracker(self.tokenizer.decode_fn(params.skip_special_tokens), stops, include),
                future=request_future(),
                deadline=None if timeout is None else now + timeout,
                on_token=on_token,
                submitted_at=now,
                choice=choice,
                leader=reqs[0] if reqs else None,
            )
            if params.extras:
                row = grammar.row() if grammar is not None else None
                req.state = RowState(params, ids, self.vocab_size, self.eos_token_ids, row)
            if params.logprobs is not None:
                req.logprobs = []
            reqs.append(req)
        return reqs

    def compile(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled grammar (``None`` when it has no constraint); a grammar that
        does not compile is an :class:`InvalidInputError` naming its field."""
        constraint = params.constraint
        if constraint is None:
            return None
        if self.grammars is None:
            raise InvalidInputError(f"{constraint.kind} is not supported here", input_name=constraint.kind)
        return self.grammars.compile(constraint)

    def check(
        self, prompt: Any, params: SamplingParams, timeout_s: float | None
    ) -> tuple[np.ndarray, int, float | None]:
        """The prompt's token ids, the tokens to generate and the deadline in seconds, once
        every check :meth:`build` makes has passed (:class:`InvalidInputError` otherwise)."""
        ids = self.prompt_ids(prompt)
        n_new = self.default_max_new_tokens if params.max_new_tokens is None else params.max_new_tokens
        self._check_fits(int(ids.shape[0]), n_new)
        if tuple(params.stop) and self.tokenizer.decode_fn() is None:
            raise InvalidInputError(f"stop strings need a tokenizer but {self.tokenizer.error}", input_name="stop")
        if params.min_tokens > n_new:
            raise InvalidInputError(
                f"min_tokens ({params.min_tokens}) must be <= max_new_tokens ({n_new})", input_name="min_tokens"
            )
        for name, given in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(dict(params.logit_bias))),
        ):
            outside = [i for i in given if i >= self.vocab_size]
            if outside:
                raise InvalidInputError(
                    f"{name} has id {outside[0]}, outside the vocabulary [0, {self.vocab_size})", input_name=name
                )
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0
        ):
            raise InvalidInputError(
                f"timeout_s must be a positive number of seconds, got {timeout!r}", input_name="timeout_s"
            )
        return ids, n_new, timeout

    def _check_fits(self, prompt_tokens: int, n_new: int) -> None:
        if prompt_tokens + n_new > self.max_context_length:
            raise InvalidInputError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({n_new}) exceeds the model's "
                f"context of {self.max_context_length} tokens",
                input_name="prompt",
            )
        if prompt_tokens + n_new > self.max_tokens_in_flight:
            raise InvalidInputError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({n_new}) exceeds "
                f"max_tokens_in_flight={self.max_tokens_in_flight}: it could never be admitted",
                input_name="prompt",
            )

    def prompt_ids(self, prompt: Any) -> np.ndarray:
        """The prompt as 1-D int64 token ids, each inside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty", input_name="prompt")
            ids = np.asarray(self.tokenizer.encode(prompt), dtype=np.int64)
        else:
            try:
                arr = np.asarray(prompt)
            except (TypeError, ValueError) as exc:
                raise InvalidInputError(f"prompt must be text or token ids: {exc}", input_name="prompt") from exc
            if arr.ndim == 2 and arr.shape[0] == 1:
                arr = arr[0]
            if arr.ndim != 1:
                raise InvalidInputError(
                    f"token-id prompt must be 1-D (or [1, n]), got shape {arr.shape}", input_name="prompt"
                )
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise InvalidInputError(f"token ids must be integers, got dtype {arr.dtype}", input_name="prompt")
            ids = arr.astype(np.int64)
        if ids.size == 0:
            raise InvalidInputError("prompt has no tokens", input_name="prompt")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            pos = int(np.argmax(bad))
            raise InvalidInputError(
                f"prompt token {pos} is id {int(ids[pos])}, outside the vocabulary [0, {self.vocab_size})",
                input_name="prompt",
            )
        return ids
