"""The generation contract of a decoder export: cache layout, special ids, limits.

:func:`generation_section` inspects an export directory (``model.onnx`` plus the
``config.json`` / ``generation_config.json`` / tokenizer files that optimum writes
beside it) and returns the plain dict the exporter stores as ``manifest.generation``::

    {"format": 1, "model": "model.onnx", "model_type": "gpt2",
     "input_ids": "input_ids", "attention_mask": "attention_mask",
     "position_ids": "position_ids", "logits": "logits",
     "past_keys": ["past_key_values.0.key", ...], "past_values": [...],
     "present_keys": ["present.0.key", ...], "present_values": [...],
     "num_layers": 12, "num_kv_heads": 12, "head_dim": 64, "cache_dtype": "float32",
     "vocab_size": 50257, "eos_token_ids": [50256], "pad_token_id": 50256,
     "bos_token_id": 50256, "max_context_length": 1024,
     "padding_side": "left", "tokenizer": "tokenizer.json", "kv_cache": "in-place"}

``kv_cache`` says which KV cache the graph allows: ``"in-place"`` when its attention matches
the rewrite into a preallocated cache (:mod:`.gqa`; the generator then runs it so on the CPU
provider, once its logits are checked against the export's at load), ``"concat"`` when only the
export's own concatenating cache can run (also a way to keep the generator off the in-place
path), ``None`` when it was not checked.

:class:`GenerationLayout` is the parsed, checked form the generator runs on. Only the
standard library (plus onnx or onnxruntime to read the graph's inputs) is used.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError, ModelContractError
from ..manifest import MANIFEST_NAME, Manifest

__all__ = [
    "LAYOUT_FORMAT",
    "GenerationLayout",
    "generation_section",
    "layout_from_io",
    "load_layout",
    "read_io",
    "read_json",
    "token_text",
]

LAYOUT_FORMAT = 1

# ONNX tensor element types (TensorProto.DataType) and ORT type strings -> numpy names.
_ONNX_ELEM = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16", 7: "int64", 6: "int32"}
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
}
# optimum names the cache "past_key_values.{i}.key" / "present.{i}.key"; older exports
# and some other tools use "past.{i}.key" or "past_key_values.{i}.decoder.key".
_PAST_RE = re.compile(r"^past(?:_key_values)?\.(\d+)\.(?:decoder\.)?(key|value)$")
_PRESENT_RE = re.compile(r"^present(?:s)?\.(\d+)\.(?:decoder\.)?(key|value)$")
# config.json keys that bound the context, in the order transformers' configs use them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


# A graph I/O described independently of onnx/onnxruntime: (name, dtype, shape).
IOSpec = tuple[str, str, Sequence[int | str | None]]


@dataclass(frozen=True)
class GenerationLayout:
    """Everything the generator needs to know about a decoder-with-past export."""

    input_ids: str
    attention_mask: str
    position_ids: str | None
    logits: str
    past_keys: tuple[str, ...]
    past_values: tuple[str, ...]
    present_keys: tuple[str, ...]
    present_values: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    cache_dtype: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    max_context_length: int
    bos_token_id: int | None = None
    model_type: str | None = None
    tokenizer: str | None = None
    model: str = "model.onnx"
    padding_side: str = "left"
    kv_cache: str | None = None

    @property
    def num_layers(self) -> int:
        return len(self.past_keys)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "generation") -> GenerationLayout:
        """Parse (and check) a ``generation`` section; :class:`ManifestError` if malformed."""

        def get(key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
            value = data.get(key)
            if value is None and optional:
                return None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ManifestError(f"{where}.{key}: expected {_kind_name(kind)}, got {value!r}")
            return value

        def names(key: str) -> tuple[str, ...]:
            value = get(key, list)
            if not all(isinstance(v, str) and v for v in value):
                raise ManifestError(f"{where}.{key}: expected a list of tensor names, got {value!r}")
            return tuple(value)

        fmt = data.get("format", LAYOUT_FORMAT)
        if not isinstance(fmt, int) or fmt > LAYOUT_FORMAT:
            raise ManifestError(f"{where}.format {fmt!r} is newer than this ortbatch understands")
        side = data.get("padding_side", "left")
        if side != "left":
            raise ManifestError(f"{where}.padding_side must be 'left' for generation, got {side!r}")
        kv_cache = data.get("kv_cache")
        if kv_cache not in (None, "in-place", "concat"):
            raise ManifestError(f"{where}.kv_cache must be 'in-place' or 'concat', got {kv_cache!r}")
        eos = data.get("eos_token_ids", [])
        if not isinstance(eos, list) or not all(isinstance(e, int) for e in eos):
            raise ManifestError(f"{where}.eos_token_ids: expected a list of ints, got {eos!r}")
        layout = cls(
            input_ids=get("input_ids", str),
            attention_mask=get("attention_mask", str),
            position_ids=get("position_ids", str, optional=True),
            logits=get("logits", str),
            past_keys=names("past_keys"),
            past_values=names("past_values"),
            present_keys=names("present_keys"),
            present_values=names("present_values"),
            num_kv_heads=get("num_kv_heads", int),
            head_dim=get("head_dim", int),
            cache_dtype=get("cache_dtype", str),
            vocab_size=get("vocab_size", int),
            eos_token_ids=tuple(eos),
            pad_token_id=get("pad_token_id", int),
            max_context_length=get("max_context_length", int),
            bos_token_id=get("bos_token_id", int, optional=True),
            model_type=get("model_type", str, optional=True),
            tokenizer=get("tokenizer", str, optional=True),
            model=data.get("model") or "model.onnx",
            kv_cache=kv_cache,
        )
        n = layout.num_layers
        if n == 0 or any(len(x) != n for x in (layout.past_values, layout.present_keys, layout.present_values)):
            raise ManifestError(f"{where}: past/present key/value lists must be non-empty and equal in length")
        return layout

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LAYOUT_FORMAT,
            "model": self.model,
            "model_type": self.model_type,
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "logits": self.logits,
            "past_keys": list(self.past_keys),
            "past_values": list(self.past_values),
            "present_keys": list(self.present_keys),
            "present_values": list(self.present_values),
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "cache_dtype": self.cache_dtype,
            "vocab_size": self.vocab_size,
            "eos_token_ids": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "max_context_length": self.max_context_length,
            "padding_side": self.padding_side,
            "tokenizer": self.tokenizer,
            "kv_cache": self.kv_cache,
        }


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def generation_section(
    export_dir: str | Path,
    model: str = "model.onnx",
    *,
    max_context_length: int | None = None,
    check_kv_cache: bool = True,
) -> dict[str, Any]:
    """Inspect a decoder-with-past export directory and return its ``generation`` section.

    Reads the graph's inputs/outputs (with ``onnx`` when installed, weights not loaded;
    otherwise with onnxruntime), ``config.json``, ``generation_config.json`` and the
    tokenizer files. Raises :class:`ModelContractError` when the graph is not a
    decoder with a KV cache (``--task text-generation-with-past``).
    ``max_context_length`` replaces the context length ``config.json`` gives (or lacks).
    ``check_kv_cache``: find out whether the graph allows the in-place KV cache
    (``kv_cache``; needs ``onnx``, and reads the graph once more).
    """
    d = Path(export_dir)
    path = d / model
    if not path.is_file():
        raise ModelContractError(f"{path}: no such model file in the export directory")
    inputs, outputs = read_io(path)
    config = read_json(d / "config.json")
    gen_config = read_json(d / "generation_config.json")
    tok_config = read_json(d / "tokenizer_config.json")
    tokenizer = "tokenizer.json" if (d / "tokenizer.json").is_file() else None
    layout = layout_from_io(
        inputs,
        outputs,
        config=config,
        generation_config=gen_config,
        tokenizer_config=tok_config,
        tokenizer_json=read_json(d / tokenizer) if tokenizer else {},
        where=str(path),
        max_context_length=max_context_length,
    )
    data = layout.to_dict()
    data["model"] = model
    data["tokenizer"] = tokenizer
    if check_kv_cache:
        data["kv_cache"] = _kv_cache(path, layout, config)
    return data


def _kv_cache(path: Path, layout: GenerationLayout, config: Mapping[str, Any]) -> str | None:
    """``"in-place"`` when the graph's attention matches the in-place KV cache rewrite, else
    ``"concat"``; ``None`` without ``onnx`` (the rewrite needs it)."""
    from .gqa import NotRewritable, cache_spec
    from .rewrites import check_in_place

    try:
        import onnx  # noqa: F401
    except ImportError:
        return None
    try:
        return "concat" if check_in_place(path, cache_spec(layout, config)) else "in-place"
    except NotRewritable:
        return "concat"


def layout_from_io(
    inputs: Sequence[IOSpec],
    outputs: Sequence[IOSpec],
    *,
    config: Mapping[str, Any] | None = None,
    generation_config: Mapping[str, Any] | None = None,
    tokenizer_config: Mapping[str, Any] | None = None,
    tokenizer_json: Mapping[str, Any] | None = None,
    where: str = "model",
    max_context_length: int | None = None,
) -> GenerationLayout:
    """Build a :class:`GenerationLayout` from graph I/O specs and the HF config files;
    ``max_context_length``, when given, replaces the config's context length."""
    config = config or {}
    generation_config = generation_config or {}
    in_by_name = {name: (dtype, list(shape)) for name, dtype, shape in inputs}
    out_by_name = {name: (dtype, list(shape)) for name, dtype, shape in outputs}

    _check_decoder_io(in_by_name, out_by_name, where)
    past, present, layers = _cache_layers(in_by_name, out_by_name, where)
    cache_dtype, heads, head_dim = _cache_shape(in_by_name, past, layers, config, where)
    vocab = out_by_name["logits"][1][-1]
    if not isinstance(vocab, int):
        vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ModelContractError(f"{where}: cannot tell the vocabulary size from logits or config.json")

    eos, bos, pad = _special_ids(config, generation_config, tokenizer_config, tokenizer_json)
    context = _context_length(config, max_context_length, where)

    return GenerationLayout(
        input_ids="input_ids",
        attention_mask="attention_mask",
        position_ids="position_ids" if "position_ids" in in_by_name else None,
        logits="logits",
        past_keys=tuple(past[i]["key"] for i in layers),
        past_values=tuple(past[i]["value"] for i in layers),
        present_keys=tuple(present[i]["key"] for i in layers),
        present_values=tuple(present[i]["value"] for i in layers),
        num_kv_heads=int(heads),
        head_dim=int(head_dim),
        cache_dtype=cache_dtype,
        vocab_size=int(vocab),
        eos_token_ids=tuple(eos),
        pad_token_id=int(pad),
        max_context_length=int(context),
        bos_token_id=bos,
        model_type=config.get("model_type"),
    )


