"""BatchedGenerator: many callers, one batched decode step per iteration.

One scheduler thread owns the model, the KV cache and every active row; callers only
append to the pending queue (under one lock) and wait on their own future. Each
iteration of the scheduler:

1. drops pending requests that were cancelled or whose deadline passed, and active
   rows whose caller cancelled or whose deadline passed (their row is freed now);
2. admits pending requests oldest-first while rows < ``max_batch_size`` and the
   reserved tokens (prompt + max_new_tokens of every admitted row) stay within
   ``max_tokens_in_flight``; the first that does not fit stops admission, so nothing
   starves;
3. prefills the admitted prompts (grouped by length to bound padding), samples their
   first token and merges their cache into the batch, left-padded;
4. runs ONE decode step for all active rows: input = each row's last token, attention
   mask = each row's mask plus one column, positions = cumulative mask - 1, past = the
   cache; the step's ``present`` becomes the next past;
5. settles finished rows (eos, stop string, max_new_tokens) and compacts the cache.

Every request ends in exactly one of: a :class:`Completion`; or a typed error from
:mod:`ortbatch.errors`. Nothing waits without a timeout and close() joins the thread.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from ..errors import (
    InferenceError,
    InvalidInputError,
    ManifestError,
    ModelContractError,
    OrtBatchError,
    ProviderError,
    QueueFullError,
    RequestTimeoutError,
    SessionClosedError,
    map_ort_error,
)
from ..manifest import MANIFEST_NAME, Manifest
from .cache import KVCache
from .graph import LAST_POSITION_LOGITS, rewrite_decoder
from .layout import GenerationLayout, generation_section
from .sampling import SamplingParams, choose_token
from .text import TextTracker

log = logging.getLogger("ortbatch")

__all__ = ["BatchedGenerator", "Completion", "GenerationStats", "StreamToken"]

_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider")
_SHORTCUTS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "gpu": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
    "trt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
_IDLE_WAIT_S = 0.25  # the scheduler re-checks deadlines at least this often when idle


_LIVE: weakref.WeakSet[BatchedGenerator] = weakref.WeakSet()


@atexit.register
def _abort_all_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    for gen in list(_LIVE):
        try:
            gen.close(drain=False, timeout=1.0)
        except Exception:
            pass


def _resolve_providers(ort: Any, providers: str | Sequence[Any] | None) -> list[Any]:
    if providers is None:
        available = ort.get_available_providers()
        return (
            ["CUDAExecutionProvider", "CPUExecutionProvider"]
            if "CUDAExecutionProvider" in available
            else ["CPUExecutionProvider"]
        )
    if isinstance(providers, str):
        return list(_SHORTCUTS.get(providers.lower(), [providers]))
    return list(providers)


@dataclass(frozen=True)
class Completion:
    """The result of one request.

    ``token_ids`` are the generated ids (the eos id included when generation ended on
    it, as transformers' ``generate`` returns it); ``text`` is their decoded text, without
    special tokens and cut before a matched stop string. ``finish_reason`` is ``"stop"``
    (eos or a stop string; ``stop_sequence`` says which string) or ``"length"``
    (``max_new_tokens`` reached).
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0


@dataclass(frozen=True)
class StreamToken:
    """One generated token as streamed: its id, the text that became final with it
    (may be empty while a multi-byte character or a possible stop string is incomplete),
    its index, and ``finish_reason`` on the last one."""

    token_id: int
    text: str
    index: int
    finish_reason: str | None = None


@dataclass(frozen=True)
class GenerationStats:
    """A snapshot of a :class:`BatchedGenerator`'s counters."""

    submitted: int
    completed: int
    failed: int
    cancelled: int
    timed_out: int
    rejected: int
    queued: int
    active_rows: int
    reserved_tokens: int
    cache_length: int
    decode_steps: int
    prefill_runs: int
    prompt_tokens: int
    generated_tokens: int
    mean_decode_rows: float
    max_decode_rows: int
    cache_padding_fraction: float
    decode_time_s: float
    prefill_time_s: float
    cache_copies: int = 0
    slot_reuses: int = 0


@dataclass(eq=False)
class _Request:
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

    @property
    def reserve(self) -> int:
        return int(self.prompt.shape[0]) + self.max_new_tokens

    def completion(self, finish_reason: str) -> Completion:
        now = time.monotonic()
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
        )


