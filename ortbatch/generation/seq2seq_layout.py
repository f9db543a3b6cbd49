"""What the encoder-decoder engine must know of an export: the manifest's ``generation`` section
of a ``text2text-generation-with-past`` export.

Written by the exporter (:func:`seq2seq_section`), read by :class:`~.seq2seq.Seq2SeqGenerator`
(:func:`load_seq2seq_layout`; an export without the section, e.g. optimum's own, is read the same
way from its files). It records:

- the three graphs (``encoder``, ``decoder``: the first step, which also returns every layer's
  cross-attention keys and values ``present.{i}.encoder.*``; ``decoder_with_past``: each later
  step) and the encoder's inputs (``input_ids`` + ``attention_mask`` for text; a speech model's
  ``input_features`` goes in the same place);
- the cache: per layer the self-attention past names (``past_key_values.{i}.decoder.key/value``,
  grown by the graph by one position per step: ``self_attention: "concat"``) and the
  cross-attention ones (``past_key_values.{i}.encoder.key/value``, computed once per row and fed
  unchanged: ``cross_attention: "kept"``), heads and head size;
- the tokens: ``decoder_start_token_id``, eos ids, pad id, vocabulary size; the longest source
  and target;
- ``languages``: for a multilingual tokenizer (NLLB, M2M100, mBART), the language codes, their
  token ids and where the source language token goes (``prefix`` or ``suffix``), so a request's
  ``src_lang`` / ``tgt_lang`` need no tokenizer state and no transformers at serve time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelContractError
from ..manifest import MANIFEST_NAME, Manifest
from .layout import read_io, read_json

__all__ = ["Languages", "Seq2SeqLayout", "load_seq2seq_layout", "seq2seq_section"]

_PAST = re.compile(r"^past_key_values\.(\d+)\.(decoder|encoder)\.(key|value)$")
_FILES = {
    "encoder": "encoder_model.onnx",
    "decoder": "decoder_model.onnx",
    "decoder_with_past": "decoder_with_past_model.onnx",
}


@dataclass(frozen=True)
class Languages:
    """A multilingual tokenizer's language codes (code -> token id) and where the source
    language's token goes: ``"prefix"`` (``[lang] text </s>``: NLLB, M2M100, mBART-50) or
    ``"suffix"`` (``text </s> [lang]``: mBART-cc25, NLLB's legacy behaviour)."""

    codes: Mapping[str, int]
    source_position: str = "prefix"
    default_source: str | None = None
    default_target: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "codes": dict(self.codes),
            "source_position": self.source_position,
            "default_source": self.default_source,
            "default_target": self.default_target,
        }


