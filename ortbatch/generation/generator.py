"""BatchedGenerator: many callers, one batched decode step per iteration.

The public face, the step loop and the lifecycle. One thread owns the model, the KV cache
and every active row; callers only queue requests (:mod:`.requests` checks them) and wait
on their own future. Each iteration asks the :mod:`.scheduler` what to admit, reap and
where joining rows go, runs prefill and ONE decode step for all active rows on the
:mod:`.runner` (input = each row's last token, mask = its mask plus one column, positions
= cumulative mask - 1, past = the cache), and records one token per row. Every request
ends in exactly one of: a :class:`Completion`; or a typed error from :mod:`ortbatch.errors`.
Nothing waits without a timeout and close() joins the thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._lifecycle import check_positive, check_timeout, forget_live, track_live
from .._observe import BatchRecord, GenerationObserver, StepRecord, next_batch_id, notify, tag_for
from ..errors import InferenceError, InvalidInputError, OrtBatchError, SessionClosedError
from .constrained import CompiledGrammar, GrammarCompiler
from .defaults import read_model_defaults
from .layout import load_layout
from .prefill import Prefill
from .requests import (
    Completion,
    ExportTokenizer,
    RequestFactory,
    SamplingOptions,
    StreamToken,
    sampling_params,
)
from .runner import DecoderRunner, SessionFactory
from .sampling import SamplingParams
from .scheduler import CompactionCost, Scheduler
from .scoring import PromptScorer
from .stats import GenerationStats, GenerationStatsRecorder

if TYPE_CHECKING:  # annotations only (typing.Unpack is Python 3.11+)
    from typing_extensions import Unpack

__all__ = ["BatchedGenerator", "Completion", "GenerationStats", "SamplingParams", "StreamToken"]

Prompt = str | Sequence[int] | np.ndarray


def _check_arguments(
    max_batch_size: int,
    max_queue: int,
    max_new_tokens: int,
    timeout_s: float | None,
    max_context_length: int | None,
    prefix_cache_bytes: int | None,
) -> None:
    check_positive("max_batch_size", max_batch_size)
    check_positive("max_queue", max_queue)
    check_positive("max_new_tokens", max_new_tokens)
    check_timeout("timeout_s", timeout_s)
    if max_context_length is not None and max_context_length < 2:
        raise ValueError(f"max_context_length must be >= 2, got {max_context_length}")
    if prefix_cache_bytes is not None and prefix_cache_bytes < 1:
        raise ValueError(f"prefix_cache_bytes must be positive, got {prefix_cache_bytes}")


class BatchedGenerator:
    """Continuous-batching text generation over a decoder-with-past ONNX export.

    Args:
        export_dir: a directory holding ``model.onnx`` exported with
            ``--task text-generation-with-past`` (by ``ortbatch export`` or optimum's
            ``main_export``) and, for text prompts, ``tokenizer.json``. The cache layout
            comes from ``ortbatch.json``'s ``generation`` section when present,
            otherwise it is read from the graph and ``config.json``.
        max_batch_size: most rows decoded in one step.
        max_tokens_in_flight: most tokens reserved by active rows together (each row
            reserves its prompt length + ``max_new_tokens``): bounds KV-cache memory.
            Default ``max_batch_size * max_context_length``.
        max_queue: most requests waiting for admission; beyond it ``submit`` raises
            :class:`QueueFullError`.
        timeout_s: default deadline of each request, from submit to its last token.
        providers: ``None`` (CUDA when this onnxruntime build has it, else CPU), a
            shortcut ``"cpu"`` / ``"cuda"`` / ``"tensorrt"``, or a list as ONNX Runtime
            takes it. A requested GPU provider that is not active raises
            :class:`ProviderError` (no silent fallback to CPU). On CUDA, fp32 matrix
            products run in fp32 (``use_tf32=0``, as PyTorch's ``generate`` runs them)
            unless the options set ``use_tf32``.
        session_options: ``onnxruntime.SessionOptions`` for the model's session.
        io_binding: run through IOBinding with the cache kept where the provider
            lives (default: on for GPU providers, off on CPU where plain numpy is as fast).
        max_new_tokens: default ``max_new_tokens`` of a request.
        prefill_padding: how much padding a prefill group may add, as a fraction of
            its real tokens, before the group is split (lower = less wasted compute,
            more prefill runs).
        last_position_logits: run the LM head on the last position only (a graph
            rewrite, see :mod:`ortbatch.generation.rewrites`): prefill then computes and
            returns ``rows x vocab`` logits, not ``rows x prompt x vocab``.
            ``None`` (default): when ``onnx`` is installed and the graph allows it;
            ``True``: required (:class:`ModelContractError` if impossible); ``False``: never.
        attention_rewrite: move the attention scale from the key cache to the scores, so
            ONNX Runtime reads the key cache in place instead of transposing and scaling
            all of it every step (a graph rewrite, see :mod:`ortbatch.generation.rewrites`;
            about 1.5x faster decode steps at 16 rows on CPU). Applied where ``onnx`` is
            installed and the graph has that pattern; ``False``: never.
        max_context_length: most positions a row may reach (prompt + new tokens). Default:
            the export's, from ``config.json`` (``max_position_embeddings`` and the like) or
            the manifest; required for models whose config gives none (ALiBi models such as
            BLOOM). The manifest's ``limits.max_sequence_length`` still caps it.
        compaction_cost: the starting estimates of what a cache copy costs against the
            decode compute that rows which left waste (:class:`CompactionCost`); both
            are learned as it runs.
        kv_cache: ``"auto"`` (default): the in-place KV cache (the graph's attention
            rewritten to write each step's keys and values into a preallocated cache, a slot
            per row; see :mod:`ortbatch.generation.gqa`) on the CPU provider wherever the
            graph allows it, else the export's own concatenating cache; ``"in-place"``:
            required (:class:`ModelContractError` saying why when impossible); ``"concat"``:
            the export's own cache. :attr:`kv_cache` says which runs.
        prefix_cache: reuse the keys and values of prompt prefixes computed before (blocks
            of 16 tokens, least recently used evicted first); on the in-place cache only.
            ``False`` turns it off.
        prefix_cache_bytes: the prefix cache's memory budget (default: four full contexts'
            keys and values).
        session_factory: builds the ONNX Runtime session from ``(model, providers,
            session_options=, where=)``; default :func:`ortbatch._ort.build_session` (a seam
            for wrapping the session, e.g. to instrument or to inject failures in tests).
        observer: told of each request (queued, its prefill, its end) and of one decode step
            in every ``observer.step_every``: a :class:`~ortbatch._observe.GenerationObserver`,
            such as ``ortbatch serve``'s tracing. Also settable as ``generator.observer``.
    """

    def __init__(
        self,
        export_dir: str | os.PathLike[str],
        *,
        max_batch_size: int = 32,
        max_tokens_in_flight: int | None = None,
        max_queue: int = 1024,
        timeout_s: float | None = None,
        providers: str | Sequence[Any] | None = None,
        session_options: Any = None,
        io_binding: bool | None = None,
        max_new_tokens: int = 64,
        prefill_padding: float = 0.25,
        last_position_logits: bool | None = None,
        attention_rewrite: bool = True,
        max_context_length: int | None = None,
        compaction_cost: CompactionCost | None = None,
        session_factory: SessionFactory | None = None,
        observer: GenerationObserver | None = None,
        kv_cache: str = "auto",
        prefix_cache: bool = True,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        #: told of requests, prefills and sampled steps (see ``observer`` above)
        self.observer = observer
        self._steps = 0
        _check_arguments(max_batch_size, max_queue, max_new_tokens, timeout_s, max_context_length, prefix_cache_bytes)
        self._dir = Path(export_dir)
        self.layout, manifest = load_layout(self._dir, max_context_length)
        #: What the export's generation_config.json sets for every request (:mod:`.defaults`).
        self.model_defaults = read_model_defaults(self._dir)
        if manifest is not None and manifest.max_batch_size:
            max_batch_size = min(max_batch_size, manifest.max_batch_size)
        runner_args: dict[str, Any] = dict(
            providers=providers,
            session_options=session_options,
            io_binding=io_binding,
            attention_rewrite=attention_rewrite,
            session_factory=session_factory,
            manifest_providers=manifest.providers if manifest is not None else (),
            max_batch_size=max_batch_size,
        )
        #: The decoder's session, its contract and the batch's KV cache.
        self.runner = DecoderRunner(
            self._dir,
            self.layout,
            last_position_logits=last_position_logits,
            kv_cache=kv_cache,
            prefix_cache_bytes=(prefix_cache_bytes if prefix_cache else 0),
            **runner_args,
        )
        scorer = PromptScorer(
            lambda: DecoderRunner(self._dir, self.layout, last_position_logits=False, kv_cache="concat", **runner_args)
        )
        self._describe_runner()
        self._start(max_batch_size, max_tokens_in_flight, max_queue, timeout_s, max_new_tokens, prefill_padding)
        self._scheduler = Scheduler(
            max_batch_size=max_batch_size,
            max_tokens_in_flight=self.max_tokens_in_flight,
            max_queue=max_queue,
            eos_token_ids=self.layout.eos_token_ids,
            stats=self._stats,
            prefill_padding=prefill_padding,
            cost=compaction_cost,
            slots=self.runner.in_place,
        )
        self._prefill = Prefill(self.runner, self._scheduler, self._stats, scorer)
        # Daemon, so a process that never calls close() still exits; atexit aborts it first.
        self._thread = threading.Thread(target=self._loop, name="ortbatch-generator", daemon=True)
        self._thread.start()
        track_live(self)

    def _describe_runner(self) -> None:
        """The runner's facts, as the generator's attributes."""
        #: ``"in-place"`` or ``"concat"``: the KV cache that runs (see ``kv_cache=``).
        self.kv_cache = self.runner.kv_cache
        #: Why the KV cache is the export's own concatenating one (empty when in place).
        self.kv_cache_reason = self.runner.kv_cache_reason
        #: The graph rewrites applied (name -> places changed); empty when the export runs as it is.
        self.graph_rewrites = self.runner.graph_rewrites
        #: True when the graph was rewritten to return the last position's logits only.
        self.last_position_logits = self.runner.last_position_logits

    def _start(
        self,
        max_batch_size: int,
        max_tokens_in_flight: int | None,
        max_queue: int,
        timeout_s: float | None,
        max_new_tokens: int,
        prefill_padding: float,
    ) -> None:
        """The limits, the tokenizer, the grammar compiler, the request factory and the stats."""
        self.max_batch_size = max_batch_size
        context = self.layout.max_context_length
        self.max_tokens_in_flight = max_batch_size * context if max_tokens_in_flight is None else max_tokens_in_flight
        if self.max_tokens_in_flight < 2:
            raise ValueError(f"max_tokens_in_flight must be >= 2, got {self.max_tokens_in_flight}")
        self.max_queue, self.timeout_s = max_queue, timeout_s
        self.default_max_new_tokens = max_new_tokens
        self.prefill_padding = prefill_padding
        self._tokenizer = ExportTokenizer(self._dir, self.layout.tokenizer)
        limits = (self.layout.vocab_size, context, self.max_tokens_in_flight, max_new_tokens, timeout_s)
        tokenizer_json = self._dir / self.layout.tokenizer if self.layout.tokenizer else None
        #: Compiles constrained requests' grammars (cached; on its own thread): see :meth:`compile_grammar`.
        self.grammars = GrammarCompiler(tokenizer_json, self.layout.vocab_size, self.layout.eos_token_ids)
        eos = tuple(self.layout.eos_token_ids)
        self._requests = RequestFactory(self._tokenizer, *limits, eos_token_ids=eos, grammars=self.grammars)
        self._stats = GenerationStatsRecorder()

    @property
    def export_dir(self) -> Path:
        """The export directory this generator serves."""
        return self._dir

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as the export's tokenizer makes them (special tokens added
        as the tokenizer does, e.g. Llama's BOS, unless ``add_special_tokens=False``, as for
        text rendered from a chat template, which holds its special tokens already)."""
        return self._tokenizer.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens skipped unless ``skip_special_tokens=False``)."""
        return self._tokenizer.decode(ids, skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (OpenAI's logprobs ``bytes``; their concatenation is the
        UTF-8 of the text, which a single token may split mid-character)."""
        return self._tokenizer.token_bytes(ids)

    def compile_grammar(self, params: SamplingParams) -> Future[CompiledGrammar | None]:
        """Compile ``params``' constraint (``json_schema``, ``regex``, ...) on the grammar
        compiler's thread; the future's result is cached, so a ``submit`` of the same
        constraint afterwards compiles nothing. For callers on an event loop: ``await
        asyncio.wrap_future(gen.compile_grammar(params))`` before ``submit``. The future fails
        with :class:`InvalidInputError` naming the field for a grammar that does not compile,
        or :class:`UnsupportedError` without the ``structured`` extra; its result is ``None``
        when there is no constraint."""
        if params.constraint is None:
            done: Future[CompiledGrammar | None] = Future()
            done.set_result(None)
            return done
        return self.grammars.compile_async(params.constraint)  # type: ignore[return-value]

    # -- public API --------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
        on_token: Callable[[StreamToken], None] | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Future[Completion]:
        """Queue one completion; returns a future of its :class:`Completion`.

        ``params`` says how it generates (:class:`SamplingParams`; default greedy); every
        field of it is also a keyword argument (``temperature=``, ``logprobs=``, ...) and
        ``max_new_tokens`` the second positional one, a shorthand that sets (or overrides)
        that field. ``n > 1`` is refused here: see :meth:`submit_choices`.

        Raises at once: :class:`InvalidInputError` for a bad prompt or parameter (empty,
        ids outside the vocabulary, longer than the context with ``max_new_tokens``),
        :class:`QueueFullError` when ``max_queue`` requests wait, :class:`SessionClosedError`
        after close. The future fails with :class:`RequestTimeoutError` when the deadline
        passes (its ``partial`` attribute holds what was generated), :class:`InferenceError`
        when ONNX Runtime fails, :class:`SessionClosedError` on ``close(drain=False)``.
        Cancelling the future frees the request's row at the next step. ``on_token`` is
        called on the scheduler thread with each :class:`StreamToken`: keep it quick.
        """
        how = sampling_params(params, max_new_tokens, sampling)
        if how.n != 1:
            raise InvalidInputError(f"n={how.n}: use submit_choices or generate_choices", input_name="n")
        return self.submit_choices(prompt, params=how, timeout_s=timeout_s, on_token=on_token)[0]

    def submit_choices(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
        on_token: Callable[[StreamToken], None] | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> list[Future[Completion]]:
        """Queue the ``n`` choices of one prompt (``params.n`` or ``n=``); one future each, in
        choice order (``Completion.index``; ``StreamToken.choice`` tells ``on_token`` which).

        The prompt is prefilled once and its cache copied into the ``n`` rows when they are
        admitted together (they are queued next to each other); each samples from its own
        random generator (see :meth:`RequestFactory.build_choices`), so a seeded ``n`` is
        reproducible. Errors as :meth:`submit`; the ``n`` are queued all or none.
        """
        if self._scheduler.closed:
            raise SessionClosedError("the generator is closed")
        how = sampling_params(params, max_new_tokens, sampling)
        if how.repetition_penalty is None:  # not set by the request: the model's, as generate takes it
            how = dataclasses.replace(how, repetition_penalty=self.model_defaults.repetition_penalty)
        reqs = self._requests.build_choices(prompt, how, timeout_s, on_token, self._scheduler.clock())
        observer = self.observer
        tag = tag_for(observer) if observer is not None else None
        for r in reqs:
            r.tag = tag
        self._scheduler.put_many(reqs)
        if observer is not None and tag is not None:
            for r in reqs:
                r.future.add_done_callback(lambda f: notify(observer.on_done, tag, f))
        return [r.future for r in reqs]

    def generate_choices(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> list[Completion]:
        """The ``n`` completions of one prompt, blocking; see :meth:`submit_choices`."""
        self._check_may_block()
        futures = self.submit_choices(prompt, max_new_tokens, params=params, timeout_s=timeout_s, **sampling)
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Completion:
        """Generate one completion, blocking; see :meth:`submit` for arguments and errors.
        Not from ``on_token`` or a done-callback (the scheduler thread): an
        :class:`InvalidInputError` there, since that thread would wait for itself."""
        self._check_may_block()
        fut = self.submit(prompt, max_new_tokens, params=params, timeout_s=timeout_s, **sampling)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt: free the row
            raise

    def _check_may_block(self) -> None:
        """Refuse a blocking call on the scheduler thread: it would wait forever for itself."""
        if threading.current_thread() is self._thread:
            raise InvalidInputError(
                "generate() was called on the generator's own scheduler thread (from on_token or a "
                "future's done-callback), which would wait forever for itself; use submit() there"
            )

    async def generate_async(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Completion:
        """``await`` one completion; cancelling the awaiting task cancels the request."""
        fut = self.submit(prompt, max_new_tokens, params=params, timeout_s=timeout_s, **sampling)
        return await asyncio.wrap_future(fut)

    async def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> AsyncIterator[StreamToken]:
        """Yield the request's tokens as they are generated (an async generator); with
        ``n`` choices, theirs interleaved (``StreamToken.choice`` says whose).

        Errors of :meth:`submit` are raised at the first iteration; a failure later is
        raised after the tokens that came before it. Leaving the loop early, closing the
        generator or cancelling the consuming task cancels the request, and its row is
        freed at the next step (use ``contextlib.aclosing`` to close it promptly).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamToken | None] = asyncio.Queue()

        def put(item: StreamToken | None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        futures = self.submit_choices(
            prompt, max_new_tokens, params=params, timeout_s=timeout_s, on_token=put, **sampling
        )
        # Tokens are put before a future settles, on the same thread, so the end markers
        # come after the last tokens; with n choices the stream ends after the n-th marker.
        for fut in futures:
            fut.add_done_callback(lambda _f: put(None))
        try:
            ended = 0
            while ended < len(futures):
                item = await queue.get()
                if item is None:
                    ended += 1
                    continue
                yield item
            for fut in futures:
                if not fut.cancelled() and (exc := fut.exception()) is not None:
                    raise exc
        finally:
            for fut in futures:
                fut.cancel()

    def stats(self) -> GenerationStats:
        """Counters since construction, and the current queue/batch state."""
        prefix = self.runner.prefix_cache
        return self._stats.snapshot(
            self._scheduler.queued, kv_cache=self.kv_cache, prefix=prefix.stats() if prefix is not None else None
        )

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests. ``drain=True`` finishes queued and active requests
        first; ``drain=False`` fails them with :class:`SessionClosedError`. Joins the
        scheduler thread (up to ``timeout`` seconds). Calling it again is harmless."""
        self._scheduler.close(drain)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            self.grammars.close()
        if not self._thread.is_alive():
            forget_live(self)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._scheduler.closed

    def __enter__(self) -> BatchedGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the step loop (its own thread) ---------------------------------------------------
    def _loop(self) -> None:
        sched, runner = self._scheduler, self.runner
        try:
            while True:
                admitted, stop = sched.admit()
                if stop:
                    break
                keep = sched.reap()
                wall, t0 = (time.time_ns(), time.perf_counter()) if self.observer is not None else (0, 0.0)
                joining, joined = self._prefill.run(admitted) if admitted else ([], [])
                if admitted and self.observer is not None:
                    self._observe_prefill(admitted, wall, time.perf_counter() - t0)
                lens = [int(n) for c in joining for n in c.lens]
                plan = sched.place(keep, joined, lens, runner.cache.length, runner.cache_bytes)
                if (copy_s := runner.seat(plan, joining)) is not None:  # learn what a copy costs
                    sched.cost.observe_copy(plan.copy_bytes, copy_s)
                if sched.rows:
                    self._decode_step()
                if not sched.live():
                    sched.rows = []
                    runner.reset_cache()
                sched.publish(runner.cache.length)
        except BaseException as exc:  # never leave a caller hanging, whatever broke
            error = InferenceError(f"the generator's scheduler failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            sched.fail_everything(error)
        finally:
            runner.reset_cache()
            sched.publish(0)
            sched.stopped()

    def _observe_prefill(self, admitted: list[Any], wall: int, elapsed: float) -> None:
        """Tell the observer of the prefill that admitted ``admitted`` (one batch id for all)."""
        assert self.observer is not None
        now = self._scheduler.clock()
        lengths = [int(r.prompt.shape[0]) for r in admitted]
        record = BatchRecord(
            batch_id=next_batch_id(),
            rows=len(admitted),
            requests=len(admitted),
            padded_tokens=len(admitted) * max(lengths),
            real_tokens=sum(lengths),
            started_ns=wall,
            duration_ns=int(elapsed * 1e9),
            tags=[r.tag for r in admitted],
            waits_ns=[max(0, int((now - elapsed - r.submitted_at) * 1e9)) for r in admitted],
        )
        notify(self.observer.on_prefill, record)

    def _decode_step(self) -> None:
        sched, cache = self._scheduler, self.runner.cache
        rows = sched.rows
        # rows that left and were not replaced yet ride along (see Scheduler.place); their outputs are unread
        live = sched.live()
        live_tokens = float(cache.lens[live].sum())
        self._stats.decode(len(live), 1.0 - live_tokens / max(1, cache.rows * cache.length))
        t0 = time.perf_counter()
        try:
            logits = self.runner.decode([r.generated[-1] for r in rows])
        except OrtBatchError as exc:
            # A failed decode step cannot be pinned on one row: every row in it fails (the
            # loop then drops them all), and the generator carries on with the next requests.
            for i in live:
                sched.fail(rows[i], exc)
            return
        finally:
            elapsed = time.perf_counter() - t0
            self._stats.decode_time(elapsed)
        sched.cost.step_s = elapsed
        self._steps += 1
        observer = self.observer
        if observer is not None and (self._steps - 1) % max(1, observer.step_every) == 0:
            tags = [rows[i].tag for i in live]
            padded = cache.rows * cache.length
            started = time.time_ns() - int(elapsed * 1e9)
            notify(observer.on_step, StepRecord(self._steps, len(live), padded, started, int(elapsed * 1e9), tags))
        # Finished rows are settled now; at the next step boundary their slots go to rows
        # that join, or are dropped when that is worth a copy (see Scheduler.place).
        sched.next_tokens([rows[i] for i in live], logits[:, -1], live)
