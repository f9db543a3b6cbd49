"""sentence-transformers checkpoints, read by ortbatch itself (no sentence-transformers needed).

* :func:`read_pipeline` parses ``modules.json`` (Transformer -> Pooling -> Dense* ->
  Normalize), each module's config and weights, and ``config_sentence_transformers.json``
  (prompts, default prompt, similarity, truncate_dim) into an
  :class:`~ortbatch.embed.pipeline.EmbeddingPipeline`; a module ortbatch does not know is
  an :class:`~ortbatch.errors.ExportError` naming it.
* :func:`append_pipeline` appends that pipeline to the transformer's ONNX graph, after
  ``last_hidden_state`` (output ``sentence_embedding``).
* :class:`TorchPipeline` is an independent PyTorch implementation of the parsed pipeline
  (row by row on the unpadded tokens, not the graph's masked formulas), and
  :func:`reference_embeddings` is the checks' reference: sentence-transformers' own
  ``encode`` when it is importable, else :class:`TorchPipeline`.

Pooling follows sentence-transformers' ``Pooling._forward_padded`` (v5). One deliberate
difference: ``weightedmean`` weighs a token by its position in its own text, where
sentence-transformers weighs by the padded column, so a left-padded batch gives each row
the embedding it has alone (right-padded, the two are the same).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..embed.pipeline import POOLING_MODES, DenseSpec, EmbeddingPipeline, SparseSpec
from ..errors import ExportError

__all__ = [
    "ParsedPipeline",
    "TorchPipeline",
    "append_pipeline",
    "checkpoint_task",
    "flag_pipeline",
    "graph_embeddings",
    "prompt_token_count",
    "read_pipeline",
    "reference_embeddings",
    "sentence_transformers_available",
]

# modules.json "type" (its last dotted part) -> what ortbatch does with it
_KNOWN_MODULES = ("Transformer", "MLMTransformer", "Pooling", "SpladePooling", "Dense", "Normalize")
# Dense's activation_function, as sentence-transformers saves it (fullname of the module)
_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.SiLU": "silu",
}
_LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass
class ParsedPipeline:
    """A checkpoint's pipeline: the description, where its transformer is, Dense weights,
    and the checkpoint's own folder (``root``: the transformer's for a plain transformer)."""

    pipeline: EmbeddingPipeline
    transformer_path: Path
    dense_weights: list[tuple[np.ndarray, np.ndarray | None]] = field(default_factory=list)
    max_seq_length: int | None = None
    root: Path | None = None
    # sentence_bert_config.json's do_lower_case: texts are lowercased before tokenizing
    lower_case: bool = False

    @property
    def checkpoint(self) -> Path:
        """The folder the user's model loads from (``SentenceTransformer(checkpoint)``)."""
        return self.root if self.root is not None else self.transformer_path


def sentence_transformers_available() -> bool:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from exc


def _pooling_modes(cfg: dict[str, Any], where: Path) -> tuple[str, ...]:
    mode = cfg.get("pooling_mode")
    if mode is None:
        # legacy booleans, in sentence-transformers' concatenation order; none set means mean
        modes = tuple(m for k, m in _LEGACY_POOLING.items() if cfg.get(k))
        return modes or ("mean",)
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    for m in modes:
        if m not in POOLING_MODES:
            raise ExportError(f"{where}: unknown pooling mode {m!r}; sentence-transformers has {list(POOLING_MODES)}")
    return modes


