"""The PyTorch reference the checks compare against (needs torch + transformers).

Loaded from the export's ``source.model`` with the same optimum loader the export
used; when that fails (no weights offline, deleted directory, missing extra),
:func:`load_reference` says why and the checks run ONNX-only.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Reference", "load_reference"]


class Reference:
    """Runs the PyTorch model on numpy feeds and returns numpy outputs by ONNX name."""

    def __init__(self, model: Any, family: str, library: str) -> None:
        self.model = model
        self.family = family
        self.library = library

    def _t(self, feed: Mapping[str, np.ndarray]) -> dict[str, Any]:
        import torch

        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feed.items()}

    def encoder(self, feed: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """Outputs of an encoder-only model (feature extraction, classification, ...)."""
        import torch

        args = self._t({k: v for k, v in feed.items() if k in ("input_ids", "attention_mask", "token_type_ids")})
        with torch.inference_mode():
            out = self.model(args) if self.library == "sentence_transformers" else self.model(**args)
        items = dict(out.items())
        return {n: items[n].float().numpy() for n in names if n in items and items[n] is not None}

    def decoder_logits(self, feed: Mapping[str, np.ndarray]) -> np.ndarray:
        import torch

        args = self._t({k: v for k, v in feed.items() if k in ("input_ids", "attention_mask", "position_ids")})
        with torch.inference_mode():
            out = self.model(**args, use_cache=False)
        return out.logits.float().numpy()

    def _encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Any:
        import torch

        args = self._t({"input_ids": input_ids, "attention_mask": attention_mask})
        encoder = self.model.get_encoder()
        # T5's encoder is a T5Stack that reads use_cache from its config (which the export may
        # have turned on) and refuses it unless it is a decoder: ask for no cache where it takes the flag
        if "use_cache" in inspect.signature(encoder.forward).parameters:
            args["use_cache"] = False
        with torch.inference_mode():
            return encoder(**args, return_dict=True)

    def encoder_hidden(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self._encode(input_ids, attention_mask).last_hidden_state.float().numpy()

    def seq2seq_logits(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, decoder_input_ids: np.ndarray
    ) -> np.ndarray:
        import torch

        encoded = self._encode(input_ids, attention_mask)
        args = self._t({"attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids})
        with torch.inference_mode():
            out = self.model(**args, encoder_outputs=encoded, use_cache=False)
        return out.logits.float().numpy()

    def greedy(
        self, prompts: list[list[int]], new_tokens: int, pad_id: int, start_id: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Greedy continuation of each prompt alone, recomputing the full sequence each
        step (no cache): an independent path from the ONNX model's past key values.

        Returns the tokens (rows, steps) and each step's two best logits (rows, steps, 2),
        so a divergence at a near-tie can be told from a real one."""
        rows, tops = [], []
        for ids in prompts:
            prompt = np.array([ids], dtype=np.int64)
            mask = np.ones_like(prompt)
            out: list[int] = []
            top: list[np.ndarray] = []
            seq = prompt if self.family != "seq2seq" else np.array([[start_id]], dtype=np.int64)
            for _ in range(new_tokens):
                if self.family == "seq2seq":
                    logits = self.seq2seq_logits(prompt, mask, seq)[0, -1]
                else:
                    pos = np.arange(seq.shape[1], dtype=np.int64)[None]
                    logits = self.decoder_logits(
                        {"input_ids": seq, "attention_mask": np.ones_like(seq), "position_ids": pos}
                    )[0, -1]
                nxt = int(logits.argmax())
                out.append(nxt)
                top.append(np.sort(logits)[-2:][::-1])
                seq = np.concatenate([seq, [[nxt]]], axis=1)
            rows.append(out)
            tops.append(np.stack(top))
        return np.array(rows, dtype=np.int64), np.stack(tops)


def load_reference(source: Mapping[str, Any], model: Any = None) -> tuple[Reference | None, str]:
    """(reference, "") or (None, why it could not be loaded)."""
    family = str(source.get("family", "encoder"))
    library = str(source.get("library", "transformers"))
    if model is not None:
        return Reference(model, family, library), ""
    name = source.get("model")
    task = source.get("task")
    if not name or not task:
        return None, "the manifest does not name the source model and task"
    try:
        import torch  # noqa: F401
        from optimum.exporters.tasks import TasksManager
    except ImportError as exc:
        return None, f"the export extra is not installed ({exc}); pip install 'ortbatch[export]'"
    try:
        loaded = TasksManager.get_model_from_task(task, name, framework="pt", library_name=library, device="cpu")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"could not load {name} ({type(exc).__name__}: {first[:300]})"
    loaded.eval()
    return Reference(loaded, family, library), ""
