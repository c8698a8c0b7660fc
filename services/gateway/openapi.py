"""The OpenAPI 3 document served at ``/openapi.json``: every route, its request body and its
responses, so schema-driven fuzzers (schemathesis) and client generators can use it.

Kept next to the handlers by hand; the limits come from ``services.protocol.openai``, so the
document and the 400s agree. ``tests/gateway`` checks that every route of the app is described
here, and ``tests/gateway/test_fuzz_openapi.py`` fuzzes the gateway from this document.
"""

from __future__ import annotations

from typing import Any

from services.protocol import openai as oa

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {
        400: "invalid request (names the offending param)",
        401: "missing or invalid API key",
        404: "unknown model",
        408: "the request body did not arrive within the read timeout",
        413: "request body too large",
        429: "too many requests are waiting for an engine of the model to start",
        500: "unexpected server error",
        502: "the engine failed mid-generation",
        503: "no engine (or router) available",
        504: "the request timed out",
    }
    retry = {"Retry-After": {"description": "seconds to wait before trying again",
                             "schema": {"type": "integer"}}}
    return {str(s): {"description": text[s], **({"headers": retry} if s in (429, 503) else {}),
                     **_json(_ERROR)} for s in statuses}


def _lora_admin(summary: str, required: dict[str, Any]) -> dict[str, Any]:
    """vLLM's runtime adapter routes (services.gateway.lora_admin): a plain-text answer."""
    errors = _errors(400, 401, 404, 413, 503)
    errors["403"] = {"description": "not an admin API key", **_json(_ERROR)}
    errors["404"]["description"] = "runtime loading is off, or (unload) an unknown adapter"
    errors["502"] = {"description": "some engines failed (named in the message)",
                     **_json(_ERROR)}
    body = {"type": "object", "required": list(required),
            "properties": {**required, "base_model_name": {"type": "string"}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, **_json(body)},
            "responses": {
                "200": {"description": "done on every live engine of the model",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                **errors,
            },
        }
    }


_NAME = {"type": "string", "minLength": 1}
_BODY_ERRORS = (400, 401, 404, 408, 413, 500)
_GEN_ERRORS = (*_BODY_ERRORS, 429, 502, 503, 504)

_SAMPLING: dict[str, Any] = {
    "n": {
        "type": "integer",
        "minimum": 1,
        "maximum": oa.MAX_N,
        "default": 1,
        "description": f"samples per prompt; prompts x n at most {oa.MAX_CHOICES}",
    },
    "temperature": {"type": "number", "minimum": 0, "default": 1},
    "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": -1, "default": 0},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "default": 0},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1, "nullable": True},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
    "repetition_penalty": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "default": 1},
    "max_tokens": {
        "type": "integer",
        "minimum": 1,
        "nullable": True,
        "description": "at most the model's context; past what the prompt leaves, generation "
        "stops at the context (finish_reason length). Absent: 16 for completions, up to the "
        "context for chat",
    },
    "min_tokens": {
        "type": "integer",
        "minimum": 0,
        "default": 0,
        "description": "at most max_tokens",
    },
    "stop": {
        "nullable": True,
        "oneOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "maxItems": oa.MAX_STOP,
                "items": {"type": "string", "minLength": 1},
            },
        ],
    },
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "logit_bias": {
        "type": "object",
        "nullable": True,
        "additionalProperties": {"type": "number"},
        "description": "token id (a string of digits, below the vocabulary size) -> bias added "
        "to its logit, clamped to [-100, 100]",
    },
    "prompt_logprobs": {
        "type": "integer",
        "minimum": 0,
        "maximum": oa.MAX_COMPLETION_LOGPROBS,
        "nullable": True,
        "description": "vLLM's extension: logprobs of each prompt token (the first null)",
    },
    "ignore_eos": {"type": "boolean", "default": False},
    "skip_special_tokens": {"type": "boolean", "default": True},
    "include_stop_str_in_output": {"type": "boolean", "default": False},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "nullable": True,
        "properties": {
            "include_usage": {"type": "boolean"},
            "continuous_usage_stats": {"type": "boolean"},
        },
        "description": "only allowed when stream is true",
    },
    "cache_salt": {
        "type": "string",
        "minLength": 1,
        "description": "namespaces the prefix cache (scoped per API key when keys are set)",
    },
    "user": {"type": "string"},
    "kv_transfer_params": {
        "type": "object",
        "nullable": True,
        "description": "vLLM's, for disaggregated prefill/decode: passed to the engine's KV "
        "connector (one prompt, n=1); the response returns the engine's (a flat object of "
        "scalars)",
    },
    "response_format": {
        "type": "object",
        "nullable": True,
        "description": 'OpenAI\'s: {"type": "text" | "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name", "schema", "strict"}}; enforced by a grammar',
    },
    "structured_outputs": {
        "type": "object",
        "nullable": True,
        "description": "vLLM's guided decoding: exactly one of json (a schema), json_object, "
        "regex, choice (strings), grammar (EBNF or Lark); any_whitespace (default false)",
    },
}

