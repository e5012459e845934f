"""Typed errors shared by every layer.

Each error carries what the server needs to answer in OpenAI's shape (status, type, param,
code); the server maps these types to HTTP responses in one place (server/errors.py).
Lower layers raise them with a message that names the field and the allowed range.
"""

from __future__ import annotations


class TokiosError(Exception):
    """Base class. `status` is the HTTP status the server answers with."""

    status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelLoadError(TokiosError):
    """The model file or directory is missing, malformed or of an unsupported kind."""

    error_type = "model_load_error"


class UnsupportedError(ModelLoadError):
    """An architecture or tensor type that this build does not implement."""


class InvalidRequestError(TokiosError, ValueError):
    """A request parameter is out of range or malformed; `param` names it."""

    status = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus completion does not fit the model's context or the whole KV cache."""

    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class AuthenticationError(TokiosError):
    status = 401
    error_type = "authentication_error"

    def __init__(self, message: str = "Invalid or missing API key."):
        super().__init__(message, code="invalid_api_key")


class PermissionDeniedError(TokiosError):
    status = 403
    error_type = "permission_error"


class NotFoundError(TokiosError):
    status = 404
    error_type = "not_found_error"


class OverloadedError(TokiosError):
    """The waiting queue is full (429) or the server is draining (503)."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, status: int = 429, retry_after_s: float = 1.0):
        super().__init__(message, code="overloaded")
        self.status = status
        self.retry_after_s = retry_after_s
