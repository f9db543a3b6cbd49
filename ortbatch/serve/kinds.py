"""The two kinds of export ortbatch serves, each declared whole (:class:`~.served.kinds.ModelKind`):

* :class:`EncoderKind` (``encoder``): a :class:`~.served.model.ServedModel` over one
  BatchedSession: KServe v2 inference, ``/v1/embeddings`` and the text tasks (rerank,
  classify, tokenize), its ``{name}_text`` entry; ``ortbatch run`` computes embeddings or
  classifications. It is the fallback: any graph no other kind recognises.
* :class:`DecoderKind` (``decoder``): a :class:`~.served.generator.ServedGenerator` over one
  BatchedGenerator (a decoder-with-past export): OpenAI completions and chat, the decoupled v2
  model (streamed over gRPC ModelStreamInfer), ``ortbatch generate``; ``ortbatch run``
  generates.

They sit above the transports, beside :mod:`.assembly`, because their routes are the
transports' (the core's registry, :mod:`.served.kinds`, imports none); ``ortbatch.serve``
imports this module, so they are registered before anything is served. The front ends'
stand-ins (``--frontends``) are imported only when a front end asks for them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from .http.kserve import generation_routes, kserve_routes
from .http.openai_api import completion_routes, embedding_routes
from .http.task_routes import task_routes
from .metrics import GeneratorCollector, ServerMetrics, SessionCollector
from .served.generator import ServedGenerator, is_generation_export
from .served.kinds import ExportFacts, ModelKind, register
from .served.lookup import GENERATOR_VERSION
from .served.model import ServedModel
from .served.protocol import DATATYPES
from .served.task_fields import TASK_FIELDS
from .served.text_tasks import served_endpoints
from .served.textview import TextModelView

__all__ = ["DECODER", "ENCODER", "DecoderKind", "EncoderKind"]


class EncoderKind(ModelKind):
    """An encoder export served by one BatchedSession (any graph no other kind takes)."""

    name = "encoder"
    description = "an encoder export"
    served_type = ServedModel
    fallback = True
    body_routes = MappingProxyType(
        {
            "/v1/embeddings": "embeddings",
            "/embed": "embeddings",
            "/embed_sparse": "embed_sparse",
            "/v1/rerank": "rerank",
            "/rerank": "rerank",
            "/v1/classify": "classify",
            "/tokenize": "tokenize",
            "/detokenize": "tokenize",
        }
    )
    bulk_task = "encoder"

    def recognises(self, export: ExportFacts) -> bool:
        return not is_generation_export(export.directory)

    def load(
        self, directory: Path, name: str | None, config: Any, session_options: Callable[[bool], Any] | None = None
    ) -> ServedModel:
        kw = config.session_kwargs()
        if session_options is not None:
            kw["session_options"] = session_options(False)
        return ServedModel.load(
            directory,
            name=name,
            session_kwargs=kw,
            normalize_embeddings=config.normalize_embeddings,
            max_text_chars=config.max_text_chars,
            truncate=config.truncate,
            lenient_params=config.lenient_params,
        )

    def warm_up(self, served: ServedModel) -> None:
        feed = {}
        for m in served.inputs:
            dtype = DATATYPES.get(m.datatype)
            if dtype is None or dtype.kind == "O":
                return  # nothing generic to send
            feed[m.name] = np.zeros(tuple(d if d > 0 else 1 for d in m.shape), dtype=dtype)
        served.session.run(None, feed)

    def endpoints(self, served: ServedModel) -> dict[str, str]:
        return served_endpoints(served)

    def summary(self, served: ServedModel) -> str:
        text = "text input on" if served.text_input else "no text input"
        emb = "/v1/embeddings on" if served.embedding_output else "no /v1/embeddings"
        return f"{text}, {emb}"

    def text_view(self, served: ServedModel) -> TextModelView | None:
        return TextModelView(served) if served.text_model_name is not None else None

    def kserve_metadata(self, served: ServedModel, entries: Any) -> dict[str, Any]:
        out = {served.name: served.metadata()}
        if entries.text_view is not None:
            out[entries.text_view.name] = entries.text_view.metadata()
        return out

    def request_fields(self, served: ServedModel) -> Mapping[str, frozenset[str]]:
        return {p: f for p, f in TASK_FIELDS.items() if p in self.body_routes}

    def http_routes(self, served: ServedModel, body: Any) -> list[Any]:
        return [*kserve_routes(served, body), *embedding_routes(served, body), *task_routes(served, body)]

    def metrics(self, served: ServedModel) -> ServerMetrics:
        return ServerMetrics(served.session.stats)

    def collector(self, served: ServedModel) -> Any:
        return SessionCollector(served.session.stats)

    def refusal(self, path: str, name: str, owner: ModelKind) -> str:
        if owner is DECODER:
            return f"{path}: model {name!r} is not a text-generation export"
        return super().refusal(path, name, owner)

    def engine_side(self, served: ServedModel) -> tuple[Any, Any]:
        from .frontends.proxy import SessionInfo

        return served.session, SessionInfo.of(served.session)

    def front_end_view(self, link: Any, key: int, info: Any, directory: Path, name: str, config: Any) -> ServedModel:
        return ServedModel.for_export(
            link.for_model(key, info),
            directory,
            name=name,
            normalize_embeddings=config.normalize_embeddings,
            max_text_chars=config.max_text_chars,
            truncate=config.truncate,
            lenient_params=config.lenient_params,
        )


class DecoderKind(ModelKind):
    """A decoder-with-past export served by one BatchedGenerator (``/v1/completions``)."""

    name = "decoder"
    description = "a text-generation export"
    served_type = ServedGenerator
    body_routes = MappingProxyType({"/v1/completions": "completions", "/v1/chat/completions": "completions"})
    index_label = "generator"
    bulk_task = "generation"

    def recognises(self, export: ExportFacts) -> bool:
        if is_generation_export(export.directory):
            return True
        # optimum's causal-LM export without ortbatch.json (BatchedGenerator reads those too)
        archs = export.config.get("architectures")
        causal = isinstance(archs, list) and any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
        return export.manifest is None and causal and "model.onnx" not in export.onnx_files

    def load(
        self, directory: Path, name: str | None, config: Any, session_options: Callable[[bool], Any] | None = None
    ) -> ServedGenerator:
        gen_kw = config.generator_kwargs()
        if session_options is not None:
            gen_kw["session_options"] = session_options(True)
        return ServedGenerator.load(directory, name=name, generator_kwargs=gen_kw, lenient_params=config.lenient_params)

    def warm_up(self, served: ServedGenerator) -> None:
        served.generator.generate([0], max_new_tokens=1)

    def summary(self, served: ServedGenerator) -> str:
        return "text generation: /v1/completions"

    def version(self, served: Any, found: Any) -> str:
        return GENERATOR_VERSION

    def request_fields(self, served: ServedGenerator) -> Mapping[str, frozenset[str]]:
        from .served.parameters import CHAT, COMPLETIONS, FIELDS

        return {
            path: frozenset(f.name for f in FIELDS.values() if api in f.apis)
            for path, api in (("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHAT))
        }

    def http_routes(self, served: ServedGenerator, body: Any) -> list[Any]:
        return [*completion_routes(served, body), *generation_routes(served, body)]

    def metrics(self, served: ServedGenerator) -> ServerMetrics:
        return ServerMetrics(generator_stats=served.generator.stats)

    def collector(self, served: ServedGenerator) -> Any:
        return GeneratorCollector(served.generator.stats)

    def refusal(self, path: str, name: str, owner: ModelKind) -> str:
        return f"{path}: model {name!r} is a text-generation export: it serves /v1/completions"

    def openapi_refusal(self, served: Any, method: str, path: str, endpoints: Mapping[str, str]) -> str:
        if path.endswith("/infer"):
            return "a text-generation export is served by /v1/completions (gRPC: ModelStreamInfer)"
        if path == "/v1/chat/completions" and getattr(served, "chat_template", None) is None:
            return "this model has no chat template"
        reason = super().openapi_refusal(served, method, path, endpoints)
        return "not served by a text-generation export" if reason.startswith("served by ") else reason

    def grpc_model(self, found: ServedGenerator) -> Any:
        from .served.decoupled import GenerationModel

        return GenerationModel(found)

    def engine_side(self, served: ServedGenerator) -> tuple[Any, Any]:
        from .frontends.generation import GeneratorInfo

        return served.generator, GeneratorInfo.of(served.generator)

    def front_end_view(
        self, link: Any, key: int, info: Any, directory: Path, name: str, config: Any
    ) -> ServedGenerator:
        from .frontends.generation import ProxyGenerator

        return ServedGenerator(ProxyGenerator(link, info, key, directory), name, lenient_params=config.lenient_params)

    def generate(self, directory: Path, args: Any) -> int:
        """Complete ``args.prompts`` together on one BatchedGenerator and print them."""
        from ..generation import BatchedGenerator, StreamToken

        options = {
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "seed": args.seed,
            "stop": args.stop,
        }
        with BatchedGenerator(
            directory,
            max_batch_size=args.max_batch_size,
            providers=args.providers,
            max_context_length=args.max_context_length,
        ) as gen:
            on_token: Callable[[StreamToken], None] | None = None
            if args.stream and not args.json:

                def on_token(tok: StreamToken) -> None:
                    sys.stdout.write(tok.text)
                    sys.stdout.flush()

            futures = [
                gen.submit(p, args.max_new_tokens, on_token=on_token if i == 0 else None, **options)
                for i, p in enumerate(args.prompts)
            ]
            results = [f.result() for f in futures]
        for i, (prompt, out) in enumerate(zip(args.prompts, results, strict=True)):
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "text": out.text,
                            "token_ids": list(out.token_ids),
                            "finish_reason": out.finish_reason,
                            "prompt_tokens": out.prompt_tokens,
                            "completion_tokens": out.completion_tokens,
                        }
                    )
                )
            elif args.stream and i == 0:
                print(f"\n[{out.finish_reason}, {out.completion_tokens} tokens]")
            else:
                print(f"{prompt}{out.text}\n[{out.finish_reason}, {out.completion_tokens} tokens]")
        return 0


#: in this order, so the body routes are mounted (and documented) as before the kinds; which
#: kind an export is does not depend on it (the encoder is the fallback, asked last)
ENCODER = register(EncoderKind())
DECODER = register(DecoderKind())
