"""The text tower's inputs: texts tokenized with the export's ``tokenizer.json`` (the ``tokenizers``
library, no transformers), truncated to the tower's length and padded as it was trained
(CLIP: right padding with a mask, each text its own length; SigLIP: every text padded to its
fixed length, no mask). Shared by :class:`~ortbatch.vision.ImageEmbedder` and the export checks,
so what is checked is what is served."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInputError, ManifestError

__all__ = ["TextTower"]


class TextTower:
    """A two-tower export's text settings (``vision.towers.text`` in ``ortbatch.json``) and
    its tokenizer."""

    def __init__(self, directory: str | os.PathLike[str], settings: Mapping[str, Any]) -> None:
        self.directory = Path(directory)
        self.max_length = int(settings["max_length"])
        self.pad_to = int(settings["pad_to"]) if settings.get("pad_to") else None
        self.pad_id = int(settings["pad_id"])
        self.mask = bool(settings["mask"])
        self.output = str(settings["output"])
        self.model = str(settings["model"])
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from .._extras import require

            tokenizers = require("tokenizers", "serve")
            path = self.directory / "tokenizer.json"
            if not path.is_file():
                raise ManifestError(
                    f"{self.directory} has no tokenizer.json (the checkpoint's tokenizer has no fast version): "
                    "ortbatch cannot tokenize texts for its text tower without it"
                )
            tok = tokenizers.Tokenizer.from_file(str(path))
            tok.no_padding()  # one request = one text; the session (or pad_to) pads
            tok.enable_truncation(self.max_length)
            self._tokenizer = tok
        return self._tokenizer

    def ids(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str) or any(not isinstance(t, str) for t in texts):
            raise InvalidInputError("texts must be a sequence of strings")
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def feed(self, rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
        """The graph's inputs for ``rows`` of ids, right-padded to the longest (or ``pad_to``)."""
        width = self.pad_to or max((len(r) for r in rows), default=1)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask} if self.mask else {"input_ids": ids}
