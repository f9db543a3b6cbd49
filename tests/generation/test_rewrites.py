"""The decoder graph rewrites (ortbatch.generation.rewrites): where they apply, where they
must not, and that a rewritten graph computes what the export computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ortbatch.generation import rewrites as rewrites_module
from ortbatch.generation.rewrites import (
    ATTENTION_SCALE,
    IN_PLACE_KV,
    LAST_POSITION_LOGITS,
    RewrittenGraph,
    rewrite_decoder,
    write_model,
)

from .conftest import TinyModel

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

B, H, S, D = 2, 3, 5, 4


def _scores_graph(
    path: Path, scale: np.ndarray | None, *, perm: tuple[int, ...] = (0, 1, 3, 2), expose: bool = False
) -> Path:
    """scores = q @ (transpose(k) * s), the shape of an exported SDPA; ``scale=None``
    makes ``s`` a graph input whose shape is not known statically."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=list(perm)),
        helper.make_node("Mul", ["kt", "s"], ["kts"]),
        helper.make_node("MatMul", ["q", "kts"], ["scores"]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", H, 1, D]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, ["b", H, "past", D]),
    ]
    inits = []
    if scale is None:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    else:
        inits.append(numpy_helper.from_array(scale.astype(np.float32), "s"))
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)]
    if expose:  # the transposed keys are read by something else too
        outputs.append(helper.make_tensor_value_info("kt", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "scores", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _run(model: str | bytes, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("scale", [np.array(0.35), np.array([0.35]), np.full((1, 1, 1, 1), 0.35)])
def test_one_element_scale_moves_after_the_scores(tmp_path: Path, scale: np.ndarray) -> None:
    path = _scores_graph(tmp_path / "m.onnx", scale)
    rewritten = rewrite_decoder(path, last_position=False)
    assert rewritten is not None and rewritten.rewrites == {ATTENTION_SCALE: 1}
    assert isinstance(rewritten.model, str)
    nodes = onnx.load(rewritten.model).graph.node
    assert [n.op_type for n in nodes] == ["Transpose", "MatMul", "Mul"]  # topologically sorted
    rs = np.random.RandomState(0)
    feed = {"q": rs.randn(B, H, 1, D).astype(np.float32), "k": rs.randn(B, H, S, D).astype(np.float32)}
    np.testing.assert_allclose(_run(rewritten.model, feed)[0], _run(str(path), feed)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("scale", "perm", "expose"),
    [
        (np.full((D, 1), 0.35), (0, 1, 3, 2), False),  # differs along the contracted axis
        (None, (0, 1, 3, 2), False),  # shape unknown until run time
        (np.array(0.35), (0, 1, 3, 2), True),  # transposed keys are also a graph output
        (np.array(0.35), (1, 0, 3, 2), False),  # not only the last two axes swapped
    ],
)
def test_scale_stays_where_moving_it_is_not_proven_safe(
    tmp_path: Path, scale: np.ndarray | None, perm: tuple[int, ...], expose: bool
) -> None:
    path = _scores_graph(tmp_path / "m.onnx", scale, perm=perm, expose=expose)
    assert rewrite_decoder(path, last_position=False) is None


def test_nothing_asked_nothing_done(tmp_path: Path) -> None:
    path = _scores_graph(tmp_path / "m.onnx", np.array(0.35))
    assert rewrite_decoder(path, last_position=False, attention=False) is None


def test_rewritten_export_computes_the_same(tiny: TinyModel) -> None:
    """On real optimum exports (GPT-2; Llama with grouped KV heads): the attention scale is
    moved in every layer and the LM head slices the last position; presents and the last
    position's logits match the export's, on left-padded rows with a past."""
    path = tiny.export / "model.onnx"
    rewritten = rewrite_decoder(path)
    assert rewritten is not None
    assert rewritten.rewrites == {LAST_POSITION_LOGITS: 1, ATTENTION_SCALE: 2}  # two layers
    original = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    new = ort.InferenceSession(rewritten.model, providers=["CPUExecutionProvider"])
    rs = np.random.RandomState(1)
    rows, past, seq = 3, 6, 4
    mask = np.ones((rows, past + seq), np.int64)
    mask[1, :3] = 0  # a left-padded row
    positions = (np.cumsum(mask, axis=1) - 1).clip(min=0)[:, past:]
    feed: dict[str, np.ndarray] = {
        "input_ids": rs.randint(4, 300, size=(rows, seq)),
        "attention_mask": mask,
        "position_ids": positions,
    }
    for inp in original.get_inputs():
        if inp.name.startswith("past_key_values"):
            heads, dim = inp.shape[1], inp.shape[3]
            feed[inp.name] = rs.randn(rows, heads, past, dim).astype(np.float32)
    names = [o.name for o in original.get_outputs()]
    want = dict(zip(names, original.run(None, feed), strict=True))
    got = dict(zip(names, new.run(names, feed), strict=True))
    assert got["logits"].shape == (rows, 1, want["logits"].shape[-1])
    np.testing.assert_allclose(got["logits"][:, 0], want["logits"][:, -1], rtol=1e-4, atol=1e-4)
    for name in names[1:]:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


@pytest.fixture
def external_export(tiny_gpt2: TinyModel, tmp_path: Path) -> Path:
    """The tiny GPT-2 export with its weights moved to an external data file, as large
    models (over protobuf's 2 GiB) always are."""
    import shutil

    out = tmp_path / "external"
    shutil.copytree(tiny_gpt2.export, out, ignore=shutil.ignore_patterns("model.onnx"))
    model = onnx.load(str(tiny_gpt2.export / "model.onnx"))
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx_data", size_threshold=0)
    return out


def test_external_data_model_is_rewritten_beside_its_data(external_export: Path, tiny_gpt2: TinyModel) -> None:
    before = sorted(p.name for p in external_export.iterdir())
    rewritten = rewrite_decoder(external_export / "model.onnx")
    assert rewritten is not None and isinstance(rewritten.model, str)
    assert Path(rewritten.model).parent == external_export  # where the data's relative path resolves
    assert rewritten.rewrites == {LAST_POSITION_LOGITS: 1, ATTENTION_SCALE: 2}
    with rewritten:
        session = ort.InferenceSession(rewritten.model, providers=["CPUExecutionProvider"])
    assert sorted(p.name for p in external_export.iterdir()) == before  # the temporary graph is gone
    inputs = {i.name: i for i in session.get_inputs()}
    feed = {"input_ids": np.array([[5, 6, 7]]), "attention_mask": np.ones((1, 3), np.int64)}
    feed["position_ids"] = np.array([[0, 1, 2]])
    for name, inp in inputs.items():
        if name.startswith("past_key_values"):
            feed[name] = np.zeros((1, inp.shape[1], 0, inp.shape[3]), np.float32)
    original = ort.InferenceSession(str(tiny_gpt2.export / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        session.run(["logits"], feed)[0][:, -1], original.run(["logits"], feed)[0][:, -1], atol=1e-4
    )


def test_generator_on_an_external_data_export(external_export: Path, tiny_gpt2: TinyModel) -> None:
    from ortbatch import BatchedGenerator

    before = sorted(p.name for p in external_export.iterdir())
    for kv_cache, rewrites in (
        ("auto", {LAST_POSITION_LOGITS, IN_PLACE_KV}),
        ("concat", {LAST_POSITION_LOGITS, ATTENTION_SCALE}),
    ):
        with BatchedGenerator(external_export, max_batch_size=2, kv_cache=kv_cache) as gen:
            assert set(gen.graph_rewrites) == rewrites
            prompt = [5, 9, 40, 41, 7]
            assert list(gen.generate(prompt, 12).token_ids) == tiny_gpt2.reference(prompt, 12)
    assert sorted(p.name for p in external_export.iterdir()) == before


def test_unreadable_graph_is_left_to_onnxruntime(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No exception escapes a rewrite: a file onnx cannot parse runs as it is (and ONNX
    Runtime raises its own, typed, error when it loads it)."""
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x08\x07\x12not a model at all")
    assert rewrite_decoder(path) is None
    assert "graph rewrites skipped" in caplog.text


@pytest.mark.parametrize("also_read", [False, True])
def test_last_position_through_a_cast(tmp_path: Path, also_read: bool) -> None:
    """fp16 exports with float32 outputs end in Cast(MatMul(hidden, W)): the LM head still
    gets the last-position slice, unless something else reads the MatMul's output."""
    w = numpy_helper.from_array(np.random.RandomState(0).randn(D, 7).astype(np.float16), "w")
    nodes = [
        helper.make_node("MatMul", ["hidden", "w"], ["scores16"]),
        helper.make_node("Cast", ["scores16"], ["logits"], to=TensorProto.FLOAT),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 7])]
    if also_read:
        nodes.append(helper.make_node("Identity", ["scores16"], ["other"]))
        outputs.append(helper.make_tensor_value_info("other", TensorProto.FLOAT16, None))
    inputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT16, ["b", "s", D])]
    model = helper.make_model(
        helper.make_graph(nodes, "lm", inputs, outputs, initializer=[w]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    rewritten = rewrite_decoder(path, attention=False)
    if also_read:
        assert rewritten is None
        return
    assert rewritten is not None and rewritten.rewrites == {LAST_POSITION_LOGITS: 1}
    hidden = np.random.RandomState(1).randn(2, 5, D).astype(np.float16)
    got = _run(rewritten.model, {"hidden": hidden})[0]
    want = _run(str(path), {"hidden": hidden})[0]
    assert got.shape == (2, 1, 7)
    np.testing.assert_allclose(got[:, 0], want[:, -1], rtol=1e-3)


def test_generator_runs_the_export_when_the_rewritten_graph_does_not_load(
    tiny_gpt2: TinyModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rewrite must never cost a working export: a rewritten graph ONNX Runtime refuses
    falls back to the export as it is (unless the rewrite was required)."""
    import ortbatch.generation.runner as runner_module
    from ortbatch import BatchedGenerator
    from ortbatch.errors import OrtBatchError
    from ortbatch.generation.rewrites import RewrittenGraph

    broken = RewrittenGraph(b"\x08\x07not a model", {LAST_POSITION_LOGITS: 1, ATTENTION_SCALE: 2})
    monkeypatch.setattr(runner_module, "rewrite_decoder", lambda *a, **k: broken)
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=2) as gen:
        assert gen.graph_rewrites == {} and not gen.last_position_logits and gen.kv_cache == "concat"
        assert list(gen.generate([5, 6, 7], 6).token_ids) == tiny_gpt2.reference([5, 6, 7], 6)
    assert "running the export as it is" in caplog.text
    with pytest.raises(OrtBatchError):
        BatchedGenerator(tiny_gpt2.export, last_position_logits=True)


def test_in_place_graph_that_does_not_load_falls_back_to_the_other_rewrites(
    tiny_gpt2: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An in-place graph ONNX Runtime refuses costs the in-place cache only: the export's own
    cache runs, with the other rewrites, and says why (``kv_cache='in-place'``: an error)."""
    import ortbatch.generation.runner as runner_module
    from ortbatch import BatchedGenerator
    from ortbatch.errors import ModelContractError
    from ortbatch.generation.rewrites import RewrittenGraph

    real = runner_module.rewrite_decoder

    def rewrite(*args: object, **kwargs: object) -> RewrittenGraph | None:
        if kwargs.get("in_place") is not None:
            return RewrittenGraph(b"\x08\x07not a model", {IN_PLACE_KV: 2, LAST_POSITION_LOGITS: 1})
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "rewrite_decoder", rewrite)
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=2) as gen:
        assert gen.kv_cache == "concat" and "did not load" in gen.kv_cache_reason
        assert set(gen.graph_rewrites) == {LAST_POSITION_LOGITS, ATTENTION_SCALE}
        assert list(gen.generate([5, 6, 7], 6).token_ids) == tiny_gpt2.reference([5, 6, 7], 6)
    with pytest.raises(ModelContractError, match="did not load"):
        BatchedGenerator(tiny_gpt2.export, kv_cache="in-place")


def test_an_onnxruntime_without_query_seqlens_keeps_the_exports_cache_and_says_so(
    tiny_gpt2: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime 1.31's GroupQueryAttention takes 16 inputs and refuses the in-place graph
    (seen with onnxruntime-gpu 1.31.1): the version is checked first, so no in-place graph is
    built or loaded, the other rewrites run, and the reason names the version needed."""
    import onnxruntime as ort

    import ortbatch.generation.runner as runner_module
    from ortbatch import BatchedGenerator
    from ortbatch.errors import ModelContractError

    real, asked = runner_module.rewrite_decoder, []

    def rewrite(*args: object, **kwargs: object) -> Any:
        asked.append(kwargs.get("in_place"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "rewrite_decoder", rewrite)
    monkeypatch.setattr(ort, "__version__", "1.31.1")
    with BatchedGenerator(tiny_gpt2.export, max_batch_size=2) as gen:
        assert gen.kv_cache == "concat" and gen.runner.prefix_cache is None  # no prefix cache without it
        assert gen.kv_cache_reason == (
            "the in-place cache needs onnxruntime >= 1.32 (GroupQueryAttention's query_seqlens input); this is 1.31.1"
        )
        assert set(gen.graph_rewrites) == {LAST_POSITION_LOGITS, ATTENTION_SCALE}
        assert list(gen.generate([5, 6, 7], 6).token_ids) == tiny_gpt2.reference([5, 6, 7], 6)
    assert asked and all(spec is None for spec in asked)
    with pytest.raises(ModelContractError, match=r"needs onnxruntime >= 1\.32.*this is 1\.31\.1"):
        BatchedGenerator(tiny_gpt2.export, kv_cache="in-place")


# -- how the rewritten graph reaches ONNX Runtime ----------------------------------------------


def _weights_model(sizes: list[int]) -> Any:
    """``y = x + w0 + w1 + ...`` with one float32 weight of each size (elements), in that
    order, and the fields of a real export around them (metadata, a doc string, opsets)."""
    rs = np.random.RandomState(0)
    weights = [numpy_helper.from_array(rs.randn(n).astype(np.float32), f"w{i}") for i, n in enumerate(sizes)]
    names = ["x"] + [w.name for w in weights]
    nodes = [helper.make_node("Sum", names, ["y"])]
    graph = helper.make_graph(
        nodes,
        "weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [max(sizes)])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [max(sizes)])],
        initializer=weights,
        doc_string="a graph",
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests")
    model.ir_version = 8
    helper.set_model_props(model, {"origin": "test_rewrites"})
    return model


@pytest.mark.parametrize("piece", [1 << 30, 1000, 1])
def test_write_model_parses_back_to_the_same_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    """Written a piece at a time (every initializer alone, small ones grouped, or the whole
    graph in one piece), the file is the same model: equal messages, initializers in their
    order, and the same answers from ONNX Runtime."""
    monkeypatch.setattr(rewrites_module, "_PIECE_BYTES", piece)
    sizes = [1, 4000, 1, 1, 1, 4000, 1]  # large and small weights in turn (Sum broadcasts the 1s)
    model = _weights_model(sizes)
    path = tmp_path / "m.onnx"
    with open(path, "wb") as f:
        write_model(model, f)
    back = onnx.load(str(path))
    assert back == model
    assert [t.name for t in back.graph.initializer] == [f"w{i}" for i in range(len(sizes))]
    x = np.arange(4000, dtype=np.float32)
    np.testing.assert_array_equal(_run(str(path), {"x": x})[0], _run(model.SerializeToString(), {"x": x})[0])


_WRITE_PEAK = """
import sys
from pathlib import Path
import onnx
from ortbatch.generation.rewrites import write_model
model = onnx.load(sys.argv[1])
def rss(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
try:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
except OSError:
    print("unmeasurable"); sys.exit()
before = rss("VmRSS:")
if sys.argv[2] == "pieces":
    with open(sys.argv[3], "wb") as f:
        write_model(model, f)
else:
    data = model.SerializeToString()
print((rss("VmHWM:") - before) * 1024)
"""


def test_write_model_never_holds_the_whole_model(tmp_path: Path) -> None:
    """The point of writing in pieces: serializing a model in one call costs more than its
    own size again in memory (protobuf's growing buffer, then a copy into ``bytes``); pieces
    cost about the largest weight. Six weights of 24 MB each, in a fresh process."""
    import subprocess
    import sys

    path = tmp_path / "m.onnx"
    onnx.save(_weights_model([6 << 20] * 6), str(path))
    size = path.stat().st_size

    def peak(how: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _WRITE_PEAK, str(path), how, str(tmp_path / "w.onnx")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if out == "unmeasurable":
            pytest.skip("this kernel does not let a process reset its peak RSS")
        return int(out)

    whole, pieces = peak("whole"), peak("pieces")
    assert whole > size  # what the test guards against is measurable here
    assert pieces < size / 4, f"writing in pieces raised the peak by {pieces / 2**20:.0f} MiB"
    assert onnx.load(str(tmp_path / "w.onnx")) == onnx.load(str(path))


def test_inline_model_is_written_under_its_own_name_and_removed(tiny_gpt2: TinyModel) -> None:
    """A rewritten graph with inline weights is a file, not bytes (ONNX Runtime would keep the
    bytes for the session's life), named as the original (TensorRT's engine cache keys a graph
    by its file name), in a folder of its own beside the export; closing removes both."""
    export = tiny_gpt2.export
    before = sorted(p.name for p in export.iterdir())
    rewritten = rewrite_decoder(export / "model.onnx")
    assert rewritten is not None and isinstance(rewritten.model, str)
    graph = Path(rewritten.model)
    assert graph.name == "model.onnx" and graph.parent.parent == export and graph.parent == Path(rewritten.folder)
    with rewritten:
        ort.InferenceSession(rewritten.model, providers=["CPUExecutionProvider"])
    assert sorted(p.name for p in export.iterdir()) == before


def test_where_the_rewritten_graph_goes_when_the_export_folder_is_read_only(
    tiny_gpt2: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside the export when that folder can be written; else in the system's temporary
    directory; else bytes, so that a read-only model folder still gets its rewrites. A
    model with external data can only be rewritten beside it (covered above)."""
    export = tiny_gpt2.export
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(rewrites_module.tempfile, "tempdir", str(system_tmp))
    real_mkdtemp = rewrites_module.tempfile.mkdtemp
    refused: set[str] = {str(export)}

    def mkdtemp(prefix: str = "", dir: str | Path | None = None) -> str:
        if str(dir if dir is not None else system_tmp) in refused:
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkdtemp(prefix=prefix, dir=dir)

    monkeypatch.setattr(rewrites_module.tempfile, "mkdtemp", mkdtemp)
    rewritten = rewrite_decoder(export / "model.onnx")
    assert rewritten is not None and isinstance(rewritten.model, str)
    assert Path(rewritten.model).parent.parent == system_tmp
    rewritten.close()
    assert list(system_tmp.iterdir()) == []

    refused.add(str(system_tmp))
    rewritten = rewrite_decoder(export / "model.onnx")
    assert rewritten is not None and isinstance(rewritten.model, bytes)
    assert rewritten.rewrites == {LAST_POSITION_LOGITS: 1, ATTENTION_SCALE: 2}
    assert onnx.load_from_string(rewritten.model).graph.node  # a whole model
    rewritten.close()  # nothing to remove


def test_a_failed_write_leaves_nothing_behind(tiny_gpt2: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half way (a full disk) removes its partial file and folder, and the
    next place is tried."""
    export = tiny_gpt2.export
    before = sorted(p.name for p in export.iterdir())
    calls = []

    def full_disk(model: Any, file: Any) -> None:
        calls.append(file.name)
        file.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rewrites_module, "write_model", full_disk)
    rewritten = rewrite_decoder(export / "model.onnx")
    assert isinstance(rewritten, RewrittenGraph) and isinstance(rewritten.model, bytes)  # the last resort
    assert len(calls) == 2 and all(not Path(c).exists() and not Path(c).parent.exists() for c in calls)
    assert sorted(p.name for p in export.iterdir()) == before