def _dense_weights(folder: Path) -> dict[str, np.ndarray]:
    st = folder / "model.safetensors"
    if st.is_file():
        from safetensors.numpy import load_file

        return dict(load_file(str(st)))
    bin_ = folder / "pytorch_model.bin"
    if bin_.is_file():
        import torch

        state = torch.load(str(bin_), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise ExportError(f"{folder}: a Dense module needs model.safetensors or pytorch_model.bin, found neither")


def _dense(folder: Path) -> tuple[DenseSpec, np.ndarray, np.ndarray | None]:
    cfg = _json(folder / "config.json")
    act_name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    act = _ACTIVATIONS.get(act_name)
    if act is None:
        raise ExportError(
            f"{folder}: Dense activation {act_name!r} is not one ortbatch can export; known: {sorted(_ACTIVATIONS)}"
        )
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key) not in (None, "sentence_embedding"):
            raise ExportError(f"{folder}: Dense {key}={cfg[key]!r} (only 'sentence_embedding' is exported)")
    spec = DenseSpec(int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)), act)
    weights = _dense_weights(folder)
    w = weights.get("linear.weight")
    if w is None or w.shape != (spec.out_features, spec.in_features):
        raise ExportError(
            f"{folder}: expected linear.weight of shape {(spec.out_features, spec.in_features)}, "
            f"got {None if w is None else w.shape}"
        )
    b = weights.get("linear.bias") if spec.bias else None
    if spec.bias and (b is None or b.shape != (spec.out_features,)):
        raise ExportError(f"{folder}: expected linear.bias of shape {(spec.out_features,)}")
    return spec, w.astype(np.float32), None if b is None else b.astype(np.float32)


@dataclass
class _Modules:
    """What modules.json's modules said, gathered in order."""

    order: list[str] = field(default_factory=list)
    transformer: Path | None = None
    task: str = "feature-extraction"
    max_seq: int | None = None
    pooling: tuple[str, ...] | None = None
    include_prompt: bool = True
    token_dim: int | None = None
    sparse: SparseSpec | None = None
    dense: list[DenseSpec] = field(default_factory=list)
    dense_w: list[tuple[np.ndarray, np.ndarray | None]] = field(default_factory=list)
    normalize: bool = False
    # the Transformer's sentence_bert_config.json and its path
    transformer_cfg: tuple[dict[str, Any], Path] | None = None
    lower_case: bool = False


def _read_module(found: _Modules, kind: str, folder: Path, modules_file: Path) -> None:
    if kind in ("Transformer", "MLMTransformer"):
        if found.transformer is not None:
            raise ExportError(f"{modules_file}: more than one Transformer module")
        found.transformer = folder
        cfg_file = folder / "sentence_bert_config.json"
        cfg = _json(cfg_file) if cfg_file.is_file() else {}
        # the tokenizer's keyword arguments (tokenizer_args is their older name): a
        # model_max_length there is where encode truncates, ahead of max_seq_length
        tok_kwargs = {**(cfg.get("tokenizer_args") or {}), **(cfg.get("processor_kwargs") or {})}
        if tok_kwargs.get("do_lower_case"):  # what it does depends on the tokenizer's class
            raise ExportError(f"{cfg_file}: do_lower_case in the tokenizer's arguments is not supported by ortbatch")
        found.lower_case = bool(cfg.get("do_lower_case"))
        found.max_seq = tok_kwargs.get("model_max_length", cfg.get("max_seq_length"))
        call_max = _processing_max_length(cfg, cfg_file)
        if call_max is not None:
            found.max_seq = call_max
        found.task = str(cfg.get("transformer_task") or ("fill-mask" if kind == "MLMTransformer" else found.task))
        if found.task not in ("feature-extraction", "fill-mask"):
            raise ExportError(
                f"{cfg_file}: transformer_task {found.task!r} is not one ortbatch can export "
                "(feature-extraction for Pooling, fill-mask for SpladePooling)"
            )
        found.transformer_cfg = (cfg, cfg_file)
    elif kind == "Pooling":
        cfg = _json(folder / "config.json")
        found.pooling = _pooling_modes(cfg, folder / "config.json")
        found.include_prompt = bool(cfg.get("include_prompt", True))
        found.token_dim = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    elif kind == "SpladePooling":
        cfg = _json(folder / "config.json")
        try:
            found.sparse = SparseSpec(
                str(cfg.get("pooling_strategy") or "max"), str(cfg.get("activation_function") or "relu")
            )
        except ValueError as exc:
            raise ExportError(f"{folder / 'config.json'}: {exc}") from None
    elif kind == "Dense":
        spec, w, b = _dense(folder)
        found.dense.append(spec)
        found.dense_w.append((w, b))
    elif kind == "Normalize":
        found.normalize = True
    found.order.append(kind)


# processing_kwargs (the tokenizer call's keyword arguments) that leave a text's tokens as they are
_NEUTRAL_CALL_KWARGS = frozenset(
    {"padding", "padding_side", "pad_to_multiple_of", "return_tensors", "return_attention_mask"}
)


