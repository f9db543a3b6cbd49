"""The decoder on ONNX Runtime: its session, its contract, and the model runs of a step.

:class:`DecoderRunner` builds the session (providers, the load-time graph rewrites with
their fallback to the export as it is), checks that the graph is the decoder the layout
describes (and, for a graph without ``position_ids``, that it counts positions from the
attention mask), and runs prefill and decode steps. It holds the batch's KV cache, of one
of two kinds (:attr:`DecoderRunner.kv_cache`):

- ``"in-place"``: the graph's attention rewritten to write into a preallocated cache
  (:mod:`.gqa`), one slot per row, runs in :mod:`.inplace`, with prefix reuse
  (:mod:`.prefix_cache`). Chosen on the CPU provider wherever the graph allows it.
- ``"concat"``: the export's own ``present = Concat(past, new)``, a left-padded
  :class:`~.cache.KVCache` replaced by each step's outputs; with IOBinding on a GPU
  provider it stays on the device between steps.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._extras import require
from .._ort import CPU, build_session, device_of, resolve_providers
from .._ort.tolerance import fp32_parity_options
from .._ort.trt import check_generation_profiles
from ..errors import InferenceError, ModelContractError, ModelLoadError, OrtBatchError, map_ort_error
from .cache import KVCache, SlotCache
from .gqa import (
    LAST_INDEX,
    QUERY_LENGTHS,
    SEQLENS_K,
    TOTAL_LENGTH,
    CacheSpec,
    NotRewritable,
    cache_spec,
    onnxruntime_too_old,
)
from .inplace import InPlaceRuns
from .layout import GenerationLayout
from .prefix_cache import PrefixCache
from .rewrites import IN_PLACE_KV, LAST_POSITION_LOGITS, check_in_place, rewrite_decoder
from .scheduler import Placement

log = logging.getLogger("ortbatch")

__all__ = ["KV_CACHE_KINDS", "DecoderRunner", "SessionFactory"]

#: What ``kv_cache=`` takes: ``"auto"`` (in place where the graph and provider allow it),
#: ``"in-place"`` (required: :class:`ModelContractError` otherwise) or ``"concat"`` (never).
KV_CACHE_KINDS = ("auto", "in-place", "concat")

#: Builds the ONNX Runtime session: ``(model path or bytes, providers, session_options=,
#: where=)`` as :func:`ortbatch._ort.build_session` takes them (the default): fallback off,
#: the providers checked, load failures raised as ModelLoadError.
SessionFactory = Callable[..., Any]

_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


def generation_providers(
    providers: str | Sequence[Any] | None,
    manifest_providers: Sequence[Any] = (),
    directory: Path | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The provider chain a decoder runs on: the one resolver's (manifest options, e.g.
    TensorRT profiles and caches, merged per key), with TF32 off on CUDA unless asked for:
    transformers' generate runs fp32 matmuls in fp32 (PyTorch's default), and TF32's
    rounding, which differs with the batch's shape, flips greedy near-ties (measured on an
    H200: docs/generation.md, "On a GPU")."""
    return [
        (name, fp32_parity_options(name, opts))
        for name, opts in resolve_providers(providers, manifest_providers, directory)
    ]


