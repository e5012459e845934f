"""What an API dialect is: one record that the app, the error mapping, /openapi.json, the stream
guard and the gateway all read.

A `Dialect` names its routes (`Route`: method, path, handler, the pydantic model its body is
validated with, which is also the schema /openapi.json publishes, and its answer's schema), the
paths whose errors answer in its shape, its error body, how its stream frames events
(`EventEncoder`), the frame that ends a stream after an error, and its done marker. The four
records live beside their translations: dialects/openai (chat, completions, embeddings and the
OpenAI-compatible utilities), dialects/openai_responses.py, dialects/anthropic.py and
dialects/ollama.py; dialects/__init__.py lists them.

Also here, because every dialect needs them: `guarded_stream`, the one place where an error
raised after the headers went out becomes the dialect's in-stream error frame (then its done
marker), and `join_text_parts`, which reads a message's text from a list of typed parts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from tokios.errors import InvalidRequestError, TokiosError
from tokios.server.body import BodyT, parse_body
from tokios.server.errors import to_tokios_error

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"

# How a stream frames one event.
DATA_ONLY = "data"  # `data: {json}` (OpenAI chat and completions)
NAMED = "named"  # `event: {type}` + `data: {json}` (Anthropic)
SEQUENCED = "sequenced"  # NAMED, each payload numbered by `sequence_number` (OpenAI Responses)
JSON_LINES = "lines"  # one JSON object per line (Ollama)


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


class EventEncoder:
    """Frames one stream's events; a sequenced stream numbers them from `first_sequence_number`
    (a relay that already passed some events on continues their count)."""

    def __init__(self, style: str, first_sequence_number: int = 0):
        self.style = style
        self.next_sequence_number = first_sequence_number

    def encode(self, payload: dict[str, Any]) -> str:
        if self.style == JSON_LINES:
            return _json(payload) + "\n"
        if self.style == DATA_ONLY:
            return f"data: {_json(payload)}\n\n"
        if self.style == SEQUENCED:
            payload = {"type": payload["type"], "sequence_number": self.next_sequence_number, **payload}
            self.next_sequence_number += 1
        return f"event: {payload['type']}\ndata: {_json(payload)}\n\n"


# A route's handler: the server's state is `request.app.state.tokios` (server/app.py).
Handler = Callable[[Request], Awaitable[Response]]


def model_route(body_model: type[BodyT], answer: Callable[[Request, BodyT, Any], Awaitable[Response]],
                needs: str | None = None, uses_chat_template: bool = False) -> Handler:
    """The handler of a route that runs one body against the model it names: readiness, the body
    validated by `body_model`, then `answer(request, body, lease)` on that model, loaded and pinned
    (server/app.py ServerState.respond); `needs`: the kind of model it serves (generate,
    embedding, rerank), or None for any; `uses_chat_template`: it renders chat messages."""

    async def handler(request: Request) -> Response:
        state = request.app.state.tokios
        state.check_ready()
        body = await parse_body(request, body_model)
        return await state.respond(body.model, lambda lease: answer(request, body, lease), needs=needs,
                                   uses_chat_template=uses_chat_template)

    return handler


@dataclass(frozen=True)
class Route:
    method: str  # "get" or "post"
    path: str
    handler: Handler
    summary: str
    # The model the handler validates its JSON body with; /openapi.json publishes the same.
    body: type[BaseModel] | None = None
    # The 200 answer: a response model (JSON), or None for "a JSON object".
    answer: type[BaseModel] | None = None
    # The media type of a streamed answer (SSE or NDJSON), and the model of one event or line.
    stream_media_type: str | None = None
    stream_event: type[BaseModel] | None = None
    # Whether the route runs the engine: it can then also answer 429, 500 and 503.
    generates: bool = False
    # OpenAPI parameter objects (path and query parameters).
    parameters: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Dialect:
    name: str
    routes: tuple[Route, ...]
    # Paths (beyond the routes' own) whose errors answer in this shape: a path equal to a prefix
    # or under it (`prefix/...`); a prefix ending in "/" matches everything under it.
    path_prefixes: tuple[str, ...]
    error_body: Callable[[TokiosError], dict[str, Any]]
    error_schema: dict[str, Any]  # the JSON schema of error_body, for /openapi.json
    frame_style: str
    # The payload of the frame that ends a stream after an error.
    stream_error: Callable[[TokiosError], dict[str, Any]]
    done_marker: str | None = None
    route_paths: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "route_paths", frozenset(route.path for route in self.routes))

    @property
    def frame_end(self) -> str:
        """What every frame ends with: a line end for JSON lines, a blank line for SSE."""
        return "\n" if self.frame_style == JSON_LINES else "\n\n"

    def owns(self, path: str) -> bool:
        if path in self.route_paths:
            return True
        return any(path == prefix or path.startswith(prefix if prefix.endswith("/") else prefix + "/")
                   for prefix in self.path_prefixes)

    def encoder(self, first_sequence_number: int = 0) -> EventEncoder:
        return EventEncoder(self.frame_style, first_sequence_number)

    def closing_frames(self, exc: BaseException, encoder: EventEncoder | None = None) -> str:
        """The error frame (then the done marker) that ends a stream whose headers are gone."""
        error = to_tokios_error(exc)
        return (encoder or self.encoder()).encode(self.stream_error(error)) + (self.done_marker or "")


async def guarded_stream(dialect: Dialect, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """`events` framed by the dialect, then its done marker. An error once the stream has started
    (the status has been sent, so no status can tell it) becomes the dialect's error frame."""
    encoder = dialect.encoder()
    try:
        async for event in events:
            yield encoder.encode(event)
    except Exception as exc:
        yield dialect.closing_frames(exc, encoder)
        return
    finally:
        await events.aclose()
    if dialect.done_marker:
        yield dialect.done_marker


def join_text_parts(content: Any, where: str, part_types: tuple[str, ...], param: str | None = None) -> str:
    """A message's text: a string as it is, or a list of text parts (of `part_types`) joined by
    newlines; any other part is refused, naming where it is (`param`, default `where`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts", param=param or where)
    texts = []
    for index, part in enumerate(content):
        if isinstance(part, BaseModel):
            part = part.model_dump()
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in part_types or not isinstance(part.get("text"), str):
            allowed = " and ".join(repr(name) for name in part_types)
            raise InvalidRequestError(f"{where}[{index}]: parts of type {kind!r} are not supported here; only "
                                      f"{allowed}", param=param or where)
        texts.append(part["text"])
    return "\n".join(texts)
