"""The one place where errors become HTTP answers, in the shape of the API that was called.

Maps tokios.errors types, pydantic validation errors, malformed bodies, unknown routes and
anything unexpected to a status (and `Retry-After` for overload) and a body: OpenAI's
`{"error": {"message", "type", "param", "code"}}` by default, Anthropic's
`{"type": "error", "error": {"type", "message"}}` under `/v1/messages`, Ollama's
`{"error": "message"}` under `/api/`. Used by server/app.py (exception handlers and middleware)
and by the streams, which send the same body as an in-stream error event.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from tokios.errors import InvalidRequestError, NotFoundError, OverloadedError, TokiosError
from tokios.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("tokios.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}

_PARAM_NAMES = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | {
    "prompt_logprobs"}


class RequestTooLargeError(TokiosError):
    status = 413
    error_type = "invalid_request_error"

    def __init__(self, max_body_size: int):
        super().__init__(f"Request body exceeds the server's limit of {max_body_size} bytes "
                         "(--max-body-size).", code="request_too_large")


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_error_to_invalid_request(exc: ValidationError) -> InvalidRequestError:
    """The first pydantic error, named by its dotted location (e.g. `messages.0.role`)."""
    first = exc.errors(include_url=False)[0]
    location = ".".join(str(part) for part in first.get("loc", ()) if part is not None)
    # Union members show up as extra loc parts ("str", "list[int]"); the first part is the field.
    param = str(first["loc"][0]) if first.get("loc") else None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        text = f"{param} is required"
    else:
        text = f"{location or 'body'}: {message}"
    return InvalidRequestError(text, param=param)


def to_tokios_error(exc: BaseException) -> TokiosError:
    """Normalizes any exception raised while handling a request to a TokiosError."""
    if isinstance(exc, TokiosError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error_to_invalid_request(exc)
    if isinstance(exc, RequestValidationError):  # a query parameter FastAPI parsed (e.g. /health?generate=)
        first = exc.errors()[0] if exc.errors() else {}
        location = ".".join(str(part) for part in first.get("loc", ()) if part not in ("query", "body"))
        return InvalidRequestError(f"{location or 'request'}: {first.get('msg', 'invalid value')}",
                                   param=location or None)
    if isinstance(exc, StarletteHTTPException):
        error = TokiosError(str(exc.detail))
        error.status = exc.status_code
        error.error_type = _TYPE_BY_STATUS.get(exc.status_code, "invalid_request_error")
        return error
    if isinstance(exc, ValueError):
        # SamplingParams raises ValueError naming the field first ("temperature must be ...").
        message = str(exc)
        first_word = message.split(" ", 1)[0].strip(":,")
        return InvalidRequestError(message, param=first_word if first_word in _PARAM_NAMES else None)
    logger.exception("internal error while handling a request", exc_info=exc)
    return TokiosError("The server had an internal error while handling the request.")


OPENAI, ANTHROPIC, OLLAMA = "openai", "anthropic", "ollama"

_ANTHROPIC_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                             404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                             429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error"}


def dialect_of_path(path: str) -> str:
    """Which API's error shape a route answers in."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path.startswith("/api/"):
        return OLLAMA
    return OPENAI


def dialect_error_body(error: TokiosError, dialect: str) -> dict[str, Any]:
    if dialect == ANTHROPIC:
        error_type = _ANTHROPIC_TYPE_BY_STATUS.get(error.status, "api_error")
        return {"type": "error", "error": {"type": error_type, "message": error.message}}
    if dialect == OLLAMA:
        return {"error": error.message}
    return error_body(error.message, error.error_type, error.param, error.code)


def error_payload(exc: BaseException, dialect: str = OPENAI) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for any exception."""
    error = to_tokios_error(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, StarletteHTTPException) and exc.headers:
        headers.update(exc.headers)  # e.g. the Allow header of a 405
    if isinstance(error, OverloadedError):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return error.status, dialect_error_body(error, dialect), headers


def error_response(exc: BaseException, dialect: str = OPENAI) -> JSONResponse:
    status, body, headers = error_payload(exc, dialect)
    return JSONResponse(body, status_code=status, headers=headers)


def model_not_found(model: str, served_model_names: list[str]) -> NotFoundError:
    return NotFoundError(f"The model {model!r} does not exist; this server serves {served_model_names}.",
                         param="model", code="model_not_found")
