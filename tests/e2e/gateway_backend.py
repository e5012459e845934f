"""A stand-in OpenAI-compatible backend for the gateway tests: deterministic, paced, countable.

Not a model. It exists for fault injection: the gateway tests need a backend whose output is known
in advance, whose pace is set per run (so a stream is reliably "in flight" when a connector is
killed), and which counts aborted requests on /stats (so "client disconnect -> backend aborts" is
checked from the backend's side). The real server (`tokios serve`) is exercised by the tests too
where it is available.

Run: python tests/e2e/gateway_backend.py --port 8000 [--token-delay-ms 5] [--model-name NAME]
A request may add "x_first_token_delay_ms" to hold its first token back.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

# Multi-byte characters on purpose: the gateway must pass UTF-8 through whatever the chunking.
WORDS = ("alpha", "beta", "gamma", "délta", "epsilon", "zeta", "世界", "eta", "theta", "iota", "kappa", "λ")


def expected_tokens(prompt: str, max_tokens: int) -> list[str]:
    """The tokens this backend answers `prompt` with; tests compute the same list."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big")
    return [f"{WORDS[(seed + 7 * i) % len(WORDS)]}{i} " for i in range(max_tokens)]


def prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "\n".join(str(m.get("content", "")) for m in body["messages"])
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class _CountingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def create_app(model_name: str, token_delay_s: float) -> FastAPI:
    app = FastAPI()
    stats = {"num_requests": 0, "num_completed": 0, "num_aborted": 0, "num_in_flight": 0}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def get_stats() -> dict[str, int]:
        return stats

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "stand-in"}]}

    async def generate(request: Request, kind: str):
        body = await request.json()
        if body.get("model") != model_name:
            return JSONResponse(
                {"error": {"message": f"model must be {model_name!r}", "type": "not_found_error", "param": "model", "code": None}},
                status_code=404,
            )
        max_tokens = int(body.get("max_tokens") or 16)
        tokens = expected_tokens(prompt_of(body), max_tokens)
        first_delay_s = float(body.get("x_first_token_delay_ms", 0)) / 1000
        request_id = f"{kind}-{hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]}"
        created = 1700000000
        usage = {"prompt_tokens": len(prompt_of(body).split()), "completion_tokens": len(tokens)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        stats["num_requests"] += 1
        stats["num_in_flight"] += 1

        def choice(text: str | None, finish_reason: str | None, is_delta: bool) -> dict[str, Any]:
            if kind == "text_completion":
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            if is_delta:
                return {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish_reason}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}

        object_name = "text_completion" if kind == "text_completion" else "chat.completion"
        if not body.get("stream"):
            try:
                await asyncio.sleep(first_delay_s + token_delay_s * len(tokens))
            finally:
                stats["num_in_flight"] -= 1
            stats["num_completed"] += 1
            return {"id": request_id, "object": object_name, "created": created, "model": model_name,
                    "choices": [choice("".join(tokens), "length", False)], "usage": usage}

        chunk_object = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        outcome = {"is_complete": False}

        def event(choices: list[dict[str, Any]]) -> str:
            data = {"id": request_id, "object": chunk_object, "created": created, "model": model_name, "choices": choices}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def stream() -> AsyncIterator[str]:
            # Nothing, not even the role chunk, before the first token (as after a real prefill).
            await asyncio.sleep(first_delay_s)
            if kind != "text_completion":
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            for token in tokens:
                await asyncio.sleep(token_delay_s)
                yield event([choice(token, None, True)])
            yield event([choice(None, "length", True)])
            yield "data: [DONE]\n\n"
            outcome["is_complete"] = True

        def on_close() -> None:
            stats["num_in_flight"] -= 1
            stats["num_completed" if outcome["is_complete"] else "num_aborted"] += 1

        return _CountingResponse(stream(), on_close, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "text_completion")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-name", default="stand-in")
    parser.add_argument("--token-delay-ms", type=float, default=5.0)
    args = parser.parse_args()
    uvicorn.run(create_app(args.model_name, args.token_delay_ms / 1000), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