def _processing_max_length(cfg: dict[str, Any], cfg_file: Path) -> int | None:
    """The ``max_length`` sentence_bert_config.json's ``processing_kwargs`` (``common``,
    then ``text``) give the tokenizer call, where encode then truncates; any other
    argument that changes a text's tokens (``add_special_tokens``, ``truncation``, ...) is
    an :class:`ExportError` naming it: the export tokenizes as the tokenizer does."""
    kwargs = cfg.get("processing_kwargs") or {}
    call = {**(kwargs.get("common") or {}), **(kwargs.get("text") or {})}
    odd = sorted(set(call) - _NEUTRAL_CALL_KWARGS - {"max_length"})
    if odd:
        raise ExportError(
            f"{cfg_file}: processing_kwargs {odd} change how sentence-transformers tokenizes a text; "
            "ortbatch tokenizes as the tokenizer does and cannot export that"
        )
    length = call.get("max_length")
    return int(length) if isinstance(length, int) else None


# what the exported graph gives a text: the model's forward() and this output of it
_TEXT_OUTPUT = {"feature-extraction": "last_hidden_state", "fill-mask": "logits"}


def _check_text_modality(cfg: dict[str, Any], cfg_file: Path, task: str) -> None:
    """sentence-transformers takes a text's token embeddings from ``modality_config``'s
    ``text`` method and output (CLIP-like models: ``get_text_features`` /
    ``pooler_output``); ortbatch's graph is the model's ``forward``, so anything else would
    be pooled from the wrong tensor."""
    modality = cfg.get("modality_config")
    if modality is None:
        return
    text = modality.get("text") if isinstance(modality, dict) else None
    if not isinstance(text, dict):
        raise ExportError(f"{cfg_file}: modality_config has no 'text' entry: ortbatch exports text models")
    want = ("forward", _TEXT_OUTPUT[task])
    got = (text.get("method", "forward"), text.get("method_output_name", want[1]))
    if got != want:
        raise ExportError(
            f"{cfg_file}: modality_config text takes {got[0]}().{got[1]}; ortbatch exports a {task} model's "
            f"{want[0]}().{want[1]} only"
        )


def checkpoint_task(model_dir: str | Path) -> str:
    """The transformer task a sentence-transformers checkpoint is exported for:
    ``fill-mask`` when it pools with SpladePooling (a ``SparseEncoder``), else
    ``feature-extraction``."""
    parsed = read_pipeline(model_dir)
    return "fill-mask" if parsed is not None and parsed.pipeline.is_sparse else "feature-extraction"


def read_pipeline(model_dir: str | Path) -> ParsedPipeline | None:
    """Parse a local sentence-transformers checkpoint (a ``SentenceTransformer``, or a
    SPLADE ``SparseEncoder``); ``None`` when it has no modules.json (a plain transformer:
    see :func:`flag_pipeline`)."""
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list) or not modules:
        raise ExportError(f"{modules_file}: expected a non-empty list of modules")
    found = _Modules()
    for entry in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if not str(entry.get("type", "")).startswith("sentence_transformers."):
            # custom code that only shares a name (jina-embeddings-v3's custom_st.Transformer
            # applies task adapters): exporting it as sentence-transformers' own would not be it
            raise ExportError(
                f"{modules_file}: module {entry.get('type')!r} ({entry.get('name')}) is custom code, not "
                f"sentence-transformers' own {kind}: ortbatch exports only sentence-transformers' modules "
                f"{list(_KNOWN_MODULES)}"
            )
        if kind not in _KNOWN_MODULES:
            raise ExportError(
                f"{modules_file}: module {entry.get('type')!r} ({entry.get('name')}) is not one ortbatch can "
                f"export; it knows {list(_KNOWN_MODULES)}"
            )
        _read_module(found, kind, root / str(entry.get("path", "")), modules_file)
    order = found.order
    if found.sparse is not None:
        if order[1:] != ["SpladePooling"] or found.task != "fill-mask":
            raise ExportError(
                f"{modules_file}: modules {order} are not a fill-mask Transformer -> SpladePooling, "
                "the sparse pipeline ortbatch exports"
            )
    else:
        dense, norm = ["Dense"] * len(found.dense), ["Normalize"] if found.normalize else []
        if order[:1] not in (["Transformer"], ["MLMTransformer"]) or order[1:] != ["Pooling", *dense, *norm]:
            raise ExportError(
                f"{modules_file}: modules {order} are not Transformer -> Pooling -> Dense* -> Normalize, "
                "the pipeline ortbatch exports"
            )
        if found.task != "feature-extraction":
            raise ExportError(f"{modules_file}: a Pooling module after a {found.task} Transformer cannot be exported")
    assert found.transformer is not None
    if found.transformer_cfg is not None:
        _check_text_modality(*found.transformer_cfg, found.task)
    return ParsedPipeline(
        _described(root, found), found.transformer, found.dense_w, found.max_seq, root, found.lower_case
    )