_MODEL_DOC = "left out: the --default-model, or the only served model"

_TOKEN_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0},
    "description": "token ids, each below the model's vocabulary size",
}

_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": _MODEL_DOC},
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": oa.MAX_PROMPTS,
                    "items": {"type": "string", "minLength": 1},
                },
                _TOKEN_IDS,
                {"type": "array", "minItems": 1, "maxItems": oa.MAX_PROMPTS, "items": _TOKEN_IDS},
            ]
        },
        "echo": {
            "type": "boolean",
            "default": False,
            "description": "with logprobs, the prompt tokens' logprobs lead (the first null)",
        },
        "logprobs": {
            "type": "integer",
            "minimum": 0,
            "maximum": oa.MAX_COMPLETION_LOGPROBS,
            "nullable": True,
        },
        **_SAMPLING,
    },
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {
            "nullable": True,
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"type": "string", "enum": ["text"]},
                            "text": {"type": "string"},
                        },
                    },
                },
            ],
        },
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"},
                       "description": "an assistant's calls: {id, type, function: {name, "
                       "arguments}}"},
        "tool_call_id": {"type": "string", "description": "a tool message's answered call"},
    },
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": _MODEL_DOC},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        "logprobs": {"type": "boolean", "default": False},
        "top_logprobs": {
            "type": "integer",
            "minimum": 0,
            "maximum": oa.MAX_TOP_LOGPROBS,
            "nullable": True,
            "description": "requires logprobs: true",
        },
        "chat_template_kwargs": {"type": "object"},
        "add_generation_prompt": {"type": "boolean", "default": True},
        "continue_final_message": {
            "type": "boolean",
            "default": False,
            "description": "not together with add_generation_prompt: true",
        },
        "tools": {"type": "array", "items": {"type": "object"}, "nullable": True,
                  "description": '[{"type": "function", "function": {"name", "description", '
                  '"parameters"}}], passed to the chat template'},
        "tool_choice": {
            "nullable": True,
            "oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                      {"type": "object"}],
            "description": 'required and {"type": "function", "function": {"name"}} are '
            "enforced by a grammar; auto needs the gateway's --tool-call-parser",
        },
        "parallel_tool_calls": {"type": "boolean", "default": True},
        **_SAMPLING,
    },
}

_TOKENIZE_REQUEST = {
    "type": "object",
    "description": "either prompt or messages",
    "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "prompt": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "add_special_tokens": {"type": "boolean"},
        "add_generation_prompt": {"type": "boolean", "default": True},
        "continue_final_message": {"type": "boolean", "default": False},
        "return_token_strs": {"type": "boolean", "default": False},
        "chat_template_kwargs": {"type": "object"},
    },
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}

_COMPLETION_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "system_fingerprint": {"type": "string",
                               "description": "the serving configuration that answered"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {**_USAGE, "nullable": True},
    },
}

# One server-sent event (the schema of an event-stream describes each event, as OpenAPI 3.2's
# itemSchema does): data: {chunk} ... data: [DONE]; a failure after the first chunk is sent as
# data: {"error": {...}} before [DONE].
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "type": "string",
                    "description": 'a JSON chunk, a JSON {"error": {...}}, or [DONE]',
                },
            },
        }
    }
}


def _generation(summary: str, request_schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                **_json({"$ref": f"#/components/schemas/{request_schema}"}),
            },
            "responses": {
                "200": {
                    "description": "the completion (JSON), or an SSE stream when stream is true",
                    "headers": {
                        "x-pagoda-engine": {
                            "description": "the engine(s) that served the request",
                            "schema": {"type": "string"},
                        }
                    },
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/CompletionResponse"}
                        },
                        **_SSE,
                    },
                },
                **_errors(*_GEN_ERRORS),
            },
        }
    }


