"""int8 variants of an export, through onnxruntime's quantization tooling.

Two modes, both keeping the export a plain ONNX model (same inputs and outputs, fp32 at
the edges) plus its manifest:

- ``int8``: dynamic quantization (``onnxruntime.quantization.quantize_dynamic``). Weights
  of MatMul / fused Attention (and Gather, if asked) are stored as int8, per output channel
  by default; activations are quantized at run time, one scale per tensor. That scale is
  taken over the whole batch, so a row's answer moves slightly with its batch mates: the
  checks compare batched and alone rows by the task metric, not bit for bit.
- ``int8-static``: static QDQ quantization (``quantize_static``) with activation ranges
  calibrated on the recipe's sample texts or a user text file.

The options that decide accuracy are exposed (:class:`QuantizeConfig`): per-channel
weights, reduce-range (7-bit weights for CPUs without VNNI), the op types quantized, and
nodes kept in float: by name, or ``keep_float="edges"`` for the first and last
transformer layers (the usual first thing to try when int8 costs too much accuracy). On
encoders, ``outlier_ratio`` and ``mask_padding`` (:mod:`ortbatch.export.outliers`) keep
the few outlier hidden units in float and padding out of the dynamic scale: what takes
all-MiniLM-L6-v2 from cosine 0.96 to above 0.99 (docs/export.md; the ``ortbatch tune`` runs in
docs/benchmarks-log.md). ``smooth_alpha``
(SmoothQuant-style scaling of the LayerNorm-fed MatMul inputs) tames most outliers with
one elementwise Mul, or none, instead of a float MatMul each, so far fewer need the split.

onnxruntime is imported only when a model is quantized, so recipes can be read without it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ExportError

__all__ = ["CALIBRATION_METHODS", "KEEP_FLOAT", "QUANTIZE_MODES", "QuantizeConfig", "quantize_model"]

log = logging.getLogger("ortbatch.export")

QUANTIZE_MODES = ("int8", "int8-static")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
KEEP_FLOAT = ("none", "edges")
_OP_TYPES = ("MatMul", "Attention", "Gather", "Gemm", "Conv")
_LAYER = re.compile(r"(?:^|/)(?:layers?|h|block|blocks)\.(\d+)(?:/|$)")


@dataclass(frozen=True)
class QuantizeConfig:
    """How to quantize an export (the recipe's ``[quantization]`` table).

    Attributes:
        mode: ``"int8"`` (dynamic) or ``"int8-static"`` (calibrated QDQ).
        per_channel: one weight scale per output channel (more accurate than per tensor).
        reduce_range: 7-bit weights: avoids saturation of the u8s8 kernels on CPUs
            without VNNI, at some accuracy cost elsewhere.
        op_types: operator types to quantize.
        nodes_to_exclude: node names kept in float.
        keep_float: ``"edges"`` also keeps every node of the first and last transformer
            layers in float.
        calibration: static mode's range estimator (minmax, entropy, percentile).
        calibration_texts: a text file (one text per line) to calibrate on; default the
            recipe's sample texts (static mode) or those plus ortbatch's built-in corpus
            (``outlier_ratio``: channel ranges need a few hundred tokens).
        outlier_ratio: dynamic mode, encoders: input channels of a MatMul whose calibrated
            max ``|x|`` exceeds this many times the median channel's are computed in
            float, the rest in int8 (LLM.int8()-style decomposition). ``None``: off.
        mask_padding: dynamic mode, encoders: zero the pad positions of each quantized
            MatMul's input, so padding never sets the per-tensor activation scale and a
            row's answer does not move with its batch mates' lengths.
        smooth_alpha: dynamic mode: SmoothQuant-style scaling of the MatMul inputs that a
            LayerNormalization produces (QKV and FFN-in of a transformer layer): per input
            channel ``s = max|x|^alpha / max|W_row|^(1-alpha)`` from calibration, ``x / s``
            on the activation path (folded into the LayerNorm's gamma and beta where its
            output feeds only those MatMuls), ``s * W`` in the weights. Exact in fp32; the
            activations' range moves into the weights. ``None``: off. ``outlier_ratio`` then
            applies to the smoothed ranges.
    """

    mode: str = "int8"
    per_channel: bool = True
    reduce_range: bool = False
    op_types: tuple[str, ...] = ("MatMul", "Attention")
    nodes_to_exclude: tuple[str, ...] = ()
    keep_float: str = "none"
    calibration: str = "minmax"
    calibration_texts: str | None = None
    outlier_ratio: float | None = None
    mask_padding: bool = False
    smooth_alpha: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZE_MODES:
            raise ExportError(f"quantization mode must be one of {list(QUANTIZE_MODES)}, got {self.mode!r}")
        for name in ("per_channel", "reduce_range", "mask_padding"):
            if not isinstance(getattr(self, name), bool):
                raise ExportError(f"quantization.{name} must be true or false, got {getattr(self, name)!r}")
        bad = [op for op in self.op_types if op not in _OP_TYPES]
        if bad or not self.op_types:
            raise ExportError(f"quantization.op_types must be a non-empty subset of {list(_OP_TYPES)}, got {bad}")
        if not all(isinstance(n, str) and n for n in self.nodes_to_exclude):
            raise ExportError("quantization.nodes_to_exclude must be a list of node names")
        if self.keep_float not in KEEP_FLOAT:
            raise ExportError(f"quantization.keep_float must be one of {list(KEEP_FLOAT)}, got {self.keep_float!r}")
        r = self.outlier_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 1.0):
            raise ExportError(f"quantization.outlier_ratio must be a number above 1 (or unset), got {r!r}")
        a = self.smooth_alpha
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 < a < 1.0):
            raise ExportError(f"quantization.smooth_alpha must be a number between 0 and 1 (or unset), got {a!r}")
        if self.mode != "int8" and (r is not None or self.mask_padding or a is not None):
            raise ExportError(
                "quantization.outlier_ratio, mask_padding and smooth_alpha apply to mode 'int8' (dynamic)"
            )
        if self.calibration not in CALIBRATION_METHODS:
            raise ExportError(
                f"quantization.calibration must be one of {list(CALIBRATION_METHODS)}, got {self.calibration!r}"
            )

    @classmethod
    def parse(cls, value: str | QuantizeConfig | Mapping[str, Any] | None) -> QuantizeConfig | None:
        """``None``/``"none"`` -> None; a mode name; a mapping of the fields; or a config."""
        if value is None or isinstance(value, QuantizeConfig):
            return value
        if isinstance(value, str):
            return None if value in ("", "none") else cls(mode=value)
        if not isinstance(value, Mapping):
            raise ExportError(f"quantization must be a mode name or a table, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ExportError(f"unknown quantization option(s) {unknown}; expected {sorted(known)}")
        kw = dict(value)
        for key in ("op_types", "nodes_to_exclude"):
            if key in kw:
                if isinstance(kw[key], str) or not isinstance(kw[key], Sequence):
                    raise ExportError(f"quantization.{key} must be a list, got {kw[key]!r}")
                kw[key] = tuple(kw[key])
        if kw.get("mode") in (None, "", "none"):
            return None
        return cls(**kw)

    def with_overrides(self, **kw: Any) -> QuantizeConfig:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["op_types"] = list(self.op_types)
        d["nodes_to_exclude"] = list(self.nodes_to_exclude)
        return d

    @property
    def label(self) -> str:
        """A short name for tables: ``int8``, ``int8-static``, plus the options that differ."""
        parts = [self.mode]
        if not self.per_channel:
            parts.append("per-tensor")
        if self.reduce_range:
            parts.append("rr")
        if self.keep_float != "none":
            parts.append(f"float-{self.keep_float}")
        if self.nodes_to_exclude:
            parts.append(f"float-{len(self.nodes_to_exclude)}")
        if self.smooth_alpha is not None:
            parts.append(f"smooth{self.smooth_alpha:g}")
        if self.outlier_ratio is not None:
            parts.append(f"outliers{self.outlier_ratio:g}")
        if self.mask_padding:
            parts.append("padmask")
        return "-".join(parts)


@dataclass
class _Calibration:
    """Feeds for static calibration: one tokenized text per ``get_next``."""

    feeds: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._it: Iterator[dict[str, Any]] = iter(self.feeds)

    def get_next(self) -> dict[str, Any] | None:
        return next(self._it, None)


def quantize_model(
    path: str | os.PathLike[str],
    config: QuantizeConfig,
    *,
    tokenizer: Any = None,
    texts: Sequence[str] = (),
    max_length: int | None = None,
) -> dict[str, Any]:
    """Quantize the ONNX file at ``path`` in place; returns what was done (for the manifest).

    Static mode tokenizes ``texts`` (or ``config.calibration_texts``) with ``tokenizer``
    to calibrate activation ranges (cut to ``max_length`` tokens). Raises :class:`ExportError` naming what failed.
    """
    import onnx

    from .._extras import require

    quant = require("onnxruntime.quantization", "export")
    p = Path(path)
    graph_inputs, excluded, external, quantized_types = _inspect(p, config)
    # optimum's fused graphs (Attention, SkipLayerNormalization) defeat shape inference;
    # their tensors are float, which is what the quantizer needs to know.
    extra: dict[str, Any] = {"DefaultTensorType": onnx.TensorProto.FLOAT}
    root = logging.getLogger()
    level = root.level
    with tempfile.TemporaryDirectory(prefix="ortbatch-quant-", dir=p.parent) as tmp:
        out = Path(tmp) / p.name
        # quantize_dynamic logs a pre-processing hint on the root logger on every call
        root.setLevel(max(level, logging.ERROR))
        try:
            src, prepared = p, None
            if config.outlier_ratio is not None or config.mask_padding or config.smooth_alpha is not None:
                src, prepared = _prepare(
                    p, config, tokenizer, texts, graph_inputs, excluded, external, Path(tmp), max_length
                )
                excluded += prepared.float_nodes
            _run_quantizer(
                quant, config, p, src, out, excluded, external, extra, tokenizer, texts, graph_inputs, max_length
            )
        except ExportError:
            raise
        except Exception as exc:
            raise ExportError(f"{config.mode} quantization of {p.name} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            root.setLevel(level)
        for f in list(p.parent.glob(p.name + "*")):
            f.unlink()
        for f in Path(tmp).iterdir():
            if f.is_file() and (f.name.startswith(p.name) or f.suffix == ".data"):
                shutil.move(str(f), p.parent / f.name)
    return {
        **config.to_dict(),
        "nodes_kept_float": len(excluded),
        "quantized_op_types": sorted(quantized_types),
        **(prepared.to_dict() if prepared is not None else {}),
    }


def _inspect(p: Path, config: QuantizeConfig) -> tuple[list[str], list[str], bool, set[str]]:
    """The model's inputs, the nodes to keep float, whether its weights are external, and
    the op types that will be quantized; refused when the config names what is not there."""
    import onnx

    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:
        raise ExportError(f"cannot read {p} to quantize it: {type(exc).__name__}: {exc}") from exc
    external = (
        any(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)
        or p.with_name(p.name + "_data").exists()
    )
    graph_inputs = [i.name for i in model.graph.input]
    excluded = list(config.nodes_to_exclude) + (_edge_nodes(model) if config.keep_float == "edges" else [])
    known = {n.name for n in model.graph.node}
    missing = [n for n in config.nodes_to_exclude if n not in known]
    if missing:
        raise ExportError(f"quantization.nodes_to_exclude names nodes that {p.name} does not have: {missing[:5]}")
    quantized_types = {n.op_type for n in model.graph.node} & set(config.op_types)
    if not quantized_types:
        raise ExportError(f"{p.name} has none of the op types to quantize {list(config.op_types)}")
    return graph_inputs, excluded, external, quantized_types


def _run_quantizer(
    quant: Any,
    config: QuantizeConfig,
    original: Path,
    src: Path,
    out: Path,
    excluded: list[str],
    external: bool,
    extra: dict[str, Any],
    tokenizer: Any,
    texts: Sequence[str],
    graph_inputs: list[str],
    max_length: int | None,
) -> None:
    """onnxruntime's dynamic quantizer on ``src`` (the original file, or its prepared copy),
    or its static (QDQ) one on ``original``, calibrated on the texts."""
    if config.mode == "int8":
        quant.quantize_dynamic(
            src,
            out,
            op_types_to_quantize=list(config.op_types),
            per_channel=config.per_channel,
            reduce_range=config.reduce_range,
            weight_type=quant.QuantType.QInt8,
            nodes_to_exclude=excluded,
            use_external_data_format=external,
            extra_options=extra,
        )
        return
    feeds = _calibration_feeds(config, tokenizer, texts, graph_inputs, max_length)
    method = {
        "minmax": quant.CalibrationMethod.MinMax,
        "entropy": quant.CalibrationMethod.Entropy,
        "percentile": quant.CalibrationMethod.Percentile,
    }[config.calibration]
    quant.quantize_static(
        original,
        out,
        _Calibration(feeds),
        quant_format=quant.QuantFormat.QDQ,
        op_types_to_quantize=list(config.op_types),
        per_channel=config.per_channel,
        reduce_range=config.reduce_range,
        activation_type=quant.QuantType.QInt8,
        weight_type=quant.QuantType.QInt8,
        nodes_to_exclude=excluded,
        use_external_data_format=external,
        calibrate_method=method,
        extra_options={**extra, "ActivationSymmetric": True},
    )


def _prepare(
    p: Path,
    config: QuantizeConfig,
    tokenizer: Any,
    texts: Sequence[str],
    graph_inputs: list[str],
    excluded: list[str],
    external: bool,
    tmp: Path,
    max_length: int | None,
) -> tuple[Path, Any]:
    """The outlier / padding / smoothing rewrite (:mod:`.outliers`) of ``p``, saved under ``tmp/prep``."""
    import onnx

    from .outliers import prepare_int8

    if not config.calibration_texts:
        from ..bench.texts import TEXTS

        texts = [*texts, *TEXTS]
    feeds = _calibration_feeds(config, tokenizer, texts, graph_inputs, max_length)
    model = onnx.load(str(p))
    prepared = prepare_int8(
        model,
        feeds=feeds,
        outlier_ratio=config.outlier_ratio,
        mask_padding=config.mask_padding,
        exclude=excluded,
        smooth_alpha=config.smooth_alpha,
    )
    d = tmp / "prep"
    d.mkdir()
    src = d / p.name
    onnx.save(model, str(src), save_as_external_data=external, location=p.name + "_data" if external else None)
    return src, prepared


def _edge_nodes(model: Any) -> list[str]:
    """Names of the nodes in the first and last transformer layers (by their layer index)."""
    by_layer: dict[int, list[str]] = {}
    for node in model.graph.node:
        m = _LAYER.search(node.name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(node.name)
    if not by_layer:
        raise ExportError(
            "keep_float='edges': no transformer layers found by node name (e.g. '/encoder/layer.0/...'); "
            "name the nodes to keep in float with nodes_to_exclude instead"
        )
    first, last = min(by_layer), max(by_layer)
    return by_layer[first] + (by_layer[last] if last != first else [])


def _calibration_feeds(
    config: QuantizeConfig, tokenizer: Any, texts: Sequence[str], graph_inputs: list[str], max_length: int | None = None
) -> list[dict[str, Any]]:
    import numpy as np

    if config.calibration_texts:
        try:
            lines = Path(config.calibration_texts).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ExportError(f"calibration texts {config.calibration_texts}: {exc.strerror or exc}") from exc
        texts = [t for t in (line.strip() for line in lines) if t]
    if not texts:
        raise ExportError(f"{config.label} needs calibration texts (the recipe's samples or calibration_texts)")
    if tokenizer is None:
        raise ExportError(f"{config.label} needs the model's tokenizer to calibrate")
    supported = {"input_ids", "attention_mask", "token_type_ids"}
    unknown = [n for n in graph_inputs if n not in supported]
    if unknown:
        raise ExportError(
            f"{config.label} calibrates encoder models only (inputs {sorted(supported)}); this one also takes {unknown}"
        )
    feeds = []
    for text in texts:
        cut = {"truncation": True, "max_length": max_length} if max_length else {}
        enc = tokenizer([text], return_tensors="np", **cut)
        feed = {"input_ids": np.asarray(enc["input_ids"], dtype=np.int64)}
        feed["attention_mask"] = np.ones_like(feed["input_ids"])
        feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
        feeds.append({k: v for k, v in feed.items() if k in graph_inputs})
    return feeds
