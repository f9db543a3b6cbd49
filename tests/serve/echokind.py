"""A model kind added by registration alone: ``echo`` answers each text with itself.

It is the example of docs/architecture.md ("Where a new kind goes"): one declaration
(:class:`EchoKind`) and one :func:`~ortbatch.serve.served.kinds.register`, and ``ortbatch
serve`` mounts its route (``POST /v1/echo``, body-routed in a repository), documents it in
``/openapi.json``, answers it over gRPC (a v2 model: ``text`` BYTES in, ``echo`` BYTES out)
and ``ortbatch run`` computes it, with no edit in ``http/``, ``grpc/``, ``frontends/``,
``bulk/`` or the CLI. An echo export is a folder whose ``ortbatch.json`` says ``task: echo``
(:func:`write_echo_export`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ortbatch.bulk.tasks import Field, Outcome, RowFailure, Task
from ortbatch.errors import InvalidInputError, SessionClosedError
from ortbatch.serve.http.openai_api import read_openai_body
from ortbatch.serve.http.openapi_schemas import Operation
from ortbatch.serve.http.plumbing import handled_route, json_response
from ortbatch.serve.metrics import ServerMetrics
from ortbatch.serve.served.kinds import ExportFacts, ModelKind

ECHO_TASK = "echo"


def write_echo_export(directory: Path, prefix: str = "") -> Path:
    """An echo export: its manifest (task ``echo``) and the prefix its answers start with."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"format": 1, "model": "echo.json", "source": {"task": ECHO_TASK}, "inputs": {}, "outputs": {}}
    (directory / "ortbatch.json").write_text(json.dumps(manifest))
    (directory / "echo.json").write_text(json.dumps({"prefix": prefix}))
    return directory


class EchoServed:
    """What an echo export serves as: named, ready until closed; ``echo(text)`` is the model."""

    version = "1"

    def __init__(self, name: str, prefix: str) -> None:
        self.name = name
        self.prefix = prefix
        self._closed = False

    @property
    def ready(self) -> bool:
        return not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, drain: bool = True) -> None:
        self._closed = True

    def echo(self, text: str) -> str:
        if self._closed:
            raise SessionClosedError(f"model {self.name!r} is closed")
        return self.prefix + text

    # the KServe v2 model gRPC reaches (EchoKind.grpc_model)
    def metadata(self) -> dict[str, Any]:
        tensor = {"datatype": "BYTES", "shape": [-1]}
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": "ortbatch_echo",
            "inputs": [{"name": "text", **tensor}],
            "outputs": [{"name": "echo", **tensor}],
        }

    def triton_config(self) -> dict[str, Any]:
        return {"name": self.name, "platform": "ortbatch_echo", "max_batch_size": 0}

    async def infer(self, request: Any) -> list[tuple[str, np.ndarray]]:
        texts = request.inputs.get("text")
        if texts is None:
            raise InvalidInputError("the echo model takes one input, 'text'", input_name="text")
        out = [self.echo(t.decode() if isinstance(t, bytes) else str(t)) for t in texts.reshape(-1)]
        return [("echo", np.array(out, dtype=object).reshape(texts.shape))]


class EchoTask(Task):
    """``ortbatch run`` over an echo export: each row's text, echoed (column ``echo``)."""

    kind = ECHO_TASK

    def __init__(self, served: EchoServed) -> None:
        self.served = served
        self.model_name = served.name

    @property
    def fields(self) -> list[Field]:
        return [Field("echo", "string")]

    def run(self, rows: Sequence[Any]) -> list[Outcome]:
        out: list[Outcome] = []
        for row in rows:
            if row.error is not None:
                out.append(RowFailure(*row.error))
            else:
                out.append({"echo": self.served.echo(row.text or "")})
        return out

    def close(self) -> None:
        self.served.close()


class EchoKind(ModelKind):
    """The whole declaration of the echo kind."""

    name = "echo"
    description = "an echo export"
    served_type = EchoServed
    body_routes: Mapping[str, str] = {"/v1/echo": "echo"}
    index_label = "echo"

    def recognises(self, export: ExportFacts) -> bool:
        return export.task == ECHO_TASK

    def load(self, directory: Path, name: str | None, config: Any, session_options: Any = None) -> EchoServed:
        prefix = json.loads((directory / "echo.json").read_text())["prefix"]
        return EchoServed(name or config.name or directory.resolve().name, prefix)

    def summary(self, served: EchoServed) -> str:
        return "echo: /v1/echo"

    def request_fields(self, served: EchoServed) -> Mapping[str, frozenset[str]]:
        return {"/v1/echo": frozenset({"input"})}

    def http_routes(self, served: EchoServed, body: Any) -> list[Any]:
        fields = self.request_fields(served)["/v1/echo"]

        async def echo(request: Any) -> Any:
            doc = await read_openai_body(request, body, served.name)
            unknown = set(doc) - {"model", *fields}
            if unknown:
                raise InvalidInputError(f"Unrecognized request argument supplied: {sorted(unknown)[0]}")
            text = doc.get("input")
            if not isinstance(text, str):
                raise InvalidInputError("'input' must be a string", input_name="input")
            return json_response({"model": served.name, "echo": served.echo(text)})

        return [handled_route("/v1/echo", echo, "POST")]

    def operations(self) -> Mapping[tuple[str, str], Any]:
        return {
            ("POST", "/v1/echo"): Operation(
                "Echo a text",
                "Echo",
                request="EchoRequest",
                response="EchoResponse",
                example={"model": "{model}", "input": "Hello, world!"},
            )
        }

    def schemas(self) -> Mapping[str, Any]:
        return {
            "EchoRequest": {
                "type": "object",
                "required": ["input"],
                "properties": {"model": {"type": "string"}, "input": {"type": "string"}},
                "additionalProperties": False,
            },
            "EchoResponse": {
                "type": "object",
                "required": ["model", "echo"],
                "properties": {"model": {"type": "string"}, "echo": {"type": "string"}},
            },
        }

    def metrics(self, served: EchoServed) -> ServerMetrics:
        return ServerMetrics()

    def make_bulk_task(self, export_dir: Path, options: Any) -> EchoTask:
        return EchoTask(self.load(export_dir, None, _NoConfig()))


class _NoConfig:
    name = None
