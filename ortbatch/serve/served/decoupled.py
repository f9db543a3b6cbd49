"""A text-generation export as a *decoupled* KServe v2 model (served over gRPC): each request of a
``ModelStreamInfer`` stream is answered by several responses, one per piece of text, the
way Triton serves LLMs (its vLLM backend's tensor names, so clients written for it work). The
same answers back KServe v2's ``generate`` and ``generate_stream`` over HTTP
(:func:`~ortbatch.serve.http.kserve.generation_routes`).

Inputs (one prompt per request; send several requests on the stream to batch them)::

    text_input           BYTES [1]  the prompt (UTF-8)
    stream               BOOL  [1]  optional: true answers token by token, false (default) once
    sampling_parameters  BYTES [1]  optional: a JSON object of /v1/completions fields

Without ``sampling_parameters`` the fields may come as the request's parameters (``max_tokens``
an int64 parameter, ...), as Triton's vLLM backend reads them; Triton's own request
parameters (``timeout``, ``priority``, the sequence ones) are not fields.

Outputs: ``text_output`` (BYTES [1]: the new text; with ``echo``, the prompt first) in every
response; ``finish_reason`` (``"stop"`` or ``"length"``) in a choice's last one; ``index``
(INT32 [1]: which choice) when ``n`` > 1; ``logprobs`` (BYTES [1]: JSON of /v1/completions'
``logprobs`` object for the response's tokens) when ``logprobs`` is asked. Every response
carries the parameter ``triton_final_response`` (true on the last), as Triton's decoupled
responses do. The fields follow the same policy and code as ``/v1/completions``
(:func:`~ortbatch.serve.served.completions.parse_completion_request`), so a request refused
there is refused here with the same message, and the structured-output fields
(``response_format``, ``guided_json``, ``structured_outputs``, ...) constrain the text the same
way (compiled before anything is submitted). Unary ``ModelInfer`` is refused (UNIMPLEMENTED),
as Triton refuses it for a decoupled model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from ...errors import InvalidInputError, UnsupportedError
from .answers import OpenAIAnswer, Piece, whole_pieces
from .completions import (
    CompletionRequest,
    compile_constraints,
    parse_completion_request,
    prepare_prompts,
    prompt_char_limit,
    submit_all,
)
from .generator import ServedGenerator
from .protocol import InferRequest, loads_json
from .streaming import PieceStream

__all__ = ["FINAL_RESPONSE", "GenerationAnswer", "GenerationModel"]

#: the response parameter that marks a decoupled request's last response (Triton's name)
FINAL_RESPONSE = "triton_final_response"

_TEXT_INPUT, _STREAM, _SAMPLING = "text_input", "stream", "sampling_parameters"
_TEXT_OUTPUT, _FINISH, _INDEX, _LOGPROBS = "text_output", "finish_reason", "index", "logprobs"
_INPUTS = {_TEXT_INPUT: "BYTES", _STREAM: "BOOL", _SAMPLING: "BYTES"}
#: request parameters Triton's clients set for any model: not /v1/completions fields
_TRITON_PARAMETERS = frozenset(
    {
        "timeout",
        "priority",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "triton_enable_empty_final_response",
        "binary_data_output",
    }
)
_OUTPUTS = {_TEXT_OUTPUT: "BYTES", _FINISH: "BYTES", _INDEX: "INT32", _LOGPROBS: "BYTES"}


class GenerationAnswer:
    """One prompt's answer in pieces (see :meth:`GenerationModel.answer`): :meth:`pieces`
    yields each choice's pieces (one whole piece per choice unless streamed), :meth:`values`
    says what a piece carries by output name."""

    def __init__(self, model: GenerationModel, req: CompletionRequest, prompts: Any) -> None:
        self.req, self.prompts = req, prompts
        self._generator = model.generator
        self._shape = OpenAIAnswer(req, prompts, model.served.token_texts, model.name)
        self._stream: PieceStream | None = None
        self._futures: list[Any] = []

    async def _start(self) -> None:
        if self.req.stream:
            self._stream = PieceStream(self._generator, self.req, self.prompts)
            await self._stream.start()
        else:
            self._futures = submit_all(self._generator, self.req, self.prompts)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The pieces in order; a choice that fails raises its error here."""
        try:
            if self._stream is not None:
                async for piece in self._stream.pieces():
                    if piece.error is not None:
                        raise piece.error
                    yield piece
                return
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in self._futures))
            for piece in whole_pieces(self.req, self.prompts, results):
                yield piece
        finally:  # the answer ended or its client left: free the rows
            self.cancel()

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        for fut in self._futures:
            fut.cancel()

    def values(self, piece: Piece) -> dict[str, Any]:
        """The outputs ``piece`` carries: ``text_output``, and ``finish_reason`` (its choice's
        last), ``index`` (``n`` > 1), ``logprobs`` (asked) where they apply."""
        out: dict[str, Any] = {_TEXT_OUTPUT: piece.text}
        if piece.finish_reason is not None:
            out[_FINISH] = piece.finish_reason
        if self.req.n > 1:
            out[_INDEX] = piece.index
        logprobs = self._shape.logprobs(piece)
        if logprobs is not None:
            out[_LOGPROBS] = logprobs
        return out