def lowercase_tokenizer(tokenizer: Any) -> None:
    """``do_lower_case`` as sentence-transformers applies it: a ``Lowercase`` normalizer put
    in front of the fast tokenizer's own (unless it has one), so the saved tokenizer.json
    lowercases for every reader of the export."""
    from tokenizers import normalizers

    if not getattr(tokenizer, "is_fast", False):
        raise ExportError("do_lower_case needs a fast (tokenizers) tokenizer to lowercase in tokenizer.json")
    norm = tokenizer.backend_tokenizer.normalizer
    if isinstance(norm, normalizers.Lowercase):
        return
    if isinstance(norm, normalizers.Sequence) and any(isinstance(n, normalizers.Lowercase) for n in norm):
        return
    rest = list(norm) if isinstance(norm, normalizers.Sequence) else ([] if norm is None else [norm])
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *rest])


def _described(root: Path, found: _Modules) -> EmbeddingPipeline:
    """The :class:`EmbeddingPipeline` of a checkpoint's modules and its
    ``config_sentence_transformers.json`` (prompts, default prompt, similarity,
    truncate_dim)."""
    assert found.transformer is not None
    st_cfg_file = root / "config_sentence_transformers.json"
    st_cfg = _json(st_cfg_file) if st_cfg_file.is_file() else {}
    sparse = found.sparse is not None
    if sparse:
        width = _config_int(found.transformer, ("vocab_size",))
    else:
        width = int(found.token_dim) if found.token_dim is not None else _hidden_size(found.transformer)
    try:
        return EmbeddingPipeline(
            pooling=found.pooling or (),
            token_dimension=width,
            include_prompt=found.include_prompt,
            dense=tuple(found.dense),
            normalize=found.normalize,
            prompts={str(k): str(v) for k, v in (st_cfg.get("prompts") or {}).items()},
            default_prompt_name=st_cfg.get("default_prompt_name") or None,
            similarity=str(st_cfg.get("similarity_fn_name") or ("dot" if sparse else "cosine")),
            source="sentence-transformers",
            output="sparse_embedding" if sparse else "sentence_embedding",
            sparse=found.sparse,
            truncate_dim=st_cfg.get("truncate_dim"),
        )
    except ValueError as exc:
        raise ExportError(f"{root}: {exc}") from exc


def _config_int(transformer: Path, keys: tuple[str, ...]) -> int:
    cfg = _json(transformer / "config.json")
    for key in keys:
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    raise ExportError(f"{transformer}/config.json names none of {list(keys)}")


def _hidden_size(transformer: Path) -> int:
    return _config_int(transformer, ("hidden_size", "d_model", "n_embd", "dim"))


def flag_pipeline(model_dir: str | Path, pooling: str = "mean") -> ParsedPipeline:
    """A plain transformer (no modules.json): its token embeddings pooled as ``--pooling`` says."""
    if pooling not in POOLING_MODES:
        raise ExportError(f"--pooling must be one of {list(POOLING_MODES)}, got {pooling!r}")
    root = Path(model_dir)
    pipe = EmbeddingPipeline(pooling=(pooling,), token_dimension=_hidden_size(root), source="pooling-flag")
    return ParsedPipeline(pipe, root)


# -- the ONNX graph ---------------------------------------------------------------------


