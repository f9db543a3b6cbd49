"""A text-generation export as a *decoupled* KServe v2 model (served over gRPC): each request of a
``ModelStreamInfer`` stream is answered by several responses, one per piece of text, the
way Triton serves LLMs (its vLLM backend's tensor names, so clients written for it work).

Inputs (one prompt per request; send several requests on the stream to batch them)::

    text_input           BYTES [1]  the prompt (UTF-8)
    stream               BOOL  [1]  optional: true answers token by token, false (default) once
    sampling_parameters  BYTES [1]  optional: a JSON object of /v1/completions fields
                                    (max_tokens, temperature, top_p, top_k, stop, seed)

Outputs: ``text_output`` (BYTES [1]: the new text, the prompt not repeated) in every
response, and ``finish_reason`` (``"stop"`` or ``"length"``) in the last one. Every
response carries the parameter ``triton_final_response`` (true on the last), as Triton's
decoupled responses do. The fields are checked by the same code as ``/v1/completions``
(:func:`~ortbatch.serve.http.openai_api.parse_completion_request`), so a request refused there
is refused here with the same message. Unary ``ModelInfer`` is refused (UNIMPLEMENTED), as
Triton refuses it for a decoupled model.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from ...errors import InvalidInputError, UnsupportedError
from .completions import parse_completion_request, prompt_char_limit, submit_all
from .generator import ServedGenerator
from .protocol import InferRequest, loads_json

__all__ = ["FINAL_RESPONSE", "GenerationModel"]

#: the response parameter that marks a decoupled request's last response (Triton's name)
FINAL_RESPONSE = "triton_final_response"

_TEXT_INPUT, _STREAM, _SAMPLING = "text_input", "stream", "sampling_parameters"
_TEXT_OUTPUT, _FINISH = "text_output", "finish_reason"
_INPUTS = {_TEXT_INPUT: "BYTES", _STREAM: "BOOL", _SAMPLING: "BYTES"}
_OUTPUTS = (_TEXT_OUTPUT, _FINISH)


class GenerationModel:
    """The decoupled v2 model entry of a :class:`~ortbatch.serve.served.generator.ServedGenerator`
    (transport-free: gRPC's servicer streams what :meth:`stream` yields)."""

    def __init__(self, served: ServedGenerator) -> None:
        self.served = served
        self.generator = served.generator
        self.name = served.name
        self.version = "1"
        self.max_chars = prompt_char_limit(self.generator)

    @property
    def ready(self) -> bool:
        return self.served.ready

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": n, "datatype": d, "shape": [1]} for n, d in _INPUTS.items()],
            "outputs": [{"name": n, "datatype": "BYTES", "shape": [-1]} for n in _OUTPUTS],
        }

    def triton_config(self) -> dict[str, Any]:
        def entry(name: str, datatype: str, optional: bool) -> dict[str, Any]:
            dtype = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
            return {"name": name, "data_type": dtype, "dims": [1], "optional": optional}

        return {
            "name": self.name,
            "platform": "onnxruntime_onnx",
            "backend": "onnxruntime",
            "max_batch_size": 0,  # one prompt per request; requests are batched by the generator
            "input": [entry(n, d, n != _TEXT_INPUT) for n, d in _INPUTS.items()],
            "output": [{"name": n, "data_type": "TYPE_STRING", "dims": [-1]} for n in _OUTPUTS],
            "model_transaction_policy": {"decoupled": True},
        }

    async def infer(self, req: InferRequest) -> list[tuple[str, np.ndarray]]:
        raise UnsupportedError(
            f"model {self.name!r} is a decoupled text-generation model: send it over ModelStreamInfer "
            "(tritonclient: start_stream + async_stream_infer), or use HTTP /v1/completions"
        )

    def _scalar(self, req: InferRequest, name: str) -> Any:
        array = req.inputs.get(name)
        if array is None:
            return None
        if req.datatypes[name] != _INPUTS[name]:
            raise InvalidInputError(
                f"input {name!r}: expected datatype {_INPUTS[name]}, got {req.datatypes[name]}", input_name=name
            )
        if array.size != 1:
            raise InvalidInputError(
                f"input {name!r} takes one element (one prompt per request), got shape {list(array.shape)}",
                input_name=name,
            )
        return array.reshape(-1)[0]

    def _text(self, value: Any, name: str) -> str:
        try:
            return value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError:
            raise InvalidInputError(f"input {name!r} is not valid UTF-8", input_name=name) from None

    async def stream(self, req: InferRequest) -> AsyncIterator[tuple[list[tuple[str, np.ndarray]], bool]]:
        """``(outputs, final)`` for each response to one request, the last with ``final``."""
        unknown = sorted(set(req.inputs) - set(_INPUTS))
        if unknown:
            raise InvalidInputError(f"model {self.name!r} takes the inputs {list(_INPUTS)}; got {unknown}")
        wanted = [o.name for o in req.outputs] if req.outputs else list(_OUTPUTS)
        for name in wanted:
            if name not in _OUTPUTS:
                raise InvalidInputError(f"unknown output {name!r}; the model's outputs are {list(_OUTPUTS)}")
        text = self._scalar(req, _TEXT_INPUT)
        if text is None:
            raise InvalidInputError(f"missing input {_TEXT_INPUT!r} (BYTES, the prompt)", input_name=_TEXT_INPUT)
        doc: dict[str, Any] = {}
        sampling = self._scalar(req, _SAMPLING)
        if sampling is not None:
            doc = loads_json(self._text(sampling, _SAMPLING), f"input {_SAMPLING!r}")
            if not isinstance(doc, dict):
                raise InvalidInputError(f"input {_SAMPLING!r} must be a JSON object", input_name=_SAMPLING)
        stream = self._scalar(req, _STREAM)
        doc = {**doc, "prompt": self._text(text, _TEXT_INPUT), "stream": bool(stream)}
        creq = parse_completion_request(doc, self.max_chars)
        prompt: Any = creq.prompts[0]
        if isinstance(prompt, str) and prompt:  # "" is refused by submit, with its message
            prompt = await asyncio.to_thread(self.generator.encode, prompt)
        creq = dataclasses.replace(creq, prompts=[prompt])

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        on_token = (lambda i: put) if creq.stream else None
        (future,) = submit_all(self.generator, creq, on_token)
        # tokens are put before the future settles, on the same thread: None comes last
        future.add_done_callback(lambda _f: put(None))
        sent = ""
        try:
            if creq.stream:
                while (token := await queue.get()) is not None:
                    if token.text:
                        sent += token.text
                        yield self._outputs(wanted, token.text, None), False
            else:
                await asyncio.wrap_future(future)
            completion = future.result()
            rest = completion.text[len(sent) :] if completion.text.startswith(sent) else ""
            yield self._outputs(wanted, rest, completion.finish_reason), True
        finally:  # the stream ended or the client left: free the row
            future.cancel()

    @staticmethod
    def _outputs(wanted: list[str], text: str, finish_reason: str | None) -> list[tuple[str, np.ndarray]]:
        values = {_TEXT_OUTPUT: text, _FINISH: finish_reason}
        return [
            (name, np.array([values[name].encode()], dtype=object))  # type: ignore[union-attr]
            for name in wanted
            if values[name] is not None
        ]
