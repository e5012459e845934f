"""What every dialect's bodies share: the base models of requests and of answers' schemas, the
JSON number types that refuse booleans, and `parse_body`, which turns raw bytes into a validated
model so that every malformed body is a 400 in the dialect's own error shape (server/errors.py),
never FastAPI's 422."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictBool, StrictInt

from tokios.errors import InvalidRequestError

if TYPE_CHECKING:
    from starlette.requests import Request

# OpenAI caps top_logprobs at 20 and completions' logprobs at 5; we allow 20 for both (as vLLM),
# and so does every dialect that returns logprobs.
MAX_TOP_LOGPROBS = 20
BodyT = TypeVar("BodyT", bound=BaseModel)
# A token id is a JSON integer: pydantic's lax mode would take true as 1 (found by fuzzing).
TokenId = StrictInt


def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


# Numbers in request bodies: pydantic's lax mode otherwise takes true as 1 (fuzzing found `"n":
# true` answered). Kept lax otherwise, so 256.0 still reads as 256.
JsonInt = Annotated[int, BeforeValidator(_not_a_boolean)]
JsonFloat = Annotated[float, BeforeValidator(_not_a_boolean)]
# And the other way round: a JSON boolean is true or false, never 0 or 1.
JsonBool = StrictBool


class RequestBody(BaseModel):
    # Unknown fields are ignored, as OpenAI's SDKs send fields a local server may not know.
    model_config = ConfigDict(extra="ignore")


class ResponseBody(BaseModel):
    """An answer's schema: answers may grow fields; the document promises the ones listed."""

    model_config = ConfigDict(extra="allow")


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The request's body validated by `model`; an empty, non-JSON or non-object body is a 400."""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("The request body is empty; send a JSON object.", param=None)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}", param=None) from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"The request body must be a JSON object, got {type(data).__name__}.", param=None)
    return model.model_validate(data)