class _Builder:
    def __init__(self, opset: int) -> None:
        self.opset = opset
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        from onnx import helper

        self._n += 1
        name = f"ortbatch_embed/{op_type}_{self._n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name + ":0"], name=name, **attrs))
        return name + ":0"

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        from onnx import numpy_helper

        self._n += 1
        name = f"ortbatch_embed/const_{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def axes(self, *axes: int) -> str:
        return self.const(list(axes), np.int64)

    def reduce(self, op_type: str, x: str, axis: int, keepdims: int) -> str:
        # ReduceSum takes axes as an input from opset 13, ReduceMax only from 18
        new = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if new:
            return self.op(op_type, x, self.axes(axis), keepdims=keepdims)
        return self.op(op_type, x, axes=[axis], keepdims=keepdims)


def _activation(b: _Builder, x: str, act: str) -> str:
    if act == "identity":
        return x
    if act == "tanh":
        return b.op("Tanh", x)
    if act == "relu":
        return b.op("Relu", x)
    if act == "sigmoid":
        return b.op("Sigmoid", x)
    if act == "silu":
        return b.op("Mul", x, b.op("Sigmoid", x))
    if act == "gelu":  # torch's exact GELU: x/2 * (1 + erf(x/sqrt(2)))
        erf = b.op("Erf", b.op("Div", x, b.const(np.sqrt(2.0))))
        return b.op("Mul", b.op("Mul", x, b.const(0.5)), b.op("Add", erf, b.const(1.0)))
    raise ExportError(f"activation {act!r} cannot be exported")


def _gather_row(b: _Builder, tokens: str, index: str, dim: int) -> str:
    """tokens [B, S, D], index [B, 1] -> tokens[b, index[b], :] as [B, D]."""
    idx = b.op("Expand", b.op("Unsqueeze", index, b.axes(2)), b.const([1, 1, dim], np.int64))
    return b.op("Squeeze", b.op("GatherElements", tokens, idx, axis=1), b.axes(1))


def _zero_token_types(g: Any) -> None:
    """A sentence embedding is of one text, whose token types are all 0 (as the tokenizer
    gives encode): computed in the graph, so callers feed input_ids and attention_mask only,
    as sentence-transformers exports take them."""
    from onnx import TensorProto, helper

    tt = next((i for i in g.input if i.name == "token_type_ids"), None)
    if tt is None:
        return
    g.input.remove(tt)
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["ortbatch_embed/ids_shape"], name="ortbatch_embed/ids_shape"),
        helper.make_node(
            "ConstantOfShape",
            ["ortbatch_embed/ids_shape"],
            ["token_type_ids"],
            name="ortbatch_embed/token_type_ids",
            value=helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
        ),
    ]
    for n in reversed(nodes):  # ahead of every node that reads them
        g.node.insert(0, n)


def append_pipeline(model: Any, parsed: ParsedPipeline, hidden: str | None = None) -> Any:
    """Append the pooling, Dense layers and Normalize to ``model`` (an ``onnx.ModelProto``
    whose graph outputs ``hidden`` [batch, sequence, dim] and takes ``attention_mask``);
    adds the output ``sentence_embedding`` [batch, dimension] and, for
    ``include_prompt=false``, the input ``prompt_length`` [batch]. A SPLADE pipeline pools
    the masked-LM ``logits`` into ``sparse_embedding`` [batch, vocabulary] instead.
    ``hidden`` defaults to ``logits`` for SPLADE, else ``last_hidden_state``. Returns ``model``."""
    from onnx import TensorProto, helper

    pipe = parsed.pipeline
    hidden = hidden or ("logits" if pipe.is_sparse else "last_hidden_state")
    g = model.graph
    if hidden not in {o.name for o in g.output}:
        raise ExportError(f"the transformer's graph has no {hidden!r} output to pool")
    if "attention_mask" not in {i.name for i in g.input}:
        raise ExportError("the transformer's graph takes no attention_mask: padding could not be left out")
    extra = sorted({i.name for i in g.input} - {"input_ids", "attention_mask", "token_type_ids", "position_ids"})
    if extra:  # nothing the texts give could fill them (decoder_input_ids: a seq2seq graph)
        raise ExportError(f"the transformer's graph also takes {extra}: a text's tokens cannot be pooled from it")
    if pipe.output in {o.name for o in g.output}:
        raise ExportError(f"the graph already has a {pipe.output!r} output")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        raise ExportError(f"the pooling head needs opset >= 13, the graph has {opset}")
    b = _Builder(opset)
    _zero_token_types(g)
    h = b.op("Cast", hidden, to=TensorProto.FLOAT)
    m0 = b.op("Cast", "attention_mask", to=TensorProto.FLOAT)  # [B, S]
    if pipe.sparse is not None:
        x = _splade(b, h, m0, pipe.sparse)
    else:
        m = m0
        if pipe.needs_prompt_length:
            # Leave out each row's first prompt_length real tokens (sentence-transformers zeroes
            # the prompt's columns after any left padding).
            rank = b.op("CumSum", m0, b.const(1, np.int64))
            pl = b.op("Unsqueeze", b.op("Cast", "prompt_length", to=TensorProto.FLOAT), b.axes(1))
            m = b.op("Mul", m0, b.op("Cast", b.op("Greater", rank, pl), to=TensorProto.FLOAT))
            g.input.append(helper.make_tensor_value_info("prompt_length", TensorProto.INT64, ["batch"]))
        x = _head(b, parsed, h, m0, m)
    b.nodes.append(helper.make_node("Identity", [x], [pipe.output], name="ortbatch_embed/output"))
    g.node.extend(b.nodes)
    g.initializer.extend(b.inits)
    g.output.append(helper.make_tensor_value_info(pipe.output, TensorProto.FLOAT, ["batch", pipe.dimension]))
    return model


