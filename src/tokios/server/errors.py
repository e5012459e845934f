"""The one place where errors become HTTP answers, in the shape of the API that was called.

Maps tokios.errors types, pydantic validation errors, malformed bodies, unknown routes and
anything unexpected to a status (and `Retry-After` for overload, rounded up to whole seconds)
and a body in the dialect's shape (`Dialect.error_body`, server/dialects/): OpenAI's
`{"error": {"message", "type", "param", "code"}}` when no dialect is named. Used by server/app.py
(exception handlers and middleware), by the stream guard (server/dialects/dialect.py), which
sends the same body as an in-stream error frame, and by the gateway.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from tokios.errors import InvalidRequestError, NotFoundError, OverloadedError, TokiosError

if TYPE_CHECKING:
    from tokios.server.dialects.dialect import Dialect

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


class RequestTooLargeError(TokiosError):
    status = 413
    error_type = "invalid_request_error"

    def __init__(self, max_body_size: int):
        super().__init__(f"Request body exceeds the server's limit of {max_body_size} bytes "
                         "(--max-body-size).", code="request_too_large")


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def openai_error_body(error: TokiosError) -> dict[str, Any]:
    return error_body(error.message, error.error_type, error.param, error.code)


def retry_after_header(retry_after_s: float) -> str:
    """Whole seconds, rounded up and at least 1: `Retry-After: 0` would invite an instant retry."""
    return str(max(1, math.ceil(retry_after_s)))


@functools.cache
def _param_names() -> frozenset[str]:
    # The OpenAI request fields a ValueError's first word may name (imported late: the dialects
    # import this module).
    from tokios.server.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest

    return frozenset(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | {"prompt_logprobs"}


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
        return InvalidRequestError(message, param=first_word if first_word in _param_names() else None)
    logger.exception("internal error while handling a request", exc_info=exc)
    return TokiosError("The server had an internal error while handling the request.")


def error_payload(exc: BaseException, dialect: Dialect | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for any exception, the body in the dialect's shape (OpenAI's by default)."""
    error = to_tokios_error(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, StarletteHTTPException) and exc.headers:
        headers.update(exc.headers)  # e.g. the Allow header of a 405
    if isinstance(error, OverloadedError):
        headers["Retry-After"] = retry_after_header(error.retry_after_s)
    body = openai_error_body(error) if dialect is None else dialect.error_body(error)
    return error.status, body, headers


def error_response(exc: BaseException, dialect: Dialect | None = None) -> JSONResponse:
    status, body, headers = error_payload(exc, dialect)
    return JSONResponse(body, status_code=status, headers=headers)


def model_not_found(model: str, served_model_names: list[str]) -> NotFoundError:
    return NotFoundError(f"The model {model!r} does not exist; this server serves {served_model_names}.",
                         param="model", code="model_not_found")