def openapi_document() -> dict[str, Any]:
    open_route = {"security": []}
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Pagoda gateway",
            "version": "0.1.0",
            "description": "OpenAI-compatible API of the Pagoda LLM serving stack.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": "string", "nullable": True},
                                "code": {"type": "string", "nullable": True},
                            },
                        }
                    },
                },
                "CompletionRequest": _COMPLETION_REQUEST,
                "ChatCompletionRequest": _CHAT_REQUEST,
                "CompletionResponse": _COMPLETION_RESPONSE,
                "TokenizeRequest": _TOKENIZE_REQUEST,
                "DetokenizeRequest": {
                    "type": "object",
                    "required": ["tokens"],
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    },
                },
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/completions": _generation("Create a completion", "CompletionRequest"),
            "/v1/chat/completions": _generation(
                "Create a chat completion", "ChatCompletionRequest"
            ),
            "/v1/models": {
                "get": {
                    "summary": "Models that have live engines",
                    "responses": {
                        "200": {
                            "description": "the model list",
                            **_json(
                                {
                                    "type": "object",
                                    "required": ["object", "data"],
                                    "properties": {
                                        "object": {"type": "string", "enum": ["list"]},
                                        "data": {"type": "array", "items": {"type": "object"}},
                                    },
                                }
                            ),
                        },
                        **_errors(401, 503),
                    },
                }
            },
            "/v1/load_lora_adapter": _lora_admin(
                "Load a LoRA adapter on every engine of its base model (admin keys)",
                {"lora_name": _NAME, "lora_path": _NAME}),
            "/v1/unload_lora_adapter": _lora_admin(
                "Unload a LoRA adapter from every engine of its base model (admin keys)",
                {"lora_name": _NAME}),
            "/tokenize": {
                "post": {
                    "summary": "Tokenize a prompt or a conversation (vLLM's shape)",
                    "requestBody": {
                        "required": True,
                        **_json({"$ref": "#/components/schemas/TokenizeRequest"}),
                    },
                    "responses": {
                        "200": {
                            "description": "the token ids",
                            **_json(
                                {
                                    "type": "object",
                                    "required": ["count", "tokens"],
                                    "properties": {
                                        "count": {"type": "integer"},
                                        "max_model_len": {"type": "integer", "nullable": True},
                                        "tokens": {"type": "array", "items": {"type": "integer"}},
                                        "token_strs": {
                                            "type": "array",
                                            "nullable": True,
                                            "items": {"type": "string"},
                                        },
                                    },
                                }
                            ),
                        },
                        **_errors(*_BODY_ERRORS),
                    },
                }
            },
            "/detokenize": {
                "post": {
                    "summary": "Turn token ids back into text (vLLM's shape)",
                    "requestBody": {
                        "required": True,
                        **_json({"$ref": "#/components/schemas/DetokenizeRequest"}),
                    },
                    "responses": {
                        "200": {
                            "description": "the text",
                            **_json(
                                {
                                    "type": "object",
                                    "required": ["prompt"],
                                    "properties": {"prompt": {"type": "string"}},
                                }
                            ),
                        },
                        **_errors(*_BODY_ERRORS),
                    },
                }
            },
            "/health": {
                "get": {
                    **open_route,
                    "summary": "Liveness: the process is up and its tokenizers are loaded",
                    "responses": {"200": {"description": "healthy"}},
                }
            },
            "/ready": {
                "get": {
                    **open_route,
                    "summary": "Readiness: the router answers",
                    "responses": {
                        "200": {"description": "ready"},
                        "503": {"description": "the router does not answer", **_json(_ERROR)},
                    },
                }
            },
            "/metrics": {
                "get": {
                    **open_route,
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/metrics/engines": {
                "get": {
                    **open_route,
                    "summary": "Every live engine's Prometheus metrics, labelled engine_id",
                    "responses": {
                        "200": {
                            "description": "text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    **open_route,
                    "summary": "This document",
                    "responses": {"200": {"description": "the OpenAPI document"}},
                }
            },
            "/version": {
                "get": {
                    **open_route,
                    "summary": "The server's version (vLLM's shape)",
                    "responses": {
                        "200": {
                            "description": "the version",
                            **_json(
                                {
                                    "type": "object",
                                    "required": ["version"],
                                    "properties": {"version": {"type": "string"}},
                                }
                            ),
                        }
                    },
                }
            },
        },
    }
