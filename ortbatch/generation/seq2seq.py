"""Seq2SeqGenerator: continuous batching for encoder-decoder exports (T5, BART, Marian, NLLB, ...).

The sibling of :class:`~.generator.BatchedGenerator`, with its contract: one thread owns the
sessions, the caches and every row; callers queue requests and wait on their futures; every
request ends in exactly one of its :class:`Completion` (s) or a typed error; ``close()`` joins.

Each iteration of the loop (a step boundary): requests that were cancelled or passed their
deadline leave; the oldest queued requests that fit the row budget are admitted, encoded
together (length-sorted, one encoder run) and started by one first-decoder run, which gives
their cross-attention keys and values, kept for the rows' life; every cohort of rows admitted
earlier runs one decoder-with-past step (see :mod:`.seq2seq_runner` for why rows are grouped by
the step they started at); every row gets one token: greedy and sampled rows through the
logits processors (:mod:`.decoding`) and :func:`~.sampling.choose_token`, the beams of a
request through its :class:`~.beam.BeamSearch`. A request's beams are rows sharing one encoder
output, in the same runs as greedy and sampled rows.

Each request is decoded as ``model.generate(**kwargs)`` decodes it: the checkpoint's
``generation_config.json`` applies to every setting the request leaves unset
(``generation_config="ignore"``: transformers' defaults instead), and what is decoded does not
depend on which other requests share the runs.

Why a sibling class, not a mode of BatchedGenerator: the two share the request conventions,
text tracking, sampling, stats and lifecycle (imported from here), but not the model anatomy:
an encoder run at admission, a first-step graph that outputs the cross-attention cache, rows
that cannot share a run unless they started together, beams; as a mode every part of the
decoder's runner, prefill, in-place cache and prefix cache would branch on it.
"""

from __future__ import annotations

import asyncio
import collections
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from .._lifecycle import check_positive, check_timeout, forget_live, request_future, settle, track_live
from ..errors import (
    InferenceError,
    InvalidInputError,
    OrtBatchError,
    QueueFullError,
    RequestTimeoutError,
    SessionClosedError,
)
from .beam import BeamSearch
from .decoding import DECODING_FIELDS, Decoding, check_ids, process, read_generation_config
from .processors import log_softmax
from .requests import Completion, ExportTokenizer, StreamToken
from .runner import SessionFactory
from .sampling import SamplingParams, choose_token
from .seq2seq_layout import load_seq2seq_layout
from .seq2seq_requests import Seq2SeqRequest, SourceBuilder, next_request_id
from .seq2seq_runner import Cohort, Seq2SeqRunner
from .stats import GenerationStats, GenerationStatsRecorder
from .text import TextTracker

__all__ = ["Seq2SeqGenerator"]

Source = str | Sequence[int] | np.ndarray
_WAIT_S = 0.5  # the longest an idle loop or a drain waits before looking again