class DecoderRunner:
    """One decoder-with-past session and the batch's KV cache (see :class:`BatchedGenerator`
    for what the arguments mean)."""

    def __init__(
        self,
        directory: Path,
        layout: GenerationLayout,
        *,
        providers: str | Sequence[Any] | None = None,
        session_options: Any = None,
        io_binding: bool | None = None,
        last_position_logits: bool | None = None,
        attention_rewrite: bool = True,
        session_factory: SessionFactory | None = None,
        manifest_providers: Sequence[Any] = (),
        max_batch_size: int = 1,
        kv_cache: str = "auto",
        prefix_cache_bytes: int | None = None,
    ) -> None:
        if kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_KINDS}, got {kv_cache!r}")
        self._dir = directory
        self.layout = layout
        ort = require("onnxruntime")
        model_path = directory / layout.model
        wanted = generation_providers(providers, manifest_providers, directory)
        past_inputs = {name: 2 for name in (*layout.past_keys, *layout.past_values)}
        check_generation_profiles(wanted, past_inputs, layout.max_context_length, max_batch_size)
        # ONNX Runtime's own defaults unless the user gave options (as before the _ort layer)
        options = session_options if session_options is not None else ort.SessionOptions()
        spec = self._in_place_spec(kv_cache, wanted, last_position_logits)
        twin = dict(
            providers=providers,
            session_options=session_options,
            io_binding=io_binding,
            last_position_logits=last_position_logits,
            attention_rewrite=attention_rewrite,
            session_factory=session_factory,
            manifest_providers=manifest_providers,
            max_batch_size=max_batch_size,
            kv_cache="concat",
        )
        make_twin: Callable[[], DecoderRunner] = lambda: DecoderRunner(directory, layout, **twin)  # noqa: E731
        reference = None
        if spec is not None:
            self.kv_cache_reason = check_in_place(model_path, spec)
            if self.kv_cache_reason:
                spec = None
            else:
                # What the in-place graph must compute: the export's own cache's logits on a
                # short run, that runner freed before the in-place one loads (one copy of the
                # weights in memory at a time).
                reference = _Reference(*_test_run(make_twin(), min(2, max_batch_size)))
                gc.collect()
        asked = (last_position_logits, attention_rewrite, spec)
        session = self._load(model_path, wanted, options, asked, session_factory or build_session)
        self.session = session
        if kv_cache == "in-place" and not self.in_place:
            raise ModelContractError(f"{model_path}: kv_cache='in-place' is not possible: {self.kv_cache_reason}")
        self._check_session()
        #: Where present tensors are bound: (device type, device id) of the provider.
        self.device = device_of(self.session)
        #: Runs go through IOBinding, the cache staying where the provider lives.
        self.io_binding = self.device[0] != "cpu" if io_binding is None else io_binding
        self._set_types(model_path)
        self._cache = self.empty_cache()
        self._in_place: InPlaceRuns | None = None
        if self.in_place:
            self._in_place = self._in_place_runs(max_batch_size, prefix_cache_bytes)
            why = self._verify_in_place(reference) if reference is not None else ""
            if why:
                self._become(make_twin(), why, kv_cache == "in-place")
                return
        if not layout.position_ids:
            self._check_positions_follow_the_mask()

    def _become(self, other: DecoderRunner, why: str, required: bool) -> None:
        """Be ``other``, the export's-cache runner built with the same arguments, because the
        in-place cache cannot run (``why``); ``required``: raise instead."""
        if required:
            raise ModelContractError(f"{self._dir}: kv_cache='in-place' is not possible: {why}")
        if self.in_place:
            log.warning("%s: %s; running the export's own KV cache", self._dir, why)
        self.__dict__.update(other.__dict__)
        self.kv_cache_reason = why

    def _verify_in_place(self, reference: _Reference) -> str:
        """How the in-place graph's logits differ from the export's on a short test run
        (``""``: they agree): an attention the pattern matched but whose meaning it missed."""
        try:
            logits, _ = _test_run(self, len(reference.tokens[0]), reference.tokens)
        except OrtBatchError as exc:
            return f"the in-place graph failed a test run: {exc}"
        worst = max(
            float(np.abs(np.asarray(a, np.float64) - b).max()) for a, b in zip(logits, reference.logits, strict=True)
        )
        scale = max(float(np.abs(b).max()) for b in reference.logits)
        tolerance = (1e-3 if self.cache_itemsize >= 4 else 3e-2) * max(1.0, scale)
        if worst <= tolerance:
            return ""
        return f"the in-place graph's logits differ from the export's by up to {worst:.3g} (tolerance {tolerance:.3g})"

    def _in_place_spec(
        self, kv_cache: str, wanted: list[tuple[str, dict[str, Any]]], last_position_logits: bool | None
    ) -> CacheSpec | None:
        """What the in-place rewrite needs, or ``None`` (its reason in :attr:`kv_cache_reason`)."""
        #: Why the cache is the export's own concatenating one (empty on the in-place path).
        self.kv_cache_reason = ""
        if kv_cache == "concat":
            self.kv_cache_reason = "kv_cache='concat' was asked for"
        elif self.layout.kv_cache == "concat":
            self.kv_cache_reason = "the manifest's generation.kv_cache is 'concat'"
        elif last_position_logits is False:
            self.kv_cache_reason = "last_position_logits=False (the in-place graph returns one position per row)"
        elif wanted[0][0] != CPU:
            self.kv_cache_reason = f"the in-place cache runs on the CPU provider only, not {wanted[0][0]}"
        else:
            self.kv_cache_reason = onnxruntime_too_old(require("onnxruntime").__version__)
        if self.kv_cache_reason:
            return None
        try:
            return cache_spec(self.layout, _read_config(self._dir))
        except NotRewritable as exc:
            self.kv_cache_reason = str(exc)
            return None

    def _in_place_runs(self, max_batch_size: int, prefix_cache_bytes: int | None) -> InPlaceRuns:
        lay = self.layout
        token_bytes = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * self.cache_itemsize
        if prefix_cache_bytes is None:  # a few full contexts' worth
            prefix_cache_bytes = 4 * lay.max_context_length * token_bytes
        prefix = None
        if prefix_cache_bytes > 0:
            shape = (2 * lay.num_layers, lay.num_kv_heads, lay.head_dim)
            prefix = PrefixCache(shape, self.cache_dtype, max(prefix_cache_bytes, token_bytes * 16))
        dtypes = (self.cache_dtype, self._ids_dtype, self._pos_dtype)
        names = (self._past_names, self._present_names)
        return InPlaceRuns(self.session, lay, names, dtypes, max_batch_size, prefix)

    def _load(
        self,
        model_path: Path,
        wanted: list[tuple[str, dict[str, Any]]],
        session_options: Any,
        asked: tuple[bool | None, bool, CacheSpec | None],
        factory: SessionFactory,
    ) -> Any:
        """The session, on the rewritten graph when the rewrites apply and it loads; if the
        in-place graph does not load, the other rewrites; if those do not, the export."""
        last_position_logits, attention_rewrite, spec = asked
        self.graph_rewrites: dict[str, int] = {}
        self.graph_rewrites_tried = False  # a rewritten graph was refused by ONNX Runtime
        session = None
        if spec is not None or last_position_logits is not False or attention_rewrite:
            session = self._load_rewritten(model_path, wanted, session_options, asked, factory)
        if session is None and spec is not None and (last_position_logits is not False or attention_rewrite):
            session = self._load_rewritten(model_path, wanted, session_options, (*asked[:2], None), factory)
        if session is None:
            if self.graph_rewrites_tried:
                log.warning("%s: running the export as it is", model_path)
            self.graph_rewrites = {}
            session = factory(model_path, wanted, session_options=session_options, where=model_path)
        #: True when the graph was rewritten to return the last position's logits only.
        self.last_position_logits = LAST_POSITION_LOGITS in self.graph_rewrites
        if last_position_logits and not self.last_position_logits:
            raise ModelContractError(
                f"{model_path}: cannot make the LM head run on the last position only (needs the "
                "onnx package and a MatMul producing the logits)"
            )
        return session

    def _load_rewritten(
        self,
        model_path: Path,
        wanted: list[tuple[str, dict[str, Any]]],
        session_options: Any,
        asked: tuple[bool | None, bool, CacheSpec | None],
        factory: SessionFactory,
    ) -> Any:
        """A session on the graph rewritten as ``asked``; ``None`` when nothing applies, or
        the rewritten graph does not load (a rewrite must never cost a working export)."""
        last_position_logits, attention_rewrite, spec = asked
        rewritten = rewrite_decoder(
            model_path,
            logits=self.layout.logits,
            last_position=last_position_logits is not False,
            attention=attention_rewrite,
            in_place=spec,
        )
        if spec is not None:
            self.kv_cache_reason = rewritten.not_in_place if rewritten else "the graph could not be rewritten"
        if rewritten is None:
            return None
        try:
            session = factory(rewritten.model, wanted, session_options=session_options, where=model_path)
        except ModelLoadError as exc:
            log.warning("%s: the graph rewritten %s did not load: %s", model_path, sorted(rewritten.rewrites), exc)
            self.graph_rewrites_tried = True
            if IN_PLACE_KV in rewritten.rewrites:
                self.kv_cache_reason = f"the in-place graph did not load: {exc}"
            return None
        finally:
            rewritten.close()
        #: The graph rewrites applied (name -> places changed); empty when the export runs as it is.
        self.graph_rewrites = dict(rewritten.rewrites)
        return session

    @property
    def in_place(self) -> bool:
        """True when the cache is written in place (the graph's attention was rewritten)."""
        return IN_PLACE_KV in getattr(self, "graph_rewrites", {})

    @property
    def kv_cache(self) -> str:
        """``"in-place"`` or ``"concat"``: which KV cache runs (see the module docs)."""
        return "in-place" if self.in_place else "concat"

    @property
    def cache(self) -> KVCache | SlotCache:
        """The batch's cache."""
        return self._in_place.cache if self._in_place is not None else self._cache

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (``None`` on the concat path or when turned off)."""
        return self._in_place.prefix if self._in_place is not None else None

    def _set_types(self, model_path: Path) -> None:
        lay = self.layout
        cache_type = self._input_type(lay.past_keys[0])
        if cache_type not in _NP_TYPES:
            raise ModelContractError(
                f"{model_path}: KV cache of type {cache_type} is not supported (numpy has no such dtype); "
                "export in float32 or float16"
            )
        self.cache_dtype = _NP_TYPES[cache_type]
        self.cache_itemsize = np.dtype(self.cache_dtype).itemsize
        self._ids_dtype = _NP_TYPES.get(self._input_type(lay.input_ids), np.int64)
        self._mask_dtype = _NP_TYPES.get(self._input_type(lay.attention_mask), np.int64)
        self._pos_dtype = _NP_TYPES.get(self._input_type(lay.position_ids), np.int64) if lay.position_ids else np.int64
        self._present_names = [n for pair in zip(lay.present_keys, lay.present_values, strict=True) for n in pair]
        self._past_names = [n for pair in zip(lay.past_keys, lay.past_values, strict=True) for n in pair]
        self._output_names = [lay.logits, *self._present_names]

    # -- contract checks -------------------------------------------------------------------
    def _input_type(self, name: str | None) -> str:
        for i in self.session.get_inputs():
            if i.name == name:
                return str(i.type)
        return ""

    def _check_session(self) -> None:
        inputs = {i.name for i in self.session.get_inputs()}
        outputs = {o.name for o in self.session.get_outputs()}
        lay = self.layout
        need_in = {lay.input_ids, *lay.past_keys, *lay.past_values}
        need_in |= {SEQLENS_K, TOTAL_LENGTH, QUERY_LENGTHS, LAST_INDEX} if self.in_place else {lay.attention_mask}
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
        empty = np.zeros((1, lay.num_kv_heads, 0, lay.head_dim), self.cache_dtype)
        cache = KVCache([empty] * len(self._past_names), np.zeros(1, np.int64), 0)
        _, presents = self.forward(tokens[:, :3], np.ones((1, 3), self._mask_dtype), cache)
        cache.advance(presents, new=3)
        cache.host()
        shift = ((0, 0), (0, 0), (5, 0), (0, 0))  # 5 columns of left padding
        moved = KVCache([np.pad(t, shift) for t in cache.tensors], cache.lens, cache.length + 5)
        here, _ = self.forward(tokens[:, 3:], cache.attention_mask(1, self._mask_dtype), cache)
        there, _ = self.forward(tokens[:, 3:], moved.attention_mask(1, self._mask_dtype), moved)
        a, b = np.asarray(here[:, -1], np.float64), np.asarray(there[:, -1], np.float64)
        if not np.abs(a - b).max() <= 1e-2 * max(1.0, float(np.abs(a).max())):
            raise ModelContractError(
                f"{self._dir}: the model has no position_ids input and counts positions from the cache "
                "length instead of the attention mask, so rows that join or leave a running batch would "
                "get wrong positions (moving a row 5 cache columns changed its next logits by up to "
                f"{float(np.abs(a - b).max()):.3g}). Export it with `ortbatch export MODEL --task "
                "text-generation-with-past`, which adds a position_ids input"
            )

    # -- the cache -------------------------------------------------------------------------
    def empty_cache(self) -> KVCache:
        lay = self.layout
        return KVCache.empty(lay.num_layers, lay.num_kv_heads, lay.head_dim, self.cache_dtype)

    def reset_cache(self) -> None:
        """No row is left: drop the batch's cache."""
        if self._in_place is not None:
            self._in_place.reset()
        else:
            self._cache = self.empty_cache()

    def cache_bytes(self) -> int:
        return self.cache.nbytes(self.cache_itemsize)

    def seat(self, plan: Placement, joining: Sequence[Any]) -> float | None:
        """Carry out a :class:`Placement` with the joining rows of ``joining`` (in order);
        returns how long its rebuild (or row moves) took (``None``: none)."""
        if self._in_place is not None:
            return self._in_place.seat(plan, joining)
        if plan.reset:
            self.reset_cache()
            return None
        incoming = [(c, r) for c in joining for r in range(c.rows)]
        for (c, r), slot in zip(incoming, plan.slots, strict=False):
            self._cache.place(slot, c, r)
        if plan.rebuild is None:
            return None
        t0 = time.perf_counter()
        self._cache.rebuild(plan.rebuild, joining if plan.append else ())
        return time.perf_counter() - t0

    # -- model runs ------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, Any]:
        """Run ``prompts``; returns each row's last logits row (``[rows, 1 or longest,
        vocab]``) and the group's own cache (a :class:`~.cache.KVCache`, left-padded, or on
        the in-place path :class:`~.cache.PrefilledRows`, reusing cached prefixes)."""
        if self._in_place is not None:
            return self._in_place.prefill(prompts)
        return self._prefill_concat(prompts)

    def _prefill_concat(self, prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, KVCache]:
        lay = self.layout
        n = len(prompts)
        lens = np.array([p.shape[0] for p in prompts], dtype=np.int64)
        longest = int(lens.max())
        ids = np.full((n, longest), lay.pad_token_id, dtype=self._ids_dtype)
        for i, prompt in enumerate(prompts):
            ids[i, longest - lens[i] :] = prompt
        empty = (n, lay.num_kv_heads, 0, lay.head_dim)
        cache = KVCache([np.zeros(empty, self.cache_dtype) for _ in self._past_names], np.zeros(n, np.int64), 0)
        # Prefill is a step that appends `longest` columns to an empty cache; the rows'
        # left padding is then exactly the all-zero start of their mask.
        mask = (np.arange(longest)[None, :] >= (longest - lens)[:, None]).astype(self._mask_dtype)
        logits, presents = self.forward(ids, mask, cache)
        cache.advance(presents, new=longest)
        cache.lens = lens  # each row's real length; its padding is the start of the cache
        return logits, cache

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        """One decode step of the batch's cache, one token per row; returns the logits."""
        if self._in_place is not None:
            return self._in_place.decode(tokens)
        ids = np.array([[t] for t in tokens], dtype=self._ids_dtype)
        mask = self._cache.attention_mask(1, self._mask_dtype)
        logits, presents = self.forward(ids, mask, self._cache)
        self._cache.advance(presents, new=1)
        return logits

    def forward(self, ids: np.ndarray, mask: np.ndarray, cache: KVCache) -> tuple[np.ndarray, list[Any]]:
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
            if self.io_binding:
                logits, presents = self._run_bound(feed, cache)
            else:
                feed.update(zip(self._past_names, cache.tensors, strict=True))
                outs = self.session.run(self._output_names, feed)
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
        device, device_id = self.device
        binding = self.session.io_binding()
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
        self.session.run_with_iobinding(binding)
        outs = binding.get_outputs()
        return outs[0].numpy(), list(outs[1:])


