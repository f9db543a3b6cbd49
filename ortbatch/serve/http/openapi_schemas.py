"""What each HTTP route takes and answers, for the OpenAPI document (:mod:`.openapi`).

Two tables, the one place to edit when a route or a field changes:

* :data:`SCHEMAS`: the request and response bodies as JSON Schema (OpenAPI 3.1 uses JSON
  Schema 2020-12), by name. A new request field is one line in its schema's
  ``properties``.
* :data:`OPERATIONS`: ``(METHOD, path template)`` -> :class:`Operation` (summary, tag,
  the schemas of its body and answer, a request example). A new route is one entry here;
  ``tests/serve/test_openapi.py`` fails, naming it, while a mounted route has none.

Examples may say ``{model}``: the document puts in the served model's name, so
"Try it out" works as it stands. The answers' schemas are checked against real answers by
the tests (``jsonschema``), so they describe what the server sends, not what it meant to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["HEALTH_TAG", "OPERATIONS", "SCHEMAS", "Operation"]

HEALTH_TAG = "Health and metrics"

_STR = {"type": "string"}
_INT = {"type": "integer"}
#: an OpenAI model object (`GET /v1/models`, `GET /v1/models/{name}`)
_OPENAI_MODEL = {
    "type": "object",
    "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR},
    "required": ["id", "object"],
}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_IDS = {"type": "array", "items": _INT}
_TEXTS = {"oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1}]}
#: TEI's truncation_direction (ortbatch cuts at the right; Left is refused when truncate is on)
_DIRECTION = {
    "type": "string",
    "enum": ["Right", "right", "Left", "left"],
    "default": "Right",
    "description": "TEI's: where an over-long input is cut; Left is refused when truncate is on",
}
#: what /v1/embeddings and TEI's /embed take alike: the input, and the pipeline's options
_EMBED_INPUT = {
    "description": "a text, texts, token ids, or lists of token ids",
    "oneOf": [_STR, {"type": "array", "items": _STR}, _IDS, {"type": "array", "items": _IDS}],
}
_EMBED_OPTIONS = {
    "dimensions": {
        "type": "integer",
        "minimum": 1,
        "description": "the first N values (Matryoshka), re-normalized when the model normalizes",
    },
    "prompt_name": {"type": "string", "description": "one of the model's prompts, put before each text"},
    "prompt": {"type": "string", "description": "a prompt put before each text (wins over prompt_name)"},
}
#: the embedding and task requests: a field not listed is a 400 (unless --lenient-params)
_CLOSED = {"additionalProperties": False}
_TRUNCATE = {
    "type": "boolean",
    "description": "cut an input longer than the model's limit to the limit instead of a 400 "
    "(default: the server's --truncate)",
}
#: the sampling fields both OpenAI completion APIs take
_SAMPLING: dict[str, Any] = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "description": "an extension (vLLM's); 0 or -1: off"},
    "stop": {"oneOf": [_STR, {"type": "array", "items": _STR}]},
    "seed": _INT,
    "n": {"type": "integer", "minimum": 1, "maximum": 128, "default": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "user": _STR,
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
}
_SCHEMA_OBJECT = {"type": ["object", "boolean"], "description": "a JSON schema"}
_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}  # a schema's or a function's, as OpenAI checks it
#: OpenAI's structured output (vLLM's guided_* and structured_outputs are extras, in the description)
_STRUCTURED: dict[str, Any] = {
    "response_format": {
        "oneOf": [
            {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "properties": {
                            "name": _NAME,
                            "description": _STR,
                            "schema": _SCHEMA_OBJECT,
                            "strict": {"type": ["boolean", "null"]},
                        },
                        "required": ["name", "schema"],
                    },
                },
                "required": ["type", "json_schema"],
            },
        ],
        "description": "json_object: a JSON object; json_schema: JSON valid against the schema (strict or not)",
    },
}
_FUNCTION_TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": _NAME,
                "description": _STR,
                "parameters": {"type": "object", "description": "a JSON schema of an object"},
                "strict": _BOOL,
            },
            "required": ["name"],
        },
    },
    "required": ["function"],
}
#: tool calling: chat only
_TOOLS: dict[str, Any] = {
    "tools": {"type": "array", "items": _FUNCTION_TOOL, "description": "shown through the chat template"},
    "tool_choice": {
        "oneOf": [
            {"enum": ["auto", "none", "required"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "properties": {"name": _STR}, "required": ["name"]},
                },
                "required": ["type", "function"],
            },
        ],
        "description": "required or a named function: a call forced by grammar",
    },
    "parallel_tool_calls": {"type": "boolean", "default": True},
}
_USAGE = {
    "type": "object",
    "properties": {"prompt_tokens": _INT, "total_tokens": _INT, "completion_tokens": _INT},
    "required": ["prompt_tokens", "total_tokens"],
}
_DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]
_TENSOR = {
    "type": "object",
    "properties": {
        "name": _STR,
        "shape": _IDS,
        "datatype": {
            "type": "string",
            "enum": _DATATYPES,
        },
        "parameters": {"type": "object"},
        "data": {"type": "array", "description": "the tensor's elements, flat (row-major) or nested"},
    },
    "required": ["name", "shape", "datatype"],
}
_TENSOR_META = {
    "type": "object",
    "properties": {"name": _STR, "datatype": _STR, "shape": _IDS},
    "required": ["name", "datatype", "shape"],
}

#: request and response bodies by name (``#/components/schemas/{name}``)
SCHEMAS: dict[str, dict[str, Any]] = {
    # -- errors --------------------------------------------------------------------------
    "Error": {
        "description": '``{"error": message}`` under /v2 and elsewhere; OpenAI\'s shape under /v1',
        "oneOf": [
            {"type": "object", "properties": {"error": _STR}, "required": ["error"]},
            {
                "type": "object",
                "properties": {
                    "error": {
                        "type": "object",
                        "properties": {
                            "message": _STR,
                            "type": _STR,
                            "param": {"type": ["string", "null"]},
                            "code": _INT,
                        },
                        "required": ["message", "type"],
                    }
                },
                "required": ["error"],
            },
        ],
    },
    # -- health, server ------------------------------------------------------------------
    "Live": {"type": "object", "properties": {"live": _BOOL}, "required": ["live"]},
    "Ready": {"type": "object", "properties": {"ready": _BOOL}, "required": ["ready"]},
    "ServerMetadata": {
        "type": "object",
        "properties": {"name": _STR, "version": _STR, "extensions": {"type": "array", "items": _STR}},
        "required": ["name", "version", "extensions"],
    },
    "Model": _OPENAI_MODEL,
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _OPENAI_MODEL},
        },
        "required": ["object", "data"],
    },
    # -- KServe v2 ------------------------------------------------------------------------
    "ModelMetadata": {
        "type": "object",
        "properties": {
            "name": _STR,
            "versions": {"type": "array", "items": _STR},
            "platform": _STR,
            "inputs": {"type": "array", "items": _TENSOR_META},
            "outputs": {"type": "array", "items": _TENSOR_META},
            "parameters": {"type": "object"},
        },
        "required": ["name", "platform", "inputs", "outputs"],
    },
    "ModelConfig": {
        "type": "object",
        "description": "a Triton-style model configuration (dims without the batch dim)",
        "properties": {"name": _STR, "platform": _STR, "max_batch_size": _INT, "input": {}, "output": {}},
        "required": ["name"],
    },
    "ModelReady": {"type": "object", "properties": {"name": _STR, "ready": _BOOL}, "required": ["name", "ready"]},
    "InferRequest": {
        "type": "object",
        "description": "the Open Inference Protocol's JSON form (binary tensors: the "
        "Inference-Header-Content-Length header and a body past the JSON header)",
        "properties": {
            "id": _STR,
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "items": _TENSOR, "minItems": 1},
            "outputs": {
                "type": "array",
                "items": {"type": "object", "properties": {"name": _STR, "parameters": {"type": "object"}}},
            },
        },
        "required": ["inputs"],
    },
    "InferResponse": {
        "type": "object",
        "properties": {
            "model_name": _STR,
            "model_version": _STR,
            "id": _STR,
            "parameters": {"type": "object"},
            "outputs": {"type": "array", "items": _TENSOR},
        },
        "required": ["model_name", "outputs"],
    },
    # -- repository ----------------------------------------------------------------------
    "RepositoryIndexRequest": {
        "type": "object",
        "properties": {"ready": {"type": "boolean", "description": "only the models that are ready"}},
    },
    "RepositoryIndex": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": _STR, "version": _STR, "state": _STR, "reason": _STR},
            "required": ["name", "state"],
        },
    },
    "RepositoryAction": {"type": "object", "properties": {"parameters": {"type": "object"}}},
    "Empty": {"type": "object", "maxProperties": 0},
    # -- OpenAI embeddings ----------------------------------------------------------------
    "EmbeddingRequest": {
        "type": "object",
        "properties": {
            "input": _EMBED_INPUT,
            "model": _STR,
            "encoding_format": {
                "type": "string",
                "enum": ["float", "base64", "int8", "uint8", "binary", "ubinary"],
                "default": "float",
                "description": "base64: little-endian float32 bytes; int8, uint8, binary, ubinary: "
                "sentence-transformers' quantize_embeddings, as lists of integers",
            },
            **_EMBED_OPTIONS,
            "truncate": _TRUNCATE,
            "user": _STR,
        },
        "required": ["input"],
        **_CLOSED,
    },
    "EmbeddingResponse": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "object": {"const": "embedding"},
                        "index": _INT,
                        "embedding": {
                            "description": "floats, integers (a quantized encoding_format), or base64 of "
                            "little-endian float32",
                            "oneOf": [{"type": "array", "items": _NUM}, _STR],
                        },
                    },
                    "required": ["object", "index", "embedding"],
                },
            },
            "model": _STR,
            "usage": _USAGE,
        },
        "required": ["object", "data", "model", "usage"],
    },
    "EmbedRequest": {
        "type": "object",
        "properties": {
            "inputs": _EMBED_INPUT,
            "model": _STR,
            "normalize": {
                "type": "boolean",
                "default": True,
                "description": "L2-normalize (TEI's default); false: the pipeline's own vectors, refused where "
                "the pipeline normalizes them itself",
            },
            **_EMBED_OPTIONS,
            "truncate": _TRUNCATE,
            "truncation_direction": _DIRECTION,
        },
        "required": ["inputs"],
        **_CLOSED,
    },
    "EmbedResponse": {
        "description": "one vector per input",
        "type": "array",
        "items": {"type": "array", "items": _NUM},
    },
    "EmbedSparseRequest": {
        "type": "object",
        "properties": {
            "inputs": {**_TEXTS, "description": "a text or texts"},
            "model": _STR,
            "truncate": _TRUNCATE,
            "truncation_direction": _DIRECTION,
            "prompt_name": {"type": "string", "description": "one of the model's prompts, put before each text"},
            "prompt": {"type": "string", "description": "a prompt put before each text"},
            "top_k": {"type": "integer", "minimum": 1, "description": "keep the k largest weights"},
            "threshold": {"type": "number", "minimum": 0, "default": 0, "description": "keep the weights above it"},
        },
        "required": ["inputs"],
        **_CLOSED,
    },
    "EmbedSparseResponse": {
        "description": "per input, its non-zero weights in vocabulary order",
        "type": "array",
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"index": _INT, "value": _NUM},
                "required": ["index", "value"],
            },
        },
    },
    # -- tasks ---------------------------------------------------------------------------
    "RerankRequest": {
        "type": "object",
        "properties": {
            "query": _STR,
            "documents": {
                "type": "array",
                "items": {"oneOf": [_STR, {"type": "object", "properties": {"text": _STR}, "required": ["text"]}]},
            },
            "top_n": {"type": "integer", "minimum": 1},
            "return_documents": {"type": "boolean", "default": True},
            "raw_scores": {"type": "boolean", "default": False},
            "model": _STR,
            "truncate": _TRUNCATE,
        },
        "required": ["query", "documents"],
        **_CLOSED,
    },
    "RerankResponse": {
        "type": "object",
        "properties": {
            "id": _STR,
            "model": _STR,
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"index": _INT, "relevance_score": _NUM, "document": {"type": "object"}},
                    "required": ["index", "relevance_score"],
                },
            },
            "usage": _USAGE,
        },
        "required": ["id", "model", "results"],
    },
    "RerankTeiRequest": {
        "type": "object",
        "properties": {
            "query": _STR,
            "texts": {"type": "array", "items": _STR},
            "top_n": {"type": "integer", "minimum": 1},
            "return_text": {"type": "boolean", "default": False},
            "raw_scores": {"type": "boolean", "default": False},
            "model": _STR,
            "truncate": _TRUNCATE,
            "truncation_direction": _DIRECTION,
        },
        "required": ["query", "texts"],
        **_CLOSED,
    },
    "RerankTeiResponse": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"index": _INT, "score": _NUM, "text": _STR},
            "required": ["index", "score"],
        },
    },
    "ClassifyRequest": {
        "type": "object",
        "properties": {"input": _TEXTS, "model": _STR, "truncate": _TRUNCATE, "user": _STR},
        "required": ["input"],
        **_CLOSED,
    },
    "ClassifyResponse": {
        "type": "object",
        "properties": {
            "id": _STR,
            "object": {"const": "list"},
            "created": _INT,
            "model": _STR,
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "description": "a label distribution (sequence classification) or entity spans (token "
                    "classification)",
                    "properties": {
                        "index": _INT,
                        "label": _STR,
                        "probs": {"type": "array", "items": _NUM},
                        "num_classes": _INT,
                        "entities": {"type": "array", "items": {"type": "object"}},
                    },
                    "required": ["index"],
                },
            },
            "usage": _USAGE,
        },
        "required": ["object", "model", "data"],
    },
    "TokenizeRequest": {
        "type": "object",
        "description": "TEI's shape (``inputs``) or vLLM's (``prompt``)",
        "properties": {
            "inputs": _TEXTS,
            "prompt": _STR,
            "add_special_tokens": {"type": "boolean", "default": True},
            "model": _STR,
        },
        **_CLOSED,
    },
    "TokenizeResponse": {
        "oneOf": [
            {
                "type": "array",
                "description": "TEI's shape: the tokens of each input",
                "items": {"type": "array", "items": {"type": "object"}},
            },
            {
                "type": "object",
                "description": "vLLM's shape",
                "properties": {"count": _INT, "max_model_len": {"type": ["integer", "null"]}, "tokens": _IDS},
                "required": ["count", "tokens"],
            },
        ]
    },
    "DetokenizeRequest": {
        "type": "object",
        "description": "TEI's shape (``ids``: ids or lists of ids) or vLLM's (``tokens``)",
        "properties": {
            "ids": {"oneOf": [_IDS, {"type": "array", "items": _IDS}]},
            "tokens": _IDS,
            "skip_special_tokens": {"type": "boolean", "default": True},
            "model": _STR,
        },
        **_CLOSED,
    },
    "DetokenizeResponse": {
        "oneOf": [
            {"type": "array", "items": _STR},
            {"type": "object", "properties": {"prompt": _STR}, "required": ["prompt"]},
        ]
    },
    # -- OpenAI completions ---------------------------------------------------------------
    "CompletionRequest": {
        "type": "object",
        "description": "OpenAI's fields below; vLLM's extra sampling parameters (min_p, repetition_penalty, "
        "min_tokens, stop_token_ids, ignore_eos, prompt_logprobs, ...) and structured output (response_format, "
        "guided_json, guided_regex, guided_choice, guided_grammar, structured_outputs) too: every field is "
        "honoured, accepted or refused with a 400 naming it, as docs/serving.md's parameter table says",
        "properties": {
            "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR}, _IDS, {"type": "array", "items": _IDS}]},
            "model": _STR,
            "max_tokens": {"type": "integer", "minimum": 0, "default": 16, "description": "0 only with echo"},
            **_SAMPLING,
            "best_of": {"type": "integer", "minimum": 1, "maximum": 128},
            "echo": {"type": "boolean", "default": False},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        },
        "required": ["prompt"],
    },
    "ChatCompletionRequest": {
        "type": "object",
        "description": "OpenAI's fields below; vLLM's extras (add_generation_prompt, continue_final_message, "
        "chat_template_kwargs, min_p, guided_json, guided_regex, guided_choice, guided_grammar, "
        "structured_outputs, ...) too, as docs/serving.md's parameter table says",
        "properties": {
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "role": _STR,
                        "content": {"oneOf": [_STR, {"type": "array"}, {"type": "null"}]},
                        "tool_calls": {"type": "array", "description": "an assistant turn's (its content may be null)"},
                        "tool_call_id": {"type": "string", "description": "a tool turn's: the call it answers"},
                    },
                    "required": ["role"],
                },
            },
            "model": _STR,
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "max_tokens": {"type": "integer", "minimum": 1},
            **_SAMPLING,
            "logprobs": {"type": "boolean", "default": False},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            **_STRUCTURED,
            **_TOOLS,
        },
        "required": ["messages"],
    },
    "GenerateRequest": {
        "type": "object",
        "description": "KServe v2's generate extension (as Triton's)",
        "properties": {
            "text_input": _STR,
            "parameters": {"type": "object", "description": "/v1/completions fields (but prompt and stream)"},
        },
        "required": ["text_input"],
    },
    "GenerateResponse": {
        "type": "object",
        "description": "with n > 1, text_output, finish_reason and logprobs are lists, one per choice",
        "properties": {
            "model_name": _STR,
            "model_version": _STR,
            "text_output": {"oneOf": [_STR, {"type": "array", "items": _STR}]},
            "finish_reason": {"oneOf": [_STR, {"type": "array", "items": _STR}]},
            "logprobs": {"oneOf": [{"type": "object"}, {"type": "array"}], "description": "as /v1/completions'"},
        },
        "required": ["model_name", "model_version", "text_output"],
    },
    "CompletionResponse": {
        "type": "object",
        "description": "OpenAI's completion (or chat completion); with stream=true, server-sent events of chunks",
        "properties": {
            "id": _STR,
            "object": {"enum": ["text_completion", "chat.completion"]},
            "created": _INT,
            "model": _STR,
            "choices": {
                "type": "array",
                "items": {"type": "object"},
                "description": "chat: message (content, and tool_calls with finish_reason tool_calls when the "
                "model called tools; streamed as delta.tool_calls pieces)",
            },
            "usage": _USAGE,
        },
        "required": ["id", "object", "model", "choices"],
    },
}


@dataclass(frozen=True)
class Operation:
    """One route as the document shows it."""

    summary: str
    tag: str
    #: the JSON request body's schema (a :data:`SCHEMAS` name), if it takes one
    request: str | None = None
    #: the 200 answer's schema (a :data:`SCHEMAS` name); None: ``media`` with no schema
    response: str | None = None
    #: a request example ("{model}" becomes the served model's name)
    example: Any = None
    #: the 200 answer's media type
    media: str = "application/json"
    description: str = ""
    #: answered without the API key (the health checks)
    open: bool = False


_V2 = "KServe v2 (Open Inference Protocol)"
_OPENAI = "OpenAI"
_TASKS = "Tasks (rerank, classify, tokenize)"
_REPO = "Model repository"
_MODEL = "/v2/models/{name}"
_VERSION = "/v2/models/{name}/versions/{version}"


def _v2_model_routes(base: str, which: str) -> dict[tuple[str, str], Operation]:
    return {
        ("GET", base): Operation(f"Model metadata{which}", _V2, response="ModelMetadata"),
        ("GET", base + "/ready"): Operation(f"Model readiness{which}", _V2, response="ModelReady"),
        ("GET", base + "/config"): Operation(f"Triton-style model configuration{which}", _V2, response="ModelConfig"),
        ("POST", base + "/infer"): Operation(
            f"Run inference{which}",
            _V2,
            "InferRequest",
            "InferResponse",
            description="Tensors in the model's own inputs, or (on the `{name}_text` entry) texts as one BYTES "
            "input; the examples are made from this model's metadata.",
        ),
        ("POST", base + "/generate"): Operation(
            f"Generate text{which} (a text-generation export)",
            _V2,
            "GenerateRequest",
            "GenerateResponse",
            {"text_input": "Once upon a time", "parameters": {"max_tokens": 16, "temperature": 0}},
        ),
        ("POST", base + "/generate_stream"): Operation(
            f"Generate text, streamed{which} (server-sent events of generate's answer, piece by piece)",
            _V2,
            "GenerateRequest",
            example={"text_input": "Once upon a time", "parameters": {"max_tokens": 16, "temperature": 0}},
            media="text/event-stream",
        ),
    }


#: every route of every app, by ``(METHOD, path template)`` (HEAD, which Starlette adds to
#: each GET, is not listed)
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("GET", "/v2/health/live"): Operation("Liveness", HEALTH_TAG, response="Live", open=True),
    ("GET", "/v2/health/ready"): Operation(
        "Readiness (503 while shutting down)", HEALTH_TAG, response="Ready", open=True
    ),
    ("GET", "/metrics"): Operation("Prometheus metrics", HEALTH_TAG, media="text/plain"),
    ("GET", "/v2"): Operation("Server metadata", _V2, response="ServerMetadata"),
    ("GET", "/v1/models"): Operation("The models served", _OPENAI, response="ModelList"),
    ("GET", "/v1/models/{name}"): Operation("One model served (404 when not)", _OPENAI, response="Model"),
    **_v2_model_routes(_MODEL, ""),
    **_v2_model_routes(_VERSION, " (a version)"),
    ("POST", "/v1/embeddings"): Operation(
        "Embeddings (OpenAI)",
        _OPENAI,
        "EmbeddingRequest",
        "EmbeddingResponse",
        {"input": ["The quick brown fox jumps over the lazy dog."], "model": "{model}"},
        description="The export's own sentence-transformers pipeline (as its encode), with dimensions, "
        "prompts and quantized encodings.",
    ),
    ("POST", "/embed"): Operation(
        "Embeddings (text-embeddings-inference shape)",
        _TASKS,
        "EmbedRequest",
        "EmbedResponse",
        {"inputs": ["The quick brown fox jumps over the lazy dog."], "model": "{model}"},
        description="The export's own sentence-transformers pipeline, L2-normalized unless normalize is false.",
    ),
    ("POST", "/embed_sparse"): Operation(
        "Sparse embeddings of a SPLADE export (text-embeddings-inference shape)",
        _TASKS,
        "EmbedSparseRequest",
        "EmbedSparseResponse",
        {"inputs": ["The quick brown fox jumps over the lazy dog."], "top_k": 16, "model": "{model}"},
    ),
    ("POST", "/v1/completions"): Operation(
        "Completions (OpenAI)",
        _OPENAI,
        "CompletionRequest",
        "CompletionResponse",
        {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "model": "{model}"},
    ),
    ("POST", "/v1/chat/completions"): Operation(
        "Chat completions (OpenAI)",
        _OPENAI,
        "ChatCompletionRequest",
        "CompletionResponse",
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "model": "{model}"},
    ),
    ("POST", "/v1/rerank"): Operation(
        "Rerank documents (Cohere / Jina / vLLM shape)",
        _TASKS,
        "RerankRequest",
        "RerankResponse",
        {"query": "What is Paris?", "documents": ["Paris is in France.", "Bananas are yellow."], "model": "{model}"},
    ),
    ("POST", "/rerank"): Operation(
        "Rerank texts (text-embeddings-inference shape)",
        _TASKS,
        "RerankTeiRequest",
        "RerankTeiResponse",
        {"query": "What is Paris?", "texts": ["Paris is in France.", "Bananas are yellow."], "model": "{model}"},
    ),
    ("POST", "/v1/classify"): Operation(
        "Classify texts (vLLM shape)",
        _TASKS,
        "ClassifyRequest",
        "ClassifyResponse",
        {"input": ["I loved this film."], "model": "{model}"},
    ),
    ("POST", "/tokenize"): Operation(
        "Tokenize (TEI or vLLM shape)", _TASKS, "TokenizeRequest", "TokenizeResponse", {"inputs": "Hello world"}
    ),
    ("POST", "/detokenize"): Operation(
        "Detokenize (TEI or vLLM shape)", _TASKS, "DetokenizeRequest", "DetokenizeResponse", {"ids": [1, 2, 3]}
    ),
    ("POST", "/v2/repository/index"): Operation(
        "The repository's models and their states", _REPO, "RepositoryIndexRequest", "RepositoryIndex", {}
    ),
    ("POST", "/v2/repository/models/{name}/load"): Operation(
        "Load a model (or reload a changed export)", _REPO, "RepositoryAction", "Empty", {}
    ),
    ("POST", "/v2/repository/models/{name}/unload"): Operation(
        "Unload a model (after its in-flight requests)", _REPO, "RepositoryAction", "Empty", {}
    ),
}
