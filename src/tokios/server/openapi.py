"""The server's OpenAPI document (GET /openapi.json): every route with its real request and
response schemas.

The routes parse their bodies by hand (server/body.py `parse_body`) so that every malformed body
gets its dialect's error shape and wording; FastAPI therefore sees no body parameters and would
publish nothing useful. This module writes the document instead, from the dialect records
(server/dialects/): each route's request body is the pydantic model its handler validates with,
its answer and stream event the models the dialect declares, its errors the dialect's error
schema. The server's own routes (health, metrics, engine stats) are described here.
`tests/e2e/test_server_fuzz.py` fuzzes the server against this document with schemathesis, so a
schema that drifts from the handlers fails the suite.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tokios.server.body import ResponseBody
from tokios.server.dialects import DIALECTS, Dialect, Route
from tokios.server.dialects.dialect import NDJSON, SSE

REF_TEMPLATE = "#/components/schemas/{model}"


class ErrorDetail(ResponseBody):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(ResponseBody):
    error: ErrorDetail


class Health(ResponseBody):
    status: str
    error: str | None = None
    generated_tokens: int | None = None
    latency_ms: float | None = None


class ProcessStats(ResponseBody):
    rss_bytes: int
    num_open_fds: int
    num_asyncio_tasks: int


class EngineStatsResponse(ResponseBody):
    model: str
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_steps: int
    num_unfinished_requests: int
    num_requests_in_flight: int
    invariants_error: str | None
    process: ProcessStats


class CacheEventsResponse(ResponseBody):
    model: str
    log_id: str
    next: int
    reset: bool
    block_size: int
    root_hash: str
    stored: list[str]
    removed: list[str]


SERVER_RESPONSE_MODELS = [ErrorResponse, Health, EngineStatsResponse, CacheEventsResponse]

# One schema per event (as OpenAPI 3.2's itemSchema): `data` holds a JSON event, an error body
# after a failure mid-stream, or the final `[DONE]` where the dialect sends one.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "contentMediaType": "application/json"},
                             "event": {"type": "string"}},
              "description": "Server-sent events: `data: {event}` (with `event: {type}` where the dialect names "
                             "its events)"}
_ERROR_DESCRIPTIONS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
                       408: "Body not received within --request-body-timeout",
                       413: "Body larger than --max-body-size", 429: "Queue full (Retry-After)",
                       500: "Engine failure", 503: "Loading, draining, stalled or failed (Retry-After)"}
_GENERATE_ERRORS = [400, 401, 404, 408, 413, 429, 500, 503]
_INPUT_ERRORS = [400, 401, 404, 408, 413, 503]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(statuses: list[int], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    content = {"application/json": {"schema": schema or _ref(ErrorResponse)}}
    return {str(status): {"description": _ERROR_DESCRIPTIONS[status], "content": content} for status in statuses}


def _operation(summary: str, ok: dict[str, Any], errors: list[int], body: type[BaseModel] | None = None,
               parameters: list[dict[str, Any]] | None = None, error_schema: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK", "content": ok},
                                                                   **_errors(errors, error_schema)}}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _json(body)}
    if parameters:
        operation["parameters"] = parameters
    return operation


def _route_operation(dialect: Dialect, route: Route) -> dict[str, Any]:
    ok: dict[str, Any] = _json(route.answer) if route.answer else {"application/json": {"schema": {"type": "object"}}}
    if route.stream_media_type == SSE:
        event = _SSE_EVENT
        if route.stream_event is not None:
            data = {**_SSE_EVENT["properties"]["data"], "contentSchema": _ref(route.stream_event)}
            event = {**_SSE_EVENT, "properties": {**_SSE_EVENT["properties"], "data": data}}
        ok[SSE] = {"schema": event}
    elif route.stream_media_type == NDJSON:
        ok[NDJSON] = {"schema": _ref(route.stream_event) if route.stream_event else {"type": "object"},
                      "description": "one JSON object per line"}
    if route.generates:
        statuses = _GENERATE_ERRORS
    elif route.body is not None or route.parameters:
        statuses = _INPUT_ERRORS
    else:
        statuses = [401, 503]
    parameters = [dict(parameter) for parameter in route.parameters]  # copies: build_openapi may name models
    return _operation(route.summary, ok, statuses, route.body, parameters, dialect.error_schema)


def _models_of(dialects: tuple[Dialect, ...]) -> tuple[list[type[BaseModel]], list[type[BaseModel]]]:
    """(request models, answer and event models) of every route, each once, in route order."""
    requests: dict[str, type[BaseModel]] = {}
    answers: dict[str, type[BaseModel]] = {}
    for dialect in dialects:
        for route in dialect.routes:
            if route.body is not None:
                requests.setdefault(route.body.__name__, route.body)
            for model in (route.answer, route.stream_event):
                if model is not None:
                    answers.setdefault(model.__name__, model)
    return list(requests.values()), list(answers.values())


def _name_the_models(schemas: dict[str, Any], request_models: list[type[BaseModel]], model_names: list[str]) -> None:
    """Every request's `model` as the names this server serves: any
    other name is refused (404), so the document says which ones pass. Where the name may be left
    out, an empty one means the default model too."""
    for model in request_models:
        properties = schemas.get(model.__name__, {}).get("properties", {})
        # (Ollama's older `name` stays free: a request that also gives `model` never reads it.)
        for field_name in ("model",):
            field = properties.get(field_name)
            if field is None or field_name not in model.model_fields:
                continue
            extra = {key: value for key, value in field.items() if key in ("title", "default", "description")}
            is_optional = "anyOf" in field and {"type": "null"} in field["anyOf"]
            if is_optional:
                properties[field_name] = {**extra, "anyOf": [{"enum": [*model_names, ""]}, {"type": "null"}]}
            else:
                properties[field_name] = {**extra, "enum": list(model_names)}


def build_openapi(title: str, version: str, protect_metrics: bool, model_names: list[str] | None = None
                  ) -> dict[str, Any]:
    """The document; `protect_metrics` says whether /health, /metrics and the stats need a key,
    `model_names` (when known) which `model` values the requests may name."""
    request_models, answer_models = _models_of(DIALECTS)
    _, definitions = models_json_schema([(model, "validation") for model in request_models] +
                                        [(model, "serialization") for model in answer_models + SERVER_RESPONSE_MODELS],
                                        ref_template=REF_TEMPLATE)
    if model_names:
        _name_the_models(definitions.get("$defs", {}), request_models, model_names)
    open_errors = [401] if protect_metrics else []
    model_query = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                   "description": "which model (default: the first)"}
    paths: dict[str, Any] = {
        "/health": {"get": _operation(
            "Readiness: 200 while the engine makes progress; with generate=1, after one generated token",
            _json(Health), open_errors + [400, 503],
            parameters=[{"name": "generate", "in": "query", "required": False, "schema": {"type": "boolean"},
                         "description": "run a one-token generation within --health-generate-timeout"}])},
        "/metrics": {"get": _operation("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}},
                                       open_errors)},
        "/v1/engine/cache_events": {"get": _operation(
            "The prefix cache's stored and dropped block hashes since a reader's last call (for the gateway's "
            "prefix-aware routing)", _json(CacheEventsResponse), [400, 401, 404, 503],
            parameters=[model_query,
                        {"name": "since", "in": "query", "required": False, "schema": {"type": "integer"},
                         "description": "the `next` of the reader's last call (default -1: a snapshot)"},
                        {"name": "log_id", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "the `log_id` of the reader's last call"}])},
        "/v1/engine/stats": {"get": _operation(
            "A loaded model's engine counters and the KV invariants", _json(EngineStatsResponse),
            open_errors + [404, 503], parameters=[model_query])},
    }
    for dialect in DIALECTS:
        for route in dialect.routes:
            # A path parameter's converter ("{model:path}") is the router's business, not the document's.
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
            operation = _route_operation(dialect, route)
            if model_names:  # a model named in the path, as in a body: any other name is a 404
                for parameter in operation.get("parameters", []):
                    if parameter["name"] == "model" and parameter["in"] == "path":
                        parameter["schema"] = {"enum": list(model_names)}
            paths.setdefault(path, {})[route.method] = operation
    # The 503 of /health is its answer, not an error body: same schema as its 200.
    paths["/health"]["get"]["responses"]["503"] = {"description": "Not ready", "content": _json(Health)}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {})},
    }
