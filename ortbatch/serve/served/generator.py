"""One served :class:`~ortbatch.BatchedGenerator` (what ``ortbatch serve`` runs for a
``text-generation-with-past`` export) and how such an export is recognised."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ...generation.chat import ChatTemplate
from ...manifest import MANIFEST_NAME, Manifest
from .answers import TokenTexts
from .parameters import ParameterPolicy

__all__ = ["ServedGenerator", "is_generation_export"]

log = logging.getLogger("ortbatch.serve")


def is_generation_export(directory: str | Path) -> bool:
    """Whether ``directory`` holds a decoder-with-past export (served as completions)."""
    path = Path(directory)
    if not path.is_dir():
        return False
    if (path / MANIFEST_NAME).is_file():
        manifest = Manifest.load(path)
        if manifest.generation:  # the encoder-decoder engine's section is not a decoder's
            return manifest.generation.get("kind") != "seq2seq"
        return any(name.startswith("past_key_values") for name in manifest.inputs)
    if not (path / "model.onnx").is_file():
        return False
    from ...generation.layout import read_io

    inputs, _ = read_io(path / "model.onnx")
    return any(name.startswith("past_key_values") for name, _, _ in inputs)


def _export_template(generator: Any) -> ChatTemplate | None:
    directory = getattr(generator, "export_dir", None)
    if directory is None:
        return None
    try:
        return ChatTemplate.from_export(directory)
    except (ValueError, ImportError) as exc:  # no jinja2, or a template that does not compile
        log.warning("%s: /v1/chat/completions is off: %s", directory, exc)
        return None


class ServedGenerator:
    """A :class:`~ortbatch.BatchedGenerator` served under ``name``. ``lenient_params``: request
    fields no API defines are accepted and logged once each (``--lenient-params``), not refused."""

    def __init__(
        self, generator: Any, name: str, chat_template: ChatTemplate | None = None, *, lenient_params: bool = False
    ) -> None:
        self.generator = generator
        self.name = name
        #: renders /v1/chat/completions messages (default: the export's, when it has one)
        self.chat_template = chat_template if chat_template is not None else _export_template(generator)
        #: which request fields are honoured, accepted or refused (every transport asks it)
        self.policy = ParameterPolicy(lenient=lenient_params)
        #: each token's text and bytes as logprobs name them
        self.token_texts = TokenTexts(generator)

    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        name: str | None = None,
        generator_kwargs: dict[str, Any] | None = None,
        lenient_params: bool = False,
    ) -> ServedGenerator:
        from ...generation import BatchedGenerator

        path = Path(directory)
        generator = BatchedGenerator(path, **(generator_kwargs or {}))
        return cls(generator, name or path.resolve().name, lenient_params=lenient_params)

    @property
    def ready(self) -> bool:
        return not self.generator.closed

    @property
    def closed(self) -> bool:
        return bool(self.generator.closed)

    def close(self, drain: bool = True) -> None:
        self.generator.close(drain=drain)
