"""Constrained decoding: each constrained row's grammar masks its logits inside the batched step.

A request that asks for structured output (``json_schema``, ``json_object``, ``regex``,
``choice`` or ``grammar`` in :class:`~.sampling.SamplingParams`) carries a
:class:`Constraint`. At submit, the generator's :class:`GrammarCompiler` compiles it for the
export's tokenizer (on its own worker thread, cached: a schema seen before costs no compile),
and each of the request's rows gets its own :class:`RowGrammar`. At every step
:func:`mask_rows` asks each constrained row's grammar which tokens may come next and sets
every other logit to ``-inf``, before logprobs, penalties and the choice (vLLM's order); the
chosen token then advances the grammar. Rows without a constraint never reach this module.

When the grammar is complete it allows only eos, so the row ends with ``finish_reason
"stop"`` as on any eos; reaching ``max_new_tokens`` first ends it with ``"length"`` and an
unfinished document.

The engine is llguidance (the ``structured`` extra): it compiles a JSON schema, a regex or a
Lark/GBNF grammar in about a millisecond, computes a mask in tens of microseconds with a
50k-token vocabulary, reads the tokenizer straight from ``tokenizer.json`` and needs no
torch (measurements in docs/generation.md, ``benchmarks/grammar_engines.py``). It is
imported only when the first constrained request arrives.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from ..errors import InferenceError, InvalidInputError, SessionClosedError, UnsupportedError

__all__ = [
    "CONSTRAINT_FIELDS",
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
    "CompiledGrammar",
    "Constraint",
    "GrammarFailedError",
    "GrammarCompiler",
    "RowGrammar",
    "mask_rows",
]

#: The fields of :class:`~.sampling.SamplingParams` that constrain the output (at most one per request).
CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")
#: The extra that installs the grammar engine.
EXTRA = "structured"
#: Longest engine message quoted in an error.
_MAX_MESSAGE = 400
#: Most strings a ``choice`` constraint takes (the engine's grammar has at most 65,525 symbols).
MAX_CHOICES = 10_000
#: Deepest nesting of a JSON schema (or of JSON given as a string where a schema or tool-call
#: arguments go): deeper is refused before parsing costs a recursion, or the engine its stack.
MAX_JSON_DEPTH = 64
#: What every integer bound of a schema must lie within: the engine enforces 64-bit integers
#: only (beyond, it clamps, and a schema's ``minimum: 10**300`` gave ``9223372036854775807``).
_INT64 = (-(2**63), 2**63 - 1)
#: Tokens a fresh grammar is walked at compile time (see :func:`_walk`).
_PROBE_STEPS = 8
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@dataclass(frozen=True)
class Constraint:
    """What one request's output must match: ``kind`` is the :class:`SamplingParams` field
    it came from (one of :data:`CONSTRAINT_FIELDS`) and ``source`` its text (a JSON
    schema's JSON, a regex, a JSON list of choices, a Lark or GBNF grammar)."""

    kind: str
    source: str

    def engine_grammar(self, ll: Any) -> str:
        """The llguidance grammar for this constraint (``ll``: the llguidance module)."""
        if self.kind in ("json_schema", "json_object"):
            # Compact JSON (no whitespace between tokens, vLLM's disable_any_whitespace): a model
            # cannot loop on whitespace. A schema's own "x-guidance" options override this.
            schema = self.source if self.kind == "json_schema" else '{"type": "object"}'
            return str(ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
        if self.kind == "regex":
            return str(ll.LLMatcher.grammar_from_regex(self.source))
        # choice: each string a Lark literal (JSON escapes); grammar: Lark, or GBNF (has "::=")
        return str(ll.grammar_from("choice" if self.kind == "choice" else "grammar", self.source))


def engine_message(message: str) -> str:
    """The engine's message as a client may read it: its first part only (never the parser
    state or the whole grammar it appends), and no Rust panic or backtrace."""
    text = str(message)
    if "panic" in text or "backtrace" in text.lower():
        return "the grammar engine cannot build it (too large or too complex)"
    text = text.split("<state>", 1)[0].split("<grammar>", 1)[0].strip() or "the grammar failed"
    if len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE] + " ..."
    return text


def _invalid(constraint: Constraint, message: str) -> InvalidInputError:
    return InvalidInputError(
        f"{constraint.kind} cannot be compiled: {engine_message(message)}", input_name=constraint.kind
    )


class GrammarFailedError(InferenceError, InvalidInputError):
    """A request's grammar compiled but the engine gave up on it while decoding (too complex
    past some token): the request's own error, so a 400 (an :class:`InvalidInputError`) on
    every transport, and still an :class:`InferenceError` for the row that failed."""


class RowGrammar:
    """One row's place in its grammar: which tokens may come next, and advancing by one."""

    def __init__(self, matcher: Any, words: int, kind: str | None = None) -> None:
        self._matcher = matcher
        self.words = words
        #: the constraint's kind (the field its errors name)
        self.kind = kind

    def fill(self, bits: np.ndarray) -> str | None:
        """Write the allowed-token bitmask into ``bits`` (``int32[words]``, bit ``i % 32`` of
        word ``i // 32`` for token ``i``); returns the engine's error, or ``None``."""
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if self._matcher.is_error():
            return engine_message(self._matcher.get_error())
        if not bits.any():
            return "the grammar allows no token here"
        return None

    def advance(self, token: int) -> None:
        """Consume the chosen ``token`` (a refused one leaves the matcher in its error state,
        reported by the next :meth:`fill`)."""
        self._matcher.consume_token(int(token))

    @property
    def finished(self) -> bool:
        """True once the grammar can take nothing more but eos."""
        return bool(self._matcher.is_stopped())


class CompiledGrammar:
    """A constraint compiled for one tokenizer; each row takes its own :meth:`row`."""

    def __init__(self, constraint: Constraint, matcher: Any, words: int, compile_s: float) -> None:
        self.constraint = constraint
        self._template = matcher
        self._lock = threading.Lock()
        self.words = words
        #: Seconds the compile took (on the compiler's thread).
        self.compile_s = compile_s

    def row(self) -> RowGrammar:
        """A fresh matcher at the grammar's start, for one row."""
        with self._lock:  # the template is shared by every submitting thread
            return RowGrammar(self._template.deep_copy(), self.words, self.constraint.kind)


class GrammarCompiler:
    """Compiles constraints for one export's tokenizer, on a worker thread, with an LRU cache.

    ``tokenizer_json``: the export's ``tokenizer.json`` (``None``: none, and a constrained
    request is refused); ``vocab_size``: the model's logits width; ``eos_token_ids``: what a
    complete grammar allows (there must be one). ``cache_size`` compiled grammars are kept,
    least recently used dropped first. :meth:`compile` waits for the compile;
    :meth:`compile_async` returns its future, so an event loop can await it and the submit
    that follows finds it cached.
    """

    def __init__(
        self,
        tokenizer_json: Path | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
    ) -> None:
        self._path = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = [int(i) for i in eos_token_ids]
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Future[CompiledGrammar]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: Any = None
        self._closed = False
        #: Compiles run and requests served from the cache (``compiles + hits`` = lookups).
        self.compiles = 0
        self.hits = 0

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar (from the cache when it was compiled before). Raises
        :class:`InvalidInputError` naming the field when it does not compile, and
        :class:`UnsupportedError` when this installation or export cannot constrain."""
        return self.compile_async(constraint).result()

    def compile_async(self, constraint: Constraint) -> Future[CompiledGrammar]:
        """:meth:`compile` as a future, run on the compiler's worker thread."""
        with self._lock:
            fut = self._cache.get(constraint)
            if fut is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
                return fut
            if self._closed:
                raise SessionClosedError("the generator is closed: no grammar is compiled any more")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ortbatch-grammar")
            fut = self._pool.submit(self._compile, constraint)
            self._cache[constraint] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

        def forget_failure(done: Future[CompiledGrammar]) -> None:
            if done.exception() is not None:
                with self._lock:
                    if self._cache.get(constraint) is done:
                        del self._cache[constraint]

        fut.add_done_callback(forget_failure)
        return fut

    def close(self) -> None:
        """Stop the worker thread (a compile under way finishes). Calling it again is harmless."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _engine(self, constraint: Constraint) -> tuple[Any, Any]:
        """llguidance and its tokenizer, made on first use (on the worker thread)."""
        try:
            ll = require("llguidance", EXTRA)
        except ImportError as exc:
            raise UnsupportedError(
                f"{constraint.kind} needs the grammar engine llguidance, which is not installed: "
                f"pip install 'ortbatch[{EXTRA}]'"
            ) from exc
        if self._tokenizer is None:
            if self._path is None or not self._path.is_file():
                raise UnsupportedError(f"{constraint.kind} needs the export's tokenizer.json, which it does not have")
            if not self._eos:
                raise UnsupportedError(f"{constraint.kind} needs an eos token, and this export names none")
            text = self._path.read_text(encoding="utf-8")
            try:
                self._tokenizer = ll.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos)
            except Exception as exc:  # the engine's own error type: nothing a request can fix
                raise UnsupportedError(
                    f"{constraint.kind}: the grammar engine cannot read this export's tokenizer.json: {exc}"
                ) from exc
        return ll, self._tokenizer

    def _probe(self, constraint: Constraint, matcher: Any, words: int) -> None:
        _walk(constraint, matcher, words, self._eos)

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        import time

        ll, tokenizer = self._engine(constraint)
        t0 = time.perf_counter()
        try:
            grammar = constraint.engine_grammar(ll)
        except (ValueError, TypeError) as exc:  # not JSON, or a GBNF grammar that does not convert
            raise _invalid(constraint, str(exc)) from exc
        matcher = ll.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise _invalid(constraint, matcher.get_error())
        words = (int(tokenizer.vocab_size) + 31) // 32
        self._probe(constraint, matcher.deep_copy(), words)
        with self._lock:
            self.compiles += 1
        return CompiledGrammar(constraint, matcher, words, time.perf_counter() - t0)


def _walk(constraint: Constraint, matcher: Any, words: int, eos: Sequence[int]) -> None:
    """Walk the first :data:`_PROBE_STEPS` tokens of one path through a fresh matcher (the
    lowest allowed token that is not eos, each step): a grammar that compiles and then fails
    at once (a regex repeated a million times, a ``$ref`` cycle, a megabyte constant: the
    engine's lexer gives up on the first mask or the first token) is the request's error,
    found here, not a failed step."""
    bits = np.zeros(words, np.int32)
    for step in range(_PROBE_STEPS):
        bits[:] = 0
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if matcher.is_error():
            raise _invalid(constraint, matcher.get_error())
        allowed = np.flatnonzero(np.unpackbits(bits.astype("<i4", copy=False).view(np.uint8), bitorder="little"))
        if step == 0 and not len(allowed):
            raise _invalid(constraint, "the grammar allows no token to begin with")
        nxt = next((int(t) for t in allowed[: len(eos) + 1] if int(t) not in eos), None)
        if nxt is None or matcher.is_stopped():
            return
        matcher.consume_token(nxt)
        if matcher.is_error():
            raise _invalid(constraint, matcher.get_error())


def mask_rows(logits: np.ndarray, grammars: Sequence[RowGrammar]) -> list[str | None]:
    """Set to ``-inf`` every logit that row ``j``'s grammar does not allow next (``logits``:
    ``[len(grammars), vocab]``, modified in place). Returns each row's engine error (``None``
    when its mask was made): a row whose grammar failed must not be sampled."""
    if not grammars:
        return []
    vocab = logits.shape[-1]
    words = max(g.words for g in grammars)
    bits = np.zeros((len(grammars), max(words, (vocab + 31) // 32)), np.int32)
    errors = [g.fill(bits[j, : g.words]) for j, g in enumerate(grammars)]
    # little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7, lowest bit first
    allowed = np.unpackbits(bits.astype("<i4", copy=False).view(np.uint8), axis=1, bitorder="little")
    np.putmask(logits, allowed[:, :vocab] == 0, -np.inf)
    return errors


def constraint_source(kind: str, value: Any) -> str:
    """The text a constraint field compiles from, checked for its type (an
    :class:`InvalidInputError` naming ``kind`` otherwise); used by ``SamplingParams``."""
    if kind == "json_schema":
        if isinstance(value, str):
            value = loads_bounded(value, kind)
        if not isinstance(value, (dict, bool)):
            raise InvalidInputError(
                f"json_schema must be a JSON schema (an object), got {type(value).__name__}", input_name=kind
            )
        _check_schema(value, kind)
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"json_schema is not JSON: {exc}", input_name=kind) from exc
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, Sequence) or not value:
            raise InvalidInputError("choice must be a non-empty list of strings", input_name=kind)
        if len(value) > MAX_CHOICES:
            raise InvalidInputError(
                f"choice has {len(value)} strings; at most {MAX_CHOICES} are taken", input_name=kind
            )
        if any(not isinstance(c, str) or not c for c in value):
            raise InvalidInputError(f"choice must hold non-empty strings, got {list(value)!r}", input_name=kind)
        return json.dumps(list(value), ensure_ascii=False)
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"{kind} must be a non-empty string, got {value!r}", input_name=kind)
    return value


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``value`` (parsed JSON) nests, counted without recursion up to ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def loads_bounded(text: str, field: str) -> Any:
    """JSON given as a string (a schema, tool-call arguments), parsed: not JSON, or nested
    deeper than :data:`MAX_JSON_DEPTH`, is an :class:`InvalidInputError` naming ``field``
    (never a ``RecursionError``)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidInputError(
            f"{field} is nested too deeply (at most {MAX_JSON_DEPTH} levels)", input_name=field
        ) from None
    except ValueError as exc:
        raise InvalidInputError(f"{field} is not valid JSON: {exc}", input_name=field) from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidInputError(f"{field} is nested too deeply (at most {MAX_JSON_DEPTH} levels)", input_name=field)
    return value


def _check_schema(schema: Any, kind: str) -> None:
    """Refuse what the engine would not enforce as written: nesting beyond :data:`MAX_JSON_DEPTH`,
    and integer bounds outside 64 bits (the engine clamps them, so ``minimum: 10**300`` would
    yield ``9223372036854775807``: valid by construction means valid or refused)."""
    if json_depth(schema) > MAX_JSON_DEPTH:
        raise InvalidInputError(f"{kind} is nested too deeply (at most {MAX_JSON_DEPTH} levels)", input_name=kind)
    low, high = _INT64
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        types = item.get("type")
        integer = types == "integer" or (isinstance(types, list) and "integer" in types)
        for key in _BOUNDS:
            bound = item.get(key)
            if isinstance(bound, bool) or not isinstance(bound, (int, float)):
                continue
            if (integer or (isinstance(bound, int) and types is None)) and not low <= bound <= high:
                shown = str(bound)
                shown = shown if len(shown) <= 24 else f"{shown[:12]}...({len(shown)} digits)"
                raise InvalidInputError(
                    f"{kind}: {key} {shown} is outside the 64-bit integer range [{low}, {high}] that structured "
                    "output can enforce",
                    input_name=kind,
                )
        stack.extend(item.values())
