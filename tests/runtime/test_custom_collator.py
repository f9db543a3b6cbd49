"""A user-written collator, end to end: images of different sizes, no batch dim on the
request, padded to the batch's largest with a mask the model honours."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from ortbatch import BatchedSession, Collator, InvalidInputError
from ortbatch.runtime import Prepared
from tests.models import image_mean_model
from tests.runtime.helpers import GatedSession


class ImageCollator(Collator):
    """Requests are ``{"image": uint8 array [H, W, 3]}``; the model takes float CHW plus a mask."""

    def prepare(self, feed: Any) -> Prepared:
        img = feed.get("image") if isinstance(feed, Mapping) else None
        if not isinstance(img, np.ndarray) or img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
            raise InvalidInputError("image must be a uint8 array of shape [H, W, 3]", input_name="image")
        h, w, _ = img.shape
        return Prepared(img, rows=1, length=h * w, lengths={"height": h, "width": w})

    def collate(self, items: Sequence[Prepared]) -> tuple[dict[str, np.ndarray], Any]:
        h = max(it.feed.shape[0] for it in items)
        w = max(it.feed.shape[1] for it in items)
        pixels = np.zeros((len(items), 3, h, w), np.float32)
        mask = np.zeros((len(items), 1, h, w), np.float32)
        for i, it in enumerate(items):
            ih, iw, _ = it.feed.shape
            pixels[i, :, :ih, :iw] = it.feed.transpose(2, 0, 1) / 255.0
            mask[i, :, :ih, :iw] = 1.0
        return {"pixels": pixels, "mask": mask}, len(items)

    def split(self, outputs: Mapping[str, np.ndarray], state: Any) -> list[dict[str, np.ndarray]]:
        return [{name: arr[i] for name, arr in outputs.items()} for i in range(state)]


def test_custom_collator_images_of_different_sizes(tmp_path):
    """Eight client threads, 300 images of different sizes: each gets its own image's mean.
    The first batch is held at a gate until every client has a request queued, so images of
    different sizes are padded into one batch however the threads are scheduled."""
    import onnxruntime as ort

    path = image_mean_model(tmp_path / "img.onnx")
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 256, (int(rng.integers(2, 30)), int(rng.integers(2, 30)), 3), dtype=np.uint8)
        for _ in range(300)
    ]
    results: list = [None] * len(images)
    errors: list[BaseException] = []
    gated = GatedSession(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    with BatchedSession(gated, collator=ImageCollator(), max_batch_size=16, workers=1) as bs:
        first = bs.submit({"image": images[0]}, ["mean"])
        assert gated.entered.wait(30)  # the worker holds image 0 at the gate

        def client(k: int) -> None:
            try:
                for i in range(1 + k, len(images), 8):
                    results[i] = bs.run(["mean"], {"image": images[i]})[0]
            except BaseException as exc:  # asserted in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while bs.stats().queued < 8 and time.monotonic() < deadline:
            time.sleep(0.01)  # polls a state the clients reach; no timing assumption
        assert bs.stats().queued == 8
        gated.gate.set()
        results[0] = first.result(30)[0]
        for t in threads:
            t.join(60)
        stats = bs.stats()
        with pytest.raises(InvalidInputError, match="image"):
            bs.run(None, {"image": np.zeros((4, 4), np.uint8)})
    assert not errors, errors[:3]
    for img, got in zip(images, results, strict=True):
        want = img.reshape(-1, 3).mean(axis=0) / 255.0
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert stats.completed == len(images) and stats.batches < len(images)
    # the 8 images queued behind the gate ran together (at least two of them in one batch),
    # padded to the largest and masked
    assert any(b["pixels"].shape[0] >= 2 and 0 < b["mask"].mean() < 1 for b in gated.batches[1:])