class GenerationModel:
    """The decoupled v2 model entry of a :class:`~ortbatch.serve.served.generator.ServedGenerator`
    (transport-free: gRPC's servicer streams what :meth:`stream` yields; HTTP's ``generate``
    routes read :meth:`answer`)."""

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
            "outputs": [{"name": n, "datatype": d, "shape": [-1]} for n, d in _OUTPUTS.items()],
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
            "output": [{**entry(n, d, False), "dims": [-1]} for n, d in _OUTPUTS.items()],
            "model_transaction_policy": {"decoupled": True},
        }

    async def infer(self, req: InferRequest) -> list[tuple[str, np.ndarray]]:
        raise UnsupportedError(
            f"model {self.name!r} is a decoupled text-generation model: send it over ModelStreamInfer "
            "(tritonclient: start_stream + async_stream_infer), or use HTTP /v1/completions"
        )

    async def answer(self, text: str, fields: dict[str, Any], stream: bool) -> GenerationAnswer:
        """Check ``fields`` (/v1/completions' fields but ``prompt`` and ``stream``), tokenize
        ``text`` and submit it: its answer, whose pieces come as the tokens do. A refused request
        (a bad field, a full queue) raises here, before any piece."""
        for key, instead in (("prompt", "the text input"), ("stream", "the stream input or route")):
            if key in fields:
                raise InvalidInputError(
                    f"'{key}' is not a sampling parameter here: send it as {instead}", input_name=key
                )
        req = parse_completion_request({**fields, "prompt": text, "stream": stream}, self.max_chars, self.served.policy)
        await compile_constraints(self.generator, req)
        prompts = await asyncio.to_thread(prepare_prompts, self.generator, req)
        answer = GenerationAnswer(self, req, prompts)
        await answer._start()
        return answer

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
        # the fields as request parameters: ignoring them answered max_tokens=100 with 16 tokens
        fields = {k: v for k, v in req.parameters.items() if k not in _TRITON_PARAMETERS}
        sampling = self._scalar(req, _SAMPLING)
        if sampling is not None:
            if fields:
                raise InvalidInputError(
                    f"send the sampling fields in the {_SAMPLING!r} input or as request parameters, not both "
                    f"(got the parameter {sorted(fields)[0]!r})",
                    input_name=_SAMPLING,
                )
            fields = loads_json(self._text(sampling, _SAMPLING), f"input {_SAMPLING!r}")
            if not isinstance(fields, dict):
                raise InvalidInputError(f"input {_SAMPLING!r} must be a JSON object", input_name=_SAMPLING)
        answer = await self.answer(self._text(text, _TEXT_INPUT), fields, bool(self._scalar(req, _STREAM)))
        left = len(answer.prompts.ids) * answer.req.n  # choices still to finish: the last one is final
        async for piece in answer.pieces():
            left -= piece.finish_reason is not None
            yield self._outputs(wanted, answer.values(piece)), left == 0

    @staticmethod
    def _outputs(wanted: list[str], values: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
        out = []
        for name in wanted:
            if name not in values:
                continue
            value = values[name]
            if name == _INDEX:
                out.append((name, np.array([value], dtype=np.int32)))
            else:
                raw = json.dumps(value, separators=(",", ":")) if name == _LOGPROBS else value
                out.append((name, np.array([raw.encode()], dtype=object)))
        return out
