"""The padding collator: checks, pad/stack, split/trim. Pure numpy."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ortbatch.errors import InferenceError, InvalidInputError, ModelContractError
from ortbatch.runtime.collate import PaddingCollator
from ortbatch.runtime.signature import ModelSignature


def arg(name, type_, shape):
    return SimpleNamespace(name=name, type=type_, shape=shape)


def signature(side="right", **kw):
    inputs = [
        arg("input_ids", "tensor(int64)", ["batch_size", "sequence_length"]),
        arg("attention_mask", "tensor(int64)", ["batch_size", "sequence_length"]),
    ]
    outputs = [
        arg("last_hidden_state", "tensor(float)", ["batch_size", "sequence_length", 4]),
        arg("pooler_output", "tensor(float)", ["batch_size", 4]),
    ]
    return ModelSignature.from_node_args(inputs, outputs, padding_side=side, **kw)


def item(c, n, rows=1, start=1):
    ids = np.arange(start, start + rows * n, dtype=np.int64).reshape(rows, n)
    return c.prepare({"input_ids": ids, "attention_mask": np.ones((rows, n), np.int64)})


def test_graph_inference_shared_symbolic_dim_is_one_ragged_axis():
    sig = signature()
    assert sig.inputs["input_ids"].ragged_axes == ((1, "sequence_length"),)
    assert sig.outputs["last_hidden_state"].ragged == ((1, "sequence_length"),)
    assert sig.outputs["pooler_output"].ragged == ()


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_pads_and_split_trims(side):
    c = PaddingCollator(signature(side, pad_values={"input_ids": 9}))
    items = [item(c, 2, start=1), item(c, 5, rows=2, start=100), item(c, 1, start=50)]
    assert [it.rows for it in items] == [1, 2, 1] and [it.length for it in items] == [2, 5, 1]
    feed, state = c.collate(items)
    ids = feed["input_ids"]
    assert ids.shape == (4, 5)
    if side == "right":
        assert ids[0].tolist() == [1, 2, 9, 9, 9]
        assert feed["attention_mask"][0].tolist() == [1, 1, 0, 0, 0]
    else:
        assert ids[0].tolist() == [9, 9, 9, 1, 2]
        assert feed["attention_mask"][3].tolist() == [0, 0, 0, 0, 1]
    hidden = np.repeat(ids[:, :, None].astype(np.float32), 4, axis=2)
    pooled = ids.sum(axis=1, keepdims=True).repeat(4, axis=1).astype(np.float32)
    out = c.split({"last_hidden_state": hidden, "pooler_output": pooled}, state)
    assert [o["last_hidden_state"].shape for o in out] == [(1, 2, 4), (2, 5, 4), (1, 1, 4)]
    assert out[0]["last_hidden_state"][0, :, 0].tolist() == [1, 2]
    assert out[2]["last_hidden_state"][0, :, 0].tolist() == [50]
    assert out[1]["pooler_output"].shape == (2, 4)


def test_split_refuses_outputs_without_the_batch_rows():
    c = PaddingCollator(signature())
    _, state = c.collate([item(c, 2), item(c, 3)])
    with pytest.raises(InferenceError, match="batch axis"):
        c.split({"pooler_output": np.zeros((1, 4), np.float32)}, state)
    with pytest.raises(InferenceError, match="cannot trim"):
        c.split({"last_hidden_state": np.zeros((2, 7, 4), np.float32)}, state)


def test_single_item_is_passed_through_without_copy():
    c = PaddingCollator(signature())
    it = item(c, 3)
    feed, _ = c.collate([it])
    assert np.shares_memory(feed["input_ids"], it.feed["input_ids"])


def test_unnamed_dynamic_dims_are_ragged_on_their_own():
    sig = ModelSignature.from_node_args(
        [arg("x", "tensor(float)", [None, None, 3])], [arg("y", "tensor(float)", [None, None, 3])]
    )
    assert sig.inputs["x"].ragged_axes == ((1, "x.1"),)
    assert sig.outputs["y"].ragged == ()


def test_signature_contract_errors():
    with pytest.raises(ModelContractError, match="scalar"):
        ModelSignature.from_node_args([arg("x", "tensor(float)", ["b"])], [arg("y", "tensor(float)", [])])
    with pytest.raises(ModelContractError, match="fixed batch"):
        ModelSignature.from_node_args([arg("x", "tensor(float)", [2, 3])], [arg("y", "tensor(float)", ["b"])])
    with pytest.raises(ModelContractError, match="unsupported tensor type"):
        ModelSignature.from_node_args([arg("x", "tensor(complex64)", ["b"])], [])


def test_prepare_messages_name_the_input():
    c = PaddingCollator(signature())
    with pytest.raises(InvalidInputError, match=r"'attention_mask' has sequence_length length 3 but 'input_ids' has 2"):
        c.prepare({"input_ids": np.ones((1, 2), np.int64), "attention_mask": np.ones((1, 3), np.int64)})
