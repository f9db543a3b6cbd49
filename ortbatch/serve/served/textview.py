"""The text-in view of a served model, as its own KServe v2 model entry.

Generic v2 clients (Triton's perf_analyzer and tritonclient-based tools among them) read
``GET /v2/models/{name}`` and send one tensor for every input listed there. So the tensor
model lists exactly its tensors (``input_ids``, ``attention_mask``, ...), and text goes to
a second entry, ``{name}_text``, whose one input is ``text`` (BYTES, one string per row):
a metadata-driven client of either entry sends exactly what the model needs. Both run on
the same BatchedSession. (Text alone sent to the tensor entry is still accepted, for the
clients that did so before.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InvalidInputError
from .model import ServedModel
from .protocol import InferRequest

__all__ = ["TextModelView"]


class TextModelView:
    """``{name}_text``: the text-in model entry of a ServedModel with a tokenizer."""

    def __init__(self, model: ServedModel) -> None:
        if model.text_input is None or model.text_model_name is None:
            raise ValueError(f"model {model.name!r} takes no text: {model.text_disabled_reason}")
        self.model = model
        self.name: str = model.text_model_name
        self.version = model.version
        self.text_input: str = model.text_input

    @property
    def ready(self) -> bool:
        return self.model.ready

    def metadata(self) -> dict[str, Any]:
        doc = self.model.metadata()
        doc["name"] = self.name
        doc["inputs"] = [{"name": self.text_input, "datatype": "BYTES", "shape": [-1, 1]}]
        doc["parameters"] = {**doc.get("parameters", {}), "tensor_model": self.model.name}
        return doc

    def triton_config(self) -> dict[str, Any]:
        doc = self.model.triton_config()
        doc["name"] = self.name
        doc["input"] = [{"name": self.text_input, "data_type": "TYPE_STRING", "dims": [1]}]
        return doc

    async def infer(self, req: InferRequest) -> list[tuple[str, np.ndarray]]:
        extra = [n for n in req.inputs if n != self.text_input]
        if extra or self.text_input not in req.inputs:
            raise InvalidInputError(
                f"model {self.name!r} takes one input, {self.text_input!r} (BYTES); got {sorted(req.inputs)}. "
                f"Tensor inputs go to model {self.model.name!r}",
                input_name=self.text_input,
            )
        return await self.model.infer(req)