def _splade(b: _Builder, logits: str, mask: str, spec: SparseSpec) -> str:
    """SpladePooling: ``log1p(relu(logits * mask))`` (``log1p`` twice for ``log1p_relu``),
    then max or sum over the tokens; padding gives 0, which neither changes."""
    x = b.op("Relu", b.op("Mul", logits, b.op("Unsqueeze", mask, b.axes(2))))
    for _ in range(2 if spec.activation == "log1p_relu" else 1):
        x = b.op("Log", b.op("Add", x, b.const(1.0)))
    return b.reduce("ReduceMax" if spec.pooling == "max" else "ReduceSum", x, 1, 0)


def _head(b: _Builder, parsed: ParsedPipeline, h: str, m0: str, m: str) -> str:
    """Pooling (``m``: the mask of the tokens pooled; ``m0``: the attention mask), Dense
    layers and Normalize, after token embeddings ``h`` [B, S, D]."""
    pipe = parsed.pipeline
    dim = pipe.token_dimension
    mu = b.op("Unsqueeze", m, b.axes(2))  # [B, S, 1]
    parts: list[str] = []
    mean_sum = count = None
    for mode in pipe.pooling:
        if mode == "cls":  # the first token the mask keeps
            parts.append(_gather_row(b, h, b.op("ArgMax", m, axis=1, keepdims=1), dim))
        elif mode == "lasttoken":  # the last token the mask keeps (the last column when none)
            idx = b.op("ArgMax", m, axis=1, keepdims=1, select_last_index=1)
            parts.append(_gather_row(b, b.op("Mul", h, mu), idx, dim))
        elif mode == "max":
            masked = b.op("Where", b.op("Less", mu, b.const(0.5)), b.const(-np.inf), h)
            parts.append(b.reduce("ReduceMax", masked, 1, 0))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            if mean_sum is None:
                mean_sum = b.reduce("ReduceSum", b.op("Mul", h, mu), 1, 0)
                count = b.op("Max", b.reduce("ReduceSum", mu, 1, 0), b.const(1e-9))
            assert count is not None
            parts.append(b.op("Div", mean_sum, count if mode == "mean" else b.op("Sqrt", count)))
        elif mode == "weightedmean":
            w = b.op("Unsqueeze", b.op("Mul", b.op("CumSum", m0, b.const(1, np.int64)), m), b.axes(2))
            total = b.reduce("ReduceSum", b.op("Mul", h, w), 1, 0)
            parts.append(b.op("Div", total, b.op("Max", b.reduce("ReduceSum", w, 1, 0), b.const(1e-9))))
    x = parts[0] if len(parts) == 1 else b.op("Concat", *parts, axis=-1)
    for spec, (weight, bias) in zip(pipe.dense, parsed.dense_weights, strict=True):
        x = b.op("MatMul", x, b.const(weight.T))
        if bias is not None:
            x = b.op("Add", x, b.const(bias))
        x = _activation(b, x, spec.activation)
    if pipe.normalize:  # torch.nn.functional.normalize: x / max(||x||, 1e-12)
        norm = b.op("Sqrt", b.reduce("ReduceSum", b.op("Mul", x, x), -1, 1))
        x = b.op("Div", x, b.op("Max", norm, b.const(1e-12)))
    if pipe.truncate_dim is not None:  # encode's truncate_dim: after Normalize, not re-normalized
        x = b.op("Slice", x, b.const([0], np.int64), b.const([pipe.truncate_dim], np.int64), b.axes(1))
    return x


