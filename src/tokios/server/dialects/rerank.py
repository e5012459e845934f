"""The rerank API in Cohere's and Jina's shape (`/v1/rerank`, `/v2/rerank`, `/rerank`, as
llama.cpp's server offers it): a query and documents in, each document's relevance score out,
best first, cut to `top_n`, with the documents' text when `return_documents` asks for it.

A translation onto server/embeddings.py's `rerank` (a cross-encoder's score of each pair); a
model of another kind is a 400 naming what is needed. Errors answer in OpenAI's shape, as
llama.cpp's do.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokios.encoder.loader import RERANK
from tokios.server.body import JsonBool, JsonInt, RequestBody, ResponseBody
from tokios.server.dialects.dialect import DATA_ONLY, Dialect, Route, model_route
from tokios.server.embeddings import rerank
from tokios.server.errors import openai_error_body
from tokios.server.registry import ModelLease


class RerankDocument(BaseModel):
    text: str


class RerankRequest(RequestBody):
    model: str | None = None
    query: str = Field(json_schema_extra={"minLength": 1})
    # Plain strings, or Jina's / Cohere's objects with a text field.
    documents: list[str | RerankDocument] = Field(json_schema_extra={"minItems": 1})
    top_n: Annotated[JsonInt, Field(ge=1)] | None = None
    return_documents: JsonBool = False
    # Whether a document too long for the model (with the query) loses its end; false: a 400.
    truncation: JsonBool = True

    def texts(self) -> list[str]:
        return [document if isinstance(document, str) else document.text for document in self.documents]


class RerankResult(ResponseBody):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(ResponseBody):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, int]


async def _rerank(http_request: Request, body: RerankRequest, lease: ModelLease) -> Response:
    serving = lease.serving
    texts = body.texts()
    scores, num_tokens = await rerank(serving, http_request, body.query, texts, truncate=body.truncation)
    # top_n past the number of documents returns them all, as Cohere's and Jina's do.
    order = sorted(range(len(texts)), key=lambda index: -scores[index])[:body.top_n]
    results: list[dict[str, Any]] = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": serving.response_model_name(body.model),
                         "results": results, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


_SUMMARY = "Relevance of each document to a query, best first (Cohere / Jina rerank; a cross-encoder)"
_HANDLER = model_route(RerankRequest, _rerank, RERANK)

RERANK_API = Dialect(
    name="rerank",
    routes=tuple(Route("post", path, _HANDLER, _SUMMARY, RerankRequest, RerankResponse, generates=True)
                 for path in ("/v1/rerank", "/v2/rerank", "/rerank")),
    path_prefixes=(),
    error_body=openai_error_body,
    error_schema={"$ref": "#/components/schemas/ErrorResponse"},
    frame_style=DATA_ONLY,
    stream_error=openai_error_body,
)