class Seq2SeqGenerator:
    """Continuous-batching generation over an encoder-decoder ONNX export
    (``ortbatch export MODEL --task text2text-generation-with-past``, or optimum's).

    Args:
        export_dir: the export directory (``encoder_model.onnx``, ``decoder_model.onnx``,
            ``decoder_with_past_model.onnx``, ``config.json``; ``tokenizer.json`` for text).
        max_batch_size: most decoder rows at once (a request takes ``num_beams`` rows, or
            ``num_return_sequences`` when sampling, else one).
        max_queue: most requests waiting; beyond it ``submit`` raises :class:`QueueFullError`.
        timeout_s: default deadline of each request, from submit to its last token.
        providers, session_options, session_factory: as :class:`BatchedGenerator` takes them.
        max_new_tokens: the default when neither the request nor the checkpoint's generation
            config (``max_new_tokens`` or ``max_length``) sets one.
        generation_config: ``"auto"`` (default): the checkpoint's ``generation_config.json``
            applies to every setting a request leaves unset, as in ``generate``; a setting
            ortbatch cannot honour is a :class:`ModelContractError` at load naming it.
            ``"ignore"``: transformers' defaults instead (its token ids are still read).
    """

    def __init__(
        self,
        export_dir: str | os.PathLike[str],
        *,
        max_batch_size: int = 32,
        max_queue: int = 1024,
        timeout_s: float | None = None,
        providers: str | Sequence[Any] | None = None,
        session_options: Any = None,
        max_new_tokens: int = 64,
        generation_config: str = "auto",
        session_factory: SessionFactory | None = None,
    ) -> None:
        check_positive("max_batch_size", max_batch_size)
        check_positive("max_queue", max_queue)
        check_positive("max_new_tokens", max_new_tokens)
        check_timeout("timeout_s", timeout_s)
        if generation_config not in ("auto", "ignore"):
            raise ValueError(f"generation_config must be 'auto' or 'ignore', got {generation_config!r}")
        self._dir = Path(export_dir)
        self.layout, manifest = load_seq2seq_layout(self._dir)
        #: What the checkpoint's generation_config.json sets (empty with ``generation_config="ignore"``).
        self.model_generation = read_generation_config(self._dir, use=generation_config == "auto")
        self._eos = tuple(self.model_generation.eos_token_ids or self.layout.eos_token_ids)
        start = self.model_generation.decoder_start_token_id
        self._start_token = self.layout.decoder_start_token_id if start is None else start
        if manifest is not None and manifest.max_batch_size:
            max_batch_size = min(max_batch_size, manifest.max_batch_size)
        self.max_batch_size, self.max_queue, self.timeout_s = max_batch_size, max_queue, timeout_s
        self.default_max_new_tokens = max_new_tokens
        #: The three sessions.
        self.runner = Seq2SeqRunner(
            self._dir,
            self.layout,
            providers=providers,
            session_options=session_options,
            manifest_providers=manifest.providers if manifest is not None else (),
            session_factory=session_factory,
        )
        self._tokenizer = ExportTokenizer(self._dir, self.layout.tokenizer)
        self._sources = SourceBuilder(self._tokenizer, self.layout)
        self._stats = GenerationStatsRecorder()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[Seq2SeqRequest] = collections.deque()
        self._closed = False
        self._drain = True
        self._cohorts: list[Cohort] = []
        # requests taken off the queue and not yet in a cohort (while _start runs)
        self._starting: list[Seq2SeqRequest] = []
        # answers of this iteration, settled once their rows have left (so a caller that sees
        # its future done sees stats() without its rows)
        self._answers: list[tuple[Future[Completion], Completion]] = []
        self._thread = threading.Thread(target=self._loop, name="ortbatch-seq2seq", daemon=True)
        self._thread.start()
        track_live(self)

    # -- the face ------------------------------------------------------------------------
    @property
    def export_dir(self) -> Path:
        return self._dir

    def encode(self, text: str) -> list[int]:
        """The encoder's token ids of ``text``, as the export's tokenizer makes them."""
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens)

    def submit(
        self,
        source: Source,
        max_new_tokens: int | None = None,
        **options: Any,
    ) -> Future[Completion]:
        """Queue one request; a future of its best :class:`Completion` (see :meth:`submit_choices`
        for the arguments; ``num_return_sequences > 1`` is refused here)."""
        futures = self.submit_choices(source, max_new_tokens, **options)
        if len(futures) != 1:
            for f in futures:
                f.cancel()
            raise InvalidInputError(
                "num_return_sequences > 1: use submit_choices or generate_choices", input_name="num_return_sequences"
            )
        return futures[0]

    def submit_choices(
        self,
        source: Source,
        max_new_tokens: int | None = None,
        *,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        timeout_s: float | None = None,
        on_token: Callable[[StreamToken], None] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        skip_special_tokens: bool = True,
        **decoding: Any,
    ) -> list[Future[Completion]]:
        """Queue one request; one future per returned sequence (``num_return_sequences``, best
        first for beam search).

        ``decoding``: any setting of :class:`~.decoding.Decoding` (``num_beams``,
        ``length_penalty``, ``early_stopping``, ``num_return_sequences``, ``do_sample``,
        ``temperature``, ``top_k``, ``top_p``, ``no_repeat_ngram_size``, ``bad_words_ids``,
        ``forced_bos_token_id``, ``forced_eos_token_id``, ``min_length``, ``min_new_tokens``,
        ``suppress_tokens``, ``begin_suppress_tokens``, ``repetition_penalty``,
        ``max_length``); unset ones come from the checkpoint's generation config.
        ``src_lang`` / ``tgt_lang``: a multilingual model's language codes (the source's
        language token, and the target's as ``forced_bos_token_id``). ``stop``: strings that end
        a greedy or sampled row (not beams). ``seed``: a sampled request's random stream.
        ``on_token``: each token of a greedy or sampled row as generated; a beam request's
        tokens come when it ends (a beam's tokens are not final before).

        Raises at once :class:`InvalidInputError` naming the field (empty or too long source,
        ids outside the vocabulary, an unknown language, ``num_beams`` over ``max_batch_size``,
        a bad setting), :class:`QueueFullError`, :class:`SessionClosedError`.
        """
        unknown = sorted(set(decoding) - DECODING_FIELDS)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; decoding takes {sorted(DECODING_FIELDS)}")
        if self._closed:
            raise SessionClosedError("the generator is closed")
        if max_new_tokens is not None:
            decoding["max_new_tokens"] = max_new_tokens
        forced = self._sources.target(tgt_lang)
        if forced is not None:
            if decoding.get("forced_bos_token_id") not in (None, forced):
                raise InvalidInputError("give tgt_lang or forced_bos_token_id, not both", input_name="tgt_lang")
            decoding["forced_bos_token_id"] = forced
        ids = self._sources.ids(source, src_lang)
        cfg = Decoding(**decoding).over(self.model_generation.decoding).resolved(1, self.default_max_new_tokens)
        check_ids(cfg, self.layout.vocab_size)
        req = self._build(ids, cfg, stop, seed, skip_special_tokens, timeout_s, on_token)
        with self._lock:
            if self._closed:
                raise SessionClosedError("the generator is closed")
            if len(self._queue) >= self.max_queue:
                self._stats.count("rejected")
                raise QueueFullError(len(self._queue), self.max_queue)
            self._queue.append(req)
            self._stats.count("submitted", len(req.futures))
            self._wake.notify()
        return list(req.futures)

    def _build(
        self,
        ids: np.ndarray,
        cfg: Decoding,
        stop: str | Sequence[str] | None,
        seed: int | None,
        skip_special_tokens: bool,
        timeout_s: float | None,
        on_token: Callable[[StreamToken], None] | None,
    ) -> Seq2SeqRequest:
        beams = cfg.num_beams or 1
        returned = cfg.num_return_sequences or 1
        rows = beams if beams > 1 else returned
        if rows > self.max_batch_size:
            name = "num_beams" if beams > 1 else "num_return_sequences"
            raise InvalidInputError(
                f"{name}={rows} needs {rows} rows, more than max_batch_size={self.max_batch_size}", input_name=name
            )
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if stops and beams > 1:
            raise InvalidInputError(
                "stop strings apply to greedy and sampled requests, not beam search", input_name="stop"
            )
        top = self.layout.max_target_length
        if top is not None and (cfg.max_length or 0) > top:
            raise InvalidInputError(
                f"max_new_tokens ({cfg.max_new_tokens}) exceeds the decoder's {top - 1} positions",
                input_name="max_new_tokens",
            )
        sampling = SamplingParams(
            temperature=float(cfg.temperature or 0.0) if cfg.do_sample else 0.0,
            top_k=cfg.top_k or None,
            top_p=cfg.top_p,
            seed=seed,
            stop=stops,
            skip_special_tokens=skip_special_tokens,
        )
        base = secrets.randbits(64) if seed is None else seed
        rngs: list[np.random.Generator | None] = [
            np.random.Generator(np.random.PCG64(base if i == 0 else np.random.SeedSequence([base, i])))
            if cfg.do_sample
            else None
            for i in range(rows)
        ]
        decode = self._tokenizer.decode_fn(skip_special_tokens)
        if stops and decode is None:
            raise InvalidInputError(f"stop strings need a tokenizer but {self._tokenizer.error}", input_name="stop")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        check_timeout("timeout_s", timeout)
        now = time.monotonic()
        req = Seq2SeqRequest(
            id=next_request_id(),
            source=ids,
            decoding=cfg,
            sampling=sampling,
            rngs=rngs,
            futures=[request_future() for _ in range(returned)],
            trackers=[TextTracker(decode, stops) for _ in range(max(rows, returned))],
            deadline=None if timeout is None else now + timeout,
            on_token=on_token,
            submitted_at=now,
            start_token=self._start_token,
        )
        if beams > 1:
            req.beam = BeamSearch(
                beams,
                [self._start_token],
                int(cfg.max_length or 0),
                self._eos,
                float(cfg.length_penalty or 1.0),
                cfg.early_stopping if cfg.early_stopping is not None else False,
                returned,
            )
        req.histories = [[self._start_token] for _ in range(rows)]
        return req

    def generate_choices(self, source: Source, max_new_tokens: int | None = None, **options: Any) -> list[Completion]:
        """Every returned sequence of one request, blocking; see :meth:`submit_choices`."""
        self._check_may_block()
        futures = self.submit_choices(source, max_new_tokens, **options)
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def generate(self, source: Source, max_new_tokens: int | None = None, **options: Any) -> Completion:
        """One request's (best) completion, blocking; see :meth:`submit_choices`."""
        self._check_may_block()
        fut = self.submit(source, max_new_tokens, **options)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    async def generate_async(self, source: Source, max_new_tokens: int | None = None, **options: Any) -> Completion:
        """``await`` one completion; cancelling the awaiting task cancels the request."""
        return await asyncio.wrap_future(self.submit(source, max_new_tokens, **options))

    async def stream(
        self, source: Source, max_new_tokens: int | None = None, **options: Any
    ) -> AsyncIterator[StreamToken]:
        """Yield the request's tokens as they come (a beam request's when it ends); leaving the
        loop early cancels the request. Errors of :meth:`submit` are raised at the first iteration."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamToken | None] = asyncio.Queue()

        def put(item: StreamToken | None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass

        fut = self.submit(source, max_new_tokens, on_token=put, **options)
        fut.add_done_callback(lambda _f: put(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            if not fut.cancelled() and (exc := fut.exception()) is not None:
                raise exc
        finally:
            fut.cancel()

    def _check_may_block(self) -> None:
        if threading.current_thread() is self._thread:
            raise InvalidInputError(
                "generate() was called on the generator's own thread (from on_token or a done-callback), "
                "which would wait forever for itself; use submit() there"
            )

    def stats(self) -> GenerationStats:
        """Counters since construction, and the current queue and rows."""
        with self._lock:
            queued = len(self._queue)
        return self._stats.snapshot(queued, kv_cache="concat")

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; ``drain=True`` finishes queued and running ones first,
        ``drain=False`` fails them with :class:`SessionClosedError`. Joins the thread."""
        with self._lock:
            self._closed = True
            self._drain = self._drain and drain
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            forget_live(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Seq2SeqGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop (its own thread) ----------------------------------------------------------
    def _rows(self) -> int:
        return sum(c.rows for c in self._cohorts)

    def _admit(self) -> tuple[list[Seq2SeqRequest], bool]:
        """The requests to admit now (oldest first, within the row budget) and whether to stop;
        waits while there is nothing to do."""
        with self._lock:
            while True:
                if self._closed and not self._drain:
                    return [], True
                if self._queue or self._cohorts:
                    break
                if self._closed:
                    return [], True
                self._wake.wait(_WAIT_S)
            free = self.max_batch_size - self._rows()
            admitted: list[Seq2SeqRequest] = []
            while self._queue and self._queue[0].rows <= free:
                req = self._queue.popleft()
                if not req.live():
                    for f in req.futures:
                        if f.cancelled():
                            self._stats.outcome("cancelled")
                    continue
                admitted.append(req)
                free -= req.rows
            return admitted, False

    def _loop(self) -> None:
        try:
            while True:
                admitted, stop = self._admit()
                if stop:
                    break
                self._reap()
                for cohort in list(self._cohorts):
                    if cohort.rows:
                        self._step(cohort)
                if admitted:
                    self._starting = admitted
                    self._start(admitted)
                    self._starting = []
                self._cohorts = [c for c in self._cohorts if c.rows]
                self._stats.active(self._rows(), 0, max((c.length for c in self._cohorts), default=0))
                self._settle_answers()
        except BaseException as exc:  # never leave a caller hanging, whatever broke
            error = InferenceError(f"the seq2seq generator failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._fail_all(error)
        finally:
            self._cohorts, cohorts = [], self._cohorts
            self._stats.active(0, 0, 0)
            self._settle_answers()
            self._fail_all(SessionClosedError("the generator was closed before the request ran"), cohorts)
            self._starting = []

    def _answer(self, future: Future[Completion], completion: Completion) -> None:
        self._answers.append((future, completion))

    def _settle_answers(self) -> None:
        answers, self._answers = self._answers, []
        for future, completion in answers:
            if settle(future, result=completion):
                self._stats.outcome("completed")
            elif future.cancelled():
                self._stats.outcome("cancelled")

    def _fail_all(self, error: BaseException, cohorts: list[Cohort] | None = None) -> None:
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        owners = {id(o): o for c in (self._cohorts if cohorts is None else cohorts) for o in c.owners}
        # a request whose start broke is in no cohort yet, but its caller waits all the same
        owners.update((id(r), r) for r in self._starting)
        for req in [*queued, *owners.values()]:
            self._settle_error(req, error)

    def _settle_error(self, req: Seq2SeqRequest, error: BaseException) -> None:
        req.done = True
        for f in req.futures:
            if settle(f, error=error):
                key = "timed_out" if isinstance(error, RequestTimeoutError) else "failed"
                self._stats.outcome(key, error)
            elif f.cancelled():
                self._stats.outcome("cancelled")

    def _reap(self) -> None:
        """Rows of requests that were cancelled or passed their deadline leave."""
        now = time.monotonic()
        for cohort in self._cohorts:
            for req in {id(o): o for o in cohort.owners}.values():
                if req.done:
                    continue
                if not req.live():
                    req.done = True
                    for f in req.futures:
                        if f.cancelled():
                            self._stats.outcome("cancelled")
                elif req.deadline is not None and now > req.deadline:
                    self._settle_error(req, RequestTimeoutError(f"the request's deadline passed ({req.id})"))
            keep = [i for i, o in enumerate(cohort.owners) if not o.done]
            if len(keep) != cohort.rows:
                cohort.select(keep)

    def _start(self, admitted: list[Seq2SeqRequest]) -> None:
        """Encode the admitted requests together and run their first decoder step."""
        admitted.sort(key=lambda r: r.source.shape[0])
        lengths = [int(r.source.shape[0]) for r in admitted]
        width = max(lengths)
        ids = np.full((len(admitted), width), self.layout.pad_token_id, np.int64)
        mask = np.zeros((len(admitted), width), np.int64)
        for i, r in enumerate(admitted):
            ids[i, : lengths[i]] = r.source
            mask[i, : lengths[i]] = 1
        t0 = time.perf_counter()
        try:
            hidden = self.runner.encode({"input_ids": ids, "attention_mask": mask})
            logits, cohort = self.runner.start(hidden, mask, self._start_token)
        except OrtBatchError as exc:
            for r in admitted:
                self._settle_error(r, exc)
            return
        finally:
            self._stats.prefill(time.perf_counter() - t0, sum(lengths))
        # one run per request; its rows (beams, samples) are copies of it
        expand = [i for i, r in enumerate(admitted) for _ in range(r.rows)]
        cohort.owners = admitted
        cohort.select(expand)
        self._cohorts.append(cohort)
        self._choose(cohort, logits[expand])

    def _step(self, cohort: Cohort) -> None:
        tokens = np.array([0] * cohort.rows, np.int64)
        offsets: dict[int, int] = {}
        for i, req in enumerate(cohort.owners):
            j = offsets.get(id(req), 0)
            offsets[id(req)] = j + 1
            tokens[i] = req.histories[j][-1]
        t0 = time.perf_counter()
        try:
            logits = self.runner.step(cohort, tokens)
        except OrtBatchError as exc:
            for req in {id(o): o for o in cohort.owners}.values():
                self._settle_error(req, exc)
            cohort.select([])
            return
        finally:
            self._stats.decode_time(time.perf_counter() - t0)
        self._stats.decode(cohort.rows, 0.0)
        self._choose(cohort, logits)

    def _choose(self, cohort: Cohort, logits: np.ndarray) -> None:
        """Every row's next token; rows of ended requests leave the cohort."""
        groups: dict[int, list[int]] = {}
        for i, req in enumerate(cohort.owners):
            groups.setdefault(id(req), []).append(i)
        reorder = np.arange(cohort.rows)
        moved = False
        now = time.monotonic()
        for rows in groups.values():
            req = cohort.owners[rows[0]]
            if req.first_token_at is None:
                req.first_token_at = now
            try:
                if req.beam is not None:
                    src = self._beam_step(req, logits[rows])
                    if not np.array_equal(src, np.arange(len(rows))):
                        reorder[rows] = np.asarray(rows)[src]
                        moved = True
                else:
                    self._sample_step(req, logits[rows])
            except OrtBatchError as exc:
                self._settle_error(req, exc)
        if moved:
            cohort.reorder_past(reorder)
        keep = [i for i, o in enumerate(cohort.owners) if not o.done]
        if len(keep) != cohort.rows:
            cohort.select(keep)

    def _beam_step(self, req: Seq2SeqRequest, logits: np.ndarray) -> np.ndarray:
        beam = req.beam
        assert beam is not None
        if np.isnan(logits).any() or np.isposinf(logits).any():
            raise InferenceError("the model produced non-finite values (NaN or +inf) in its logits")
        scores = log_softmax(logits)
        scores = process(scores, beam.histories(), req.decoding, self._eos, 1)
        src, tokens = beam.step(scores)
        req.histories = [[*req.histories[s], int(t)] for s, t in zip(src.tolist(), tokens.tolist(), strict=True)]
        self._stats.count("generated_tokens", len(tokens))
        if beam.done:
            self._finish_beams(req)
        return src

    def _finish_beams(self, req: Seq2SeqRequest) -> None:
        req.done = True
        now = time.monotonic()
        assert req.beam is not None
        for k, hyp in enumerate(req.beam.results()):
            tracker = req.trackers[k]
            for t in hyp.tokens:
                tracker.push(t)
            tracker.finish()
            if k == 0 and req.on_token is not None:
                for n, t in enumerate(hyp.tokens):
                    last = n == len(hyp.tokens) - 1
                    text = tracker.text if last else ""
                    reason = ("stop" if hyp.ended_on_eos else "length") if last else None
                    _tell(req.on_token, StreamToken(t, text, n, reason))
            reason = "stop" if hyp.ended_on_eos else "length"
            self._answer(req.futures[k], req.completion(k, hyp.tokens, reason, now))

    def _sample_step(self, req: Seq2SeqRequest, logits: np.ndarray) -> None:
        cfg = req.decoding
        live = [j for j in range(logits.shape[0]) if j not in req.ended]
        scores = np.array(logits[live], np.float32)
        process(scores, [req.histories[j] for j in live], cfg, self._eos, 1)
        for k, j in enumerate(live):
            token = choose_token(scores[k], req.sampling, req.rngs[j])
            history = req.histories[j]
            history.append(token)
            self._stats.count("generated_tokens")
            tracker = req.trackers[j]
            text, stopped = tracker.push(token)
            reason = None
            if token in self._eos or stopped:
                reason = "stop"
            elif len(history) >= (cfg.max_length or 0):
                reason = "length"
            if reason is not None:
                text += tracker.finish()
            if req.on_token is not None:
                _tell(req.on_token, StreamToken(token, text, len(history) - 2, reason, choice=j))
            if reason is not None:
                req.ended[j] = reason
                self._answer(req.futures[j], req.completion(j, history[1:], reason))
        if len(req.ended) == logits.shape[0]:
            req.done = True


def _tell(on_token: Callable[[StreamToken], None], token: StreamToken) -> None:
    try:
        on_token(token)
    except Exception:  # a caller's callback must not break the loop
        pass
