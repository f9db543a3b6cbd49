"""A text-generation export over front-end processes: the front end's stand-in for the
engine's :class:`~ortbatch.BatchedGenerator`.

The front end tokenizes, renders chat templates and checks every prompt and sampling
parameter itself, with the generator's own checks (:class:`~ortbatch.generation.requests.RequestFactory`
built from the engine's limits, and a :class:`~ortbatch.generation.constrained.GrammarCompiler`
of its own for structured output and tool calls), so a bad request is refused at once with the
message one process gives. The request then goes to the engine as token ids; the engine's generator
queues it (``admitted``, or the error that refused it: a full queue), streams its tokens
when asked (``tok``, in order, on the link) and answers its
:class:`~ortbatch.generation.requests.Completion` (``done``). Cancelling the future (a
client that leaves) frees the request's row in the engine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InvalidInputError, SessionClosedError
from ...generation.constrained import GrammarCompiler
from ...generation.requests import ExportTokenizer, RequestFactory, StreamToken, sampling_params

__all__ = ["GenerationFuture", "GeneratorInfo", "ProxyGenerator"]


class GenerationFuture(concurrent.futures.Future[Any]):
    """The future of a generation request made in a front end; ``admitted`` is done once
    the engine's generator has queued it, or failed with the error that refused it
    (await it before starting a stream, so a full queue is still answered as a 429)."""

    def __init__(self) -> None:
        super().__init__()
        self.admitted: concurrent.futures.Future[None] = concurrent.futures.Future()


@dataclass(frozen=True)
class GeneratorInfo:
    """What a front end knows of the engine's generator without loading the model."""

    layout: Any  # GenerationLayout
    max_batch_size: int
    max_tokens_in_flight: int
    max_queue: int
    timeout_s: float | None
    default_max_new_tokens: int

    @classmethod
    def of(cls, generator: Any) -> GeneratorInfo:
        return cls(
            generator.layout,
            generator.max_batch_size,
            generator.max_tokens_in_flight,
            generator.max_queue,
            generator.timeout_s,
            generator.default_max_new_tokens,
        )


class ProxyGenerator:
    """The engine's generator ``key``, over a front end's link (a
    :class:`~ortbatch.serve.frontends.proxy.ProxySession`), with the methods
    :class:`~ortbatch.serve.served.generator.ServedGenerator` and the completion routes use."""

    def __init__(self, link: Any, info: GeneratorInfo, key: int, directory: str | Path) -> None:
        self._link, self._key = link, key
        self._dir = Path(directory)
        self.layout = info.layout
        self.max_batch_size = info.max_batch_size
        self.max_tokens_in_flight = info.max_tokens_in_flight
        self.max_queue = info.max_queue
        self.timeout_s = info.timeout_s
        self.default_max_new_tokens = info.default_max_new_tokens
        self._tokenizer = ExportTokenizer(self._dir, info.layout.tokenizer)
        self._requests = RequestFactory(
            self._tokenizer,
            info.layout.vocab_size,
            info.layout.max_context_length,
            info.max_tokens_in_flight,
            info.default_max_new_tokens,
            info.timeout_s,
        )
        # the front end compiles a constrained request's grammar too, so one that does not
        # compile is refused here, naming its field, before it reaches the engine
        tokenizer_json = self._dir / info.layout.tokenizer if info.layout.tokenizer else None
        #: compiles structured output's grammars here (the engine compiles them again, from its cache)
        self.grammars = GrammarCompiler(tokenizer_json, info.layout.vocab_size, info.layout.eos_token_ids)
        self._closed = False

    @property
    def export_dir(self) -> Path:
        return self._dir

    @property
    def closed(self) -> bool:
        return self._closed or bool(self._link.closed)

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Accept no more requests (the engine's generator is the engine's to close)."""
        self._closed = True
        self.grammars.close()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return self._tokenizer.token_bytes(ids)

    def stats(self) -> Any:
        """The engine's ``BatchedGenerator.stats()`` (asked over the link)."""
        return self._link._stats(self._key)

    def submit(
        self,
        prompt: Any,
        max_new_tokens: int | None = None,
        *,
        params: Any = None,
        timeout_s: float | None = None,
        on_token: Callable[[StreamToken], None] | None = None,
        **sampling: Any,
    ) -> GenerationFuture:
        """As ``BatchedGenerator.submit``: a bad prompt or parameter raises here; a full
        queue fails the future (and its ``admitted``) once the engine says so."""
        how = sampling_params(params, max_new_tokens, sampling)
        if how.n != 1:
            raise InvalidInputError(f"n={how.n}: use submit_choices or generate_choices", input_name="n")
        return self.submit_choices(prompt, params=how, timeout_s=timeout_s, on_token=on_token)[0]

    def submit_choices(
        self,
        prompt: Any,
        max_new_tokens: int | None = None,
        *,
        params: Any = None,
        timeout_s: float | None = None,
        on_token: Callable[[StreamToken], None] | None = None,
        **sampling: Any,
    ) -> list[GenerationFuture]:
        """As ``BatchedGenerator.submit_choices``: the ``n`` choices go to the engine as one
        request (prefilled once there) and come back together; each future settles with its
        choice, and cancelling one cancels them all."""
        if self.closed:
            raise SessionClosedError("the generator is closed")
        how = sampling_params(params, max_new_tokens, sampling)
        ids, n_new, _ = self._requests.check(prompt, how, timeout_s)  # raises what submit raises
        request = (ids.tolist(), dataclasses.replace(how, max_new_tokens=n_new), timeout_s)
        whole = self._link._submit_generation(self._key, request, on_token)
        if how.n == 1:
            return [whole]
        return _choices_of(whole, how.n)


def _choices_of(whole: GenerationFuture, n: int) -> list[GenerationFuture]:
    """One future per choice of ``whole`` (whose result is the list of the ``n`` completions)."""
    parts = [GenerationFuture() for _ in range(n)]

    def settle(done: concurrent.futures.Future[Any]) -> None:
        for i, part in enumerate(parts):
            if part.done():
                continue
            if done.cancelled():
                part.cancel()
            elif (exc := done.exception()) is not None:
                part.set_exception(exc)
            else:
                part.set_result(done.result()[i])

    def cancel_whole(part: concurrent.futures.Future[Any]) -> None:
        if part.cancelled():
            whole.cancel()

    for part in parts:
        part.admitted = whole.admitted
        part.add_done_callback(cancel_whole)
    whole.add_done_callback(settle)
    return parts