def _check_decoder_io(in_by_name: Mapping[str, Any], out_by_name: Mapping[str, Any], where: str) -> None:
    for required in ("input_ids", "attention_mask"):
        if required not in in_by_name:
            raise ModelContractError(
                f"{where}: no {required!r} input; a decoder export with inputs input_ids, "
                f"attention_mask, position_ids and past_key_values.N.key/value is needed "
                f"(export with --task text-generation-with-past). Inputs: {sorted(in_by_name)}"
            )
    if "logits" not in out_by_name:
        raise ModelContractError(
            f"{where}: no 'logits' output (outputs are {sorted(out_by_name)}); a decoder export "
            "is needed (--task text-generation-with-past)"
        )


def _cache_layers(
    in_by_name: Mapping[str, Any], out_by_name: Mapping[str, Any], where: str
) -> tuple[dict[int, dict[str, str]], dict[int, dict[str, str]], list[int]]:
    """The past and present tensor names by layer and kind, and the layer indices."""
    past = _indexed(in_by_name, _PAST_RE)
    present = _indexed(out_by_name, _PRESENT_RE)
    if not past or not present:
        raise ModelContractError(
            f"{where}: the graph has no KV-cache inputs/outputs (past_key_values.N.key / present.N.key); "
            "export with --task text-generation-with-past (not text-generation)"
        )
    if sorted(past) != list(range(len(past))) or sorted(present) != sorted(past):
        raise ModelContractError(
            f"{where}: cache layers do not line up: past layers {sorted(past)}, present layers {sorted(present)}"
        )
    layers = sorted(past)
    for i in layers:
        if set(past[i]) != {"key", "value"} or set(present[i]) != {"key", "value"}:
            raise ModelContractError(f"{where}: layer {i} lacks a key or value cache tensor")
    return past, present, layers


