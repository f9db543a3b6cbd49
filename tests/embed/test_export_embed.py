"""``export_model`` of sentence-transformers checkpoints: the graph carries the checkpoint's
own pipeline, the manifest records it, and the parity check's reference is the user's model
(sentence-transformers' encode, or ortbatch's torch implementation when it is hidden), so a
graph whose pooling disagrees with the checkpoint fails the checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("optimum.exporters.onnx")
st_mod = pytest.importorskip("sentence_transformers")

from ortbatch import export_model, validate  # noqa: E402
from ortbatch.embed import Embedder, EmbeddingPipeline  # noqa: E402
from ortbatch.errors import ExportError, ValidationError  # noqa: E402
from ortbatch.manifest import Manifest, model_hash  # noqa: E402
from tests.embed.stmodels import TEXTS, build_base, build_st, cosines  # noqa: E402

pytestmark = [pytest.mark.export, pytest.mark.slow]
MIN_COSINE = 0.9999
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bert_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_base("bert", tmp_path_factory.mktemp("base") / "bert")


@pytest.fixture(scope="module")
def cls_export(bert_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cls")
    st_dir = build_st(bert_base, root / "st-cls", pooling="cls", dense=((16, "Tanh"),), normalize=True)
    result = export_model(st_dir, root / "export", max_batch_size=4)
    return st_dir, result.directory


def test_export_carries_the_checkpoints_pipeline(cls_export):
    st_dir, export = cls_export
    manifest = Manifest.load(export)
    pipe = EmbeddingPipeline.from_manifest(manifest)
    assert pipe is not None
    assert (pipe.pooling, pipe.dimension, pipe.normalize, pipe.source) == (("cls",), 16, True, "sentence-transformers")
    assert pipe.quantization_ranges is not None
    assert "sentence_embedding" in manifest.outputs
    report = json.loads((export / "validation.json").read_text())
    parity = next(c for c in report["checks"] if c["check"] == "reference_parity")
    labels = [case["label"] for case in parity["cases"]]
    assert any("sentence_embedding vs sentence-transformers" in lb for lb in labels), labels
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS * 2, batch_size=3)
    with Embedder(export) as emb:
        got = emb.encode(TEXTS * 2)
    assert cosines(got, want).min() >= MIN_COSINE


def _mean_graph(export: Path, st_dir: Path, out: Path) -> Path:
    """The export with its CLS pooling swapped for mean: what ortbatch used to serve for a
    CLS checkpoint. The manifest is made consistent (hash, pipeline) so only the check can tell."""
    import onnx

    from ortbatch.export import st_pipeline

    shutil.copytree(export, out)
    model = onnx.load(str(out / "model.onnx"))
    graph = model.graph
    keep_nodes = ("ortbatch_embed/ids_shape", "ortbatch_embed/token_type_ids")  # the inputs, not the pooling
    ours = [n for n in graph.node if n.name.startswith("ortbatch_embed/") and n.name not in keep_nodes]
    for n in ours:
        graph.node.remove(n)
    keep = [i for i in graph.initializer if not i.name.startswith("ortbatch_embed/")]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    for o in [o for o in graph.output if o.name == "sentence_embedding"]:
        graph.output.remove(o)
    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None
    import dataclasses

    parsed.pipeline = dataclasses.replace(parsed.pipeline, pooling=("mean",))
    st_pipeline.append_pipeline(model, parsed)
    onnx.save(model, str(out / "model.onnx"))
    manifest = Manifest.load(out)
    manifest.extra["components"]["model"]["sha256"] = model_hash(out / "model.onnx")
    manifest.extra["embedding"]["pooling"] = ["mean"]
    manifest.save(out)
    return out


def test_pooling_that_disagrees_with_the_checkpoint_fails(cls_export, tmp_path):
    st_dir, export = cls_export
    bad = _mean_graph(export, st_dir, tmp_path / "mean-for-cls")
    report = validate(bad)
    assert not report.passed
    failed = [c for c in report.failed() if c.name == "reference_parity"]
    assert failed, report.summary()
    cos = [
        comp.metric_value
        for case in failed[0].cases
        for comp in case.comparisons
        if comp.output == "sentence_embedding" and not comp.passed
    ]
    assert cos and cos[0] is not None and cos[0] < 0.99
    # the CLI names the check and the cosine; serve refuses it
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "validate", str(bad)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "reference_parity" in text and "sentence_embedding" in text, text
    assert "cosine" in text, text
    from ortbatch.commands.serve import refuse_failed_checks

    with pytest.raises(ValidationError, match="allow-unvalidated"):
        refuse_failed_checks(bad, allow_unvalidated=False)
    refuse_failed_checks(bad, allow_unvalidated=True)
    # `ortbatch serve` as users run it: refused before it binds or loads, one line, exit 2
    out = subprocess.run(
        [sys.executable, "-m", "ortbatch.cli", "serve", str(bad), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode != 0 and "allow-unvalidated" in out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr


_HIDDEN = textwrap.dedent(
    """
    import sys, json
    from tests.embed.stmodels import block_sentence_transformers
    block_sentence_transformers()
    import numpy as np
    from ortbatch import export_model
    from ortbatch.embed import Embedder
    from tests.embed.stmodels import TEXTS
    st_dir, out, npy = sys.argv[1:4]
    result = export_model(st_dir, out, max_batch_size=4)
    report = json.load(open(out + "/validation.json"))
    parity = next(c for c in report["checks"] if c["check"] == "reference_parity")
    print("LABELS", [case["label"] for case in parity["cases"]])
    with Embedder(out) as emb:
        np.save(npy, emb.encode(TEXTS))
    """
)


def test_export_without_sentence_transformers(bert_base, tmp_path):
    """Exported where sentence-transformers cannot be imported (checked against ortbatch's
    torch reference), then embedded in process there and served here: each equals
    sentence-transformers' encode, the checkpoint's default prompt included."""
    st_dir = build_st(
        bert_base,
        tmp_path / "st",
        pooling="lasttoken",
        include_prompt=False,
        dense=((8, "ReLU"),),
        normalize=False,
        prompts={"query": "query: ", "passage": "passage: "},
        default_prompt_name="query",
    )
    model = st_mod.SentenceTransformer(str(st_dir), device="cpu")
    want = model.encode(TEXTS, batch_size=4)
    npy = tmp_path / "hidden.npy"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", _HIDDEN, str(st_dir), str(tmp_path / "export"), str(npy)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sentence_embedding vs torch reference" in done.stdout
    assert cosines(np.load(npy), want).min() >= MIN_COSINE
    httpx = pytest.importorskip("httpx")
    from ortbatch.serve import BackgroundServer, ServedModel

    with BackgroundServer(ServedModel.load(tmp_path / "export", name="hidden")) as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS * 2}, timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert cosines(got, model.encode(TEXTS * 2, batch_size=5)).min() >= MIN_COSINE
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS, "prompt_name": "passage"}, timeout=60)
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert cosines(got, model.encode(TEXTS, prompt_name="passage")).min() >= MIN_COSINE


def test_plain_transformer_pooled_by_the_flag(bert_base, tmp_path):
    said: list[str] = []
    result = export_model(bert_base, tmp_path / "export", pooling="cls", max_batch_size=4, progress=said.append)
    assert any("cls pooling" in s and "--pooling" in s for s in said), said
    pipe = EmbeddingPipeline.from_manifest(result.manifest)
    assert pipe is not None and pipe.pooling == ("cls",) and pipe.source == "pooling-flag"
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bert_base))
    model = AutoModel.from_pretrained(str(bert_base)).eval()
    import torch

    with torch.inference_mode():
        want = np.stack([model(**tok(t, return_tensors="pt")).last_hidden_state[0, 0].numpy() for t in TEXTS])
    with Embedder(result.directory) as emb:
        got = emb.encode(TEXTS)
    assert cosines(got, want).min() >= MIN_COSINE


@pytest.mark.parametrize("setting", ["max_seq_length", "tokenizer_args", "processor_kwargs", "processing_kwargs"])
def test_checkpoint_max_seq_length_truncates_as_encode(bert_base, tmp_path, setting):
    """A checkpoint whose sentence_bert_config.json sets max_seq_length (or the tokenizer's
    model_max_length in tokenizer_args / processor_kwargs, or its call's max_length in
    processing_kwargs) below the tokenizer's own
    model_max_length (as all-MiniLM-L6-v2: 256 vs 512) is truncated where encode
    truncates, and its checks (on samples longer than that) pass; a longer
    max_sequence_length is refused, naming the setting."""
    st_dir = build_st(bert_base, tmp_path / "st", pooling="mean", normalize=True)
    cfg_file = st_dir / "sentence_bert_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg[setting] = {
        "max_seq_length": 12,
        "processing_kwargs": {"text": {"max_length": 12}},  # the tokenizer call's
    }.get(setting, {"model_max_length": 12})
    cfg_file.write_text(json.dumps(cfg))
    tok_file = st_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_file.read_text())
    tok_cfg["model_max_length"] = 128
    tok_file.write_text(json.dumps(tok_cfg))
    model = st_mod.SentenceTransformer(str(st_dir), device="cpu")
    # (processing_kwargs' max_length is the tokenizer call's: max_seq_length does not show it)
    assert model.max_seq_length == (128 if setting == "processing_kwargs" else 12)
    texts = [*TEXTS, " ".join(TEXTS)]
    assert max(len(model.tokenizer(t)["input_ids"]) for t in texts) > 12
    result = export_model(st_dir, tmp_path / "export", max_batch_size=4, samples=texts)
    assert result.manifest.max_sequence_length == 12
    with Embedder(result.directory) as emb:
        got = emb.embed(texts)
    assert cosines(got.vectors, model.encode(texts, batch_size=3)).min() >= MIN_COSINE
    assert max(got.tokens) == 12
    with pytest.raises(ExportError, match=r"max_seq_length=12 .*sentence_bert_config\.json"):
        export_model(st_dir, tmp_path / "longer", max_sequence_length=64, validate=False)


def test_encoder_decoder_checkpoint_is_an_export_error(tmp_path):
    """sentence-transformers embeds a T5 checkpoint with its encoder alone; ortbatch's
    feature-extraction graph of it would be the whole seq2seq model, so the export is
    refused by name instead of failing later on decoder_input_ids."""
    import torch
    from transformers import T5Config, T5EncoderModel

    from tests.embed.stmodels import _tokenizer

    torch.manual_seed(0)
    tok = _tokenizer("gpt2")
    base = tmp_path / "t5"
    cfg = T5Config(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, pad_token_id=0)
    T5EncoderModel(cfg).eval().save_pretrained(base)
    tok.save_pretrained(base)
    st_dir = build_st(base, tmp_path / "st", pooling="mean")
    assert st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS).shape == (len(TEXTS), 32)
    with pytest.raises(ExportError, match=r"encoder-decoder \(t5\).*encoder alone"):
        export_model(st_dir, tmp_path / "export", validate=False)
    assert not (tmp_path / "export").exists()


def test_transformer_in_a_subfolder(bert_base, tmp_path):
    """An older sentence-transformers layout keeps the Transformer in 0_Transformer/
    (modules.json's path): the export takes the transformer from there and the pipeline
    from the root, and equals encode."""
    st_dir = build_st(bert_base, tmp_path / "st", pooling="cls", dense=((8, "Tanh"),), normalize=True)
    sub = st_dir / "0_Transformer"
    sub.mkdir()
    for f in st_dir.iterdir():
        if f.is_file() and f.name not in ("modules.json", "config_sentence_transformers.json", "README.md"):
            f.rename(sub / f.name)
    modules = json.loads((st_dir / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (st_dir / "modules.json").write_text(json.dumps(modules))
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS, batch_size=4)
    result = export_model(st_dir, tmp_path / "export", max_batch_size=4)
    pipe = EmbeddingPipeline.from_manifest(result.manifest)
    assert pipe is not None and (pipe.pooling, pipe.dimension) == (("cls",), 8)
    assert result.manifest.source["embedding_checkpoint"] == str(st_dir)
    with Embedder(result.directory) as emb:
        assert cosines(emb.encode(TEXTS), want).min() >= MIN_COSINE


def test_left_truncating_tokenizer_is_an_export_error(bert_base, tmp_path):
    """encode cuts a long text where the checkpoint's tokenizer says (truncation_side left:
    its last tokens kept); ortbatch keeps the first ones, so such a checkpoint is refused by
    name rather than embedding long texts differently."""
    st_dir = build_st(bert_base, tmp_path / "st", pooling="mean")
    tok_file = st_dir / "tokenizer_config.json"
    tok_file.write_text(json.dumps(json.loads(tok_file.read_text()) | {"truncation_side": "left"}))
    model = st_mod.SentenceTransformer(str(st_dir), device="cpu")
    long = " ".join(TEXTS) * 3
    ids = model.tokenizer(long, truncation=True, max_length=model.max_seq_length)["input_ids"]
    assert ids[1:-1] != model.tokenizer(long)["input_ids"][1 : len(ids) - 1]  # sentence-transformers keeps the end
    with pytest.raises(ExportError, match=r"tokenizer_config\.json: truncation_side='left'"):
        export_model(st_dir, tmp_path / "export", validate=False)


def test_do_lower_case_lowercases_as_encode(bert_base, tmp_path):
    """sentence_bert_config.json's do_lower_case: encode lowercases texts before its
    tokenizer (whose vocabulary here is lowercase only, so case changes the answer); the
    export's tokenizer.json lowercases too, for the checks, the Embedder and the server."""
    st_dir = build_st(bert_base, tmp_path / "st", pooling="mean")
    texts = [t.upper() if i % 2 else t.title() for i, t in enumerate(TEXTS)]
    plain = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(texts)
    cfg_file = st_dir / "sentence_bert_config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"do_lower_case": True}))
    want = st_mod.SentenceTransformer(str(st_dir), device="cpu").encode(texts, batch_size=4)
    assert cosines(plain, want).min() < 0.99  # lowercasing does change the answer
    from ortbatch.export import st_pipeline

    parsed = st_pipeline.read_pipeline(st_dir)
    assert parsed is not None and parsed.lower_case
    # the checks' reference where sentence-transformers is not installed
    assert cosines(st_pipeline.TorchPipeline(parsed).encode(texts), want).min() >= MIN_COSINE
    result = export_model(st_dir, tmp_path / "export", max_batch_size=4, samples=texts)
    with Embedder(result.directory) as emb:
        assert cosines(emb.encode(texts), want).min() >= MIN_COSINE