def append_pipeline_file(onnx_path: str | Path, parsed: ParsedPipeline) -> None:
    """:func:`append_pipeline` on a saved model, in place (external data kept external)."""
    import onnx

    path = Path(onnx_path)
    model = onnx.load(str(path))
    append_pipeline(model, parsed)
    onnx.checker.check_model(model, full_check=False)
    external = any(p.suffix in (".onnx_data", ".data") or p.name.endswith("_data") for p in path.parent.iterdir())
    if external or model.ByteSize() > 1_800_000_000:
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + "_data")
    else:
        onnx.save(model, str(path))


def graph_embeddings(
    onnx_path: str | Path, tokenizer: Any, texts: Sequence[str], max_length: int, prompt: str | None = None
) -> np.ndarray:
    """``sentence_embedding`` of ``texts`` (after ``prompt``, as ``encode`` prepends the
    checkpoint's default prompt) from the saved graph on CPU, for the int8 calibration
    ranges the export records."""
    from .._ort import plain_session

    sess = plain_session(onnx_path)
    full = list(texts) if prompt is None else [prompt + t for t in texts]
    enc = tokenizer(full, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    ids = enc["input_ids"].astype(np.int64)
    mask = enc["attention_mask"].astype(np.int64)
    feed: dict[str, np.ndarray] = {}
    for arg in sess.get_inputs():
        if arg.name == "input_ids":
            feed[arg.name] = ids
        elif arg.name == "attention_mask":
            feed[arg.name] = mask
        elif arg.name == "token_type_ids":
            feed[arg.name] = np.zeros_like(ids)
        elif arg.name == "position_ids":
            feed[arg.name] = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        elif arg.name == "prompt_length":
            n = 0 if prompt is None else prompt_token_count(tokenizer, prompt)
            feed[arg.name] = np.full(len(ids), n, dtype=np.int64)
        else:
            raise ExportError(f"cannot fill input {arg.name!r} to calibrate the embeddings")
    return np.asarray(sess.run(["sentence_embedding"], feed)[0], dtype=np.float32)


def prompt_token_count(tokenizer: Any, prompt: str) -> int:
    """Tokens of ``prompt`` that ``include_prompt=false`` leaves out, as sentence-transformers
    counts them with a transformers tokenizer: with the special tokens, less a trailing one."""
    ids = tokenizer(prompt)["input_ids"]
    return len(ids) - (1 if ids and ids[-1] in tokenizer.all_special_ids else 0)


# -- the reference ----------------------------------------------------------------------


class TorchPipeline:
    """The parsed pipeline in PyTorch, as an independent check of the graph: the
    transformer from ``transformers``, then each row pooled over its own unpadded tokens."""

    def __init__(self, parsed: ParsedPipeline) -> None:
        from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

        self.parsed = parsed
        self.tokenizer = AutoTokenizer.from_pretrained(str(parsed.transformer_path))
        if parsed.lower_case:
            lowercase_tokenizer(self.tokenizer)
        auto = AutoModelForMaskedLM if parsed.pipeline.is_sparse else AutoModel
        self.model = auto.from_pretrained(str(parsed.transformer_path)).eval()

    def _sparse_row(self, logits: Any) -> Any:
        """SpladePooling of one unpadded row's logits [S, V]."""
        import torch

        spec = self.parsed.pipeline.sparse
        assert spec is not None
        x = torch.log1p(torch.relu(logits))
        if spec.activation == "log1p_relu":
            x = torch.log1p(x)
        return x.max(dim=0).values if spec.pooling == "max" else x.sum(dim=0)

    def _pool_row(self, tokens: Any, first_real: int) -> Any:
        import torch

        pipe = self.parsed.pipeline
        n_all = tokens.shape[0]
        out = []
        for mode in pipe.pooling:
            t = tokens[first_real:]
            if mode == "cls":
                out.append(t[0] if len(t) else tokens[0] * 0)
            elif mode == "lasttoken":
                out.append(t[-1] if len(t) else tokens[-1] * 0)
            elif mode == "max":
                out.append(t.max(dim=0).values if len(t) else torch.full_like(tokens[0], -float("inf")))
            elif mode == "mean":
                out.append(t.sum(dim=0) / max(len(t), 1e-9))
            elif mode == "mean_sqrt_len_tokens":
                out.append(t.sum(dim=0) / max(len(t), 1e-9) ** 0.5)
            elif mode == "weightedmean":
                w = torch.arange(first_real + 1, n_all + 1, dtype=tokens.dtype)[:, None]
                out.append((t * w).sum(dim=0) / max(float(w.sum()), 1e-9))
        return torch.cat(out)

    def encode(self, texts: Sequence[str], prompt: str | None = None) -> np.ndarray:
        import torch

        pipe = self.parsed.pipeline
        skip = 0
        if prompt and not pipe.include_prompt:  # "" is no prompt, as for encode
            skip = prompt_token_count(self.tokenizer, prompt)
        rows = []
        with torch.inference_mode():
            for text in texts:  # one at a time: no padding at all
                full = prompt + text if prompt else text
                enc = self.tokenizer(full, return_tensors="pt", truncation=True, max_length=self.parsed.max_seq_length)
                if pipe.is_sparse:
                    rows.append(self._sparse_row(self.model(**enc).logits[0].float()).numpy())
                    continue
                hidden = self.model(**enc).last_hidden_state[0].float()
                x = self._pool_row(hidden, skip)
                for spec, (w, b) in zip(pipe.dense, self.parsed.dense_weights, strict=True):
                    x = torch.from_numpy(w) @ x + (torch.from_numpy(b) if b is not None else 0)
                    x = _torch_activation(spec.activation)(x)
                if pipe.normalize:
                    x = x / x.norm().clamp_min(1e-12)
                rows.append(x[: pipe.dimension].numpy())
        return np.stack(rows).astype(np.float32)


def _torch_activation(name: str) -> Any:
    import torch

    return {
        "identity": lambda x: x,
        "tanh": torch.tanh,
        "relu": torch.relu,
        "sigmoid": torch.sigmoid,
        "gelu": torch.nn.functional.gelu,
        "silu": torch.nn.functional.silu,
    }[name]


def reference_embeddings(
    model_dir: str | Path,
    texts: Sequence[str],
    *,
    prompt: str | None = None,
    parsed: ParsedPipeline | None = None,
    batch_size: int = 32,
) -> tuple[np.ndarray, str]:
    """The user's model's embeddings of ``texts`` and what computed them:
    ``SentenceTransformer(model_dir).encode`` (``SparseEncoder``'s, densified, for SPLADE)
    when sentence-transformers is importable and the checkpoint is one, else
    :class:`TorchPipeline` on the parsed pipeline."""
    if parsed is None:
        parsed = read_pipeline(model_dir)
        if parsed is None:
            raise ExportError(f"{model_dir} has no modules.json; pass the pipeline --pooling made")
    pipe = parsed.pipeline
    if prompt is None and pipe.default_prompt_name is not None:  # as encode() applies it
        prompt = pipe.prompts[pipe.default_prompt_name]
    if pipe.source == "sentence-transformers" and sentence_transformers_available():
        if pipe.is_sparse:
            from sentence_transformers import SparseEncoder

            sparse = SparseEncoder(str(model_dir), device="cpu").encode(
                list(texts), prompt=prompt, batch_size=batch_size, convert_to_tensor=True
            )
            return sparse.to_dense().numpy().astype(np.float32), "sentence-transformers SparseEncoder"
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(model_dir), device="cpu")
        vecs = st.encode(list(texts), prompt=prompt, batch_size=batch_size, convert_to_numpy=True)
        return np.asarray(vecs, dtype=np.float32), "sentence-transformers"
    return TorchPipeline(parsed).encode(texts, prompt=prompt), "torch reference"