def _cache_shape(
    in_by_name: Mapping[str, Any],
    past: Mapping[int, Mapping[str, str]],
    layers: list[int],
    config: Mapping[str, Any],
    where: str,
) -> tuple[str, int, int]:
    """The cache's dtype, kv heads and head dim (the same for every layer)."""
    key0 = in_by_name[past[0]["key"]]
    cache_dtype, shape = key0
    if len(shape) != 4:
        raise ModelContractError(
            f"{where}: {past[0]['key']} has rank {len(shape)}; expected [batch, kv_heads, past_sequence, head_dim]"
        )
    heads, head_dim = shape[1], shape[3]
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        heads = heads if isinstance(heads, int) else _config_kv_heads(config)
        head_dim = head_dim if isinstance(head_dim, int) else _config_head_dim(config, heads)
    if not heads or not head_dim:
        raise ModelContractError(f"{where}: cannot tell the cache's kv heads / head dim from {shape}")
    for i in layers:
        for kind in ("key", "value"):
            dt, shp = in_by_name[past[i][kind]]
            if dt != cache_dtype or len(shp) != 4:
                raise ModelContractError(
                    f"{where}: {past[i][kind]} is {dt}{shp}; expected the same layout as {past[0]['key']}"
                )
    return cache_dtype, int(heads), int(head_dim)


