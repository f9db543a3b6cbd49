"""The encoder-decoder engine's ONNX Runtime runs and the rows' caches.

:class:`Seq2SeqRunner` holds the three sessions of an export (encoder, first decoder step,
decoder with past). The rows live in :class:`Cohort` s: the requests admitted at one step
boundary, encoded together in one encoder run and started by one first-decoder run, which
also returns every layer's cross-attention keys and values (``present.{i}.encoder.*``).

Why cohorts: the exported decoder-with-past graphs (optimum's, for every encoder-decoder
family) take no decoder attention mask and no position ids; a row's position is the length of
the cache it is given. Rows of different decoder lengths therefore cannot share one run
without changing the graph, so each cohort (whose rows all started at the same step and so
share their length) runs one decoder-with-past step for all its rows, and a step of the
engine runs each cohort once. Requests still join at every step boundary (as a new cohort)
and leave at any (their rows are dropped from their cohort).

What is copied: a cohort's cross-attention keys and values are computed once and fed to
every step unchanged (never re-concatenated); they, the encoder mask and the self-attention
cache are gathered (a copy) only when the cohort's rows change: rows leaving, or beams that
continue another beam's hypothesis (transformers' ``_reorder_cache``, on the self-attention
cache only: a request's beams share identical cross-attention rows). The self-attention cache
grows inside the graph (``present = concat(past, new)``), one copy per step by ONNX Runtime:
the in-place cache of the decoder-only path needs a graph rewrite not done for these graphs yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._ort import build_session
from ..errors import map_ort_error
from .runner import SessionFactory, generation_providers
from .seq2seq_layout import Seq2SeqLayout

__all__ = ["Cohort", "Seq2SeqRunner"]


@dataclass(eq=False)
class Cohort:
    """Rows that started together: their encoder mask, cross-attention K/V and self-attention
    cache (arrays whose first axis is the row), and who each row belongs to (``owners[i]``:
    the request of row ``i``, set by the engine)."""

    mask: np.ndarray
    cross: dict[str, np.ndarray]
    past: dict[str, np.ndarray]
    hidden: np.ndarray | None
    owners: list[Any] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        """The decoder positions cached per row."""
        first = next(iter(self.past.values()))
        return int(first.shape[2])

    def select(self, index: Sequence[int]) -> None:
        """Keep rows ``index`` (in that order, repeats allowed): the rows' membership changed."""
        idx = np.asarray(index, np.int64)
        self.mask = self.mask[idx]
        self.cross = {k: v[idx] for k, v in self.cross.items()}
        self.past = {k: v[idx] for k, v in self.past.items()}
        if self.hidden is not None:
            self.hidden = self.hidden[idx]
        self.owners = [self.owners[i] for i in idx]

    def reorder_past(self, index: np.ndarray) -> None:
        """Beams moved: row ``i`` continues the self-attention cache of row ``index[i]`` (the
        cross-attention rows of one request's beams are identical and stay)."""
        self.past = {k: v[index] for k, v in self.past.items()}

    def cache_bytes(self) -> int:
        return sum(v.nbytes for v in self.cross.values()) + sum(v.nbytes for v in self.past.values())


class Seq2SeqRunner:
    """The encoder, decoder and decoder-with-past sessions of one export."""

    def __init__(
        self,
        directory: Path,
        layout: Seq2SeqLayout,
        *,
        providers: str | Sequence[Any] | None = None,
        session_options: Any = None,
        manifest_providers: Sequence[Any] = (),
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.layout = layout
        chain = generation_providers(providers, manifest_providers, directory)
        build = session_factory or build_session
        self.sessions: dict[str, Any] = {}
        for part in ("encoder", "decoder", "decoder_with_past"):
            path = directory / layout.files[part]
            self.sessions[part] = build(path, chain, session_options=session_options, where=path)
        self.inputs = {p: [i.name for i in s.get_inputs()] for p, s in self.sessions.items()}
        n = layout.num_layers
        self.self_names = [name for i in range(n) for name in layout.self_past(i)]
        self.cross_names = [name for i in range(n) for name in layout.cross_past(i)]
        self._first_outputs = ["logits"] + [_present(x) for x in self.self_names + self.cross_names]
        self._step_outputs = ["logits"] + [_present(x) for x in self.self_names]
        self.needs_hidden = "encoder_hidden_states" in self.inputs["decoder_with_past"]

    def _run(self, part: str, outputs: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return list(self.sessions[part].run(outputs, feed))
        except Exception as exc:
            raise map_ort_error(exc, f"the {part} run failed") from exc

    def encode(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """The encoder's ``last_hidden_state`` for the padded ``feeds`` (its own input names)."""
        feed = {k: v for k, v in feeds.items() if k in self.inputs["encoder"]}
        return self._run("encoder", ["last_hidden_state"], feed)[0]

    def start(self, hidden: np.ndarray, mask: np.ndarray, start_token: int) -> tuple[np.ndarray, Cohort]:
        """The first decoder step of every row: its logits ``[rows, vocab]`` and the cohort
        holding the rows' caches (cross-attention K/V included)."""
        rows = hidden.shape[0]
        ids = np.full((rows, 1), start_token, np.int64)
        feed = {"input_ids": ids, "encoder_attention_mask": mask, "encoder_hidden_states": hidden}
        if "attention_mask" in self.inputs["decoder"]:
            feed["attention_mask"] = mask
        feed = {k: v for k, v in feed.items() if k in self.inputs["decoder"]}
        out = self._run("decoder", self._first_outputs, feed)
        logits = out[0][:, -1]
        n_self = len(self.self_names)
        past = dict(zip(self.self_names, out[1 : 1 + n_self], strict=True))
        cross = dict(zip(self.cross_names, out[1 + n_self :], strict=True))
        cohort = Cohort(mask=mask, cross=cross, past=past, hidden=hidden if self.needs_hidden else None)
        return logits, cohort

    def step(self, cohort: Cohort, tokens: np.ndarray) -> np.ndarray:
        """One decoder-with-past step of every row of ``cohort`` (``tokens``: each row's last
        token); updates its self-attention cache and returns the logits ``[rows, vocab]``."""
        feed: dict[str, np.ndarray] = {
            "input_ids": tokens.reshape(-1, 1).astype(np.int64),
            "encoder_attention_mask": cohort.mask,
            **cohort.past,
            **cohort.cross,
        }
        if cohort.hidden is not None:
            feed["encoder_hidden_states"] = cohort.hidden
        out = self._run("decoder_with_past", self._step_outputs, feed)
        cohort.past = dict(zip(self.self_names, out[1:], strict=True))
        return out[0][:, -1]


def _present(past_name: str) -> str:
    return past_name.replace("past_key_values", "present", 1)
