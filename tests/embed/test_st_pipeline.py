"""The sentence-transformers pipeline in the graph equals sentence-transformers' own encode.

Tiny random BERT and GPT-2 checkpoints, each pooling mode, with and without Dense and
Normalize, prompts with include_prompt false; batched mixed lengths (right padding).
The reference is always ``SentenceTransformer(dir).encode``, never ortbatch's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")
st_mod = pytest.importorskip("sentence_transformers")

from ortbatch.embed import Embedder, EmbeddingPipeline  # noqa: E402
from ortbatch.errors import ExportError, InvalidInputError  # noqa: E402
from ortbatch.export import st_pipeline  # noqa: E402
from tests.embed.stmodels import (  # noqa: E402
    CORPUS,
    TEXTS,
    build_splade,
    build_st,
    cosines,
    make_export,
    padded_feed,
)

pytestmark = [pytest.mark.export, pytest.mark.slow]
MIN_COSINE = 0.9999
PROMPTS = {"query": "query: ", "passage": "passage: "}


def _graph_session(onnx_path: Path, parsed: st_pipeline.ParsedPipeline) -> Any:
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path))
    st_pipeline.append_pipeline(model, parsed)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _encode_graph(
    sess: Any, st_dir: Path, texts: list[str], prompt: str | None = None, output: str = "sentence_embedding"
) -> np.ndarray:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(st_dir))
    names = {i.name for i in sess.get_inputs()}
    full = texts if prompt is None else [prompt + t for t in texts]
    feed = padded_feed(tok, full, names)
    if "prompt_length" in names:
        n = 0
        if prompt is not None:
            ids = tok(prompt)["input_ids"]
            n = len(ids) - (1 if ids and ids[-1] in tok.all_special_ids else 0)
        feed["prompt_length"] = np.full(len(texts), n, dtype=np.int64)
    return sess.run([output], feed)[0]


CASES = [
    ("bert", "cls", (), False),
    ("bert", "max", (), False),
    ("bert", "mean", (), True),
    ("bert", "mean_sqrt_len_tokens", (), False),
    ("bert", "weightedmean", (), False),
    ("bert", "lasttoken", (), False),
    ("bert", "cls", ((16, "Tanh"),), True),
    ("bert", ("cls", "mean", "max"), ((24, "GELU"), (8, "Identity")), True),
    ("gpt2", "lasttoken", (), True),
    ("gpt2", "mean", ((16, "ReLU"),), False),
    ("gpt2", "weightedmean", (), True),
    ("gpt2", "cls", (), False),
    ("gpt2", "max", ((16, "SiLU"),), True),
    ("gpt2", "mean_sqrt_len_tokens", ((16, "Sigmoid"),), False),
]


@pytest.mark.parametrize(("kind", "pooling", "dense", "normalize"), CASES, ids=lambda v: str(v))
def test_graph_and_torch_reference_equal_sentence_transformers(bases, tmp_path, kind, pooling, dense, normalize):
    base, onnx_path = bases[kind]
    st_dir = build_st(base, tmp_path / "st", pooling=pooling, dense=dense, normalize=normalize)
    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS, batch_size=4)
    got = _encode_graph(_graph_session(onnx_path, parsed), st_dir, TEXTS)
    assert got.shape == want.shape == (len(TEXTS), parsed.pipeline.dimension)
    assert cosines(got, want).min() >= MIN_COSINE
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    ref = st_pipeline.TorchPipeline(parsed).encode(TEXTS)
    assert cosines(ref, want).min() >= MIN_COSINE


@pytest.mark.parametrize("normalize", [True, False])
def test_truncate_dim_of_the_checkpoint(bases, tmp_path, normalize):
    """config_sentence_transformers.json's truncate_dim: encode keeps the first values of
    the pipeline's output (after Normalize, not re-normalized); so do the graph, the torch
    reference and the Embedder, and the manifest records that dimension."""
    base, onnx_path = bases["bert"]
    st_dir = build_st(base, tmp_path / "st", pooling="mean", dense=((16, "Tanh"),), normalize=normalize, truncate_dim=6)
    model = st_mod.SentenceTransformer(str(st_dir), device="cpu")
    want = model.encode(TEXTS, batch_size=4)
    assert want.shape == (len(TEXTS), 6)
    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None and parsed.pipeline.dimension == 6
    got = _encode_graph(_graph_session(onnx_path, parsed), st_dir, TEXTS)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(st_pipeline.TorchPipeline(parsed).encode(TEXTS), want, atol=1e-5)
    export = make_export(onnx_path, st_dir, tmp_path / "export")
    with Embedder(export) as emb:
        assert emb.dimension == 6
        np.testing.assert_allclose(emb.encode(TEXTS), want, atol=1e-5)
        want4 = model.encode(TEXTS, truncate_dim=4, normalize_embeddings=normalize)
        np.testing.assert_allclose(emb.encode(TEXTS, dimensions=4), want4, atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "lasttoken", "weightedmean", "max"])
def test_prompts_left_out_of_pooling(bases, tmp_path, kind, pooling):
    base, onnx_path = bases[kind]
    st_dir = build_st(base, tmp_path / "st", pooling=pooling, include_prompt=False, prompts=PROMPTS)
    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None and parsed.pipeline.needs_prompt_length
    assert PROMPTS.items() <= dict(parsed.pipeline.prompts).items()  # sentence-transformers may add its own
    model = st_mod.SentenceTransformer(str(st_dir), device="cpu")
    want = model.encode(TEXTS, prompt_name="query", batch_size=4)
    sess = _graph_session(onnx_path, parsed)
    got = _encode_graph(sess, st_dir, TEXTS, prompt=PROMPTS["query"])
    assert cosines(got, want).min() >= MIN_COSINE
    # the prompt does change the answer, so the check above could fail
    assert cosines(got, model.encode(TEXTS, batch_size=4)).min() < 0.999
    ref = st_pipeline.TorchPipeline(parsed).encode(TEXTS, prompt=PROMPTS["query"])
    assert cosines(ref, want).min() >= MIN_COSINE


def test_pytorch_bin_dense_and_config(bases, tmp_path):
    base, onnx_path = bases["bert"]
    st_dir = build_st(
        base,
        tmp_path / "st",
        pooling="mean",
        dense=((12, "Tanh"),),
        normalize=True,
        prompts=PROMPTS,
        default_prompt_name="passage",
        safe_serialization=False,
    )
    assert (st_dir / "2_Dense" / "pytorch_model.bin").is_file()
    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None
    pipe = parsed.pipeline
    assert (pipe.pooling, pipe.dimension, pipe.normalize, pipe.default_prompt_name) == (("mean",), 12, True, "passage")
    assert pipe.similarity == "cosine"
    assert EmbeddingPipeline.from_dict(json.loads(json.dumps(pipe.to_dict()))) == pipe
    # default prompt applied, by sentence-transformers and by the reference alike
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS)
    got, by = st_pipeline.reference_embeddings(st_dir, TEXTS, parsed=parsed)
    assert by == "sentence-transformers" and cosines(got, want).min() >= MIN_COSINE
    graph = _encode_graph(_graph_session(onnx_path, parsed), st_dir, TEXTS, prompt=PROMPTS["passage"])
    assert cosines(graph, want).min() >= MIN_COSINE


def test_unknown_module_and_activation_are_export_errors(bases, tmp_path):
    base, _ = bases["bert"]
    st_dir = build_st(base, tmp_path / "st", pooling="mean", dense=((8, "Tanh"),))
    modules = json.loads((st_dir / "modules.json").read_text())
    modules.append({"idx": 9, "name": "9", "path": "9_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (st_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ExportError, match="LayerNorm"):
        st_pipeline.read_pipeline(st_dir)
    modules.pop()
    # custom code under a known module's name (jina-embeddings-v3's custom_st.Transformer)
    custom = [dict(m) for m in modules]
    custom[0]["type"] = "custom_st.Transformer"
    (st_dir / "modules.json").write_text(json.dumps(custom))
    with pytest.raises(ExportError, match=r"'custom_st\.Transformer' \(0\) is custom code"):
        st_pipeline.read_pipeline(st_dir)
    (st_dir / "modules.json").write_text(json.dumps(modules))
    cfg_file = st_dir / "2_Dense" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["activation_function"] = "my_package.Swish"
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"my_package\.Swish"):
        st_pipeline.read_pipeline(st_dir)
    with pytest.raises(ExportError, match="--pooling"):
        st_pipeline.flag_pipeline(base, "median")
    assert st_pipeline.read_pipeline(base) is None


_HIDDEN_SCRIPT = textwrap.dedent(
    """
    import sys
    from tests.embed.stmodels import block_sentence_transformers
    block_sentence_transformers()
    import numpy as np, onnx, onnxruntime as ort
    from transformers import AutoTokenizer
    from ortbatch.export import st_pipeline
    from tests.embed.stmodels import TEXTS, padded_feed
    st_dir, onnx_path, out = sys.argv[1:4]
    assert not st_pipeline.sentence_transformers_available()
    parsed = st_pipeline.read_pipeline(st_dir)
    ref, by = st_pipeline.reference_embeddings(st_dir, TEXTS, parsed=parsed)
    model = onnx.load(onnx_path)
    st_pipeline.append_pipeline(model, parsed)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    tok = AutoTokenizer.from_pretrained(st_dir)
    feed = padded_feed(tok, TEXTS, {i.name for i in sess.get_inputs()})
    graph = sess.run(["sentence_embedding"], feed)[0]
    np.savez(out, ref=ref, graph=graph, by=np.array(by))
    """
)


@pytest.mark.parametrize(("kind", "pooling"), [("bert", "cls"), ("gpt2", "lasttoken")])
def test_without_sentence_transformers(bases, tmp_path, kind, pooling):
    base, onnx_path = bases[kind]
    st_dir = build_st(base, tmp_path / "st", pooling=pooling, dense=((16, "Tanh"),), normalize=True)
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS, batch_size=4)
    out = tmp_path / "hidden.npz"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    subprocess.run(
        [sys.executable, "-c", _HIDDEN_SCRIPT, str(st_dir), str(onnx_path), str(out)], check=True, env=env, timeout=240
    )
    res = np.load(out)
    assert str(res["by"]) == "torch reference"
    assert cosines(res["ref"], want).min() >= MIN_COSINE
    assert cosines(res["graph"], want).min() >= MIN_COSINE


# -- the in-process face -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_embedder_equals_encode(bases, tmp_path, kind):
    from sentence_transformers.util import quantize_embeddings

    base, onnx_path = bases[kind]
    pooling = "cls" if kind == "bert" else "lasttoken"
    st_dir = build_st(base, tmp_path / "st", pooling=pooling, include_prompt=False, normalize=True, prompts=PROMPTS)
    export = make_export(onnx_path, st_dir, tmp_path / "export")
    model = st_mod.SentenceTransformer(str(st_dir), device="cpu")
    texts = TEXTS * 3  # 18 texts through a session of max_batch_size 4: several batches
    with Embedder(export, max_batch_size=4) as emb:
        assert emb.dimension == HIDDEN_DIM
        got = emb.embed(texts)
        assert cosines(got.vectors, model.encode(texts, batch_size=5)).min() >= MIN_COSINE
        assert emb.session.stats().batches >= 5
        tok = model.tokenizer
        assert got.tokens == tuple(len(tok(t)["input_ids"]) for t in texts)

        q = emb.embed(texts, prompt_name="query")
        assert cosines(q.vectors, model.encode(texts, prompt_name="query")).min() >= MIN_COSINE
        assert q.tokens == tuple(len(tok(PROMPTS["query"] + t)["input_ids"]) for t in texts)

        small = emb.encode(texts, dimensions=8)
        want_small = model.encode(texts, truncate_dim=8, normalize_embeddings=True)
        assert small.shape == (len(texts), 8)
        np.testing.assert_allclose(small, want_small, atol=1e-5)

        cal = model.encode(CORPUS)
        full = model.encode(texts)
        for fmt in ("int8", "uint8", "binary", "ubinary"):
            mine = emb.encode(texts, encoding_format=fmt)
            theirs = quantize_embeddings(full, fmt, calibration_embeddings=cal)
            assert mine.dtype == theirs.dtype, fmt
            # a value on a bucket edge may round either way in float32
            assert np.abs(mine.astype(np.int64) - theirs.astype(np.int64)).max() <= 1, fmt
            if fmt.endswith("binary"):
                assert (mine == theirs).mean() >= 0.99, fmt

        with pytest.raises(InvalidInputError, match="dimensions=999"):
            emb.encode(["x"], dimensions=999)
        with pytest.raises(InvalidInputError, match="prompt_name 'nope'"):
            emb.encode(["x"], prompt_name="nope")
        with pytest.raises(InvalidInputError, match="encoding_format"):
            emb.encode(["x"], encoding_format="int4")


HIDDEN_DIM = 32


# -- SPLADE ----------------------------------------------------------------------------


@pytest.mark.parametrize(("pooling", "activation"), [("max", "relu"), ("sum", "log1p_relu")])
def test_splade_graph_and_torch_reference_equal_sparse_encoder(tmp_path, pooling, activation):
    from optimum.exporters.onnx import main_export

    st_dir = build_splade(tmp_path / "splade", pooling=pooling, activation=activation)
    assert st_pipeline.checkpoint_task(st_dir) == "fill-mask"
    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None and parsed.pipeline.is_sparse
    pipe = parsed.pipeline
    assert (pipe.sparse.pooling, pipe.sparse.activation, pipe.output) == (pooling, activation, "sparse_embedding")
    assert pipe.similarity == "dot"
    encoder = st_mod.SparseEncoder(str(st_dir), device="cpu")
    want = encoder.encode(TEXTS, batch_size=4, convert_to_tensor=True).to_dense().numpy()
    assert want.shape == (len(TEXTS), pipe.dimension)
    np.testing.assert_allclose(st_pipeline.TorchPipeline(parsed).encode(TEXTS), want, rtol=1e-4, atol=1e-6)
    onnx_dir = tmp_path / "onnx"
    main_export(
        str(parsed.transformer_path),
        output=onnx_dir,
        task="fill-mask",
        library_name="transformers",
        do_validation=False,
        opset=18,
    )
    got = _encode_graph(_graph_session(onnx_dir / "model.onnx", parsed), st_dir, TEXTS, output="sparse_embedding")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_splade_modules_that_cannot_be_exported(tmp_path):
    st_dir = build_splade(tmp_path / "splade")
    modules = json.loads((st_dir / "modules.json").read_text())
    cfg_file = st_dir / "1_SpladePooling" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps(cfg | {"pooling_strategy": "mean"}))
    with pytest.raises(ExportError, match="SPLADE pooling 'mean'"):
        st_pipeline.read_pipeline(st_dir)
    cfg_file.write_text(json.dumps(cfg))
    bert_cfg = st_dir / "sentence_bert_config.json"
    bert_cfg.write_text(json.dumps(json.loads(bert_cfg.read_text()) | {"transformer_task": "feature-extraction"}))
    with pytest.raises(ExportError, match="fill-mask Transformer -> SpladePooling"):
        st_pipeline.read_pipeline(st_dir)
    modules[1]["type"] = "sentence_transformers.sparse_encoder.modules.SparseStaticEmbedding"
    (st_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ExportError, match="SparseStaticEmbedding"):
        st_pipeline.read_pipeline(st_dir)


def test_text_modality_other_than_forward_is_an_export_error(bases, tmp_path):
    """sentence-transformers pools the tensor sentence_bert_config.json's modality_config
    names for text (CLIP-like models: get_text_features' pooler_output); the graph is the
    model's forward(), so any other is refused by name rather than pooled from the wrong one."""
    base, _ = bases["bert"]
    st_dir = build_st(base, tmp_path / "st", pooling="mean")
    cfg_file = st_dir / "sentence_bert_config.json"
    cfg = json.loads(cfg_file.read_text())
    assert cfg["modality_config"]["text"] == {"method": "forward", "method_output_name": "last_hidden_state"}
    assert st_pipeline.read_pipeline(st_dir) is not None
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS[:2])
    cfg["modality_config"]["text"]["method_output_name"] = "pooler_output"
    cfg_file.write_text(json.dumps(cfg))
    # sentence-transformers does pool another tensor then
    got = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS[:2])
    assert got.shape != want.shape or not np.allclose(got, want)
    with pytest.raises(ExportError, match=r"modality_config text takes forward\(\)\.pooler_output"):
        st_pipeline.read_pipeline(st_dir)


def test_processing_kwargs_that_change_the_tokens_are_an_export_error(bases, tmp_path):
    """sentence_bert_config.json's processing_kwargs are the tokenizer call's arguments in
    encode: one that changes a text's tokens (add_special_tokens=False here) is refused by
    name, since the export tokenizes as the tokenizer does."""
    base, _ = bases["bert"]
    st_dir = build_st(base, tmp_path / "st", pooling="cls")
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS[:2])
    cfg_file = st_dir / "sentence_bert_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps(cfg | {"processing_kwargs": {"text": {"add_special_tokens": False}}}))
    got = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS[:2])
    assert not np.allclose(got, want)  # sentence-transformers does tokenize otherwise
    with pytest.raises(ExportError, match=r"processing_kwargs \['add_special_tokens'\]"):
        st_pipeline.read_pipeline(st_dir)
    cfg_file.write_text(json.dumps(cfg | {"processing_kwargs": {"common": {"padding": True}}}))
    assert st_pipeline.read_pipeline(st_dir) is not None