def _special_ids(
    config: Mapping[str, Any],
    generation_config: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any] | None,
    tokenizer_json: Mapping[str, Any] | None,
) -> tuple[list[int], int | None, int]:
    """eos ids, bos id and pad id, from generation_config.json, config.json or the tokenizer."""
    eos = _ids(generation_config.get("eos_token_id"))
    if not eos:
        eos = _ids(config.get("eos_token_id"))
    if not eos and tokenizer_config and tokenizer_json:
        token = token_text(tokenizer_config.get("eos_token"))
        eos = _ids(_token_id(tokenizer_json, token)) if token else []
    bos = _first(_ids(generation_config.get("bos_token_id")) or _ids(config.get("bos_token_id")))
    pad = _first(_ids(generation_config.get("pad_token_id")) or _ids(config.get("pad_token_id")))
    if pad is None:
        # The pad id never reaches the model unmasked; any valid id will do.
        pad = eos[0] if eos else 0
    return eos, bos, pad


def _context_length(config: Mapping[str, Any], max_context_length: int | None, where: str) -> int:
    context = max_context_length
    for key in _CONTEXT_KEYS if context is None else ():
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            context = value
            break
    if context is None:
        raise ModelContractError(
            f"{where}: config.json does not say the model's context length ({' / '.join(_CONTEXT_KEYS)}); "
            "give it as max_context_length (--max-context-length on the command line)"
        )
    return int(context)


