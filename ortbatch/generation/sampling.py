"""How one request generates (:class:`SamplingParams`), and choosing its next token. Pure numpy.

:data:`PARAMETERS` is the one list of every sampling parameter: its range, what it means and
whose definition it follows. :class:`SamplingParams` checks each field against it when it is
built, so the Python API, and the serve layer that maps OpenAI, vLLM, gRPC and KServe fields
onto it, raise the same :class:`~ortbatch.errors.InvalidInputError` naming the same field.

Each request carries its own :class:`numpy.random.Generator`, seeded from the request's
``seed``, and draws exactly one uniform number per sampled token from it. What else is
in the batch therefore never changes which random numbers a request sees, so seeded
sampling is reproducible per request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InferenceError, InvalidInputError
from .constrained import CONSTRAINT_FIELDS, Constraint, constraint_source

__all__ = ["MAX_LOGPROBS", "MAX_N", "PARAMETERS", "Parameter", "SamplingParams", "choose_token"]

#: Most alternatives ``logprobs`` / ``prompt_logprobs`` may ask for (OpenAI's ``top_logprobs`` <= 20;
#: vLLM's default ``max_logprobs`` is 20).
MAX_LOGPROBS = 20
#: Most choices ``n`` may ask for (OpenAI documents no bound; 128 is the rows a batch may hold at most).
MAX_N = 128


@dataclass(frozen=True)
class Parameter:
    """One sampling parameter: its range in words, what it does and whose definition it follows."""

    name: str
    range: str
    meaning: str
    follows: str


def _p(name: str, rng: str, meaning: str, follows: str) -> tuple[str, Parameter]:
    return name, Parameter(name, rng, meaning, follows)


#: Every field of :class:`SamplingParams`, in order: what the docs table and the serve layer read.
PARAMETERS: dict[str, Parameter] = dict(
    [
        _p("temperature", ">= 0", "0 is greedy (argmax); above, logits are divided by it before sampling", "OpenAI"),
        _p("top_k", "a positive integer", "sample among the k most likely tokens only", "transformers/vLLM"),
        _p("top_p", "in (0, 1]", "nucleus: the smallest set of tokens whose probability reaches top_p", "OpenAI"),
        _p("min_p", "in [0, 1]", "drop tokens whose probability is below min_p x the top token's", "vLLM/transformers"),
        _p("max_new_tokens", "a positive integer (0 with prompt_logprobs)", "most tokens generated", "transformers"),
        _p(
            "min_tokens",
            "an integer >= 0 (and <= max_new_tokens)",
            "eos and stop_token_ids masked until then; stop strings looked for from the next token on",
            "vLLM",
        ),
        _p("stop", "non-empty strings", "text that ends the completion, cut before it", "OpenAI"),
        _p("stop_token_ids", "token ids (in the vocabulary)", "ids that end the completion", "vLLM"),
        _p("ignore_eos", "a bool", "eos does not end the completion", "vLLM"),
        _p("include_stop_str_in_output", "a bool", "keep the matched stop string (or stop token's text)", "vLLM"),
        _p("skip_special_tokens", "a bool", "leave special tokens out of the text", "vLLM"),
        _p("seed", "a non-negative integer", "seeds the request's own random generator", "OpenAI"),
        _p("presence_penalty", "in [-2, 2]", "logit -= p if the token was generated before", "OpenAI"),
        _p("frequency_penalty", "in [-2, 2]", "logit -= f x times the token was generated before", "OpenAI"),
        _p(
            "repetition_penalty",
            "> 0",
            "tokens in the prompt or generated: logit / r if > 0, else logit x r; "
            "unset: the export's generation_config.json value, else 1",
            "transformers (RepetitionPenaltyLogitsProcessor)/vLLM",
        ),
        _p("logit_bias", "{token id: bias in [-100, 100]}", "bias added to the token's logit", "OpenAI"),
        _p("logprobs", f"an integer in [0, {MAX_LOGPROBS}]", "the chosen token's logprob and the top k", "vLLM"),
        _p("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}]", "each prompt token's logprob, top k", "vLLM"),
        _p("n", f"an integer in [1, {MAX_N}]", "choices of one prompt, prefilled once", "OpenAI"),
        # Structured output: at most one of these five per request (constrained.py).
        _p(
            "json_schema",
            "a JSON schema (dict or JSON text)",
            "the output is JSON valid against the schema",
            "OpenAI response_format json_schema/vLLM guided_json",
        ),
        _p("json_object", "a bool", "the output is a JSON object", "OpenAI response_format json_object"),
        _p("regex", "a regular expression (Rust regex syntax)", "the output matches the regex", "vLLM guided_regex"),
        _p("choice", "a non-empty list of non-empty strings", "the output is one of the strings", "vLLM guided_choice"),
        _p(
            "grammar",
            "a Lark grammar (llguidance's dialect) or a GBNF grammar",
            "the output is derived from the grammar's start rule",
            "vLLM guided_grammar",
        ),
    ]
)


def _shown(value: object) -> str:
    """``repr(value)``, cut short (a client may send an integer of thousands of digits)."""
    try:
        text = repr(value)
    except ValueError:  # past Python's int-to-str digit limit
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(name: str, got: object) -> InvalidInputError:
    return InvalidInputError(f"{name} must be {PARAMETERS[name].range}, got {_shown(got)}", input_name=name)


def _real(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


def _integer(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _in(name: str, value: Any, lo: float, hi: float) -> float:
    if not _real(value) or not lo <= float(value) <= hi:
        raise _fail(name, value)
    return float(value)


def _count(name: str, value: Any, lo: int, hi: int | None = None, none: bool = True) -> int | None:
    if value is None and none:
        return None
    if not _integer(value) or value < lo or (hi is not None and value > hi):
        raise _fail(name, value)
    return int(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(name, value)
    return bool(value)


def _given(value: object) -> bool:
    """Whether a constraint field was given: not ``None`` and not a false bool."""
    return value is not None and not (isinstance(value, (bool, np.bool_)) and not value)


def _bias(value: object) -> tuple[tuple[int, float], ...]:
    items: Any = value.items() if isinstance(value, Mapping) else value
    try:
        # OpenAI sends the ids as JSON object keys, i.e. strings: "50256" is id 50256.
        pairs = [(int(k) if isinstance(k, str) and k.strip().isdigit() else k, v) for k, v in items]
    except (TypeError, ValueError) as exc:
        raise _fail("logit_bias", value) from exc
    for k, v in pairs:
        if not _integer(k) or k < 0 or not _real(v) or not -100.0 <= float(v) <= 100.0:
            raise _fail("logit_bias", value)
    return tuple(sorted((int(k), float(v)) for k, v in dict(pairs).items()))


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates: how many tokens, how it picks each, when it stops, what it reports.

    Every field, its range and whose definition it follows is in :data:`PARAMETERS` (and the
    table in docs/generation.md). ``temperature == 0`` is greedy (argmax); above it, tokens
    are sampled after ``min_p``, ``top_k`` and ``top_p`` filtering, from a generator seeded by
    ``seed`` (``None``: a fresh random seed). Before that, in vLLM's order: ``logit_bias``,
    ``min_tokens`` (eos and ``stop_token_ids`` masked), ``repetition_penalty``, then
    ``frequency_penalty`` and ``presence_penalty``. ``logprobs=k`` reports, per generated
    token, its log-probability and the k most likely tokens', from the raw logits (before any
    of the above, as vLLM's default ``logprobs_mode="raw_logprobs"``); ``prompt_logprobs=k``
    the same for every prompt token after the first. ``n`` completions of one prompt share
    its prefill (see ``BatchedGenerator.submit_choices``). Bad values raise
    :class:`~ortbatch.errors.InvalidInputError` naming the field, here at construction; ids
    are checked against the vocabulary at submit.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    stop: str | Sequence[str] = ()
    seed: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = field(default=())
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    json_schema: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        t: Any = self.temperature
        p: Any = self.top_p
        if not _real(t) or t < 0:
            raise _fail("temperature", t)
        _count("top_k", self.top_k, 1)
        if p is not None and (not _real(p) or not 0.0 < p <= 1.0):
            raise _fail("top_p", p)
        prompt_lp = _count("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        n_new = _count("max_new_tokens", self.max_new_tokens, 0 if prompt_lp is not None else 1)
        seed = _count("seed", self.seed, 0)
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise _fail("stop", self.stop)
        try:
            stop_ids = tuple(self.stop_token_ids or ())
        except TypeError as exc:
            raise _fail("stop_token_ids", self.stop_token_ids) from exc
        if any(not _integer(i) or i < 0 for i in stop_ids):
            raise _fail("stop_token_ids", self.stop_token_ids)
        min_tokens = _count("min_tokens", self.min_tokens, 0, none=False)
        if n_new is not None and min_tokens is not None and min_tokens > n_new:
            raise InvalidInputError(
                f"min_tokens ({min_tokens}) must be <= max_new_tokens ({n_new})", input_name="min_tokens"
            )
        repetition: Any = self.repetition_penalty
        if repetition is not None and (not _real(repetition) or not repetition > 0):
            raise _fail("repetition_penalty", repetition)
        values: dict[str, Any] = {
            "temperature": float(t),
            "top_p": None if p is None else float(p),
            "max_new_tokens": n_new,
            "stop": stops,
            "seed": seed,
            "min_p": _in("min_p", self.min_p, 0.0, 1.0),
            "min_tokens": min_tokens,
            "stop_token_ids": tuple(int(i) for i in stop_ids),
            "presence_penalty": _in("presence_penalty", self.presence_penalty, -2.0, 2.0),
            "frequency_penalty": _in("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
            "repetition_penalty": None if repetition is None else float(repetition),
            "logit_bias": _bias(self.logit_bias),
            "logprobs": _count("logprobs", self.logprobs, 0, MAX_LOGPROBS),
            "prompt_logprobs": prompt_lp,
            "n": _count("n", self.n, 1, MAX_N, none=False),
        }
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            values[name] = _flag(name, getattr(self, name))
        # frozen: normalise through object.__setattr__ (lists become tuples, ints floats)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        # Asked once per row per step: computed here, once (not a field: eq and hash ignore it).
        processes = bool(
            values["logit_bias"]
            or min_tokens
            or values["repetition_penalty"] not in (None, 1.0)
            or values["presence_penalty"]
            or values["frequency_penalty"]
        )
        object.__setattr__(self, "_processes_logits", processes)
        self._check_constraint()

    def _check_constraint(self) -> None:
        """At most one constraint field, of the right type; normalised (a schema dict
        becomes its JSON text, choices a tuple) and kept as :attr:`constraint`."""
        given = [f for f in CONSTRAINT_FIELDS if _given(getattr(self, f))]
        constraint = None
        if len(given) > 1:
            raise InvalidInputError(
                f"{given[0]} and {given[1]} cannot be given together: one constraint per request",
                input_name=given[1],
            )
        if given:
            kind = given[0]
            value = getattr(self, kind)
            if kind == "json_object":
                object.__setattr__(self, kind, _flag(kind, value))
                source = '{"type": "object"}'
            else:
                source = constraint_source(kind, value)
                normal: Any = tuple(value) if kind == "choice" else source
                object.__setattr__(self, kind, normal)
            constraint = Constraint(kind, source)
            for name, bad in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens)):
                if bad:
                    raise InvalidInputError(
                        f"{name} cannot be combined with {kind}: the grammar decides where the output ends",
                        input_name=name,
                    )
        else:
            object.__setattr__(self, "json_object", _flag("json_object", self.json_object))
        object.__setattr__(self, "_constraint", constraint)

    @classmethod
    def from_fields(cls, given: Mapping[str, Any], aliases: Mapping[str, str] | None = None) -> SamplingParams:
        """Build from a request's fields (``None`` values mean "not given"), the way a
        transport maps its protocol: ``aliases`` renames the protocol's field to ours
        (``{"max_tokens": "max_new_tokens"}``), and every error names the field as the
        client sent it. A field that is neither ours nor an alias is refused the way
        OpenAI refuses one ("Unrecognized request argument supplied: X")."""
        names = dict(aliases or {})
        back = {ours: theirs for theirs, ours in names.items()}
        values: dict[str, Any] = {}
        for key, value in given.items():
            ours = names.get(key, key)
            if ours not in PARAMETERS:
                raise InvalidInputError(f"Unrecognized request argument supplied: {key}", input_name=key)
            if value is not None:
                values[ours] = value
        try:
            return cls(**values)
        except InvalidInputError as exc:
            theirs = back.get(exc.input_name or "", exc.input_name)
            if theirs == exc.input_name:
                raise
            raise InvalidInputError(str(exc).replace(exc.input_name or "", theirs or "", 1), input_name=theirs) from exc

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor applies (penalties, bias, min_tokens): then the row
        leaves the fast path and its logits are processed before the choice."""
        return bool(self._processes_logits)  # type: ignore[attr-defined]

    @property
    def constraint(self) -> Constraint | None:
        """What the output must match (``json_schema``, ``json_object``, ``regex``, ``choice``
        or ``grammar``), or ``None``: see :mod:`.constrained`."""
        return self._constraint  # type: ignore[attr-defined]

    @property
    def extras(self) -> bool:
        """Whether the row needs per-row state beyond the fast path (processing, logprobs or
        a grammar)."""
        return self.processes_logits or self.logprobs is not None or self.constraint is not None


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Pick the next token id from a 1-D ``logits`` row (already processed, see :mod:`.processors`).

    Greedy takes the argmax (lowest id on ties, as torch does). Sampling applies
    temperature, then min-p (tokens below ``min_p`` times the top probability are dropped),
    top-k, then top-p (nucleus: the smallest set of most likely tokens whose probability
    reaches ``top_p``), in float64, and inverts the CDF of what is left at one uniform draw
    from ``rng``.

    Logits with NaN or +inf (a damaged model, an overflow) raise :class:`InferenceError`:
    argmax and the CDF would otherwise silently pick a token from garbage.
    """
    if np.isnan(logits).any() or np.isposinf(logits).any():
        raise InferenceError("the model produced non-finite values (NaN or +inf) in its logits")
    if params.greedy:
        return int(np.argmax(logits))
    if rng is None:
        raise ValueError("sampling needs a random generator")
    # Shifted by the max before dividing: at a tiny temperature the best token scores 0 and
    # the rest -inf (greedy in effect) instead of inf - inf = NaN.
    scores = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # overflowing to -inf is the intended limit
        scores = (scores - scores.max()) / params.temperature
    if params.min_p > 0.0:
        # p_i < min_p * p_max  <=>  score_i < log(min_p) (scores are log-probs shifted so the max is 0)
        scores = np.where(scores < math.log(params.min_p), -np.inf, scores)
    vocab = scores.shape[0]
    k = vocab if params.top_k is None else min(params.top_k, vocab)
    # Candidates sorted by score, highest first; stable so ties keep id order.
    order = np.argsort(-scores, kind="stable")[:k]
    kept = scores[order]
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    if params.top_p is not None and params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        # Keep every token up to and including the one that crosses top_p.
        cut = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        order, probs = order[:cut], probs[:cut]
        probs = probs / probs.sum()
    u = rng.random()
    index = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(index, len(order) - 1)])
