"""Session wrappers for runtime tests: a gate that holds a batch until released,
and a poison that fails any batch containing a marked row."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class WrappedSession:
    """Delegates to a real InferenceSession through plain ``run`` (no IOBinding)."""

    def __init__(self, sess: Any) -> None:
        self.sess = sess

    def get_inputs(self) -> list[Any]:
        return self.sess.get_inputs()

    def get_outputs(self) -> list[Any]:
        return self.sess.get_outputs()

    def get_providers(self) -> list[str]:
        return self.sess.get_providers()

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.sess.run(names, feed)


class GatedSession(WrappedSession):
    """Records each batch's feed; every run waits for ``gate`` (set by the test), so the
    test decides what is queued when the next batch forms, without sleeps."""

    def __init__(self, sess: Any) -> None:
        super().__init__(sess)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list[dict[str, np.ndarray]] = []
        self._lock = threading.Lock()

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self._lock:
            self.batches.append({k: v.copy() for k, v in feed.items()})
        self.entered.set()
        if not self.gate.wait(30):
            raise RuntimeError("test gate never opened")
        return super().run(names, feed)


class PoisonSession(WrappedSession):
    """Fails the whole run when any row's first input_ids value equals ``poison``."""

    def __init__(self, sess: Any, poison: int = -7) -> None:
        super().__init__(sess)
        self.poison = poison
        self.runs = 0

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.runs += 1
        if (feed["input_ids"][:, 0] == self.poison).any():
            raise RuntimeError("poisoned row in batch")
        return super().run(names, feed)
