"""Running an export's ONNX sessions for the checks: sessions per component on one
provider (built by ``ortbatch._ort``, on its provider chain), and feeds per family."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..._extras import require
from ..._ort import (
    CPU,
    TRT,
    ProviderChain,
    build_session,
    fallback_names,
    fp32_parity_options,
    probe_providers,
    resolve_providers,
)
from ..._ort.trt import resolve_cache_paths
from ...errors import ProviderError
from ...manifest import Manifest

__all__ = ["OnnxModel", "chain_for", "component_files", "open_sessions", "positions", "vocab_size"]


class OnnxModel:
    """The ONNX sessions of one export on one provider, with feed builders per family."""

    def __init__(self, manifest: Manifest, sessions: dict[str, Any], tokenizer: Any) -> None:
        self.m = manifest
        self.sessions = sessions
        self.family = str(manifest.source.get("family", "encoder"))
        self.side = manifest.padding_side
        self.pads = manifest.pad_values
        comps = manifest.extra.get("components") or {}
        self.component_io = {k: v for k, v in comps.items()} if comps else {}
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        self.start_id = _decoder_start(manifest)

    # generic ------------------------------------------------------------------------
    def run(self, component: str, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.sessions[component]
        names = [i.name for i in sess.get_inputs()]
        missing = [n for n in names if n not in feed]
        if missing:
            raise KeyError(f"no value for input(s) {missing}")
        outs = sess.run(None, {n: feed[n] for n in names})
        return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=False)}

    def inputs(self, component: str) -> list[Any]:
        return list(self.sessions[component].get_inputs())

    def output_axes(self, component: str) -> dict[str, list[str | None]]:
        if component in self.component_io:
            return {k: v["axes"] for k, v in self.component_io[component]["outputs"].items()}
        return {k: list(v.axes) for k, v in self.m.outputs.items()}

    # feeds -------------------------------------------------------------------------
    def pad_rows(self, rows: Sequence[Sequence[int]], side: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        side = side or self.side
        n = max(len(r) for r in rows)
        ids = np.full((len(rows), n), self.pads.get("input_ids", self.pad_id), dtype=np.int64)
        mask = np.zeros((len(rows), n), dtype=np.int64)
        for i, r in enumerate(rows):
            if side == "left":
                ids[i, n - len(r) :] = r
                mask[i, n - len(r) :] = 1
            else:
                ids[i, : len(r)] = r
                mask[i, : len(r)] = 1
        return ids, mask

    def feed(self, component: str, ids: np.ndarray, mask: np.ndarray, **extra: np.ndarray) -> dict[str, np.ndarray]:
        """Inputs for ``component``: ids/mask plus zeros for token types, positions from the
        mask, empty past key values, and whatever ``extra`` supplies."""
        feed: dict[str, np.ndarray] = {}
        for arg in self.inputs(component):
            name = arg.name
            if name in extra:
                feed[name] = extra[name]
            elif name == "input_ids":
                feed[name] = ids
            elif name in ("attention_mask", "encoder_attention_mask"):
                feed[name] = mask
            elif name == "token_type_ids":
                feed[name] = np.zeros_like(ids)
            elif name == "position_ids":
                feed[name] = positions(mask)
            elif name == "prompt_length":  # the embedding pipeline's: no prompt in the samples
                feed[name] = np.zeros(ids.shape[0], dtype=np.int64)
            elif name.startswith("past_key_values"):
                shape = [ids.shape[0]] + [d if isinstance(d, int) else 0 for d in arg.shape[1:]]
                feed[name] = np.zeros(shape, dtype=_np_dtype(arg.type))
            else:
                raise KeyError(f"the checks do not know how to fill input {name!r} of {component}")
        return feed

    # greedy generation ----------------------------------------------------------------
    def greedy(self, rows: Sequence[Sequence[int]], new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Greedy continuation of all rows at once, batched (left padding for decoders).
        Returns the tokens (rows, steps) and each step's two best logits (rows, steps, 2)."""
        if self.family == "seq2seq":
            return self._greedy_seq2seq(rows, new_tokens)
        ids, mask = self.pad_rows(rows, "left")
        has_past = any(i.name.startswith("past_key_values") for i in self.inputs("model"))
        out, tops = [], []
        feed = self.feed("model", ids, mask)
        seq = ids
        for _ in range(new_tokens):
            res = self.run("model", feed)
            nxt = res["logits"][:, -1].argmax(axis=-1).astype(np.int64)
            out.append(nxt)
            tops.append(_top2(res["logits"][:, -1]))
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            if has_past:
                past = {k.replace("present", "past_key_values"): v for k, v in res.items() if k.startswith("present")}
                feed = self.feed("model", nxt[:, None], mask, position_ids=positions(mask)[:, -1:], **past)
            else:
                seq = np.concatenate([seq, nxt[:, None]], axis=1)
                feed = self.feed("model", seq, mask)
        return np.stack(out, axis=1), np.stack(tops, axis=1)

    def _greedy_seq2seq(self, rows: Sequence[Sequence[int]], new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = self.pad_rows(rows, "right")
        enc = self.run("encoder", self.feed("encoder", ids, mask))["last_hidden_state"]
        b = len(rows)
        dec = np.full((b, 1), self.start_id, dtype=np.int64)
        res = self.run("decoder", self.feed("decoder", dec, mask, encoder_hidden_states=enc))
        out, tops = [], []
        enc_past = {
            k.replace("present", "past_key_values"): v
            for k, v in res.items()
            if k.startswith("present") and ".encoder." in k
        }
        for step in range(new_tokens):
            nxt = res["logits"][:, -1].argmax(axis=-1).astype(np.int64)
            out.append(nxt)
            tops.append(_top2(res["logits"][:, -1]))
            if step == new_tokens - 1:
                break
            past = {
                k.replace("present", "past_key_values"): v
                for k, v in res.items()
                if k.startswith("present") and ".decoder." in k
            }
            res = self.run(
                "decoder_with_past",
                self.feed("decoder_with_past", nxt[:, None], mask, encoder_hidden_states=enc, **past, **enc_past),
            )
        return np.stack(out, axis=1), np.stack(tops, axis=1)


def _top2(logits: np.ndarray) -> np.ndarray:
    """(rows, vocab) -> (rows, 2): the best and second-best logit of each row."""
    return np.sort(logits.astype(np.float64), axis=-1)[:, -2:][:, ::-1]


def positions(mask: np.ndarray) -> np.ndarray:
    pos = np.cumsum(mask, axis=1) - 1
    return np.where(mask > 0, pos, 0).astype(np.int64)


def _np_dtype(ort_type: str) -> Any:
    return {
        "tensor(float)": np.float32,
        "tensor(float16)": np.float16,
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(bool)": np.bool_,
        "tensor(double)": np.float64,
    }.get(ort_type, np.float32)


def _decoder_start(manifest: Manifest) -> int:
    cfg_path = (manifest.directory or Path(".")) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    for key in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    return 0


def vocab_size(manifest: Manifest, tokenizer: Any) -> int:
    n = len(tokenizer)
    try:
        cfg = json.loads(((manifest.directory or Path(".")) / "config.json").read_text(encoding="utf-8"))
        if isinstance(cfg.get("vocab_size"), int):
            n = min(n, cfg["vocab_size"])
    except (OSError, ValueError):
        pass
    return n


# -- sessions and providers ----------------------------------------------------------------


def component_files(manifest: Manifest) -> dict[str, str]:
    comps = manifest.extra.get("components") or {}
    if comps:
        return {k: v["model"] for k, v in comps.items()}
    return {"model": manifest.model}


def chain_for(provider: str, manifest: Manifest, component: str, dtype: str) -> ProviderChain:
    """The chain a check session on ``provider`` gets: ``provider`` and its fallbacks from
    the one table in ``_ort`` (TensorRT hands what it cannot build to CUDA, as ONNX Runtime
    recommends, then CPU), each with the manifest's options merged per key by the one
    resolver (cache paths under the export directory); for TensorRT, the component's own
    profiles when the export wrote them (an encoder-decoder's encoder and decoder take
    different inputs)."""
    ort = require("onnxruntime")
    available = ort.get_available_providers()
    names = [n for n in fallback_names(provider) if n in (provider, CPU) or n in available]
    base = manifest.directory or Path(".")
    chain = resolve_providers(names, manifest.providers, base)
    comp = (manifest.extra.get("components") or {}).get(component) or {}
    if comp.get("tensorrt"):
        chain = [(n, {**o, **resolve_cache_paths(comp["tensorrt"], base)} if n == TRT else o) for n, o in chain]
    if dtype == "fp32":  # check fp32 parity in fp32: TF32 off where the provider has the switch
        chain = [(n, fp32_parity_options(n, o)) for n, o in chain]
    return chain


def not_here(provider: str) -> str | None:
    """Why ``provider`` cannot run on this machine at all (not in this onnxruntime build, or
    a tiny probe session asking for it does not get it), or None when it starts here. A
    provider that starts but fails on this export is a failure of the export, not this."""
    if provider == CPU:
        return None
    ort = require("onnxruntime")
    available = ort.get_available_providers()
    if provider not in available:
        return f"{provider} is not in this onnxruntime build (available: {available})"
    chain = tuple(n for n in fallback_names(provider) if n in (provider, CPU) or n in available)
    active, error = probe_providers(chain)
    if provider not in active:
        return f"{provider} is not active here; a session asking for it runs on {list(active)}" + (
            f" ({error})" if error else ""
        )
    return None


def open_sessions(
    manifest: Manifest, provider: str, dtype: str = "fp32"
) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
    """Sessions for every component on ``provider`` (CPU as the fallback ORT requires),
    the options ``provider`` got, or (None, why the provider is not really in use, {})."""
    ort = require("onnxruntime")
    available = ort.get_available_providers()
    if provider not in available:
        return (
            None,
            f"{provider} is not available in this onnxruntime build (available: {available}); "
            "install onnxruntime-gpu with matching CUDA/TensorRT libraries",
            {},
        )
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sessions = {}
    used: dict[str, Any] = {}
    for comp, fname in component_files(manifest).items():
        chain = chain_for(provider, manifest, comp, dtype)
        used = used or chain[0][1]
        try:
            # build_session turns fallback off and refuses a session that is not on `provider`
            sessions[comp] = build_session((manifest.directory or Path(".")) / fname, chain, session_options=so)
        except ProviderError as exc:
            return None, f"requested {provider}, which is not active: {exc}", {}
    return sessions, "", used