@dataclass(frozen=True)
class Seq2SeqLayout:
    """The facts of one encoder-decoder export (see the module docstring)."""

    num_layers: int
    num_heads: int
    head_dim: int
    vocab_size: int
    decoder_start_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    encoder_inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    files: Mapping[str, str] = field(default_factory=lambda: dict(_FILES))
    max_source_length: int | None = None
    max_target_length: int | None = None
    tokenizer: str | None = "tokenizer.json"
    languages: Languages | None = None
    kv_dtype: str = "float32"

    def self_past(self, i: int) -> tuple[str, str]:
        return f"past_key_values.{i}.decoder.key", f"past_key_values.{i}.decoder.value"

    def cross_past(self, i: int) -> tuple[str, str]:
        return f"past_key_values.{i}.encoder.key", f"past_key_values.{i}.encoder.value"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "seq2seq",
            "files": dict(self.files),
            "encoder_inputs": list(self.encoder_inputs),
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "kv_dtype": self.kv_dtype,
            "self_attention": "concat",
            "cross_attention": "kept",
            "past_names": {
                "self": [list(self.self_past(i)) for i in range(self.num_layers)],
                "cross": [list(self.cross_past(i)) for i in range(self.num_layers)],
            },
            "vocab_size": self.vocab_size,
            "decoder_start_token_id": self.decoder_start_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "max_source_length": self.max_source_length,
            "max_target_length": self.max_target_length,
            "tokenizer": self.tokenizer,
            "languages": self.languages.to_dict() if self.languages is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "generation") -> Seq2SeqLayout:
        try:
            langs = d.get("languages")
            return cls(
                num_layers=int(d["num_layers"]),
                num_heads=int(d["num_heads"]),
                head_dim=int(d["head_dim"]),
                vocab_size=int(d["vocab_size"]),
                decoder_start_token_id=int(d["decoder_start_token_id"]),
                eos_token_ids=tuple(int(i) for i in d["eos_token_ids"]),
                pad_token_id=int(d["pad_token_id"]),
                encoder_inputs=tuple(d.get("encoder_inputs", ("input_ids", "attention_mask"))),
                files=dict(d.get("files", _FILES)),
                max_source_length=d.get("max_source_length"),
                max_target_length=d.get("max_target_length"),
                tokenizer=d.get("tokenizer"),
                languages=None
                if not langs
                else Languages(
                    codes={str(k): int(v) for k, v in langs["codes"].items()},
                    source_position=str(langs.get("source_position", "prefix")),
                    default_source=langs.get("default_source"),
                    default_target=langs.get("default_target"),
                ),
                kv_dtype=str(d.get("kv_dtype", "float32")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelContractError(
                f"{where}: not a seq2seq generation section ({type(exc).__name__}: {exc})"
            ) from exc


def _first_int(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            return v
        if isinstance(v, list) and v and isinstance(v[0], int):
            return int(v[0])
    return None


def _eos(*values: Any) -> tuple[int, ...]:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            return (v,)
        if isinstance(v, list) and v and all(isinstance(i, int) for i in v):
            return tuple(v)
    return ()


def _languages(d: Path, tokenizer_config: Mapping[str, Any]) -> Languages | None:
    """The language codes of an NLLB / M2M100 / mBART tokenizer, read from its files."""
    cls = str(tokenizer_config.get("tokenizer_class") or "")
    if not any(cls.startswith(p) for p in ("Nllb", "M2M100", "MBart")):
        return None
    tok = read_json(d / "tokenizer.json")
    added = {str(t.get("content")): int(t.get("id")) for t in tok.get("added_tokens", []) if "content" in t}
    extra = tokenizer_config.get("additional_special_tokens") or []
    codes: dict[str, int] = {}
    for token in extra:
        text = token if isinstance(token, str) else (token or {}).get("content")
        if isinstance(text, str) and text in added:
            # M2M100's tokens are "__en__"; its codes are "en"
            code = text[2:-2] if cls.startswith("M2M100") and text.startswith("__") and text.endswith("__") else text
            codes[code] = added[text]
    if not codes:
        return None
    suffix = cls.startswith("MBartTokenizer") or (
        cls.startswith("Nllb") and bool(tokenizer_config.get("legacy_behaviour"))
    )
    return Languages(
        codes=codes,
        source_position="suffix" if suffix else "prefix",
        default_source=tokenizer_config.get("src_lang"),
        default_target=tokenizer_config.get("tgt_lang"),
    )


def seq2seq_section(export_dir: str | Path) -> dict[str, Any]:
    """Inspect an encoder-decoder export directory (``encoder_model.onnx``,
    ``decoder_model.onnx``, ``decoder_with_past_model.onnx``, ``config.json``) and return its
    manifest ``generation`` section; :class:`ModelContractError` when it is not one."""
    d = Path(export_dir)
    for f in _FILES.values():
        if not (d / f).is_file():
            raise ModelContractError(
                f"{d}: no {f}: not an encoder-decoder export with past (text2text-generation-with-past)"
            )
    config = read_json(d / "config.json")
    gen = read_json(d / "generation_config.json")
    tok_config = read_json(d / "tokenizer_config.json")
    enc_in, _ = read_io(d / _FILES["encoder"])
    past_in, _ = read_io(d / _FILES["decoder_with_past"])
    _, first_out = read_io(d / _FILES["decoder"])
    layers: set[int] = set()
    heads = dim = None
    dtype = "float32"
    for name, dt, shape in past_in:
        m = _PAST.match(name)
        if m is None:
            continue
        layers.add(int(m.group(1)))
        dtype = dt
        if len(shape) == 4:
            heads = shape[1] if isinstance(shape[1], int) else heads
            dim = shape[3] if isinstance(shape[3], int) else dim
    if not layers:
        raise ModelContractError(f"{d / _FILES['decoder_with_past']}: no past_key_values.* inputs")
    n = len(layers)
    if sorted(layers) != list(range(n)):
        raise ModelContractError(f"{d}: past_key_values layers {sorted(layers)} are not 0..{n - 1}")
    outs = {o[0] for o in first_out}
    missing = [f"present.{i}.encoder.{kv}" for i in range(n) for kv in ("key", "value")]
    missing = [m for m in missing if m not in outs]
    if missing:
        raise ModelContractError(f"{d / _FILES['decoder']}: no cross-attention outputs {missing[:2]}")
    heads = heads or _first_int(config.get("decoder_attention_heads"), config.get("num_heads"))
    if heads is None:
        raise ModelContractError(f"{d}: cannot tell the decoder's attention heads")
    if dim is None:
        dim = _first_int(config.get("d_kv"))
        if dim is None:
            width = _first_int(config.get("d_model"), config.get("hidden_size"))
            dim = width // heads if width else None
    if dim is None:
        raise ModelContractError(f"{d}: cannot tell the attention head size")
    vocab = _first_int(config.get("vocab_size"))
    start = _first_int(gen.get("decoder_start_token_id"), config.get("decoder_start_token_id"))
    eos = _eos(gen.get("eos_token_id"), config.get("eos_token_id"))
    pad = _first_int(gen.get("pad_token_id"), config.get("pad_token_id"))
    if vocab is None or start is None or not eos:
        raise ModelContractError(
            f"{d}: config.json must give vocab_size, decoder_start_token_id and eos_token_id "
            f"(got {vocab}, {start}, {list(eos)})"
        )
    positions = _first_int(config.get("max_position_embeddings"))
    layout = Seq2SeqLayout(
        num_layers=n,
        num_heads=int(heads),
        head_dim=int(dim),
        vocab_size=int(vocab),
        decoder_start_token_id=int(start),
        eos_token_ids=eos,
        pad_token_id=int(pad if pad is not None else eos[0]),
        encoder_inputs=tuple(i[0] for i in enc_in),
        max_source_length=positions,
        max_target_length=positions,
        tokenizer="tokenizer.json" if (d / "tokenizer.json").is_file() else None,
        languages=_languages(d, tok_config),
        kv_dtype=dtype,
    )
    return layout.to_dict()


def load_seq2seq_layout(directory: Path) -> tuple[Seq2SeqLayout, Manifest | None]:
    """The layout of an encoder-decoder export directory (the manifest's ``generation`` section,
    else read from its files), capped by the manifest's ``limits.max_sequence_length``; and the
    manifest, if there is one."""
    if not directory.is_dir():
        raise ModelContractError(f"{directory}: not an export directory")
    manifest = None
    section: dict[str, Any] | None = None
    if (directory / MANIFEST_NAME).is_file():
        manifest = Manifest.load(directory).verify()
        if manifest.generation and manifest.generation.get("kind") == "seq2seq":
            section = dict(manifest.generation)
    if section is None:
        section = seq2seq_section(directory)
    layout = Seq2SeqLayout.from_dict(section, where=f"{directory / MANIFEST_NAME}: generation")
    if manifest is not None and manifest.max_sequence_length:
        cap = manifest.max_sequence_length
        src = layout.max_source_length
        layout = Seq2SeqLayout(**{**layout.__dict__, "max_source_length": cap if src is None else min(src, cap)})
    return layout, manifest