@dataclass(frozen=True)
class _Reference:
    """The export's own cache's logits and the tokens fed on :func:`_test_run`."""

    logits: list[np.ndarray]
    tokens: list[list[int]]


def _test_run(
    runner: DecoderRunner, rows: int, tokens: list[list[int]] | None = None
) -> tuple[list[np.ndarray], list[list[int]]]:
    """``rows`` (1 or 2) prompts prefilled, then two decode steps (of ``tokens``, else of the
    argmax): each run's last-position logits, and the tokens fed."""
    vocab = max(16, runner.layout.vocab_size)
    lengths = ((2, 9, 11, 13, 4, 6), (3, 5, 7))[:rows]
    prompts = [np.array([vocab // d for d in ds], np.int64) for ds in lengths]
    prefix = runner.prefix_cache
    if runner._in_place is not None:
        runner._in_place.prefix = None  # the test run is no prompt to remember
    fed: list[list[int]] = []
    try:
        logits, joining = runner.prefill(prompts)
        if runner.in_place:
            runner.seat(Placement(slots=list(range(len(prompts))), rows=len(prompts), capacity=16), [joining])
        else:
            runner.seat(Placement(rebuild=[], append=True), [joining])
        out = [np.asarray(logits[:, -1], np.float64)]
        for step in range(2):
            fed.append(tokens[step] if tokens is not None else [int(t) for t in out[-1].argmax(-1)])
            out.append(np.asarray(runner.decode(fed[-1])[:, -1], np.float64))
    finally:
        if runner._in_place is not None:
            runner._in_place.prefix = prefix
        runner.reset_cache()
    return out, fed


def _read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of the export (empty when absent or unreadable: the graph decides)."""
    try:
        data = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