def _settle(fut: Future[Any], *, result: Any = None, error: BaseException | None = None) -> bool:
    """Set a future's outcome unless it is already done (e.g. cancelled meanwhile)."""
    if fut.done():
        return False
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:  # cancelled between the check and the set
        return False
    return True


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
            :class:`ProviderError` (no silent fallback to CPU).
        session_options: ``onnxruntime.SessionOptions`` for the model's session.
        io_binding: run through IOBinding with the cache kept where the provider
            lives (default: on for GPU providers, off on CPU where plain numpy is as fast).
        max_new_tokens: default ``max_new_tokens`` of a request.
        prefill_padding: how much padding a prefill group may add, as a fraction of
            its real tokens, before the group is split (lower = less wasted compute,
            more prefill runs).
        last_position_logits: run the LM head on the last position only (a graph
            rewrite, see :mod:`ortbatch.generation.graph`): prefill then computes and
            returns ``rows x vocab`` logits, not ``rows x prompt x vocab``.
            ``None`` (default): when ``onnx`` is installed and the graph allows it;
            ``True``: required (:class:`ModelContractError` if impossible); ``False``: never.
        attention_rewrite: move the attention scale from the key cache to the scores, so
            ONNX Runtime reads the key cache in place instead of transposing and scaling
            all of it every step (a graph rewrite, see :mod:`ortbatch.generation.graph`;
            about 1.5x faster decode steps at 16 rows on CPU). Applied where ``onnx`` is
            installed and the graph has that pattern; ``False``: never.
        max_context_length: most positions a row may reach (prompt + new tokens). Default:
            the export's, from ``config.json`` (``max_position_embeddings`` and the like) or
            the manifest; required for models whose config gives none (ALiBi models such as
            BLOOM). The manifest's ``limits.max_sequence_length`` still caps it.
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
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if max_context_length is not None and max_context_length < 2:
            raise ValueError(f"max_context_length must be >= 2, got {max_context_length}")
        self._dir = Path(export_dir)
        self.layout, manifest = self._load_layout(self._dir, max_context_length)
        # The manifest's limits (e.g. TensorRT profile shapes) bound what may be run.
        if manifest is not None and manifest.max_sequence_length:
            context = min(self.layout.max_context_length, manifest.max_sequence_length)
            self.layout = dataclasses.replace(self.layout, max_context_length=context)
        if manifest is not None and manifest.max_batch_size:
            max_batch_size = min(max_batch_size, manifest.max_batch_size)
        ort = require("onnxruntime")
        self._ort = ort
        model_path = self._dir / self.layout.model
        wanted = _resolve_providers(ort, providers)
        self._check_available(ort, wanted)
        rewritten = None
        if last_position_logits is not False or attention_rewrite:
            rewritten = rewrite_decoder(
                model_path,
                logits=self.layout.logits,
                last_position=last_position_logits is not False,
                attention=attention_rewrite,
            )
        #: The graph rewrites applied (name -> places changed); empty when the export runs as it is.
        self.graph_rewrites: dict[str, int] = dict(rewritten.rewrites) if rewritten else {}
        #: True when the graph was rewritten to return the last position's logits only.
        self.last_position_logits = LAST_POSITION_LOGITS in self.graph_rewrites
        if last_position_logits and not self.last_position_logits:
            if rewritten is not None:
                rewritten.close()
            raise ModelContractError(
                f"{model_path}: cannot make the LM head run on the last position only (needs the "
                "onnx package and a MatMul producing the logits)"
            )
        model: str | bytes = rewritten.model if rewritten else str(model_path)
        try:
            self._session = ort.InferenceSession(model, sess_options=session_options, providers=wanted)
        except Exception as exc:
            if rewritten is None or last_position_logits:  # nothing to fall back to, or required
                raise map_ort_error(exc, f"loading {model_path}") from exc
            # A rewrite must never cost a working export: run it as it is.
            log.warning("%s: the rewritten graph did not load (%s); running the export as it is", model_path, exc)
            self.graph_rewrites, self.last_position_logits = {}, False
            try:
                self._session = ort.InferenceSession(str(model_path), sess_options=session_options, providers=wanted)
            except Exception as exc2:
                raise map_ort_error(exc2, f"loading {model_path}") from exc2
        finally:
            if rewritten is not None:
                rewritten.close()
        self._check_providers(wanted)
        self._check_session()
        active = self._session.get_providers()
        on_gpu = bool(active) and active[0] in _GPU_PROVIDERS
        self._io_binding = on_gpu if io_binding is None else io_binding
        self._device = ("cuda" if on_gpu else "cpu", 0)

        context = self.layout.max_context_length
        self.max_batch_size = max_batch_size
        self.max_tokens_in_flight = max_batch_size * context if max_tokens_in_flight is None else max_tokens_in_flight
        if self.max_tokens_in_flight < 2:
            raise ValueError(f"max_tokens_in_flight must be >= 2, got {self.max_tokens_in_flight}")
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.default_max_new_tokens = max_new_tokens
        self.prefill_padding = prefill_padding
        self._tokenizer: Any = None
        self._tokenizer_error: str | None = None
        self._eos = frozenset(self.layout.eos_token_ids)
        cache_type = self._input_type(self.layout.past_keys[0])
        if cache_type not in _NP_TYPES:
            raise ModelContractError(
                f"{model_path}: KV cache of type {cache_type} is not supported (numpy has no such dtype); "
                "export in float32 or float16"
            )
        self._cache_dtype = _NP_TYPES[cache_type]
        self._ids_dtype = _NP_TYPES.get(self._input_type(self.layout.input_ids), np.int64)
        self._mask_dtype = _NP_TYPES.get(self._input_type(self.layout.attention_mask), np.int64)
        self._pos_dtype = (
            _NP_TYPES.get(self._input_type(self.layout.position_ids), np.int64)
            if self.layout.position_ids
            else np.int64
        )
        self._present_names = [
            n for pair in zip(self.layout.present_keys, self.layout.present_values, strict=True) for n in pair
        ]
        self._past_names = [
            n for pair in zip(self.layout.past_keys, self.layout.past_values, strict=True) for n in pair
        ]
        self._output_names = [self.layout.logits, *self._present_names]
        if not self.layout.position_ids:
            self._check_positions_follow_the_mask()

        # Shared between callers and the scheduler: guarded by _lock.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[_Request] = deque()
        self._state = "open"  # open -> draining | aborting -> closed
        self._ids = itertools.count(1)
        self._counts = dict.fromkeys(
            (
                "submitted",
                "completed",
                "failed",
                "cancelled",
                "timed_out",
                "rejected",
                "decode_steps",
                "prefill_runs",
                "prompt_tokens",
                "generated_tokens",
                "decode_rows",
                "max_decode_rows",
                "cache_copies",
                "slot_reuses",
            ),
            0,
        )
        self._padding_sum = 0.0
        self._decode_time = 0.0
        self._prefill_time = 0.0
        self._active_snapshot = (0, 0, 0)  # rows, reserved tokens, cache length

        # Owned by the scheduler thread only.
        self._rows: list[_Request] = []  # one per cache row; rows that left may linger (see _place)
        self._cache = self._empty_cache()
        self._cache_itemsize = np.dtype(self._cache_dtype).itemsize
        self._last_step_s = 0.0  # the last decode step's time
        self._copy_s_per_byte = 1e-9  # learned from the cache copies made

        # Daemon, so a process that never calls close() still exits; atexit aborts it first.
        self._thread = threading.Thread(target=self._run, name="ortbatch-generator", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- construction helpers ---------------------------------------------------------
    @staticmethod
    def _load_layout(directory: Path, max_context_length: int | None) -> tuple[GenerationLayout, Manifest | None]:
        """The generation layout (from the manifest, else read from the export), with
        ``max_context_length`` in place of the export's when given."""
        if not directory.is_dir():
            raise ModelContractError(f"{directory}: not an export directory")
        model = "model.onnx"
        manifest = None
        if (directory / MANIFEST_NAME).is_file():
            manifest = Manifest.load(directory).verify()
            model = manifest.model
            if manifest.generation:
                section = dict(manifest.generation)
                section.setdefault("model", model)
                if max_context_length is not None:
                    section["max_context_length"] = max_context_length
                where = f"{directory / MANIFEST_NAME}: generation"
                return GenerationLayout.from_dict(section, where=where), manifest
        try:
            section = generation_section(directory, model, max_context_length=max_context_length)
            return GenerationLayout.from_dict(section), manifest
        except ManifestError as exc:  # our own inference produced it: a model problem
            raise ModelContractError(str(exc)) from exc

    @staticmethod
    def _check_available(ort: Any, wanted: Sequence[Any]) -> None:
        available = set(ort.get_available_providers())
        for p in wanted:
            name = p[0] if isinstance(p, tuple) else p
            if name in _GPU_PROVIDERS and name not in available:
                raise ProviderError(
                    f"{name} was requested but this onnxruntime build offers only {sorted(available)}; "
                    "install onnxruntime-gpu (ortbatch[gpu]) or pass providers='cpu'"
                )

    def _check_providers(self, wanted: Sequence[Any]) -> None:
        active = set(self._session.get_providers())
        for p in wanted:
            name = p[0] if isinstance(p, tuple) else p
            if name in _GPU_PROVIDERS and name not in active:
                raise ProviderError(
                    f"{name} was requested but the session runs on {sorted(active)}; "
                    "install onnxruntime-gpu and check the CUDA libraries"
                )

    def _input_type(self, name: str | None) -> str:
        for i in self._session.get_inputs():
            if i.name == name:
                return str(i.type)
        return ""

    def _check_session(self) -> None:
        inputs = {i.name for i in self._session.get_inputs()}
        outputs = {o.name for o in self._session.get_outputs()}
        lay = self.layout
        need_in = {lay.input_ids, lay.attention_mask, *lay.past_keys, *lay.past_values}
        if lay.position_ids:
            need_in.add(lay.position_ids)
        need_out = {lay.logits, *lay.present_keys, *lay.present_values}
        missing = sorted((need_in - inputs) | (need_out - outputs))
        extra = sorted(inputs - need_in)
        if missing or extra:
            raise ModelContractError(
                f"{self._dir}: the generation layout does not match the model: "
                f"missing {missing}, unexpected inputs {extra}"
            )

    def _check_positions_follow_the_mask(self) -> None:
        """For a graph without a ``position_ids`` input: check that it counts each row's
        positions from the attention mask, as the scheduler needs.

        Rows move within the cache (a row joining a longer cache gets more left padding;
        compaction trims padding). A graph that derives positions from the mask (GPT-2 and
        OPT style, ALiBi) does not notice; one that counts them from the cache length
        (optimum's Gemma-family exports) would give a moved row's new tokens positions
        shifted against its cached ones, and silently generate something else. So a short
        probe decodes one token after a 3-token prefill twice, the second time with the
        cache moved 5 columns right, and the two must agree.
        """
        vocab = max(2, self.layout.vocab_size)
        tokens = np.array([[vocab // 3, vocab // 5, vocab // 7, vocab // 2]], dtype=self._ids_dtype)
        lay = self.layout
        empty = np.zeros((1, lay.num_kv_heads, 0, lay.head_dim), self._cache_dtype)
        cache = KVCache([empty] * len(self._past_names), np.zeros(1, np.int64), 0)
        _, presents = self._forward(tokens[:, :3], np.ones((1, 3), self._mask_dtype), cache)
        cache.advance(presents, new=3)
        cache.host()
        shift = ((0, 0), (0, 0), (5, 0), (0, 0))  # 5 columns of left padding
        moved = KVCache([np.pad(t, shift) for t in cache.tensors], cache.lens, cache.length + 5)
        here, _ = self._forward(tokens[:, 3:], cache.attention_mask(1, self._mask_dtype), cache)
        there, _ = self._forward(tokens[:, 3:], moved.attention_mask(1, self._mask_dtype), moved)
        a, b = np.asarray(here[:, -1], np.float64), np.asarray(there[:, -1], np.float64)
        if not np.abs(a - b).max() <= 1e-2 * max(1.0, float(np.abs(a).max())):
            raise ModelContractError(
                f"{self._dir}: the model has no position_ids input and counts positions from the cache "
                "length instead of the attention mask, so rows that join or leave a running batch would "
                "get wrong positions (moving a row 5 cache columns changed its next logits by up to "
                f"{float(np.abs(a - b).max()):.3g}). Export it with `ortbatch export MODEL --task "
                "text-generation-with-past`, which adds a position_ids input"
            )

    def _empty_cache(self) -> KVCache:
        lay = self.layout
        return KVCache.empty(lay.num_layers, lay.num_kv_heads, lay.head_dim, self._cache_dtype)

    # -- tokenizer ---------------------------------------------------------------------
    def _get_tokenizer(self) -> Any:
        if self._tokenizer is None and self._tokenizer_error is None:
            if not self.layout.tokenizer or not (self._dir / self.layout.tokenizer).is_file():
                self._tokenizer_error = f"{self._dir} has no tokenizer.json"
            else:
                tokenizers = require("tokenizers", "serve")
                self._tokenizer = tokenizers.Tokenizer.from_file(str(self._dir / self.layout.tokenizer))
        return self._tokenizer

    def _decode_fn(self) -> Callable[[Sequence[int]], str] | None:
        tok = self._get_tokenizer()
        if tok is None:
            return None
        return lambda ids: tok.decode(list(ids), skip_special_tokens=True)

    @property
    def export_dir(self) -> Path:
        """The export directory this generator serves."""
        return self._dir

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as the export's tokenizer makes them (special tokens added
        as the tokenizer does, e.g. Llama's BOS, unless ``add_special_tokens=False``, as for
        text rendered from a chat template, which holds its special tokens already)."""
        tok = self._get_tokenizer()
        if tok is None:
            raise InvalidInputError(
                f"text prompt given but {self._tokenizer_error}: pass token ids", input_name="prompt"
            )
        return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        tok = self._get_tokenizer()
        if tok is None:
            raise InvalidInputError(f"{self._tokenizer_error}: cannot decode", input_name="prompt")
        return str(tok.decode(list(ids), skip_special_tokens=True))

    # -- public API --------------------------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int] | np.ndarray,
        max_new_tokens: int | None = None,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        timeout_s: float | None = None,
        on_token: Callable[[StreamToken], None] | None = None,
    ) -> Future[Completion]:
        """Queue one completion; returns a future of its :class:`Completion`.

        Raises at once: :class:`InvalidInputError` for a bad prompt or parameter (empty,
        ids outside the vocabulary, longer than the context with ``max_new_tokens``),
        :class:`QueueFullError` when ``max_queue`` requests wait, :class:`SessionClosedError`
        after close. The future fails with :class:`RequestTimeoutError` when the deadline
        passes (its ``partial`` attribute holds what was generated), :class:`InferenceError`
        when ONNX Runtime fails, :class:`SessionClosedError` on ``close(drain=False)``.
        Cancelling the future frees the request's row at the next step. ``on_token`` is
        called on the scheduler thread with each :class:`StreamToken`: keep it quick.
        """
        req = self._make_request(prompt, max_new_tokens, temperature, top_k, top_p, stop, seed, timeout_s, on_token)
        with self._lock:
            if self._state != "open":
                raise SessionClosedError("the generator is closed")
            if len(self._pending) >= self.max_queue:
                self._counts["rejected"] += 1
                raise QueueFullError(len(self._pending), self.max_queue)
            self._pending.append(req)
            self._counts["submitted"] += 1
            self._wake.notify()
        return req.future

    def generate(
        self,
        prompt: str | Sequence[int] | np.ndarray,
        max_new_tokens: int | None = None,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        timeout_s: float | None = None,
    ) -> Completion:
        """Generate one completion, blocking; see :meth:`submit` for arguments and errors."""
        fut = self.submit(
            prompt,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop=stop,
            seed=seed,
            timeout_s=timeout_s,
        )
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt: free the row
            raise

    async def generate_async(
        self,
        prompt: str | Sequence[int] | np.ndarray,
        max_new_tokens: int | None = None,
        **kwargs: Any,
    ) -> Completion:
        """``await`` one completion; cancelling the awaiting task cancels the request."""
        return await asyncio.wrap_future(self.submit(prompt, max_new_tokens, **kwargs))

    async def stream(
        self,
        prompt: str | Sequence[int] | np.ndarray,
        max_new_tokens: int | None = None,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[StreamToken]:
        """Yield the request's tokens as they are generated (an async generator).

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

        fut = self.submit(
            prompt,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop=stop,
            seed=seed,
            timeout_s=timeout_s,
            on_token=put,
        )
        # Tokens are put before the future settles, on the same thread, so the end marker
        # comes after the last token.
        fut.add_done_callback(lambda _f: put(None))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    if fut.cancelled():
                        return
                    exc = fut.exception()
                    if exc is not None:
                        raise exc
                    return
                yield item
        finally:
            fut.cancel()

    def stats(self) -> GenerationStats:
        """Counters since construction, and the current queue/batch state."""
        with self._lock:
            c = dict(self._counts)
            rows, reserved, length = self._active_snapshot
            queued = len(self._pending)
            padding = self._padding_sum
            decode_time, prefill_time = self._decode_time, self._prefill_time
        steps = c["decode_steps"]
        return GenerationStats(
            submitted=c["submitted"],
            completed=c["completed"],
            failed=c["failed"],
            cancelled=c["cancelled"],
            timed_out=c["timed_out"],
            rejected=c["rejected"],
            queued=queued,
            active_rows=rows,
            reserved_tokens=reserved,
            cache_length=length,
            decode_steps=steps,
            prefill_runs=c["prefill_runs"],
            prompt_tokens=c["prompt_tokens"],
            generated_tokens=c["generated_tokens"],
            mean_decode_rows=c["decode_rows"] / steps if steps else 0.0,
            max_decode_rows=c["max_decode_rows"],
            cache_padding_fraction=padding / steps if steps else 0.0,
            decode_time_s=decode_time,
            prefill_time_s=prefill_time,
            cache_copies=c["cache_copies"],
            slot_reuses=c["slot_reuses"],
        )

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests. ``drain=True`` finishes queued and active requests
        first; ``drain=False`` fails them with :class:`SessionClosedError`. Joins the
        scheduler thread (up to ``timeout`` seconds). Calling it again is harmless."""
        with self._lock:
            if self._state == "open":
                self._state = "draining" if drain else "aborting"
            elif self._state == "draining" and not drain:
                self._state = "aborting"
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        with self._lock:
            return self._state != "open"

    def __enter__(self) -> BatchedGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request validation ---------------------------------------------------------------
    def _make_request(
        self,
        prompt: Any,
        max_new_tokens: int | None,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        stop: str | Sequence[str] | None,
        seed: int | None,
        timeout_s: float | None,
        on_token: Callable[[StreamToken], None] | None,
    ) -> _Request:
        if self.closed:
            raise SessionClosedError("the generator is closed")
        ids = self._prompt_ids(prompt)
        n_new = self.default_max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(n_new, bool) or not isinstance(n_new, (int, np.integer)) or n_new < 1:
            raise InvalidInputError(
                f"max_new_tokens must be a positive integer, got {n_new!r}", input_name="max_new_tokens"
            )
        n_new = int(n_new)
        context = self.layout.max_context_length
        if ids.shape[0] + n_new > context:
            raise InvalidInputError(
                f"prompt ({ids.shape[0]} tokens) + max_new_tokens ({n_new}) exceeds the model's "
                f"context of {context} tokens",
                input_name="prompt",
            )
        if ids.shape[0] + n_new > self.max_tokens_in_flight:
            raise InvalidInputError(
                f"prompt ({ids.shape[0]} tokens) + max_new_tokens ({n_new}) exceeds "
                f"max_tokens_in_flight={self.max_tokens_in_flight}: it could never be admitted",
                input_name="prompt",
            )
        if not isinstance(temperature, (int, float)) or not np.isfinite(temperature) or temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {temperature!r}", input_name="temperature")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise InvalidInputError(f"top_k must be a positive integer, got {top_k!r}", input_name="top_k")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
            raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}", input_name="top_p")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidInputError(f"stop must be non-empty strings, got {stop!r}", input_name="stop")
        decode = self._decode_fn()
        if stops and decode is None:
            raise InvalidInputError(f"stop strings need a tokenizer but {self._tokenizer_error}", input_name="stop")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout is not None and timeout <= 0:
            raise InvalidInputError(f"timeout_s must be positive, got {timeout!r}", input_name="timeout_s")
        params = SamplingParams(float(temperature), top_k, None if top_p is None else float(top_p))
        rng = None
        if not params.greedy:
            rng = np.random.Generator(np.random.PCG64(secrets.randbits(64) if seed is None else seed))
        now = time.monotonic()
        fut: Future[Completion] = Future()
        return _Request(
            id=next(self._ids),
            prompt=ids,
            max_new_tokens=n_new,
            params=params,
            rng=rng,
            tracker=TextTracker(decode, stops),
            future=fut,
            deadline=None if timeout is None else now + timeout,
            on_token=on_token,
            submitted_at=now,
        )

    def _prompt_ids(self, prompt: Any) -> np.ndarray:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty", input_name="prompt")
            ids = np.asarray(self.encode(prompt), dtype=np.int64)
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
        bad = (ids < 0) | (ids >= self.layout.vocab_size)
        if bad.any():
            pos = int(np.argmax(bad))
            raise InvalidInputError(
                f"prompt token {pos} is id {int(ids[pos])}, outside the vocabulary [0, {self.layout.vocab_size})",
                input_name="prompt",
            )
        return ids

    # -- scheduler thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                admitted, dropped, stop = self._take_work()
                for req, err in dropped:
                    self._finish_error(req, err)
                if stop:
                    break
                keep = self._reap_rows()
                joining, joined = self._prefill(admitted) if admitted else ([], [])
                self._place(keep, joining, joined)
                if self._rows:
                    self._decode_step()
                if not any(not r.done for r in self._rows):
                    self._rows = []
                    self._cache = self._empty_cache()
                self._publish()
        except BaseException as exc:  # never leave a caller hanging, whatever broke
            error = InferenceError(f"the generator's scheduler failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            with self._lock:
                self._state = "closed"
                pending = list(self._pending)
                self._pending.clear()
            for req in [*self._rows, *pending]:
                if not req.done:
                    self._finish_error(req, error)
            self._rows = []
            self._cache = self._empty_cache()
            self._publish()
        finally:
            with self._lock:
                self._state = "closed"

    def _take_work(self) -> tuple[list[_Request], list[tuple[_Request, BaseException]], bool]:
        """Under the lock: wait for work, drop dead pending requests, admit oldest-first."""
        dropped: list[tuple[_Request, BaseException]] = []
        admitted: list[_Request] = []
        alive = [r for r in self._rows if not r.done]
        with self._lock:
            if not alive:
                self._wake.wait_for(lambda: bool(self._pending) or self._state != "open", timeout=_IDLE_WAIT_S)
            if self._state == "aborting":
                err = SessionClosedError("the generator was closed without draining")
                dropped = [(r, err) for r in [*self._pending, *alive]]
                self._pending.clear()
                self._rows = []
                self._cache = self._empty_cache()
                return [], dropped, True
            now = time.monotonic()
            waiting: deque[_Request] = deque()
            for req in self._pending:
                if req.future.cancelled():
                    dropped.append((req, _CANCELLED))
                elif req.deadline is not None and now >= req.deadline:
                    dropped.append(
                        (
                            req,
                            RequestTimeoutError(
                                f"request {req.id}: deadline passed after {now - req.submitted_at:.3f}s "
                                f"while queued; it was not run"
                            ),
                        )
                    )
                else:
                    waiting.append(req)
            self._pending = waiting
            rows = len(alive)
            reserved = sum(r.reserve for r in alive)
            while self._pending and rows < self.max_batch_size:
                head = self._pending[0]
                if reserved + head.reserve > self.max_tokens_in_flight:
                    break  # oldest first: nobody overtakes the head of the queue
                admitted.append(self._pending.popleft())
                rows += 1
                reserved += head.reserve
            stop = self._state == "draining" and not self._pending and not alive and not admitted
            return admitted, dropped, stop

    def _place(self, keep: list[int], joining: list[KVCache], joined: list[_Request]) -> None:
        """Fit the rows that join into the batch, and decide whether rows that left are dropped.

        A full cache copy costs several decode steps on a large cache, so: joining rows
        take the slots of rows that left, in place, when there are enough and the cache
        is long enough; otherwise one rebuild drops the rows that left and stacks the
        new ones. Rows that left and are not replaced stay in the batch, unread, until
        the compute they waste (a share of each step, for the steps the others still
        have to go) outweighs the copy that drops them.
        """
        rows, cache = self._rows, self._cache
        kept = set(keep)
        free = [i for i in range(len(rows)) if i not in kept]
        incoming = [(c, r) for c in joining for r in range(c.rows)]
        if not keep and not incoming:
            self._rows, self._cache = [], self._empty_cache()
            return
        if incoming and len(incoming) <= len(free) and all(int(c.lens[r]) <= cache.length for c, r in incoming):
            for (c, r), req, slot in zip(incoming, joined, free, strict=False):
                cache.place(slot, c, r)
                rows[slot] = req
            with self._lock:
                self._counts["slot_reuses"] += len(incoming)
            keep = sorted(keep + free[: len(incoming)])
            free = free[len(incoming) :]
            incoming = []
        if incoming or (free and self._worth_compacting(keep, free)):
            t0 = time.perf_counter()
            copied = cache.nbytes(self._cache_itemsize) * len(keep) // max(1, len(rows))
            cache.rebuild(keep, joining if incoming else ())
            elapsed = time.perf_counter() - t0
            self._rows = [rows[i] for i in keep] + (joined if incoming else [])
            if copied:
                self._copy_s_per_byte = 0.7 * self._copy_s_per_byte + 0.3 * elapsed / copied
            with self._lock:
                self._counts["cache_copies"] += 1

    def _worth_compacting(self, keep: list[int], free: list[int]) -> bool:
        """Whether dropping the ``free`` rows now saves more decode time than the copy costs."""
        if not keep:
            return True
        rows = len(keep) + len(free)
        # steps the surviving rows still have to go, at most (stop strings and EOS end some sooner)
        remaining = sum(self._rows[i].max_new_tokens - len(self._rows[i].generated) for i in keep) / len(keep)
        waste = self._last_step_s * len(free) / rows * remaining
        copy = self._copy_s_per_byte * self._cache.nbytes(self._cache_itemsize) * len(keep) / rows
        return waste > copy

    def _reap_rows(self) -> list[int]:
        """Indices of the rows that stay: not finished, not cancelled, not past their deadline
        (those are settled here and their rows freed by the next rebuild)."""
        now = time.monotonic()
        keep: list[int] = []
        for i, req in enumerate(self._rows):
            if req.done:
                continue
            if req.future.cancelled():
                self._finish_error(req, _CANCELLED)
            elif req.deadline is not None and now >= req.deadline:
                self._finish_timeout(req, now)
            else:
                keep.append(i)
        return keep

    # -- model runs ------------------------------------------------------------------------
    def _prefill_groups(self, reqs: list[_Request]) -> list[list[_Request]]:
        """Group prompts of similar length so a group's padding stays under ``prefill_padding``."""
        ordered = sorted(reqs, key=lambda r: r.prompt.shape[0])
        groups: list[list[_Request]] = []
        for req in ordered:
            if groups:
                group = groups[-1]
                longest = req.prompt.shape[0]
                real = sum(r.prompt.shape[0] for r in group) + longest
                if longest * (len(group) + 1) <= real * (1.0 + self.prefill_padding):
                    group.append(req)
                    continue
            groups.append([req])
        return groups

    def _prefill(self, reqs: list[_Request]) -> tuple[list[KVCache], list[_Request]]:
        """Prefill ``reqs``; returns the caches of those still generating, and them in row order."""
        caches: list[KVCache] = []
        joined: list[_Request] = []
        pending = self._prefill_groups(reqs)
        while pending:
            group = pending.pop(0)
            result = self._prefill_group(group)
            if result is None:  # the group failed: split it so only a failing request fails
                if len(group) > 1:
                    pending[:0] = [[r] for r in group]
                continue
            cache, survivors = result
            caches.append(cache)
            joined.extend(survivors)
        return caches, joined

    def _prefill_group(self, group: list[_Request]) -> tuple[KVCache, list[_Request]] | None:
        lay = self.layout
        n = len(group)
        lens = np.array([r.prompt.shape[0] for r in group], dtype=np.int64)
        longest = int(lens.max())
        ids = np.full((n, longest), lay.pad_token_id, dtype=self._ids_dtype)
        for i, req in enumerate(group):
            ids[i, longest - lens[i] :] = req.prompt
        empty = (n, lay.num_kv_heads, 0, lay.head_dim)
        cache = KVCache([np.zeros(empty, self._cache_dtype) for _ in self._past_names], np.zeros(n, np.int64), 0)
        # Prefill is a step that appends `longest` columns to an empty cache; the rows'
        # left padding is then exactly the all-zero start of their mask.
        mask = (np.arange(longest)[None, :] >= (longest - lens)[:, None]).astype(self._mask_dtype)
        t0 = time.perf_counter()
        try:
            logits, presents = self._forward(ids, mask, cache)
        except OrtBatchError as exc:
            if n == 1:
                self._finish_error(group[0], exc)
            return None
        finally:
            with self._lock:
                self._prefill_time += time.perf_counter() - t0
                self._counts["prefill_runs"] += 1
        with self._lock:
            self._counts["prompt_tokens"] += int(lens.sum())
        cache.advance(presents, new=longest)
        cache.lens = lens  # each row's real length; its padding is the start of the cache
        keep = [i for i, req in enumerate(group) if not self._add_token(req, logits[i, -1])]
        cache.keep(keep)
        return cache, [group[i] for i in keep]

    def _decode_step(self) -> None:
        rows = self._rows
        cache = self._cache
        # rows that left and were not replaced yet ride along (see _place); their outputs are unread
        ids = np.array([[r.generated[-1]] for r in rows], dtype=self._ids_dtype)
        mask = cache.attention_mask(1, self._mask_dtype)
        live = [i for i, r in enumerate(rows) if not r.done]
        with self._lock:
            self._counts["decode_steps"] += 1
            self._counts["decode_rows"] += len(live)
            self._counts["max_decode_rows"] = max(self._counts["max_decode_rows"], len(live))
            live_tokens = float(cache.lens[live].sum())
            self._padding_sum += 1.0 - live_tokens / max(1, cache.rows * cache.length)
        t0 = time.perf_counter()
        try:
            logits, presents = self._forward(ids, mask, cache)
        except OrtBatchError as exc:
            # A failed decode step cannot be pinned on one row: every row in it fails,
            # and the generator carries on with the next requests.
            for i in live:
                self._finish_error(rows[i], exc)
            self._rows = []
            self._cache = self._empty_cache()
            return
        finally:
            elapsed = time.perf_counter() - t0
            with self._lock:
                self._decode_time += elapsed
        self._last_step_s = elapsed
        cache.advance(presents, new=1)
        # Finished rows are settled now; at the next step boundary their slots go to rows
        # that join, or are dropped when that is worth a copy (see _place).
        for i in live:
            self._add_token(rows[i], logits[i, -1])

    def _forward(self, ids: np.ndarray, mask: np.ndarray, cache: KVCache) -> tuple[np.ndarray, list[Any]]:
        """One model run; checks every length, since the model silently accepts a mask
        that is one column too long."""
        lay = self.layout
        rows, new = ids.shape
        past = cache.length
        if cache.rows != rows or mask.shape != (rows, past + new):
            raise InferenceError(
                f"internal shape mismatch: ids {ids.shape}, mask {mask.shape}, cache rows {cache.rows} "
                f"x length {past}; expected mask ({rows}, {past + new})"
            )
        # Positions come from the cumulative mask: a left-padded row starts at 0 where its
        # tokens start, exactly as it would alone (padding gets 1, like transformers).
        positions = np.cumsum(mask, axis=1, dtype=np.int64) - 1
        positions = np.where(mask == 0, 1, positions)[:, past:].astype(self._pos_dtype)
        feed: dict[str, Any] = {lay.input_ids: ids, lay.attention_mask: mask}
        if lay.position_ids:
            feed[lay.position_ids] = positions
        try:
            if self._io_binding:
                logits, presents = self._run_bound(feed, cache)
            else:
                feed.update(zip(self._past_names, cache.tensors, strict=True))
                outs = self._session.run(self._output_names, feed)
                logits, presents = outs[0], outs[1:]
        except OrtBatchError:
            raise
        except Exception as exc:
            raise map_ort_error(exc, f"generation step ({rows} rows, past {past}, new {new})") from exc
        expected = (rows, lay.num_kv_heads, past + new, lay.head_dim)
        for name, t in zip(self._present_names, presents, strict=True):
            shape = tuple(t.shape) if isinstance(t, np.ndarray) else tuple(t.shape())
            if shape != expected:
                raise InferenceError(f"{name} has shape {shape}; expected {expected}")
        kept = 1 if self.last_position_logits else new
        if logits.shape[:2] != (rows, kept):
            raise InferenceError(f"logits have shape {logits.shape}; expected ({rows}, {kept}, vocab)")
        return logits, presents

    def _run_bound(self, feed: dict[str, np.ndarray], cache: KVCache) -> tuple[np.ndarray, list[Any]]:
        """IOBinding run: the cache stays on the provider's device; present is bound as the
        next step's past, and only the logits come back to the host."""
        device, device_id = self._device
        binding = self._session.io_binding()
        for name, array in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, t in zip(self._past_names, cache.tensors, strict=True):
            if isinstance(t, np.ndarray):
                # A cache just rebuilt on the host (rows joined or left): ORT copies it to
                # the device for this run; its present stays there for the next one.
                binding.bind_cpu_input(name, np.ascontiguousarray(t))
            else:
                binding.bind_ortvalue_input(name, t)
        binding.bind_output(self.layout.logits, "cpu")
        for name in self._present_names:
            binding.bind_output(name, device, device_id)
        self._session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        return outs[0].numpy(), list(outs[1:])

    # -- per-row bookkeeping ---------------------------------------------------------------
    def _add_token(self, req: _Request, logits: np.ndarray) -> bool:
        """Choose and record one token for ``req``; settle it and return True when done."""
        token = choose_token(logits, req.params, req.rng)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.generated.append(token)
        with self._lock:
            self._counts["generated_tokens"] += 1
        reason = None
        if token in self._eos:
            reason = "stop"
        delta, stopped = req.tracker.push(token) if reason is None else ("", False)
        if stopped:
            reason = "stop"
        elif reason is None and len(req.generated) >= req.max_new_tokens:
            reason = "length"
        if reason is not None:
            delta += req.tracker.finish()
        if req.on_token is not None:
            try:
                req.on_token(StreamToken(token, delta, len(req.generated) - 1, reason))
            except Exception as exc:
                self._finish_error(req, exc)
                return True
        if reason is not None:
            req.done = True
            self._settle_counted(req, "completed", result=req.completion(reason))
            return True
        return False

    def _finish_timeout(self, req: _Request, now: float) -> None:
        err = RequestTimeoutError(
            f"request {req.id}: deadline passed after {now - req.submitted_at:.3f}s with "
            f"{len(req.generated)} of {req.max_new_tokens} tokens generated"
        )
        err.partial = req.completion("timeout")  # type: ignore[attr-defined]
        self._finish_error(req, err)

    def _finish_error(self, req: _Request, err: BaseException) -> None:
        req.done = True
        if err is _CANCELLED or req.future.cancelled():
            self._count("cancelled")
            return
        self._settle_counted(req, "timed_out" if isinstance(err, RequestTimeoutError) else "failed", error=err)

    def _settle_counted(
        self, req: _Request, key: str, *, result: Any = None, error: BaseException | None = None
    ) -> None:
        # Counted before settling: the caller may read stats() as soon as its future is done.
        self._count(key)
        if not _settle(req.future, result=result, error=error):
            with self._lock:  # cancelled meanwhile
                self._counts[key] -= 1
                self._counts["cancelled"] += 1

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _publish(self) -> None:
        alive = [r for r in self._rows if not r.done]
        snapshot = (len(alive), sum(r.reserve for r in alive), self._cache.length)
        with self._lock:
            self._active_snapshot = snapshot


_CANCELLED = InferenceError("cancelled")  # marker only: never set on a future