def _indexed(by_name: Mapping[str, Any], pattern: re.Pattern[str]) -> dict[int, dict[str, str]]:
    found: dict[int, dict[str, str]] = {}
    for name in by_name:
        m = pattern.match(name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = name
    return found


def _config_kv_heads(config: Mapping[str, Any]) -> int | None:
    for key in ("num_key_value_heads", "num_attention_heads", "n_head"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def _config_head_dim(config: Mapping[str, Any], heads: int | None) -> int | None:
    if isinstance(config.get("head_dim"), int):
        return int(config["head_dim"])
    hidden = config.get("hidden_size", config.get("n_embd"))
    attn = config.get("num_attention_heads", config.get("n_head"))
    if isinstance(hidden, int) and isinstance(attn, int) and attn:
        return hidden // attn
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _first(values: list[int]) -> int | None:
    return values[0] if values else None


def token_text(value: Any) -> str | None:
    """A special token's text from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _token_id(tokenizer_json: Mapping[str, Any], token: str) -> int | None:
    for added in tokenizer_json.get("added_tokens", []) or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return int(added["id"])
    vocab = (tokenizer_json.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
        return int(vocab[token])
    return None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of an export ({} when absent or not an object; unreadable JSON is a
    ModelContractError naming the file)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelContractError(f"{path}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def read_io(path: Path) -> tuple[list[IOSpec], list[IOSpec]]:
    """The graph's inputs and outputs as (name, dtype, shape), without running it."""
    try:
        import onnx
    except ImportError:  # the runtime needs only onnxruntime: read the graph with it
        return _read_io_ort(path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # truncated/corrupt: the same typed error as a session build gives
        from .._ort import load_error

        raise load_error(exc, path) from exc

    def spec(value_info: Any) -> IOSpec:
        t = value_info.type.tensor_type
        dims: list[int | str | None] = []
        for dim in t.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(int(dim.dim_value))
            else:
                dims.append(dim.dim_param or None)
        return value_info.name, _ONNX_ELEM.get(t.elem_type, f"onnx:{t.elem_type}"), dims

    inits = {i.name for i in proto.graph.initializer}
    ins = [spec(v) for v in proto.graph.input if v.name not in inits]
    return ins, [spec(v) for v in proto.graph.output]


def _read_io_ort(path: Path) -> tuple[list[IOSpec], list[IOSpec]]:
    from .._ort import plain_session

    sess = plain_session(path)
    return (
        [(i.name, _ORT_TYPES.get(i.type, i.type), list(i.shape)) for i in sess.get_inputs()],
        [(o.name, _ORT_TYPES.get(o.type, o.type), list(o.shape)) for o in sess.get_outputs()],
    )


def load_layout(directory: Path, max_context_length: int | None = None) -> tuple[GenerationLayout, Manifest | None]:
    """The generation layout of an export directory (from the manifest's ``generation``
    section, else read from the export), with ``max_context_length`` in place of the
    export's when given and the manifest's ``limits.max_sequence_length`` (e.g. TensorRT
    profile shapes) capping it; and the manifest, if there is one."""
    if not directory.is_dir():
        raise ModelContractError(f"{directory}: not an export directory")
    model = "model.onnx"
    manifest = None
    layout = None
    if (directory / MANIFEST_NAME).is_file():
        manifest = Manifest.load(directory).verify()
        model = manifest.model
        if manifest.generation:
            section = dict(manifest.generation)
            section.setdefault("model", model)
            if max_context_length is not None:
                section["max_context_length"] = max_context_length
            layout = GenerationLayout.from_dict(section, where=f"{directory / MANIFEST_NAME}: generation")
    if layout is None:
        try:
            section = generation_section(directory, model, max_context_length=max_context_length, check_kv_cache=False)
            layout = GenerationLayout.from_dict(section)
        except ManifestError as exc:  # our own inference produced it: a model problem
            raise ModelContractError(str(exc)) from exc
    if manifest is not None and manifest.max_sequence_length:
        context = min(layout.max_context_length, manifest.max_sequence_length)
        layout = dataclasses.replace(layout, max_context_length=context)
    return layout, manifest
